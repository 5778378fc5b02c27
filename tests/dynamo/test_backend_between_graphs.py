"""What Dynamo runs eagerly between the backend's graphs gets amp_fx's decisions (amp_fx.dynamo.between_graphs).

Measured at dispatch with amp_fx.coverage against eager autocast, the reference the tables follow for GEMMs.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import amp_fx
from amp_fx.inspection.coverage import GemmCounter

BF16 = torch.bfloat16


def _backend(**options):
    return amp_fx.backend(level="O1", dtype=BF16, inner="aot_eager", **options)


def _autocast_forward(model, *args):
    with torch.autocast("cpu", BF16):
        return amp_fx.coverage(model, *args)


def _grads(model, run):
    model.zero_grad()
    out = run()
    out.float().pow(2).sum().backward()
    return out.detach().float(), [p.grad.clone() for p in model.parameters()]


def _assert_within_autocast_error(model, compiled, args):
    """Output and gradients: no further from fp32's than twice eager autocast's distance (both round to bf16).

    The graphs and the eager mode round at the same ops as autocast, but not in the same order of fusion, so
    bit equality is not expected; a route that left the encoder fp32 or cast twice would be out of this bound
    in the other direction only through a wrong decision, which the coverage checks catch.
    """
    def autocast_run():
        with torch.autocast("cpu", BF16):
            return model(*args)

    exact = _grads(model, lambda: model(*args))
    reference = _grads(model, autocast_run)
    got = _grads(model, lambda: compiled(*args))
    for name, e, r, g in [("output", exact[0], reference[0], got[0]),
                          *[(n, *t) for n, t in zip([n for n, _ in model.named_parameters()],
                                                    zip(exact[1], reference[1], got[1]))]]:
        allowed = 2 * (r - e).abs().max() + 2 ** -8 * e.abs().max()
        assert (g - e).abs().max() <= allowed, name


def _autocast_training(model, *args):
    """Forward under autocast, backward outside it (as training does): GEMM FLOPs by dtype."""
    with GemmCounter() as counter:
        with torch.autocast("cpu", BF16):
            out = model(*args)
        out.float().sum().backward()
    return counter.coverage


class Encoder(nn.Module):
    """nn.TransformerEncoder with a causal mask: its mask check calls Tensor.item(), a graph break."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0), 2,
                                             enable_nested_tensor=False)
        self.head = nn.Linear(16, 8)

    def forward(self, x, mask):
        return self.head(self.encoder(self.embed(x), mask))


def _encoder_inputs():
    return torch.randn(5, 2, 8), nn.Transformer.generate_square_subsequent_mask(5)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_transformer_encoder_break_runs_its_gemms_low_as_autocast_does():
    """Training mode: the whole encoder runs eagerly after the .item() break; its GEMMs run bf16, as under autocast."""
    torch.manual_seed(0)
    model = Encoder().train()
    args = _encoder_inputs()
    be = _backend()
    compiled = torch.compile(model, backend=be)
    compiled(*args)
    report = be.report
    assert report.eager_decided
    (event,) = report.breaks
    assert event.kind == "graph break" and "Tensor.item()" in event.reason
    assert "amp_fx/" not in (event.at or "")  # the user's line, not amp_fx's mode that Dynamo traced through
    assert "eager, amp_fx's eager decisions: Dynamo broke the graph of forward" in str(report)
    reference = _autocast_forward(model, *args)
    got = amp_fx.coverage(compiled, *args)
    assert reference.low_share > 0.9  # the encoder is most of the GEMM FLOPs (without the mode: under 10%)
    assert got.flops == reference.flops and got.by_op == reference.by_op

    assert compiled(*args).dtype == torch.float32  # cast_model_outputs: the head's graph casts back
    _assert_within_autocast_error(model, compiled, args)


def test_transformer_encoder_eval_fast_path_matches_autocast():
    torch.manual_seed(0)
    model = Encoder().eval()
    args = _encoder_inputs()
    compiled = torch.compile(model, backend=_backend())
    with torch.no_grad():
        compiled(*args)
        got = amp_fx.coverage(compiled, *args)
        reference = _autocast_forward(model, *args)
    assert reference.low_share == 1.0 and got.flops == reference.flops


class LanguageModel(nn.Module):
    """Embedding -> LSTM -> Linear: without allow_rnn, Dynamo skips the whole forward."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.rnn = nn.LSTM(8, 16)
        self.head = nn.Linear(16, 20)

    def forward(self, tokens):
        return self.head(self.rnn(self.embed(tokens))[0])


class WordLanguageModel(nn.Module):
    """pytorch/examples' word-language model: the LSTM takes the hidden state; Dynamo breaks at it (step_unsupported)
    and runs the rest of forward, the decoder included, eagerly, with no resume function to compile."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.2)
        self.encoder = nn.Embedding(20, 8)
        self.rnn = nn.LSTM(8, 16, 2, dropout=0.2)
        self.decoder = nn.Linear(16, 20)

    def forward(self, tokens, hidden):
        output, hidden = self.rnn(self.drop(self.encoder(tokens)), hidden)
        return self.decoder(self.drop(output)), hidden


@pytest.mark.parametrize("build", [LanguageModel, WordLanguageModel])
def test_lstm_model_warns_nothing_converted_and_still_runs_low(build):
    torch.manual_seed(0)
    model = build()
    inputs = (torch.randint(0, 20, (4, 2)),)
    if build is WordLanguageModel:
        inputs += ((torch.zeros(2, 2, 16), torch.zeros(2, 2, 16)),)
    be = _backend()
    compiled = torch.compile(model, backend=be)
    with pytest.warns(amp_fx.NothingConvertedWarning, match="LSTM|step_unsupported") as caught:
        compiled(*inputs)
    assert "its ops got amp_fx's eager decisions" in str(caught[0].message)
    assert be.report.nothing_converted and be.report.eager_decided

    def loss(out):
        return (out[0] if isinstance(out, tuple) else out).float().sum()

    got = amp_fx.coverage(compiled, *inputs, loss_fn=loss)
    with GemmCounter() as counter:
        with torch.autocast("cpu", BF16):
            out = model(*inputs)
        loss(out).backward()
    reference = counter.coverage
    assert got.low_share == reference.low_share == 1.0  # without the eager mode: 0.0
    assert got.by_op.keys() == reference.by_op.keys()
    assert ("mkldnn_rnn_layer", "bfloat16") in got.by_op and ("mkldnn_rnn_layer_backward", "bfloat16") in got.by_op


class Block(nn.Module):
    """A submodule whose forward breaks the graph (a print) and calls a function Dynamo must not compile."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 8)
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        if h.sum() > 0:  # data-dependent: a graph break
            h = h * 2
        print("", end="")  # an unsupported call: another break
        h = torch.softmax(self.fc2(h), dim=-1)  # after the breaks: a resume function's graph decides these
        return self._eager_projection(h)

    @torch.compiler.disable
    def _eager_projection(self, h):
        # Dynamo runs this eagerly: the mode decides it (linear low; log_softmax fp32 as in the tables).
        return torch.log_softmax(self.proj(h), dim=-1)


class WithBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.block = Block()

    def forward(self, x):
        return self.block(self.inp(x)).sum(-1)


def test_breaks_inside_a_submodule_ops_after_them_get_decisions():
    torch.manual_seed(0)
    model = WithBlock()
    x = torch.randn(3, 4)
    be = _backend()
    compiled = torch.compile(model, backend=be)
    compiled(x)
    assert len(be.report.breaks) >= 2 and all(b.kind == "graph break" for b in be.report.breaks)
    reference = _autocast_training(model, x)
    got = amp_fx.coverage(compiled, x, backward=True)
    assert got.flops == reference.flops and reference.low_share == 1.0

    # The eager projection's log_softmax ran fp32 (the tables), its linear bf16: the output is fp32.
    assert compiled(x).dtype == torch.float32
    _assert_within_autocast_error(model, compiled, (x,))


def test_graph_ops_are_not_decided_twice():
    """A model Dynamo captures whole runs no op through the eager mode: each GEMM's inputs are cast once, in the graph."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    be = _backend()
    compiled = torch.compile(model, backend=be)
    compiled(x)
    before = be.eager_decisions.decided
    copies = _count_casts(lambda: compiled(x))
    assert be.eager_decisions.decided == before  # nothing reached the mode: every op ran in the graph
    # Casts at dispatch: x, two weights, two biases to bf16, the last output back to fp32: 6, as the report says.
    assert copies == be.report.totals()["casts_inserted"] == 6


def test_eager_ops_are_decided_and_graph_ops_are_not():
    torch.manual_seed(0)
    model = WithBlock()
    x = torch.randn(3, 4)
    be = _backend()
    compiled = torch.compile(model, backend=be)
    compiled(x)
    before = be.eager_decisions.decided
    compiled(x)
    # The eager code between the graphs: the `h.sum() > 0` branch's bool(), and the disabled function's linear and
    # log_softmax; no op of a graph.
    assert 2 <= be.eager_decisions.decided - before <= 4


def _count_casts(run) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Casts(TorchDispatchMode):
        count = 0

        @classmethod
        def ignore_compile_internals(cls):
            return True

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default:
                Casts.count += 1
            return func(*args, **(kwargs or {}))

    with Casts():
        run()
    return Casts.count


def test_policy_rules_apply_between_graphs():
    """Op rules, and module rules by the modules on the Python stack: the eager projection is block.proj."""
    torch.manual_seed(0)
    model = WithBlock()
    x = torch.randn(3, 4)
    compiled = torch.compile(model, backend=_backend(policy={"op:linear": "fp32"}))
    compiled(x)
    assert amp_fx.coverage(compiled, x).low_share == 0.0  # the eager projection's linear too

    torch._dynamo.reset()
    be = _backend(policy={"module:block.proj": "fp32"})
    compiled = torch.compile(model, backend=be)
    with warnings.catch_warnings():
        warnings.simplefilter("error", amp_fx.BetweenGraphsWarning)  # the rule reaches its module: nothing to say
        compiled(x)
        cov = amp_fx.coverage(compiled, x)
    proj = 2 * 3 * 8 * 8
    assert cov.by_op[("addmm", "float32")] == proj and cov.flops["bfloat16"] == cov.total - proj


def test_module_rules_that_cannot_reach_an_eager_gemm_warn_once():
    """A compiled function's own eager GEMM sits in no module of the model: a module rule cannot reach it."""
    torch.manual_seed(0)
    layer = nn.Linear(4, 4)

    @torch.compiler.disable
    def eager_gemm(h):
        return h @ layer.weight.T

    def step(x):
        return eager_gemm(layer(x)).sum()

    compiled = torch.compile(step, backend=_backend(policy={"module:head": "fp32"}))
    x = torch.randn(2, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(x)
        compiled(x)
    mine = [w for w in caught if issubclass(w.category, amp_fx.BetweenGraphsWarning)]
    assert len(mine) == 1
    text = str(mine[0].message)
    assert text.startswith(f"matmul at {__file__}:")
    assert "policy module 'head' -> fp32" in text and "amp_fx.coverage" in text


def test_writes_into_out_and_in_place_keep_their_tensors():
    """An eager mm into out= and an in-place addmm_ write the user's fp32 tensors: the mode casts neither."""
    torch.manual_seed(0)
    weight = torch.randn(4, 4)

    @torch.compiler.disable
    def eager(h, out):
        torch.mm(h, weight, out=out)
        return out.addmm_(h, weight)

    def step(x, out):
        return eager(torch.relu(x), out) * 2

    x, out = torch.randn(3, 4), torch.zeros(3, 4)
    with pytest.warns(amp_fx.NothingConvertedWarning):  # no graph holds a GEMM: said, as ever
        result = torch.compile(step, backend=_backend())(x, out)
    expected = torch.relu(x) @ weight * 2  # mm writes h @ W, addmm_ adds it again
    # fp32 kernels (addmm's accumulation order may differ from mm's by an ulp); bf16 would be ~2**-8 off.
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    assert result.dtype == torch.float32 and torch.equal(result, out * 2)


def test_level_o0_enters_no_mode():
    model = WithBlock()
    x = torch.randn(3, 4)
    be = amp_fx.backend(level="O0", inner="aot_eager")
    compiled = torch.compile(model, backend=be)
    compiled(x)
    assert not be.report.eager_decided
    assert amp_fx.coverage(compiled, x).low_share == 0.0


def test_no_compile_entry_to_enter_from_warns_once():
    """attach() outside any torch.compile call (no context to hook): the eager ops would run fp32, said once."""
    from amp_fx.dynamo import between_graphs

    be = _backend()
    with pytest.warns(amp_fx.BetweenGraphsWarning, match="run in fp32") as caught:
        between_graphs.attach(be)
    with warnings.catch_warnings():
        warnings.simplefilter("error", amp_fx.BetweenGraphsWarning)
        between_graphs.attach(be)  # once per backend
    text = str(caught[0].message)
    assert "found no torch.compile context" in text and "amp_fx.coverage" in text and "amp_fx.convert" in text
    assert not be.report.eager_decided


class Fp32Region(nn.Module):
    """The user's own ``torch.autocast(enabled=False)`` region, in a method Dynamo does not compile."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 8)

    @torch.compiler.disable
    def region(self, h):
        with torch.autocast("cpu", enabled=False):
            return self.b(h.float())

    def forward(self, x):
        return self.c(self.region(self.a(x)))


@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")  # FlopCounterMode's
def test_the_users_autocast_region_keeps_its_meaning_between_graphs():
    """enabled=False means fp32 there, under autocast and so between graphs; under a dispatch mode (which makes
    Dynamo run every frame eagerly) as well."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    model, x = Fp32Region(), torch.randn(4, 16)
    compiled = torch.compile(model, backend=_backend())
    compiled(x)
    reference = _autocast_forward(model, x)
    assert reference.by_op == {("addmm", "bfloat16"): 2 * 4 * 16 * 32 + 2 * 4 * 32 * 8, ("addmm", "float32"): 2 * 4 * 32 * 32}
    assert amp_fx.coverage(compiled, x).by_op == reference.by_op
    with torch.autocast("cpu", BF16):
        expected = model(x).float()
    with FlopCounterMode(display=False):  # Dynamo runs the frames eagerly, under the mode
        assert torch.equal(compiled(x).float(), expected)


class LinearThenRnn(nn.Module):
    """A Linear (run low) feeds the RNN: torch's RNN dtype check refuses bf16 input with fp32 weights unless autocast."""

    def __init__(self, kind):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.rnn = getattr(nn, kind)(16, 16, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.rnn(self.embed(x))[0][:, -1])


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
def test_rnn_fed_a_low_input_runs_as_under_autocast(kind):
    torch.manual_seed(0)
    model, x = LinearThenRnn(kind), torch.randn(2, 5, 8)
    be = _backend()
    compiled = torch.compile(model, backend=be)
    with pytest.warns(amp_fx.NothingConvertedWarning):
        assert compiled(x).dtype == BF16  # eager: the head's output stays as autocast's
    reference = _autocast_training(model, x)
    with GemmCounter() as counter:
        compiled(x).float().sum().backward()
    assert reference.low_share == 1.0
    assert counter.coverage.flops == reference.flops
    _assert_within_autocast_error(model, compiled, (x,))


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])
def test_transformer_encoder_layer_fast_path_in_a_graph_runs_low_as_autocast_does(grad_mode):
    """Eval without grad and without a mask: Dynamo captures the fused _transformer_encoder_layer_fwd in the graph; fed
    a low input (the Linear before it ran bf16) it needs its weights low too, as autocast runs its GEMMs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)).eval()
    x = torch.randn(2, 6, 32)
    compiled = torch.compile(model, backend=_backend())
    with grad_mode():
        got = compiled(x)
        with torch.autocast("cpu", BF16):
            reference = model(x)
        exact = model(x)
    assert reference.dtype == BF16  # the graph casts its output back (cast_model_outputs)
    allowed = 2 * (reference.float() - exact).abs().max() + 2 ** -8 * exact.abs().max()
    assert (got.float() - exact).abs().max() <= allowed


class MatmulFn(torch.autograd.Function):
    """A custom Function doing ``x @ w``: Dynamo keeps it as one autograd_function_apply node."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad @ w.t(), x.t() @ grad


class WithMatmulFn(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.w = nn.Linear(16, 32), nn.Parameter(torch.randn(32, 32) * 0.1)

    def forward(self, x):
        return MatmulFn.apply(self.a(x), self.w)


@pytest.mark.parametrize("decision, dtype", [("fp32", torch.float32), ("low", BF16)])
def test_policy_op_rule_names_a_custom_function_on_the_backend_route(decision, dtype):
    """policy={"op:MatmulFn": ...} decides the Function's node, as on convert (without it: bf16 x @ fp32 w)."""
    torch.manual_seed(0)
    model, x = WithMatmulFn(), torch.randn(4, 16)
    be = _backend(policy={"op:MatmulFn": decision}, cast_model_outputs=False)
    out = torch.compile(model, backend=be)(x)
    out.float().sum().backward()
    assert out.dtype == dtype and model.w.grad.dtype == torch.float32
    assert [r.decision for r in be.report.graphs[0].report.nodes if r.op == "MatmulFn"] == [decision]


class PythonTensorMethods(nn.Module):
    """Tensor methods torch writes in Python (``unflatten``, ``split``, ``__rsub__``) between two Linears."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        heads = self.fc1(x).unflatten(-1, (4, 4))  # Tensor.unflatten ends in super().unflatten(...)
        first, second = heads.flatten(-2).split(8, dim=-1)
        return self.fc2(1 - torch.cat([second, first], dim=-1))


def test_the_eager_mode_costs_no_graph_break_on_tensor_methods_written_in_python():
    """Rule: the mode on the stack while Dynamo traces breaks no graph that tracing without it would not break.

    A Python-written Tensor method reaches a torch function mode as a Python
    function; called as such, Dynamo inlined its ``super().unflatten`` and broke
    the graph there (an encoder block compiled as two graphs, its qkv output
    leaving the first in fp32).  One graph, both GEMMs low, as autocast decides.
    """
    graphs = []

    def inner(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model, x = PythonTensorMethods(), torch.randn(2, 3, 16)
    compiled = torch.compile(model, backend=amp_fx.backend(level="O1", dtype=BF16, inner=inner))
    out = compiled(x)
    assert len(graphs) == 1
    report = amp_fx.last_report()
    assert len(report.graphs) == 1
    assert not report.breaks
    assert out.dtype == torch.float32  # the graph's output is cast back as the model's
    gemms = [n for n in graphs[0].graph.nodes if n.op == "call_function" and n.target is torch._C._nn.linear]
    assert len(gemms) == 2
    assert all(n.args[0].meta["example_value"].dtype == BF16 for n in gemms)
    _assert_within_autocast_error(model, compiled, (x,))
