"""Every failure the fuzzer found, as a plain test (the smallest model that showed it).

Each docstring names the rule that broke, and the fix.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import amp_fx
from amp_fx.ir.cast_nodes import cast_source, is_inserted_cast
from amp_fx.errors import UnsupportedConstructError
from amp_fx.ir.pass_manager import PassContext
from amp_fx.converter.pipeline import rewrite_graph
from fuzz.invariants import DispatchProbe, check_model
from fuzz.strategies import Program, Step, build_model, make_inputs


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _rerun(gm):
    """The pipeline run again on a converted graph (parameters shared, left alone)."""
    return rewrite_graph(fx.GraphModule(gm, copy.deepcopy(gm.graph)), PassContext(config=gm.amp_config), own_params=False)


# -- in-place writes ----------------------------------------------------------
class ScaleScoresInPlace(nn.Module):
    def forward(self, q, k):
        scores = q @ k.transpose(-1, -2)
        scores.div_(100.0)  # result unused: later readers read `scores`
        return scores.softmax(-1)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_cast_read_after_an_in_place_write_sees_the_write(level):
    """insert_casts placed the fp32 cast of `scores` right after the matmul, before `div_`, so softmax
    read the unscaled scores.  Fix: casts of a value an in-place op wrote go after the write."""
    q = torch.randn(2, 4, 8)
    gm = amp_fx.convert(ScaleScoresInPlace(), level)
    expected = (q.bfloat16() @ q.bfloat16().transpose(-1, -2)).div_(100.0).float().softmax(-1)
    torch.testing.assert_close(gm(q, q).float(), expected, atol=1e-3, rtol=0)


def test_an_in_place_fp32_op_reads_the_value_after_earlier_writes():
    """`x.clamp_(); x.exp_()`: exp_ is made out of place in fp32, and its cast of x was placed
    before clamp_ (the fuzzer's `exp_` step).  Fix: the same placement rule."""
    program = Program(("x",), (Step("relu", (0,)), Step("exp_", (0,), rebind=False)), (2, 0))
    check_model(lambda: build_model(program), lambda: make_inputs(program))


def test_two_casts_of_one_value_around_a_write_are_not_merged():
    """fold_casts merged the cast before a write with the one after it.  Fix: casts of a value
    some in-place op writes into are left where insert_casts put them."""

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            h = x * 2
            a = self.fc(h)  # reads h cast low
            h.mul_(3.0)
            return a, self.fc(h)  # reads h cast low again, after the write

    model = Model()
    gm = amp_fx.convert(model, "O1")
    casts_of_h = [n for n in gm.graph.nodes if is_inserted_cast(n) and cast_source(n).name == "mul"]
    assert len(casts_of_h) == 2
    x = torch.randn(3, 8)
    a, b = gm(x)
    torch.testing.assert_close(b.float(), model.fc(x * 6), atol=0.05, rtol=0.02)
    torch.testing.assert_close(a.float(), model.fc(x * 2), atol=0.05, rtol=0.02)


def test_an_in_place_op_keeps_the_dtype_of_the_tensor_it_writes():
    """`x.add_(y)` with a low x and an fp32 y was recorded as fp32 (the promotion), so O2 skipped
    the exit cast and returned bf16.  Fix: an in-place FOLLOW op has its first argument's dtype."""
    program = Program(("x",), (Step("layer_norm_f", (0,)), Step("relu", (0,)), Step("add_", (2, 1))), (3,))
    gm = amp_fx.convert(build_model(program), "O2")
    assert gm(*make_inputs(program)).dtype == torch.float32
    check_model(lambda: build_model(program), lambda: make_inputs(program))


def test_an_in_place_write_into_an_input_is_refused_at_o2_and_kept_at_o1():
    """`x.add_(y)` on the graph input: O2/O3 cast inputs at entry, so the caller's x would silently not change;
    that is refused, naming the line. O1 writes the caller's tensor, as eager does."""
    program = Program(("x",), (Step("layer_norm_f", (0,)), Step("add_", (0, 1))), (2,))
    with pytest.raises(UnsupportedConstructError, match="writes in place into its input 'x'"):
        amp_fx.convert(build_model(program), "O2")
    x, = make_inputs(program)
    before = x.clone()
    amp_fx.convert(build_model(program), "O1")(x)
    assert not torch.equal(x, before)
    check_model(lambda: build_model(program), lambda: make_inputs(program))


# -- float64 ------------------------------------------------------------------
class DoubleHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x).double()
        return h @ h.t(), h.softmax(-1)


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_float64_values_are_never_cast(level):
    """amp_fx cast float64 values to the low dtype (and O2's exit cast to fp32); autocast never casts
    float64.  Fix: CastBuilder and amp_cast leave float64 alone, and the report says so."""
    model = DoubleHead()
    gm = amp_fx.convert(model, level)
    x = torch.randn(4, 8)
    with DispatchProbe() as probe:
        gram, probs = gm(x)
    assert gram.dtype == probs.dtype == torch.float64
    assert probe.counts["float64"] == 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_gram, _ = model(x)
    assert ref_gram.dtype == torch.float64
    assert "float64 values left in float64" in str(gm.amp_report)


def test_a_float64_model_converts_untouched():
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)).double()
    for level in ("O1", "O2", "O3"):
        gm = amp_fx.convert(model, level)
        assert all(p.dtype == torch.float64 for p in gm.parameters())
        x = torch.randn(2, 8, dtype=torch.float64)
        assert torch.equal(gm(x), model(x)), level
    assert "never cast, as under autocast (float64 and complex tensors): 0.weight (float64)" in str(amp_fx.convert(model, "O2").amp_report)


# -- fold_casts ---------------------------------------------------------------
def test_folding_a_chain_onto_an_erased_cast_keeps_the_graph_valid():
    """O2, `mask.float()` read by a promote op: fold_casts read a chain through the mask's entry cast,
    erased it, then merged a later cast into it ("used before it has been defined").  Fix: a cast
    kept for merging is not erased."""
    program = Program(("x", "ids", "mask"), (Step("mask_float", (2,)), Step("addcmul", (3, 3, 0)),
                                              Step("sum", (4,)), Step("linear_shared", (4,))), (6, 0))
    gm = amp_fx.convert(build_model(program), "O2")
    gm.graph.lint()
    check_model(lambda: build_model(program), lambda: make_inputs(program))


def test_a_bool_mask_is_not_cast_through_the_models_float():
    """fold_casts read `cast(mask.float())` through to `cast(mask)`: an inserted cast of a bool tensor.
    Fix: widening model casts are read through only when their input is a known float tensor."""
    program = Program(("x", "ids", "mask"), (Step("mask_float", (2,)), Step("sum", (3,)),
                                              Step("add_", (0, 3), rebind=False), Step("linear_shared", (4,))), (6,))
    check_model(lambda: build_model(program), lambda: make_inputs(program), example_inputs=True)


# -- idempotence --------------------------------------------------------------
def test_runtime_promotes_are_not_added_again():
    """Without example inputs, addcmul/cat over inputs of unknown dtype get an amp_promote; a second
    run wrapped them in another one, and `addcmul(a, a, a)` promoted a value with itself.
    Fix: inputs already promoted by one amp_promote, or all the same value, need none."""
    program = Program(("x",), (Step("cat", (0, 0)), Step("addcmul", (1, 0, 0)), Step("sum", (0,)),
                               Step("addcmul", (3, 3, 3))), (4,))
    gm = amp_fx.convert(build_model(program), "O1")
    again, report = _rerun(gm)
    assert again.code == gm.code and not report.passes["insert_casts"]["modified"]
    promotes = [n for n in gm.graph.nodes if n.target is amp_fx.graph_ops.casts.amp_promote]
    assert len(promotes) == 2  # cat's slices and the first addcmul; not addcmul(v3, v3, v3)


def test_an_unused_or_cast_only_input_gets_no_entry_cast_on_a_second_run():
    """O2: an input only the exit cast reads (returned as is) got a new entry cast on every run."""
    program = Program(("x", "ids"), (Step("add", (0, 0)),), (2, 1))
    gm = amp_fx.convert(build_model(program), "O2")
    again, report = _rerun(gm)
    assert report.passes["insert_casts"]["casts_inserted"] == 0 and again.code == gm.code


def test_o2_parameters_are_not_cast_again_with_example_inputs():
    """With example inputs, cast_params left the fp32 example value on each parameter node, and a
    second run cast the bf16 parameters to bf16 again.  Fix: the stale example value is dropped."""
    program = Program(("x", "ids"), (Step("conv1d", (0,)),), (2,))
    gm = amp_fx.convert(build_model(program), "O2", example_inputs=make_inputs(program))
    again, report = _rerun(gm)
    assert report.passes["insert_casts"]["casts_inserted"] == 0 and again.code == gm.code


# -- levels -------------------------------------------------------------------
def test_o3_batch_norm_with_an_fp32_input_runs_low_beside_its_low_parameters():
    """O3 keeps no norm fp32, so batch norm's parameters are low; an fp32 input (the model's own
    `.float()`) then failed on CPU ("mixed dtype (CPU): expect parameter to have scalar type of Float").
    Fix: with keep_batchnorm_fp32=False batch norm runs low."""

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(8)

        def forward(self, x):
            return self.bn(x.float())

    gm = amp_fx.convert(Model(), "O3", dtype=torch.float16)
    out = gm(torch.randn(4, 8))
    assert out.dtype == torch.float32  # cast_model_outputs
    record = next(r for r in gm.amp_report.nodes if r.op == "batch_norm")
    assert record.decision == "low"
    program = Program(("x",), (Step("float", (0,)), Step("batch_norm", (1,))), (2,))
    check_model(lambda: build_model(program), lambda: make_inputs(program))


def test_a_runtime_cast_meeting_float64_leaves_it_alone():
    """`x.double() + x` has no static dtype without example inputs, so log_softmax reads it through
    amp_cast, which meets float64 at run time and must return it as it is (the fuzzer's check once
    counted that as a cast)."""
    program = Program(("x",), (Step("double", (0,)), Step("add", (0, 1)), Step("log_softmax", (2,))), (3,))
    gm = amp_fx.convert(build_model(program), "O1")
    assert any(n.target is amp_fx.graph_ops.casts.amp_cast for n in gm.graph.nodes)
    assert gm(*make_inputs(program)).dtype == torch.float64
    check_model(lambda: build_model(program), lambda: make_inputs(program))


def test_an_index_tensor_takes_no_part_in_a_gathers_dtype():
    """O2: `x.half().gather(1, idx)` with idx computed from an integer input (decided low, so recorded
    as bfloat16 "if floating") was recorded as fp32, the promotion of fp16 and bf16, and O2's exit cast
    was skipped: the output came back fp16.  Fix: data movement keeps its first input's dtype."""
    program = Program(("x", "ids"), (Step("add", (0, 0)), Step("half", (0,)), Step("gather", (3, 1))), (4,))
    gm = amp_fx.convert(build_model(program), "O2")
    assert gm(*make_inputs(program)).dtype == torch.float32
    check_model(lambda: build_model(program), lambda: make_inputs(program))


def test_a_view_hoisted_onto_a_sunk_cast_stays_in_order():
    """With example inputs, `bmm(x.view(...))` then `x @ w`: insert_casts sank x's cast to its first
    reader (the matmul), and dedupe_casts rewrote the earlier `cast(view(x))` into `view(that cast)`,
    before the cast was made ("used before it has been defined").  Fix: dedupe moves the shared cast
    up to the view."""
    program = Program(("x",), (Step("bmm", (0,)), Step("matmul_shared", (0,))), (2,))
    gm = amp_fx.convert(build_model(program), "O1", example_inputs=make_inputs(program))
    gm.graph.lint()
    check_model(lambda: build_model(program), lambda: make_inputs(program), example_inputs=True)
