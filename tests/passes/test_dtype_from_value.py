"""Casts whose target dtype is read from a value (``.to(h.dtype)``, ``.type_as(h)``, ``dtype=w.dtype``).

Without example inputs the analysis runs in dtype-only mode.  There a cast's
target is the dtype of that value *in the rewritten program* (bf16 for a low
GEMM's output, the weight's dtype at that level), never the dtype the cast's
input had.  When the value's dtype is unknown, so is the cast's result, and
its readers' casts are guarded.  Reference: ``torch.autocast`` on CPU with
bfloat16, eager, for outputs and gradients.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import amp_fx
from amp_fx.ir import meta

SPELLINGS = ["to_dtype", "weight_dtype", "type_as", "to_tensor"]
# bf16 has 8 significand bits: one rounding moves a value by at most U of its magnitude.
U = 2.0 ** -8


class ScaledHead(nn.Module):
    """``fc2(fc1(x) * s)`` with the buffer ``s`` cast to the activation's dtype in one of four spellings."""

    def __init__(self, buffer_dtype: torch.dtype, how: str):
        super().__init__()
        self.how = how
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)
        self.register_buffer("s", torch.linspace(0.5, 1.5, 32, dtype=buffer_dtype))

    def forward(self, x):
        h = self.fc1(x)
        if self.how == "to_dtype":
            s = self.s.to(h.dtype)
        elif self.how == "weight_dtype":
            s = self.s.to(self.fc2.weight.dtype)
        elif self.how == "type_as":
            s = self.s.type_as(h)
        else:
            s = self.s.to(h)
        return self.fc2(h * s)


class _Recorder(fx.Interpreter):
    def __init__(self, gm):
        super().__init__(gm)
        self.seen = {}

    def run_node(self, node):
        self.seen[node] = value = super().run_node(node)
        return value


def _assert_predictions_hold(gm: fx.GraphModule, x: torch.Tensor) -> None:
    """Every floating dtype the analysis predicted is the one the converted module computes (or was left unknown)."""
    recorder = _Recorder(gm)
    recorder.run(x)
    checked = 0
    for node, value in recorder.seen.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point() and node.op != "output":
            predicted = meta.float_dtype(node)
            assert predicted in (None, value.dtype), (node.name, predicted, value.dtype)
            checked += predicted is not None
    assert checked >= 2, "the analysis predicted (almost) nothing: no evidence either way"


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.float() for name, p in module.named_parameters()}


@pytest.mark.parametrize("with_examples", [False, True])
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("buffer_dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("how", SPELLINGS)
def test_a_cast_to_a_values_dtype_matches_autocast(how, buffer_dtype, level, with_examples):
    """Decisions as autocast's (the GEMM runs bf16), fp32 outputs, outputs and gradients as autocast's."""
    torch.manual_seed(0)
    model, x = ScaledHead(buffer_dtype, how), torch.randn(8, 16)
    gm = amp_fx.convert(model, level, dtype=torch.bfloat16, example_inputs=(x,) if with_examples else None)
    head = gm.amp_report.node("linear_1")
    assert head.decision == "low" and head.dtype == "bfloat16"
    _assert_predictions_hold(gm, x)

    xa, xg = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        ref = model(xa)
    out = gm(xg)
    assert out.dtype == torch.float32 and ref.dtype == torch.bfloat16
    # Same kernels on the same bf16 operands as autocast, except at O2/O3 with ``.to(self.fc2.weight.dtype)``:
    # there the weight is bf16 in the rewritten program, so ``s`` is rounded to bf16 before the product
    # (autocast multiplies by the fp32 ``s`` and rounds once, at fc2's input cast).  That moves each of fc2's
    # inputs by at most 2U of its magnitude, so each logit by 2U * (|a| @ |W|^T); the outputs are bf16 on both
    # sides, so add one rounding of each (U |ref| twice) -- doubled for safety.
    exact = how != "weight_dtype" or level == "O1"
    with torch.no_grad():
        h = model.fc1(x) * model.s.float()
        bound = 2 * (2 * U * (h.abs() @ model.fc2.weight.abs().t()) + 2 * U * ref.float().abs())
    if exact:
        assert torch.equal(out, ref.float())
    else:
        assert ((out - ref.float()).abs() <= bound).all()

    out.pow(2).sum().backward()
    ref.float().pow(2).sum().backward()
    want = _grads(model)
    got = _grads(gm)
    assert got.keys() == want.keys()
    if exact:
        assert torch.equal(xg.grad, xa.grad)
        for name in want:
            assert torch.equal(got[name], want[name]), name
    else:
        # Each gradient is a chain of bf16 GEMMs on both sides, starting from 2*out, whose operands differ by the
        # rounding of ``s`` (U) and the logits' difference above (about 2U); each side rounds its result to bf16
        # at most four times along the chain (4U each).  Relative to the largest entry that is within 8U.
        # (Measured: at most 2.2U, fc2.weight.)
        for name, g, w in [("x", xg.grad, xa.grad)] + [(n, got[n], want[n]) for n in want]:
            assert (g.float() - w).abs().max() <= 8 * U * w.abs().max(), name


class UnknownTarget(nn.Module):
    """The cast's target is a graph input's dtype: without example inputs it is known only at run time."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.fc = nn.Linear(32, 4)
        self.register_buffer("s", torch.linspace(0.5, 1.5, 32, dtype=torch.float64))

    def forward(self, x):
        if self.how == "to_dtype":
            s = self.s.to(x.dtype)
        elif self.how == "new_ones":
            s = self.s.new_ones(32, dtype=x.dtype) * 1.5
        else:
            s = self.s.type_as(x)
        return self.fc(x * s)


@pytest.mark.parametrize("how", ["to_dtype", "new_ones", "type_as"])
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16])
def test_a_cast_to_an_unknown_dtype_is_not_assumed_float64(how, input_dtype):
    """``s64.to(x.dtype)`` of an unknown ``x``: unknown, never float64, so the GEMM's input is cast (guarded)."""
    torch.manual_seed(0)
    model, x = UnknownTarget(how), torch.randn(8, 32).to(input_dtype)
    gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16)
    cast = gm.amp_report.node("to" if how == "to_dtype" else "new_ones" if how == "new_ones" else "type_as")
    assert cast.dtype is None or "float64" not in cast.dtype
    assert gm.amp_report.node("linear").dtype == "bfloat16"
    _assert_predictions_hold(gm, x)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        ref = model(x)
    out = gm(x)
    assert out.dtype == torch.float32
    assert torch.equal(out, ref.float())  # the same bf16 GEMM on the same bf16 operands


class FactoryFromValue(nn.Module):
    """``torch.full_like(s64, 0.5, dtype=h.dtype)``: a factory whose dtype is read from a low value."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)
        self.register_buffer("s", torch.linspace(0.5, 1.5, 32, dtype=torch.float64))

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(h + torch.full_like(self.s, 0.5, dtype=h.dtype))


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_a_factory_with_a_values_dtype_makes_that_dtype(level):
    """The factory makes bf16 (h's dtype in the rewritten program): outputs fp32 and equal to autocast's."""
    torch.manual_seed(0)
    model, x = FactoryFromValue(), torch.randn(8, 16)
    gm = amp_fx.convert(model, level, dtype=torch.bfloat16)
    assert gm.amp_report.node("full_like").dtype == "bfloat16"
    assert gm.amp_report.node("linear_1").dtype == "bfloat16"
    _assert_predictions_hold(gm, x)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        ref = model(x)
    out = gm(x)
    assert out.dtype == torch.float32 and torch.equal(out, ref.float())
