"""A library's GEMM-like custom op is one ``amp_fx.register_op`` call, and every pass reads its row.

The op computes ``x @ W.T + b`` with an (N, K) weight, as ``F.linear`` does, under
a name no pass knows.  Before the registry held the weight layout, ``pad_gemm``
read any weight but ``linear``'s and a convolution's as (K, N): registered the
obvious way, such an op converted, the report said padded, and the first call
crashed on a shape mismatch; and ``fp8_gemms`` retargeted only ``linear``.
Here it goes through decide (its table), cast (its weight cast once), pad (its
N padded, sliced back), fp8 (a second one, aligned, becomes an fp8 GEMM) and
runs, forward and backward, against fp32.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch
import torch.nn as nn

import amp_fx
from amp_fx.ir import op_properties, tables


@torch.library.custom_op("amp_fx_test::nk_gemm", mutates_args=())
def nk_gemm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``x @ weight.T + bias``, weight (N, K): F.linear under a name only its registration explains."""
    out = x @ weight.t()
    return out if bias is None else out + bias


@nk_gemm.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _setup(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _backward(ctx, grad):
    x, weight = ctx.saved_tensors
    grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias else None
    grad_weight = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
    return grad @ weight, grad_weight, grad_bias


nk_gemm.register_autograd(_backward, setup_context=_setup)
OP = "amp_fx_test::nk_gemm"


class TwoGemms(nn.Module):
    """First GEMM K=16, N=32 (fp8-aligned); second K=32, N=10 (N padded to 16 for bf16 tensor cores)."""

    def __init__(self):
        super().__init__()
        self.w1, self.b1 = nn.Parameter(torch.randn(32, 16) / 4), nn.Parameter(torch.randn(32) / 4)
        self.w2, self.b2 = nn.Parameter(torch.randn(10, 32) / 6), nn.Parameter(torch.randn(10) / 4)

    def forward(self, x):
        h = torch.relu(torch.ops.amp_fx_test.nk_gemm(x, self.w1, self.b1))
        return torch.ops.amp_fx_test.nk_gemm(h, self.w2, self.b2)


@pytest.fixture
def registered():
    handle = amp_fx.register_op(OP, table="low", reason="GEMM: a test library's dense layer, x @ W.T + b",
                                gemm=amp_fx.GemmSig(activation=0, weight=1, bias=2, weight_layout="NK"), fp8=True)
    yield handle
    handle.remove()
    assert op_properties.of(OP).table == "unknown" and op_properties.of(OP).gemm is None


def _relative(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def test_a_norm_row_is_read_by_the_registry_and_removed_with_it():
    """register_op(norm=) writes the norm kind every reader asks (of(op).norm, tables.NORM_OPS); remove() forgets it."""
    op = "amp_fx_test_rows::row_norm"  # a namespace torch has not loaded: the library may define it later
    handle = amp_fx.register_op(op, table="follow", reason="a test library's batch norm", norm="input_dtype")
    try:
        assert (op_properties.of(op).norm, op_properties.of(op).table) == ("input_dtype", "follow")
        assert op in tables.NORM_OPS and tables.NORMS[op] == "input_dtype"
    finally:
        handle.remove()
    assert op_properties.of(op).norm is None and op not in tables.NORM_OPS and len(tables.NORM_OPS) == 5


def test_the_row_holds_every_fact(registered):
    row = op_properties.of(OP)
    assert (row.table, row.fp8, row.gemm.weight_layout) == ("low", True, "NK")
    assert row.gemm.names == ("x", "weight", "bias")  # read off the op's schema: calls may name them
    assert OP in op_properties.known_ops() and tables.table_of(OP) == "low"


def test_a_custom_nk_gemm_goes_through_decide_cast_pad_fp8_and_runs(registered):
    torch.manual_seed(0)
    model, x = TwoGemms(), torch.randn(8, 16)
    gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16, example_inputs=(x,), pad_gemm=True,
                        fp8={"size_rule": "all"})
    rows = [r for r in gm.amp_report.nodes if r.op == OP or r.decision == "fp8"]
    assert len(rows) == 2, rows
    # decide: the registered table; fp8: the aligned GEMM (N=32, K=16) runs as an fp8 GEMM of the (N, K) weight
    fp8 = gm.amp_report.passes["fp8_gemms"]
    assert fp8["fp8"] == 1 and [(g["K"], g["N"], g["fp8"]) for g in fp8["gemms"]] == [(16, 32, True), (32, 10, False)]
    assert sorted(r.decision for r in rows) == ["fp8", "low"]
    # pad (after fp8, which took the first and left it aligned): the second's N=10 is padded to 16 and sliced
    # back, K=32 read as K; the fp8 GEMM is listed, left alone
    pads = gm.amp_report.passes["pad_gemm"]["gemms"]
    assert [(g["op"], g["K"], g["N"], g["padded"]) for g in pads] == [("fp8_linear", 16, 32, None),
                                                                       (OP, 32, 10, [32, 16])], pads
    # cast: each weight is read once, by its own cast (the fp8 GEMM quantizes w1 from fp32)
    casts = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target in ("w1", "w2")]
    assert len(casts) == 2 and all(len(n.users) == 1 for n in casts)
    # run: outputs and every gradient against fp32
    out = gm(x)
    assert out.shape == (8, 10) and out.dtype == torch.float32
    grads = torch.autograd.grad(out.float().square().sum(), list(gm.parameters()))
    want = model(x)
    want_grads = torch.autograd.grad(want.square().sum(), list(model.parameters()))
    # e4m3 operands (3 mantissa bits: 2**-4 relative rounding each) in the first GEMM, bf16 in the second
    # (2**-8), e5m2 grad_output (2**-3) backward: normwise, within two of the coarsest roundings.
    assert _relative(out, want) <= 2 * 2**-4
    assert len(grads) == len(want_grads) == 4
    for got, ref in zip(grads, want_grads):
        assert got.shape == ref.shape and _relative(got, ref) <= 2 * 2**-3


def test_a_registered_op_with_no_row_for_fp8_is_padded_but_not_fp8():
    handle = amp_fx.register_op(OP, table="low", reason="GEMM: x @ W.T + b",
                                gemm=amp_fx.GemmSig(activation=0, weight=1, bias=2, weight_layout="NK"))
    try:
        x = torch.randn(8, 16)
        gm = amp_fx.convert(TwoGemms(), "O1", dtype=torch.bfloat16, example_inputs=(x,), pad_gemm=True,
                            fp8={"size_rule": "all"})
        assert gm.amp_report.passes["fp8_gemms"]["fp8"] == 0
        assert gm.amp_report.passes["pad_gemm"]["padded"] == 1
        assert gm(x).shape == (8, 10)
    finally:
        handle.remove()


@pytest.mark.parametrize("kwargs, error", [
    ({"op": "nk_gemm"}, "namespace::name"),
    ({"op": "aten::mm"}, "namespace::name"),
    ({"table": "lowest"}, "table must be one of"),
    ({"reason": ""}, "reason"),
    ({"reason": None}, "give the one-line reason"),  # left out: an AmpValueError, not Python's TypeError
    ({"table": None}, "table must be one of"),
    ({"table": "fp32"}, "'low' table"),
    ({"gemm": None}, "fp8=True) needs gemm"),
    ({"gemm": amp_fx.GemmSig(0, 1, 2, "conv")}, "fp8=True) needs gemm"),
    ({"gemm": amp_fx.GemmSig(0, 1, 2, "MK")}, "weight_layout must be one of"),
    ({"op": "transformers::grouped_mm_fallback"}, "has a row already"),
    ({"table": "fp32", "gemm": None, "fp8": False, "norm": "batch"}, "norm must be one of"),
    # the GemmSig against nk_gemm(x: Tensor, weight: Tensor, bias: Optional[Tensor])'s schema
    ({"gemm": amp_fx.GemmSig(0, 5, 2, "NK")}, "weight=5 is past the op's positional arguments"),
    ({"gemm": amp_fx.GemmSig(0, 1, 3, "NK")}, "bias=3 is past the op's positional arguments"),
    ({"gemm": amp_fx.GemmSig(0, 0, 2, "NK")}, "names one argument twice"),
    ({"gemm": amp_fx.GemmSig(0, -2, -1, "NK")}, "weight must be the non-negative position"),
    ({"gemm": amp_fx.GemmSig(0, 1, None, "NK")}, "does not name tensor argument 2 'bias'.*pass bias=2"),
    ({"gemm": amp_fx.GemmSig(0, 1, 2, "NK", ("input", "weight", "bias"))}, "leave names out"),
    ({"table": "fp32", "gemm": None, "fp8": False, "norm": "input_dtype"}, "goes with table='follow'"),
    ({"table": "follow", "gemm": None, "fp8": False, "norm": "statistics"}, "goes with table='fp32'"),
])
def test_a_wrong_registration_is_refused_naming_the_fix(kwargs, error):
    args = {"op": OP, "table": "low", "reason": "GEMM", "gemm": amp_fx.GemmSig(0, 1, 2, "NK"), "fp8": True, **kwargs}
    args = {key: value for key, value in args.items() if value is not None or key not in ("table", "reason")}
    with pytest.raises(amp_fx.AmpValueError, match=error.replace("(", r"\(").replace(")", r"\)")):
        amp_fx.register_op(args.pop("op"), **args)
    assert op_properties.of(OP).table == "unknown"


@pytest.mark.parametrize("sig, fits", [(amp_fx.GemmSig(0, 1, 2, "KN"), "weight_layout='NK' fits these shapes"),
                                       (amp_fx.GemmSig(1, 0, 2, "NK"), "Check which argument is the activation")])
def test_a_row_that_does_not_fit_the_calls_shapes_is_refused_at_convert(sig, fits):
    """The schema cannot tell a layout or a swap: the example inputs' shapes can, before the first call crashes."""
    handle = amp_fx.register_op(OP, table="low", reason="GEMM", gemm=sig)
    try:
        for options in ({}, {"pad_gemm": True}, {"fp8": {"size_rule": "all"}}):
            with pytest.raises(amp_fx.AmpValueError, match=f"register_op\\('{OP}'\\) row GemmSig.*{fits}"):
                amp_fx.convert(TwoGemms(), "O1", dtype=torch.bfloat16, example_inputs=(torch.randn(8, 16),),
                               **options)
    finally:
        handle.remove()


def test_a_row_registered_before_its_op_is_checked_against_the_schema_at_convert():
    """Registered while torch knows no op of the namespace (accepted), checked when the graph calls it."""
    op = "amp_fx_test_late::dense"
    handle = amp_fx.register_op(op, table="low", reason="GEMM", gemm=amp_fx.GemmSig(0, 1, None, "NK"))
    try:
        @torch.library.custom_op(op, mutates_args=())
        def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
            return x @ weight.t() + bias

        dense.register_fake(lambda x, weight, bias: x.new_empty(*x.shape[:-1], weight.shape[0]))
        class Dense(nn.Linear):
            def forward(self, x):
                return torch.ops.amp_fx_test_late.dense(x, self.weight, self.bias)

        with pytest.raises(amp_fx.AmpValueError, match="does not name tensor argument 2 'bias'"):
            amp_fx.convert(Dense(16, 8), "O1", dtype=torch.bfloat16, example_inputs=(torch.randn(4, 16),))
    finally:
        handle.remove()


def test_remove_restores_the_row_it_replaced_and_a_stale_handle_removes_nothing():
    first = amp_fx.register_op(OP, table="low", reason="first", gemm=amp_fx.GemmSig(0, 1, 2, "NK"))
    second = amp_fx.register_op(OP, table="fp32", reason="second", replace=True)
    assert (op_properties.of(OP).table, op_properties.of(OP).gemm) == ("fp32", None)
    with pytest.raises(amp_fx.AmpValueError, match="a later registration replaced it"):
        first.remove()  # would take out the second's row
    second.remove()  # the first's row again, GEMM signature and all
    assert (op_properties.of(OP).table, op_properties.of(OP).reason) == ("low", "first")
    assert op_properties.of(OP).gemm.weight_layout == "NK"
    with pytest.raises(amp_fx.AmpValueError, match="removed already"):
        second.remove()
    first.remove()
    assert op_properties.of(OP).table == "unknown" and op_properties.of(OP).gemm is None
    third = amp_fx.register_op(OP, table="low", reason="third")
    with pytest.raises(amp_fx.AmpValueError, match="removed already"):
        first.remove()  # a stale handle: the third's row stays
    assert op_properties.of(OP).reason == "third"
    third.remove()


def test_a_replaced_shipped_row_comes_back_on_remove():
    op = "transformers::grouped_mm_fallback"
    shipped = op_properties.of(op)
    handle = amp_fx.register_op(op, table="fp32", reason="a test's replacement", replace=True)
    assert op_properties.of(op).table == "fp32"
    handle.remove()
    assert op_properties.of(op) == shipped


def test_a_policy_may_name_a_registered_op_torch_has_not_loaded():
    """A policy rule for a registered op is no misspelling, even before its library registers it with torch."""
    rules = {"op:amp_fx_test_later::gemm": "fp32"}
    handle = amp_fx.register_op("amp_fx_test_later::gemm", table="low", reason="GEMM: loaded later")
    try:
        amp_fx.Policy.from_dict(rules).check_op_names([], [])
    finally:
        handle.remove()


def test_a_misspelt_op_in_a_loaded_namespace_is_refused_with_close_matches():
    """Torch has loaded amp_fx_test's ops and nk_gemm is one of them: 'nk_gemn' is a misspelling."""
    with pytest.raises(amp_fx.AmpValueError, match="Did you mean 'amp_fx_test::nk_gemm'"):
        amp_fx.register_op("amp_fx_test::nk_gemn", table="low", reason="GEMM")
    assert op_properties.of("amp_fx_test::nk_gemn").table == "unknown"


@torch.library.custom_op("amp_fx_test_ac::scale", mutates_args=())
def _autocast_scale(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * weight


_autocast_scale.register_fake(lambda x, weight: torch.empty_like(x))
torch.library.register_autocast("amp_fx_test_ac::scale", "cpu", torch.bfloat16)


def test_a_register_autocast_rule_wins_over_the_row_and_register_op_warns():
    """The op's own autocast rule decides it, as under torch.autocast; register_op says so instead of going unheard."""
    op = "amp_fx_test_ac::scale"
    with pytest.warns(amp_fx.AmpWarning, match="its own autocast rule .*AutocastCPU.*policy="):
        handle = amp_fx.register_op(op, table="fp32", reason="a test library's op, kept fp32")

    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return torch.ops.amp_fx_test_ac.scale(x, self.weight)

    try:
        gm = amp_fx.convert(Scale(), "O1", dtype=torch.bfloat16, example_inputs=(torch.randn(2, 4),))
    finally:
        handle.remove()
    row = next(r for r in gm.amp_report.nodes if r.op == op)
    assert (row.decision, row.rule) == ("low", "declared"), row
