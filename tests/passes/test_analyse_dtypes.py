"""The dtype analysis: every program that runs under torch.autocast converts, and the analysis tells the truth.

Each test states the rule under test.  References: fp32 for values,
torch.autocast for what is legal, the converted module itself (recorded node
by node) for what the analysis predicted.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.utils import _pytree as pytree
from torch.nn.utils.rnn import pack_padded_sequence

import amp_fx
import zoo
from amp_fx.ir import meta
from fuzz.predictions import Recorder, check_predictions
from random_cast_graphs import random_graph

LOW = (torch.float16, torch.bfloat16)


def _close(got: torch.Tensor, want: torch.Tensor, tol: float = 0.06) -> None:
    scale = 1.0 + want.abs().max().item()
    assert (got.float() - want.float()).abs().max().item() <= tol * scale


# --------------------------------------------------------------------------
# Low-precision inputs into an fp32 model
# --------------------------------------------------------------------------
class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(self.conv(x).mean((2, 3)))


@pytest.mark.parametrize("low", LOW)
@pytest.mark.parametrize("with_examples", [True, False])
def test_low_input_into_fp32_conv_and_linear_runs_low(low, with_examples):
    """A conv/GEMM with an fp32 bias and a low input runs in the low dtype (the bias is cast, not the input widened)."""
    torch.manual_seed(0)
    model, x = ConvNet(), torch.randn(2, 3, 6, 6)
    kwargs = {"example_inputs": (x.to(low),)} if with_examples else {}
    gm = amp_fx.convert(model, "O1", dtype=low, **kwargs)
    conv = gm.amp_report.node("conv2d")
    assert conv.decision == "low" and conv.dtype == str(low).replace("torch.", "")
    xl = x.to(low).requires_grad_()
    out = gm(xl)
    _close(out, model(x))
    out.float().sum().backward()
    assert xl.grad.dtype == low
    assert model.conv.weight.grad is not None and model.conv.weight.grad.dtype == torch.float32


class Recurrent(nn.Module):
    def __init__(self, kind: str, layers: int, bidirectional: bool):
        super().__init__()
        self.rnn = getattr(nn, kind)(6, 8, num_layers=layers, bidirectional=bidirectional, batch_first=True)

    def forward(self, x, h0):
        out, _ = self.rnn(x, h0)
        return out


def _h0(kind: str, layers: int, directions: int, dtype: torch.dtype):
    h = torch.randn(layers * directions, 3, 8, dtype=dtype)
    return (h, torch.randn_like(h)) if kind == "LSTM" else h


@pytest.mark.parametrize("kind", ["RNN", "GRU", "LSTM"])
@pytest.mark.parametrize("layers,bidirectional", [(1, False), (2, False), (1, True)])
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_recurrent_nets_take_low_and_fp32_inputs(kind, layers, bidirectional, input_dtype):
    """RNN/GRU/LSTM fed fp32, bf16 or fp16 x and h0 convert with example inputs; output low, x.grad in x's dtype."""
    torch.manual_seed(0)
    model = Recurrent(kind, layers, bidirectional)
    x = torch.randn(3, 5, 6)
    h0 = _h0(kind, layers, 2 if bidirectional else 1, torch.float32)
    cast = lambda t: tuple(v.to(input_dtype) for v in t) if isinstance(t, tuple) else t.to(input_dtype)  # noqa: E731
    xl, hl = x.to(input_dtype).requires_grad_(), cast(h0)
    gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16, example_inputs=(xl, hl), cast_model_outputs=torch.bfloat16)
    out = gm(xl, hl)
    assert out.dtype == torch.bfloat16
    _close(out, model(x, h0), tol=0.08)
    out.float().sum().backward()
    assert xl.grad.dtype == input_dtype


@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16])
def test_lstm_fed_a_packed_sequence(input_dtype):
    """A PackedSequence of low or fp32 data through an LSTM converts and agrees with fp32."""
    torch.manual_seed(0)

    class Packed(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(6, 8, batch_first=True)

        def forward(self, packed):
            out, (h, _) = self.rnn(packed)
            return h

    model = Packed()
    x, lengths = torch.randn(3, 5, 6), torch.tensor([5, 3, 2])
    packed = pack_padded_sequence(x.to(input_dtype), lengths, batch_first=True)
    gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16, example_inputs=(packed,))
    _close(gm(packed), model(pack_padded_sequence(x, lengths, batch_first=True)), tol=0.08)


# --------------------------------------------------------------------------
# Promote-list ops with mixed inputs
# --------------------------------------------------------------------------
class Promoting(nn.Module):
    """Calls one promote-list op with a low activation and an fp32 buffer."""

    def __init__(self, op: str):
        super().__init__()
        self.op = op
        self.fc = nn.Linear(4, 4)  # makes the activation low
        self.register_buffer("other", torch.randn(4, 4))
        self.bil = nn.Parameter(torch.randn(3, 4, 4))

    def forward(self, x):
        h, o = self.fc(x), self.other
        if self.op == "dot":
            return torch.dot(h[0], o[0])
        if self.op == "vdot":
            return torch.vdot(h[0], o[0])
        if self.op == "tensordot":
            return torch.tensordot(h, o, dims=1)
        if self.op == "bilinear":
            return F.bilinear(h, o, self.bil)
        if self.op == "scatter_add":
            return o.scatter_add(0, torch.zeros(4, 4, dtype=torch.long), h)
        if self.op == "cat":
            return torch.cat([h, o])
        if self.op == "stack":
            return torch.stack([h, o])
        if self.op == "addcmul":
            return torch.addcmul(o, h, o)
        if self.op == "addcdiv":
            return torch.addcdiv(o, h, o.abs() + 1)
        if self.op == "atan2":
            return torch.atan2(h, o)
        if self.op == "cross":
            return torch.linalg.cross(h[:, :3], o[:, :3])
        if self.op == "index_copy":
            return o.index_copy(0, torch.tensor([0, 2]), h[:2])
        if self.op == "index_put":
            return o.index_put((torch.tensor([1, 3]),), h[:2])
        raise AssertionError(self.op)


PROMOTED = ["dot", "vdot", "tensordot", "bilinear", "scatter_add", "cat", "stack", "addcmul", "addcdiv", "atan2",
            "cross", "index_copy", "index_put"]


@pytest.mark.parametrize("op", PROMOTED)
@pytest.mark.parametrize("with_examples", [True, False])
def test_promote_ops_with_mixed_fp16_fp32_inputs(op, with_examples):
    """Each promote-list op, given an fp16 and an fp32 input, runs in the widest (fp32), within tolerance of fp32."""
    torch.manual_seed(0)
    model, x = Promoting(op), torch.randn(4, 4)
    kwargs = {"example_inputs": (x,)} if with_examples else {}
    gm = amp_fx.convert(model, "O1", dtype=torch.float16, **kwargs)
    out = gm(x)
    assert out.dtype == torch.float32
    _close(out, model(x), tol=0.02)


def test_grid_sample_promotes_its_low_grid():
    """grid_sampler (promote list) with an fp32 image and a low grid runs in fp32."""

    class Sampler(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def forward(self, img, g):
            return F.grid_sample(img, self.fc(g).tanh(), align_corners=False)

    model, img, g = Sampler(), torch.randn(1, 2, 4, 4), torch.randn(1, 3, 3, 2)
    gm = amp_fx.convert(model, "O1", dtype=torch.float16, example_inputs=(img, g))
    assert gm(img, g).dtype == torch.float32
    _close(gm(img, g), model(img, g), tol=0.02)


# --------------------------------------------------------------------------
# Nodes that cannot be fake-run
# --------------------------------------------------------------------------
class EqualCheck(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, y):
        same = torch.equal(x, y)
        return self.fc(x) * same


def test_data_dependent_op_is_unknown_and_the_conversion_goes_on():
    """torch.equal has no fake result: the node is reported unknown with its reason, and the module runs."""
    x = torch.randn(2, 4)
    gm = amp_fx.convert(EqualCheck(), "O1", example_inputs=(x, x.clone()))
    stats = gm.amp_report.passes["analyse_dtypes"]
    assert list(stats["unknown"]) == ["equal"]
    assert "DataDependent" in stats["unknown"]["equal"] or "data" in stats["unknown"]["equal"].lower()
    assert any("could not fake-run 1 node" in line for line in stats["report_lines"])
    assert torch.equal(gm(x, x.clone()).float(), gm(x, x.clone()).float())
    assert gm(x, x + 1).abs().sum() == 0


# --------------------------------------------------------------------------
# The export route keeps its dtype checks true
# --------------------------------------------------------------------------
class ExportOnlyRotary(nn.Module):
    """Not fx-traceable (a Python check of a shape); computes frequencies with .float() as HF does."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)))
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        if x.shape[-1] != 8:
            raise ValueError("expected 8 features")
        pos = torch.arange(x.shape[1], dtype=torch.float32)
        freqs = pos[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat([freqs, freqs], -1)
        h = self.fc(x)
        return (h.float() * emb.cos()).sum(-1)


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_export_route_dtype_assertions_follow_the_rewrite(level):
    """torch.export's _assert_tensor_metadata nodes are rewritten or dropped, never left to fail; none is an unknown op."""
    torch.manual_seed(0)
    model, x = ExportOnlyRotary(), torch.randn(2, 5, 8)
    gm = amp_fx.convert(model, level, example_inputs=(x,))
    assert gm.amp_report.route == "torch.export"
    _close(gm(x), model(x), tol=0.05)
    unknown = gm.amp_report.passes["assign_precision"]["unknown_ops"]
    assert not any("assert" in op or "guard" in op.lower() for op in unknown), unknown
    for node in gm.graph.nodes:
        if node.meta.get(meta.OP) == "_assert_tensor_metadata" and isinstance(node.kwargs.get("dtype"), torch.dtype):
            assert node.kwargs["dtype"] == meta.float_dtype(node.args[0])


# --------------------------------------------------------------------------
# Placement of guarded casts
# --------------------------------------------------------------------------
class RepeatThenLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(128, 8)

    def forward(self, x):
        return self.l(x.repeat(1, 64))


@pytest.mark.parametrize("with_examples", [True, False])
def test_a_repeated_value_is_cast_after_the_repeat_as_autocast_does(with_examples):
    """Casting before the 64x repeat would move 64x fewer bytes, but the repeat's backward sums 64
    gradients, and that sum would run in bf16: the cast stays after it, and x.grad is autocast's."""
    torch.manual_seed(0)
    model, x = RepeatThenLinear(), torch.randn(4, 2)
    gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16, example_inputs=(x,) if with_examples else None)
    repeat = next(n for n in gm.graph.nodes if n.meta.get(meta.OP) == "repeat")
    assert not repeat.args[0].meta.get(meta.INSERTED), gm.code
    xi, xa = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = gm(xi)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = model(xa)
    assert torch.equal(out, ref.float())
    out.pow(2).sum().backward()
    ref.float().pow(2).sum().backward()
    assert torch.equal(xi.grad, xa.grad)


# --------------------------------------------------------------------------
# The analysis tells the truth
# --------------------------------------------------------------------------
def _check_predictions(gm: fx.GraphModule, inputs: tuple, exact: bool = True) -> int:
    """Run ``gm`` on ``inputs`` and compare every prediction with what ran (tests/fuzz/predictions.py's checker)."""
    recorder = Recorder(gm)
    recorder.run(*inputs)
    return check_predictions(gm, recorder, exact)


@pytest.mark.parametrize("name", sorted(zoo.CORE_MODELS))
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_predicted_dtypes_and_shapes_match_the_converted_module_on_the_zoo(name, level):
    """Node by node, the dtype and shape the analysis predicted are what the converted module produces."""
    model, example, _ = zoo.build(name)
    gm = amp_fx.convert(model, level, example_inputs=example)
    assert _check_predictions(gm, example) > 5


@pytest.mark.parametrize("seed", range(0, 200, 7))
def test_predicted_dtypes_match_on_random_graphs_with_random_input_dtypes(seed):
    """Random graphs, inputs fp32/bf16/fp16: where eager autocast runs, convert runs, and every prediction holds."""
    gm, (x,) = random_graph(seed, max_ops=10)
    dtype = random.Random(seed).choice([torch.float32, torch.bfloat16, torch.float16])
    x = x.to(dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = gm(x)
    converted = amp_fx.convert(gm, "O1", dtype=torch.bfloat16, example_inputs=(x,))
    out = converted(x)
    leaves = zip(pytree.tree_leaves(out), pytree.tree_leaves(eager), pytree.tree_leaves(gm(x.float())))
    for got, under_autocast, fp32 in leaves:
        assert got.is_floating_point() == under_autocast.is_floating_point() and got.shape == under_autocast.shape
        _close(got, fp32, tol=0.1)
    assert _check_predictions(converted, (x,)) >= 3
    # Without example inputs nothing is assumed about x, and what is predicted still holds.
    blind = amp_fx.convert(gm, "O1", dtype=torch.bfloat16)
    torch.testing.assert_close(blind(x), out, rtol=0, atol=0)
    _check_predictions(blind, (x,), exact=False)


class CastToOwnDtype(nn.Module):
    """Ends with ``h.to(h.dtype)`` / ``h.type_as(x)``: the target dtype is a run-time value."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.l = nn.Linear(4, 4)

    def forward(self, x):
        h = self.l(x)
        return h.to(h.dtype) if self.how == "to" else h.type_as(h)


@pytest.mark.parametrize("how", ["to", "type_as"])
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("with_examples", [True, False])
def test_a_cast_to_a_run_time_dtype_still_gets_the_exit_cast(how, level, with_examples):
    """``h.to(h.dtype)`` is a cast whose target the graph only knows at run time: outputs still come back fp32."""
    x = torch.randn(2, 4)
    gm = amp_fx.convert(CastToOwnDtype(how), level, example_inputs=(x,) if with_examples else None)
    assert gm(x).dtype == torch.float32


class FloatRotary(nn.Module):
    """Rotary frequencies computed after the model's own ``.float()`` casts (as HF Llama does), no autocast region."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)), persistent=False)
        self.q = nn.Linear(8, 8)

    def forward(self, x):
        pos = torch.arange(x.shape[1], device=x.device)
        freqs = pos[:, None].float() * self.inv_freq[None, :].float()
        return self.q(x), freqs.cos()


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_the_models_own_float_casts_keep_their_meaning_at_every_level(level):
    """O2/O3 do not cast the model's x.float() back down: cos runs fp32 (bitwise fp32), the GEMM still low."""
    model, x = FloatRotary(), torch.randn(2, 512, 8)
    _, cos_ref = model(x)
    gm = amp_fx.convert(model, level, example_inputs=(x,))
    q, cos = gm(x)
    assert torch.equal(cos, cos_ref)
    assert gm.amp_report.node("cos").dtype == "float32" and gm.amp_report.node("linear").decision == "low"


class ComplexRotary(nn.Module):
    """Meta-style RoPE: view_as_complex of the widened activation, times a complex buffer, back to real."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("freqs", torch.polar(torch.ones(4), torch.linspace(0, 3, 4)))

    def forward(self, x):
        h = self.fc(x)
        hc = torch.view_as_complex(h.float().reshape(-1, 4, 2))
        return torch.view_as_real(hc * self.freqs).flatten(-2).type_as(h)


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("with_examples", [True, False])
def test_complex_rope_converts_and_returns_fp32(level, with_examples):
    """view_as_complex / view_as_real: complex values are never cast, the real result is, and outputs come back fp32."""
    model, x = ComplexRotary(), torch.randn(3, 8)
    gm = amp_fx.convert(model, level, example_inputs=(x,) if with_examples else None)
    out = gm(x)
    assert out.dtype == torch.float32
    _close(out, model(x), tol=0.03)


def test_a_call_with_other_dtypes_than_the_example_inputs_is_refused():
    """Converted with fp32 examples, the softmax reads an fp32 value with no cast; a bf16 call would run it in bf16
    while the report says fp32. It is refused, naming the input and the fix; the examples' dtype still runs."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Softmax(-1))
    x = torch.randn(2, 4)
    gm = amp_fx.convert(model, "O1", example_inputs=(x,))
    assert gm(x).dtype == torch.float32
    with pytest.raises(TypeError, match=r"input 0 was torch.float32, and is called with torch.bfloat16"):
        gm(x.bfloat16())
    blind = amp_fx.convert(model, "O1")  # without example inputs any floating dtype works
    _close(blind(x.bfloat16()), model(x))


def test_the_report_says_a_guarded_cast_only_casts_floating_inputs():
    """O2 without example inputs: integer ids pass the entry's guarded cast unchanged, and the report says so."""

    class Ids(nn.Module):
        def __init__(self):
            super().__init__()
            self.e, self.l = nn.Embedding(10, 4), nn.Linear(4, 4)

        def forward(self, ids, x):
            return self.l(self.e(ids) + x)

    gm = amp_fx.convert(Ids(), "O2")
    entry = [r for r in gm.amp_report.nodes if r.inserted and r.reason.startswith("inserted: ids")]
    assert [r.dtype for r in entry] == ["bfloat16 if floating"]
    ids = torch.randint(0, 10, (3,))
    assert gm(ids, torch.randn(3, 4)).dtype == torch.float32


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_export_keeps_the_models_float_cast_it_dropped(level):
    """torch.export drops ``h.float()`` on an fp32 h and keeps only a dtype check; at O2/O3 the readers still get
    the fp32 the model asked for (rule 'model'), the GEMM still runs low."""
    model, x = ExportOnlyRotary(), torch.randn(2, 5, 8)
    gm = amp_fx.convert(model, level, example_inputs=(x,))
    readers = [r for r in gm.amp_report.nodes if r.rule == "model"]
    assert readers and all(r.dtype == "float32" for r in readers)
    assert all(r.decision == "low" for r in gm.amp_report.nodes if r.op in ("linear", "addmm", "mm"))
    _close(gm(x), model(x), tol=0.03)


class _ValuesIntoLinear(nn.Module):
    """``.values`` of max(dim)/sort/topk/cummax/median, taken from an fp32 LayerNorm, feeds a Linear."""

    def __init__(self, how: str):
        super().__init__()
        self.enc, self.norm, self.head, self.how = nn.Linear(32, 64), nn.LayerNorm(64), nn.Linear(64, 4), how

    def forward(self, x):
        h = self.norm(self.enc(x))
        if self.how == "max":
            v = h.max(dim=1).values
        elif self.how == "sort":
            v = h.sort(-1).values[:, 0]
        elif self.how == "topk":
            v = h.topk(3, dim=1).values[:, 0]
        elif self.how == "cummax":
            v = h.cummax(1).values[:, -1]
        else:
            v = h.median(1).values
        return self.head(v)


@pytest.mark.parametrize("examples", [False, True], ids=["dtype_only", "example_inputs"])
@pytest.mark.parametrize("how", ["max", "sort", "topk", "cummax", "median"])
def test_values_of_a_named_tuple_result_reach_a_gemm_cast(how, examples):
    """Without example inputs ``out.values`` was taken for a non-tensor: no cast, and the GEMM failed on mixed dtypes."""
    torch.manual_seed(0)
    model, x = _ValuesIntoLinear(how), torch.randn(8, 10, 32)
    gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16, example_inputs=(x,) if examples else None)
    xi, xa = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = gm(xi)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = model(xa)
    assert torch.equal(out, ref.float())
    out.sum().backward()
    ref.float().sum().backward()
    # CPU autocast runs the LayerNorm in bf16, amp_fx keeps it fp32: the input gradients differ by rounding,
    # so both are measured against fp32, and amp_fx's may not be the worse one.
    x32 = x.clone().requires_grad_()
    model(x32).sum().backward()
    error = lambda g: ((g - x32.grad).norm() / x32.grad.norm()).item()  # noqa: E731
    assert error(xi.grad) <= 1.1 * error(xa.grad) + 1e-6
