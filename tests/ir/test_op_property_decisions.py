"""Conversion decisions the op registry changed, each shown at least as precise as before (against fp64 or autocast).

Unifying the passes' op lists (tests/ir/test_op_properties.py) changed four
kinds of decision, none on the example zoo or the HF models (byte-identical):

1. A view the analysis did not know (``diagonal``, ``movedim``, ...) now aliases its input:
   a cast made before an in-place write through it is no longer reused after the write.
2. At O2/O3 an in-place write into a graph input through such a view is refused, as through ``view``.
3. ``minimize_casts`` no longer moves ``clamp``/``clamp_min``/``clamp_max``/``hardtanh``/``relu6``/``threshold``
   from fp32 to low: their backward masks at a bound that rounding can cross.
4. ``fuse_precision`` no longer passes a fused norm's low result through ``relu6`` (same reason) or through an
   op whose backward sums (``expand``, ``repeat``, ``index_select``, ``x[idx]``, ...): those keep the cast form.
   It now passes it through ``sign`` (exact: its gradient is zero).

The old decisions are reproduced with a policy that pins the op ``low``: it paints the node as the old
min-cut move or fusion did, so the op runs on its input rounded low (the same program, checked when this
was written).
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_fx
from amp_fx.errors import UnsupportedConstructError
from amp_fx.ir import meta

BF16 = torch.bfloat16


def _run(model, x):
    """Output, input gradient and parameter gradients of ``model`` on ``x`` (loss: sum of squares, in fp32)."""
    for p in model.parameters():
        p.grad = None  # conversions share the model's parameters
    x = x.clone().requires_grad_()
    out = model(x)
    out.float().pow(2).sum().backward()
    return out.detach().double(), x.grad.double(), {n: p.grad.double() for n, p in model.named_parameters()}


def _rel(got, want):
    return ((got - want).norm() / want.norm()).item()


def _fp64(model, x):
    return _run(copy.deepcopy(model).double(), x.double())


# -- 1, 2: views the analysis did not know ---------------------------------------------------------------
class WriteThroughView(nn.Module):
    """y is cast low for ``a``, then written in place through a view, then read by ``b``."""

    def __init__(self, view):
        super().__init__()
        self.view, self.a, self.b = view, nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        y = x * 2.0
        first = self.a(y)
        self.view(y).add_(100.0)
        return first, self.b(y)


VIEWS = {"diagonal": torch.diagonal, "movedim": lambda y: y.movedim(0, 1), "swapaxes": lambda y: y.swapaxes(0, 1)}


@pytest.mark.parametrize("view", sorted(VIEWS))
def test_a_cast_is_not_reused_across_a_write_through_a_view(view):
    """Before, ``b`` read the cast made for ``a``: y before the write (35 off, for diagonal, against autocast)."""
    model, x = WriteThroughView(VIEWS[view]), torch.randn(8, 8)
    converted = amp_fx.convert(model, "O1", dtype=BF16, example_inputs=(x,))
    with torch.autocast("cpu", dtype=BF16):
        want = model(x)
    for got, ref in zip(converted(x), want):
        assert (got.float() - ref.float()).abs().max() <= 0.02 * ref.float().abs().max()


class WriteIntoInput(nn.Module):
    def __init__(self, view):
        super().__init__()
        self.view, self.fc = view, nn.Linear(4, 4)

    def forward(self, x):
        self.view(x).add_(1.0)
        return self.fc(x)


@pytest.mark.parametrize("view", sorted(VIEWS))
def test_at_o2_a_write_into_an_input_through_a_view_is_refused(view):
    """Inputs are cast at entry at O2: the write would change the cast copy, never the caller's tensor."""
    with pytest.raises(UnsupportedConstructError, match="writes in place into its input 'x'"):
        amp_fx.convert(WriteIntoInput(VIEWS[view]), "O2", dtype=BF16, example_inputs=(torch.randn(4, 4),))


# -- 3: minimize_casts keeps masking ops fp32 ------------------------------------------------------------
class SharedFp32Value(nn.Module):
    """An fp32 value y read by two GEMMs, one through ``f``: moving ``f`` low would share y's one cast."""

    def __init__(self, f):
        super().__init__()
        self.f, self.b, self.c = f, nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x):
        y = x * 1.0  # fp32 (follows the fp32 input)
        return self.b(y) + self.c(self.f(y))


# op -> (f, the bound it masks at): inputs are spread a few bf16 ulps around the bound, so rounding crosses it
MASKING = {"clamp": (lambda y: y.clamp(-0.5, 0.5), 0.5), "clamp_min": (lambda y: torch.clamp_min(y, 0.5), 0.5),
           "hardtanh": (lambda y: F.hardtanh(y, -0.5, 0.5), 0.5), "relu6": (F.relu6, 6.0),
           "threshold": (lambda y: torch.threshold(y, 0.25, -1.0), 0.25)}


@pytest.mark.parametrize("op", sorted(MASKING))
def test_minimize_casts_no_longer_moves_a_masking_op_low_and_loses_no_precision(op):
    torch.manual_seed(0)
    f, bound = MASKING[op]
    ulp = bound * torch.finfo(BF16).eps
    model, x = SharedFp32Value(f), bound + torch.randn(64, 32) * 2 * ulp
    new = amp_fx.convert(model, "O1", dtype=BF16, example_inputs=(x,))
    old = amp_fx.convert(model, "O1", dtype=BF16, example_inputs=(x,), policy={f"op:{op}": "low"})
    record = next(r for r in new.amp_report.nodes if r.op == op)
    assert record.decision == "follow" and record.rule != "min-cut"  # stays fp32, following y
    assert next(r for r in old.amp_report.nodes if r.op == op).decision == "low"  # what the min-cut move painted
    (_, g64, p64), (_, g_new, p_new), (_, g_old, p_old) = _fp64(model, x), _run(new, x), _run(old, x)
    assert _rel(g_new, g64) < 0.8 * _rel(g_old, g64)
    assert _rel(p_new["c.weight"], p64["c.weight"]) <= _rel(p_old["c.weight"], p64["c.weight"])


# -- 4: fuse_precision keeps the cast form before masking and summing ops ---------------------------------
IDX = torch.tensor([0, 0, 1, 2, 2, 2, 3])
AFTER_NORM = {"relu6": F.relu6, "expand": lambda h: h.expand(8, 64, 16), "repeat": lambda h: h.repeat(1, 64, 1),
              "index_select": lambda h: h.index_select(0, IDX), "getitem": lambda h: h[IDX], "sign": torch.sign}


class NormThen(nn.Module):
    """fc1 (low) -> F.layer_norm (fp32, fusable on CPU) -> f -> fc2 (a low reader)."""

    def __init__(self, f, scale=1.0, shift=0.0):
        super().__init__()
        self.f, self.fc1, self.fc2 = f, nn.Linear(16, 16), nn.Linear(16, 16)
        self.w = nn.Parameter((torch.rand(16) + 0.5) * scale)
        self.b = nn.Parameter(torch.randn(16) * scale + shift)

    def forward(self, x):
        return self.fc2(self.f(F.layer_norm(self.fc1(x), (16,), self.w, self.b)))


def _fused(gm):
    return any(n.meta.get(meta.FUSED) for n in gm.graph.nodes)


def _three_ways(op, seed, **shape):
    """fp64, the new conversion (cast form) and the old one (fused: the op on the norm's result rounded low)."""
    torch.manual_seed(seed)
    model, x = NormThen(AFTER_NORM[op], **shape), torch.randn(8, 1, 16) * 3 + 1
    new = amp_fx.convert(model, "O1", dtype=BF16, example_inputs=(x,))
    cast = amp_fx.convert(model, "O1", dtype=BF16, example_inputs=(x,), fuse_precision=False)
    old = amp_fx.convert(model, "O1", dtype=BF16, example_inputs=(x,), fuse_precision=False, policy={f"op:{op}": "low"})
    assert not _fused(new)
    (out_new, g_new, _), (out_cast, g_cast, _) = _run(new, x), _run(cast, x)
    assert torch.equal(out_new, out_cast) and torch.equal(g_new, g_cast)  # the cast form, as autocast computes it
    return _fp64(model, x)[1], g_new, _run(old, x)[1]


@pytest.mark.parametrize("op", ["expand", "repeat", "index_select", "getitem"])
def test_fuse_precision_keeps_the_cast_form_before_an_op_whose_backward_sums(op):
    """The forward is the same either way; the old form summed the gradient in bf16.  One rounding among many:
    seen against fp64 on average over a few models (expand's input gradient: 8% closer)."""
    errors = [(_rel(new, g64), _rel(old, g64)) for g64, new, old in (_three_ways(op, seed) for seed in range(4))]
    assert sum(new for new, _ in errors) <= sum(old for _, old in errors)


def test_fuse_precision_keeps_the_cast_form_before_relu6():
    """The norm's result sits around 6 here, so rounding carries inputs onto relu6's upper bound."""
    g64, new, old = _three_ways("relu6", 0, scale=0.05, shift=6.0)
    assert _rel(new, g64) < 0.8 * _rel(old, g64)


def test_fuse_precision_now_passes_through_sign_which_is_exact():
    torch.manual_seed(0)
    model, x = NormThen(torch.sign), torch.randn(8, 1, 16) * 3 + 1
    fused = amp_fx.convert(model, "O1", dtype=BF16, example_inputs=(x,))
    cast = amp_fx.convert(model, "O1", dtype=BF16, example_inputs=(x,), fuse_precision=False)
    assert _fused(fused) and not _fused(cast)
    (out_f, _, grads_f), (out_c, _, grads_c) = _run(fused, x), _run(cast, x)
    assert torch.equal(out_f, out_c)  # sign(round(y)) == round(sign(y)); its gradient is zero either way
    assert all(torch.equal(grads_f[name], grads_c[name]) for name in grads_c)
