"""The model's grad-mode regions keep their meaning on every route (issue 18, point 1).

A frozen teacher under ``torch.no_grad()`` must not be trained: the set of
parameters that get a gradient, and the gradients themselves, match the
model run eagerly under ``torch.autocast``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from routes import ROUTES, convert, eager_autocast

D = 8
KINDS = ("no_grad", "set_grad_enabled", "inference_mode", "enable_grad_inside_no_grad", "shared_weight")


class GradRegions(nn.Module):
    """``b`` computed without grad in several ways; ``a``/``c`` (and ``d`` under enable_grad) train."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.a, self.b, self.c, self.d = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x):
        if self.kind == "shared_weight":
            # a is first read without grad, then with it: the two reads must not share one cast
            with torch.no_grad():
                t = self.a(x * 2)
            h = self.a(x)
            return self.c(h + t)
        h = self.a(x)
        if self.kind == "no_grad":
            with torch.no_grad():
                t = self.b(x)
        elif self.kind == "set_grad_enabled":
            with torch.set_grad_enabled(False):
                t = self.b(x)
        elif self.kind == "inference_mode":
            with torch.inference_mode():
                t = self.b(x)
        else:
            with torch.no_grad():
                u = self.b(x)
                with torch.enable_grad():
                    t = self.d(u)
        return self.c(h + t)


def _grads(model, fn, x):
    model.zero_grad(set_to_none=True)
    fn(x).float().sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("route", ROUTES)
def test_grad_regions_give_the_parameters_eager_gives(route, kind):
    """Same parameters with gradients as eager under autocast; gradients within bf16 tolerance."""
    model, x = GradRegions(kind), torch.randn(4, D)
    reference = copy.deepcopy(model)
    expected = _grads(reference, lambda v: eager_autocast(reference, v), x)
    conv = convert(model, route, x)
    got = _grads(model, conv.fn, x)
    assert set(got) == set(expected), f"{route}/{kind}: {sorted(got)} != {sorted(expected)}"
    for name, grad in got.items():
        scale = expected[name].abs().max().item() + 1e-3
        assert (grad - expected[name]).abs().max().item() <= 0.05 * scale, name
    if route != "backend" and kind in ("no_grad", "set_grad_enabled"):
        (b,) = conv.records("linear", "b")
        assert b.rule == "grad-mode" and "torch.no_grad()" in b.reason


def test_no_grad_region_leaves_grad_mode_as_it_found_it():
    """The region restores the caller's mode, also when the forward raises inside it."""

    class Raises(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(D, D)

        def forward(self, x):
            with torch.no_grad():
                y = self.a(x)
                return y[x.long()]  # an index error at run time, inside the region

    gm = convert(Raises(), "symbolic", torch.randn(4, D)).fn
    assert torch.is_grad_enabled()
    with pytest.raises(IndexError):
        gm(torch.full((4, D), 100.0))
    assert torch.is_grad_enabled()
    with torch.no_grad():
        gm(torch.zeros(4, D))
        assert not torch.is_grad_enabled()


class EnableInside(nn.Module):
    """``d`` runs under enable_grad; everything else follows the caller's mode."""

    def __init__(self):
        super().__init__()
        self.a, self.d = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        h = self.a(x)
        with torch.enable_grad():
            t = self.d(x)
        return h, t


@pytest.mark.parametrize("route", ["symbolic", "symbolic+examples"])
def test_whole_forward_under_no_grad_with_enable_grad_inside(route):
    """Called under no_grad, an enable_grad region inside still records its op and trains d, as eager."""
    model, x = EnableInside(), torch.randn(4, D)
    with torch.no_grad():
        h_ref, t_ref = model(x)
    assert not h_ref.requires_grad and t_ref.requires_grad  # the eager meaning
    gm = convert(model, route, x).fn
    with torch.no_grad():
        h, t = gm(x)
    assert not h.requires_grad and t.requires_grad
    t.float().sum().backward()
    assert model.d.weight.grad is not None and model.a.weight.grad is None


def test_export_route_says_which_enable_grad_region_it_cannot_keep():
    """torch.export traces with grad on, so enable_grad leaves no trace: the report names the line instead."""
    conv = convert(EnableInside(), "export", torch.randn(4, D))
    lines = conv.report().passes["honour_autocast_regions"]["report_lines"]
    assert any("torch.enable_grad() is not kept by torch.export" in line and "test_grad_regions.py" in line for line in lines)
    assert "torch.enable_grad() is not kept" in str(conv.report())


def test_export_route_keeps_inference_mode_as_no_grad_and_says_so():
    conv = convert(GradRegions("inference_mode"), "export", torch.randn(4, D))
    assert any("inference_mode() kept as torch.no_grad()" in line
               for line in conv.report().passes["honour_autocast_regions"]["report_lines"])
