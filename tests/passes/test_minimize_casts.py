"""Tests for passes/minimize_casts: the min-cut placement beats or equals the greedy paint, exactly where it should.

``check()`` wraps tests/pass_check.py's contract (after torch's
test_cse_pass): the pass adds no node (it only repaints), reports ``modified``
truthfully, a second run changes nothing, the graph lints, and the finished
rewrite is within bf16 tolerance of fp32.  Its own extras: ``modified`` is
"some node moved", the moved count, and a second run measures the same bytes.
Byte counts are asserted exactly, computed in the test from the tensor sizes:
a cast reads fp32 (4 B) and writes bf16 (2 B) or the reverse, so it moves 6 B
per element.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import amp_fx
import zoo
from amp_fx.ir import meta
from amp_fx.ir.config import make_config
from amp_fx.ir.pass_manager import PassContext, run_passes
from amp_fx.converter.pipeline import build_pipeline, rewrite_graph
from amp_fx.passes.assign_precision import assign_precision
from amp_fx.passes.dedupe_casts import dedupe_casts
from amp_fx.passes.fold_casts import fold_casts
from amp_fx.passes.insert_casts import insert_casts
from amp_fx.passes.analyse_dtypes import analyse_dtypes
from amp_fx.passes.minimize_casts import build_problem, cost_view, minimize_casts
from amp_fx.passes.propagate_meta import propagate_meta
from pass_check import run_checked
from random_cast_graphs import random_graph

CAST = 6  # bytes a fp32<->bf16 cast moves per element


class _Recorder(fx.Interpreter):
    """Stores each node's real value as its example value (cheaper than FakeTensor propagation on tiny graphs)."""

    def run_node(self, node):
        value = super().run_node(node)
        node.meta["val"] = value
        return value


def _context(gm: fx.GraphModule, example: tuple, **overrides) -> PassContext:
    config = make_config("O1", dtype=torch.bfloat16, **{"cast_model_outputs": False, **overrides})
    return PassContext(config=config, example_inputs=example)


def _close(actual, expected, tol: float = 0.05) -> None:
    actual = actual if isinstance(actual, tuple) else (actual,)
    expected = expected if isinstance(expected, tuple) else (expected,)
    for got, want in zip(actual, expected):
        scale = 1.0 + want.abs().max().item()
        assert (got.float() - want).abs().max().item() <= tol * scale


def check(gm: fx.GraphModule, example: tuple, *, moved: int | None = None, **overrides) -> tuple[dict, fx.GraphModule]:
    """Run minimize_casts on ``gm`` and check the pass contract and its extras; return its stats and the finished module.

    ``moved``: how many nodes the pass must repaint (None: any number).
    """
    reference = copy.deepcopy(gm)  # the fp32 graph
    ctx = _context(gm, example, **overrides)
    gm = run_passes(gm, ctx, [propagate_meta, assign_precision])
    # The contract: no node added (it only repaints), modified == the paint changed, lint, a second run
    # changes nothing; the casts written, outputs and gradients within bf16 tolerance of fp32 (0.05 of
    # max(1, |fp32|): tighter than the 0.05 of 1 + |fp32| this helper asked of outputs alone before).
    checked = run_checked(minimize_casts, gm, ctx, delta=0, model=reference, inputs=example,
                          finish=lambda done: run_passes(done, ctx, [insert_casts, dedupe_casts, fold_casts]))
    result, again = checked.result, checked.again
    assert result.modified == (result.stats["moved"] > 0)
    if moved is not None:
        assert result.stats["moved"] == moved
    assert again.stats["cast_bytes_min_cut"] == result.stats["cast_bytes_min_cut"]
    return result.stats, checked.graph_module


def _measured(model: nn.Module, example: tuple, minimize: bool, **kwargs) -> amp_fx.AmpGraphModule:
    return amp_fx.convert(model, "O1", dtype=torch.bfloat16, example_inputs=example, minimize_casts=minimize,
                          **{"cast_model_outputs": False, **kwargs})


# --------------------------------------------------------------------------
# Hand-built graphs where the greedy paint casts more than it needs to
# --------------------------------------------------------------------------
class HandBias(nn.Module):
    """x @ W1 + b1 then @ W2: the bias add runs fp32 (as autocast's promotion does), its sum is cast down."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(16, 32) * 0.3)
        self.b1 = nn.Parameter(torch.randn(32))
        self.w2 = nn.Parameter(torch.randn(32, 8) * 0.3)

    def forward(self, x):
        return (x @ self.w1 + self.b1) @ self.w2


class FanOut(nn.Module):
    """An fp32 layer_norm read by two FOLLOW ops that feed two Linears: tanh computes, so it stays fp32."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 8)
        self.b = nn.Linear(16, 8)

    def forward(self, x):
        h = F.layer_norm(x, (16,))
        return self.a(F.relu(h)) + self.b(torch.tanh(h))


class Broadcast(nn.Module):
    """An fp32 row sum expanded to (4, 16) before a Linear: greedy casts after the expand."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 8)

    def forward(self, x):
        return self.proj(x.sum(-1, keepdim=True).expand(-1, 16))


class FanIn32(nn.Module):
    """A low Linear read by two FOLLOW ops that feed fp32 ops: greedy casts each branch up."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 8)

    def forward(self, x):
        h = self.proj(x)
        return torch.softmax(F.relu(h), -1) + F.layer_norm(torch.tanh(h), (8,))


X = (4, 16)
# (model, greedy cast elements, optimal cast elements, nodes moved); weight casts are in both.
HAND_BUILT = [
    (FanIn32, 4 * 16 + 8 * 16 + 8 + 2 * 4 * 8, 4 * 16 + 8 * 16 + 8 + 4 * 8, 2),
]


@pytest.mark.parametrize("factory,greedy,optimal,moved", HAND_BUILT, ids=[h[0].__name__ for h in HAND_BUILT])
def test_hand_built_graph_reaches_the_optimum(factory, greedy, optimal, moved):
    """The greedy paint needs more cast bytes than the optimum; the pass finds the optimum, byte for byte."""
    model, example = factory(), (torch.randn(*X),)
    stats, _ = check(fx.symbolic_trace(model), example, moved=moved)
    assert stats["cast_bytes_greedy"] == greedy * CAST
    assert stats["cast_bytes_min_cut"] == optimal * CAST
    # The cut's own cost model counts the same casts but the weights' (not free to move): byte for byte.
    # (Mutation testing: cost() was only ever compared with itself, so an offset or a dropped term survived.)
    weights = sum(p.numel() for p in model.parameters())
    assert (stats["model_bytes_greedy"], stats["model_bytes_min_cut"]) == ((greedy - weights) * CAST,
                                                                           (optimal - weights) * CAST)
    # The conversion's own report agrees, and minimize_casts=False keeps the greedy casts.
    assert _measured(model, example, True).amp_report.cast_bytes == optimal * CAST
    assert _measured(model, example, False).amp_report.cast_bytes == greedy * CAST


def test_reasons_say_placed_by_min_cut():
    """Moved nodes say so in the report: 'placed fp32: min-cut', with the bytes saved in one line."""
    converted = _measured(FanIn32(), (torch.randn(*X),), True)
    relu, tanh = converted.amp_report.node("relu"), converted.amp_report.node("tanh")
    for record in (relu, tanh):
        assert (record.decision, record.reason, record.rule, record.dtype) == ("fp32", "placed fp32: min-cut", "min-cut", "float32")
    line = converted.amp_report.passes["minimize_casts"]["report_lines"][0]
    assert line == "cast bytes per forward 1,584 greedy -> 1,392 min-cut (192 saved, 12%); 2 nodes moved: 0 to low, 2 to fp32"
    assert "minimize_casts: " + line in str(converted.amp_report)


def test_without_example_inputs_sizes_are_estimated():
    """No example inputs: activation sizes fall back to estimates, the report says so, the placement is the same."""
    model, x = FanIn32(), torch.randn(*X)
    estimated = amp_fx.convert(model, "O1", dtype=torch.bfloat16, cast_model_outputs=False)
    stats = estimated.amp_report.passes["minimize_casts"]
    assert stats["sizes_estimated"] and stats["moved"] == 2 and stats["cast_bytes_min_cut"] < stats["cast_bytes_greedy"]
    assert stats["report_lines"][0].startswith("cast bytes per forward ~") and "(sizes estimated" in stats["report_lines"][0]
    exact = _measured(model, (x,), True)
    assert [r.decision for r in estimated.amp_report.nodes if r.rule == "min-cut"] == ["fp32", "fp32"]
    assert {r.name for r in estimated.amp_report.nodes if r.rule == "min-cut"} == {r.name for r in exact.amp_report.nodes if r.rule == "min-cut"}
    torch.testing.assert_close(estimated(x), exact(x), rtol=0, atol=0)


class Residual(nn.Module):
    """A residual stream: each ``x + f(x)`` adds an fp32 stream to a low branch (autocast promotes it to fp32)."""

    def __init__(self, d: int = 16, layers: int = 6):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.head = nn.Linear(d, 4)
        for layer in self.layers:
            nn.init.normal_(layer.weight, std=0.01)

    def forward(self, x):
        for layer in self.layers:
            x = x + 0.1 * torch.tanh(layer(x))
        return self.head(x)


@pytest.mark.parametrize("factory", [HandBias, FanOut, Residual], ids=lambda f: f.__name__)
def test_never_computes_lower_than_the_tables(factory):
    """Moving casts never rounds what an op computes with: a bias add, a tanh and a residual stream stay fp32.

    Moving them low would save bytes, but would compute them from rounded fp32
    inputs, less precise than the tables and autocast (a 12-layer residual
    network measured twice autocast's error that way). The outputs and the
    gradients are bitwise those of minimize_casts=False, and of autocast.
    """
    torch.manual_seed(0)
    model, x = factory(), torch.randn(*X) * 30
    on = amp_fx.convert(model, "O1", dtype=torch.bfloat16, example_inputs=(x,))
    off = amp_fx.convert(model, "O1", dtype=torch.bfloat16, example_inputs=(x,), minimize_casts=False)
    assert not any(r.rule == "min-cut" and r.decision == "low" for r in on.amp_report.nodes)
    results = []
    for module in (on, off):
        xi = x.clone().requires_grad_()
        out = module(xi)
        results.append((out, *torch.autograd.grad(out.sum(), [xi, *model.parameters()])))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = model(x)
    assert torch.equal(results[0][0], reference.float())


def test_moved_to_fp32_and_switched_off():
    """FanIn32 moves its FOLLOW ops to fp32; minimize_casts=False leaves them following their low input."""
    model, example = FanIn32(), (torch.randn(*X),)
    on, off = _measured(model, example, True), _measured(model, example, False)
    assert on.amp_report.node("relu").decision == "fp32" and on.amp_report.node("relu").dtype == "float32"
    assert off.amp_report.node("relu").decision == "follow" and off.amp_report.node("relu").dtype == "bfloat16"
    assert "minimize_casts" not in off.amp_report.passes
    torch.testing.assert_close(on(*example), off(*example), rtol=0.02, atol=0.02)


def test_policy_pinned_nodes_never_move():
    """A node pinned by the policy keeps its paint even where moving it would save bytes."""
    example = (torch.randn(*X),)
    converted = _measured(FanOut(), example, True, policy={"op:relu": "follow"})
    relu, tanh = converted.amp_report.node("relu"), converted.amp_report.node("tanh")
    assert (relu.decision, relu.rule, relu.dtype) == ("follow", "policy", "float32")
    # tanh alone gains nothing (layer_norm's cast would replace tanh's), so nothing moves.
    assert tanh.decision == "follow" and converted.amp_report.passes["minimize_casts"]["moved"] == 0


class WrittenInPlace(FanOut):
    """FanOut, but a view of the layer_norm output is scaled in place before tanh reads it."""

    def forward(self, x):
        h = F.layer_norm(x, (16,))
        r = F.relu(h)
        h.view(4, 16).mul_(2)
        return self.a(r) + self.b(torch.tanh(h))


def test_values_written_in_place_are_not_moved():
    """Casting h for a moved reader would copy it before the in-place write: nothing around h moves."""
    model, example = WrittenInPlace(), (torch.randn(*X),)
    stats, _ = check(fx.symbolic_trace(model), example, moved=0)
    assert stats["cast_bytes_min_cut"] == stats["cast_bytes_greedy"]
    torch.testing.assert_close(_measured(model, example, True)(*example).float(), model(*example), rtol=0.05, atol=0.05)


class IntegerPath(nn.Module):
    """Integer ids flow through FOLLOW ops beside the float path; they carry no cost and are never painted."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 16)
        self.proj = nn.Linear(16, 8)

    def forward(self, ids, x):
        shifted = (ids + 1).clamp(max=9)
        return self.proj(F.layer_norm(x + self.embed(shifted), (16,)).sum(-1, keepdim=True).expand(-1, -1, 16))


def test_integer_values_carry_no_cost_and_keep_their_paint():
    example = (torch.randint(0, 9, (2, 3)), torch.randn(2, 3, 16))
    gm = fx.symbolic_trace(IntegerPath())
    stats, finished = check(gm, example, moved=0)  # the expand's backward sums: it stays fp32
    ctx = _context(gm, example)
    gm = run_passes(fx.symbolic_trace(IntegerPath()), ctx, [propagate_meta, assign_precision, analyse_dtypes])
    paint = {n: n.meta["amp_fx.decision"] for n in gm.graph.nodes}
    problem, free = build_problem(gm, ctx, paint, cost_view(gm, ctx, dict(paint)))
    integer = [n for n in gm.graph.nodes if meta.is_float(n) is False]
    assert integer and not set(integer) & (set(problem.weight) | set(free))
    # x + embed is free but stays fp32 (it feeds layer_norm); ids + 1 and clamp are integer: not free.
    assert {n.name for n in free} == {"add_1", "expand"}


# --------------------------------------------------------------------------
# Random graphs
# --------------------------------------------------------------------------
def _rewritten(seed: int, minimize: bool):
    gm, example = random_graph(seed, max_ops=10)
    _Recorder(gm).run(*example)
    # Without fuse_precision: the bytes compared are the ones the min-cut measured, before a fused norm drops casts.
    ctx = _context(gm, example, minimize_casts=minimize, fuse_precision=False)
    return rewrite_graph(gm, ctx, own_params=False)[1], gm, example


@pytest.mark.parametrize("first", [0, 100, 200])
def test_random_graphs_never_cost_more_than_greedy(first):
    """300 seeded random graphs (three tests of 100): min-cut bytes <= greedy bytes, lint clean, bf16-close to fp32.

    The greedy bytes are the pass's own measurement; every third graph is
    also converted with minimize_casts=False to check that measurement.
    """
    wins = 0
    for seed in range(first, first + 100):
        report, converted, example = _rewritten(seed, True)
        stats = report.passes["minimize_casts"]
        placed_bytes = report.cast_bytes or 0  # None: no cast at all
        assert stats["cast_bytes_min_cut"] == placed_bytes <= stats["cast_bytes_greedy"], seed
        if seed % 3 == 0:
            assert stats["cast_bytes_greedy"] == (_rewritten(seed, False)[0].cast_bytes or 0), seed
        converted.graph.lint()
        _close(converted(*example), random_graph(seed, max_ops=10)[0](*example))
        wins += placed_bytes < stats["cast_bytes_greedy"]
        # PROMOTE semantics: a promote op is never repainted.
        assert all(r.decision == "promote" for r in report.nodes if r.op in ("cat", "addcmul")), seed
    # (How often the min-cut wins depends on the seeds: moves that would compute or sum gradients
    # lower than the tables are forbidden; FanIn32 above shows a win byte for byte.)


def test_random_graphs_second_run_changes_nothing():
    for seed in range(0, 300, 5):
        gm, example = random_graph(seed, max_ops=10)
        _Recorder(gm).run(*example)
        check(gm, example)


def test_min_cut_equals_brute_force_on_the_model():
    """The cut network encodes the cost model: its optimum equals exhaustive search over the free nodes."""
    checked = 0
    for seed in range(120):
        gm, example = random_graph(seed, max_ops=10)
        _Recorder(gm).run(*example)
        ctx = _context(gm, example)
        gm = run_passes(gm, ctx, [propagate_meta, assign_precision])
        paint = {n: n.meta["amp_fx.decision"] for n in gm.graph.nodes}
        problem, _ = build_problem(gm, ctx, paint, cost_view(gm, ctx, dict(paint)))
        if not problem.free or len(problem.free) > 10:
            continue
        best = min(problem.cost(dict(zip(problem.free, sides))) for sides in itertools.product((0, 1), repeat=len(problem.free)))
        assert problem.cost(problem.solve()) == best <= problem.cost({}), seed
        checked += 1
    assert checked >= 60


# --------------------------------------------------------------------------
# Real models and the pipeline
# --------------------------------------------------------------------------
def test_level_defaults_and_pipeline_position():
    """On by default at O1 (where FOLLOW ops abound), off at O2/O3; it runs just before insert_casts (fuse_precision and
    retarget_dtype_constants between: both read the final paint)."""
    assert make_config("O1").minimize_casts and not make_config("O2").minimize_casts
    assert not make_config("O1", minimize_casts=False).minimize_casts
    names = [p.__name__ for p in build_pipeline(make_config("O1"), own_params=False)]
    assert names[names.index("minimize_casts") + 1:names.index("insert_casts")] == ["fuse_precision", "retarget_dtype_constants"]


@pytest.mark.parametrize("name", ["sdpa", "encoder"])
def test_zoo_transformers_report_their_cast_bytes(name):
    """The zoo's attention models: greedy (plus dedupe_casts) is already minimal there, and the report says so."""
    model, example, _ = zoo.build(name)
    on, off = _measured(model, example, True), _measured(model, example, False)
    stats = on.amp_report.passes["minimize_casts"]
    assert stats["cast_bytes_greedy"] == off.amp_report.cast_bytes == stats["cast_bytes_min_cut"] == on.amp_report.cast_bytes
    assert stats["free_nodes"] > 5 and stats["moved"] == 0
    assert f"minimize_casts: cast bytes per forward {off.amp_report.cast_bytes:,}" in str(on.amp_report)
    assert torch.equal(on(*example), off(*example))


class BiasMLPBlock(zoo.SDPABlock):
    """SDPABlock whose MLP layers keep their biases apart (bias-free Linear, then + b), as some checkpoints do."""

    def __init__(self, d: int = 32, heads: int = 4):
        super().__init__(d, heads)
        self.mlp_in = nn.Linear(d, 2 * d, bias=False)
        self.mlp_in_bias = nn.Parameter(torch.randn(2 * d) * 0.1)
        self.mlp_out = nn.Linear(2 * d, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_out(F.gelu(self.mlp_in(self.norm2(x)) + self.mlp_in_bias))


def test_transformer_block_with_separate_bias_keeps_the_bias_add_fp32():
    """A transformer block whose MLP adds a separate fp32 bias: the add stays fp32, as autocast runs it.

    Casting the (64,) bias instead of the (2, 6, 64) sum would save bytes but
    add in low precision; the min-cut leaves it, and the output is bitwise the
    greedy placement's.
    """
    torch.manual_seed(0)
    model, example = BiasMLPBlock(), zoo.SDPABlock.example()
    on, off = _measured(model, example, True), _measured(model, example, False)
    assert on.amp_report.node("add_1").decision != "low" and on.amp_report.node("add_1").dtype == "float32"
    assert on.amp_report.cast_bytes <= off.amp_report.cast_bytes
    assert torch.equal(on(*example), off(*example))


class TableLookup(nn.Module):
    """A learned table read by index (a Swin-style bias table): the gather's backward sums into 4 rows."""

    def __init__(self):
        super().__init__()
        self.table, self.proj = nn.Parameter(torch.randn(4, 16)), nn.Linear(16, 16)
        self.register_buffer("idx", torch.arange(256) % 4)

    def forward(self, x):
        return self.proj(self.table[self.idx]) * x


class TokenExpand(nn.Module):
    """A learned token broadcast over the batch (a CLS token): the expand's backward sums over it."""

    def __init__(self):
        super().__init__()
        self.token, self.proj = nn.Parameter(torch.randn(1, 16)), nn.Linear(16, 16)

    def forward(self, x):
        return self.proj(self.token.expand(x.shape[0], 16)) * x


@pytest.mark.parametrize("minimize", [True, False], ids=["min_cut", "greedy"])
@pytest.mark.parametrize("factory", [TableLookup, TokenExpand], ids=lambda f: f.__name__)
def test_gathered_and_broadcast_weights_sum_their_gradients_in_fp32_as_autocast(factory, minimize):
    """Casting a weight before a gather or an expand is the same forward, but its backward would sum in bf16."""
    torch.manual_seed(0)
    model, x = factory(), torch.randn(256, 16)
    gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16, minimize_casts=minimize)
    out = gm(x)
    grads = torch.autograd.grad(out.sum(), list(model.parameters()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = model(x)
    assert torch.equal(out, ref.float())
    for got, want in zip(grads, torch.autograd.grad(ref.float().sum(), list(model.parameters()))):
        assert torch.equal(got, want)


# --------------------------------------------------------------------------
# A size-growing cat of copies (issue 23, item 6)
# --------------------------------------------------------------------------
class CatCopies(nn.Module):
    """``proj(cat([x] * 64, 1))`` (``stack`` then ``flatten`` too; or of ``relu(x)``): the Linear reads 64 copies of x."""

    def __init__(self, op: str = "cat", relu: bool = False, copies: int = 64, width: int = 4):
        super().__init__()
        self.op, self.relu, self.copies = op, relu, copies
        self.proj = nn.Linear(copies * width, 8)

    def forward(self, x):
        h = torch.relu(x) if self.relu else x
        if self.op == "cat":
            return self.proj(torch.cat([h] * self.copies, 1))
        return self.proj(torch.stack([h] * self.copies, 1).flatten(1))


X_COPIED = (4, 4)
# cast elements per forward: the (4, 256) copies, the (8, 256) weight and the (8,) bias; the
# placement before the copies would cast the (4, 4) x instead of the copies (64x fewer there).
CAST_AFTER_COPIES = 4 * 256 + 8 * 256 + 8
CAST_BEFORE_COPIES = 4 * 4 + 8 * 256 + 8


def _output_and_grads(module, model, x):
    xi = x.clone().requires_grad_()
    out = module(xi)
    out = out.float() if out.dtype != torch.float64 else out
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)  # the same in fp64
    return (out, *torch.autograd.grad(out, [xi, *model.parameters()], g))


def _autocast(model):
    def run(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x)
    return run


@pytest.mark.parametrize("relu", [False, True], ids=["x", "relu_x"])
@pytest.mark.parametrize("op", ["cat", "stack"])
@pytest.mark.parametrize("example", [True, False], ids=["known_dtypes", "guarded"])
def test_copies_keep_the_cast_after_them_and_sum_their_gradient_in_fp32(example, op, relu):
    """A cat of 64 copies of x keeps its cast after the cat, on both routes: its backward sums 64 gradients into x.

    Casting x before the cat would cast 64x fewer bytes there, with the same
    forward; but autograd sums the gradients of the 64 copies into the cast
    of x, and in bf16 that sum rounds 63 times (x.grad measured 3.6x further
    from fp64 than autocast's, which sums in fp32).  So the cut treats a node
    that reads one value twice as an op whose backward sums (as ``repeat``),
    and the output and every gradient are bitwise autocast's (same kernels).
    """
    torch.manual_seed(0)
    model, x = CatCopies(op, relu), torch.randn(*X_COPIED)
    converted = amp_fx.convert(model, "O1", dtype=torch.bfloat16, example_inputs=(x,) if example else None,
                               cast_model_outputs=False)
    stats = converted.amp_report.passes["minimize_casts"]
    assert stats["moved"] == 0 and stats["cast_bytes_min_cut"] == stats["cast_bytes_greedy"]
    copies = next(n for n in converted.graph.nodes if n.op == "call_function" and n.target in (torch.cat, torch.stack))
    assert all(a.meta.get("amp_fx.inserted") is not True for a in copies.all_input_nodes)  # x (or relu(x)) uncast
    after = copies if op == "cat" else next(iter(copies.users))  # stack: the flatten, fp32 too
    assert [u.meta.get("amp_fx.inserted") for u in after.users] == [True]  # one cast, after the copies
    if example:
        assert converted.amp_report.totals()["cast_bytes_per_forward"] == CAST_AFTER_COPIES * CAST
    else:
        assert converted.amp_report.totals()["cast_bytes_per_forward"] is None  # no shapes: the cut's own estimates only
        assert stats["sizes_estimated"]
    for got, want in zip(_output_and_grads(converted, model, x), _output_and_grads(_autocast(model), model, x)):
        assert torch.equal(got, want.float())


def test_copies_of_a_free_op_no_longer_move_low_and_that_is_more_precise_against_fp64():
    """The one decision this changes: relu before a cat of copies stayed fp32 only now (the min-cut used to move it low).

    ``policy={"op:relu": "low"}`` gives the old placement (x cast, relu and
    the cat low: 64x fewer bytes cast before the Linear).  The forward is the
    same bit for bit (relu and copies commute with rounding); x.grad against
    fp64 is at least as close now, and in fact ~3.6x closer (measured), as
    its 64 terms are summed in fp32 as under autocast.
    """
    torch.manual_seed(0)
    model, x = CatCopies("cat", relu=True), torch.randn(*X_COPIED)
    now = _measured(model, (x,), True)
    before = _measured(model, (x,), True, policy={"op:relu": "low"})
    assert (now.amp_report.node("relu").decision, now.amp_report.node("relu").dtype) == ("follow", "float32")
    assert now.amp_report.cast_bytes == CAST_AFTER_COPIES * CAST
    assert before.amp_report.node("cat").dtype == "bfloat16" and before.amp_report.cast_bytes == CAST_BEFORE_COPIES * CAST
    exact = CatCopies("cat", relu=True).double()
    exact.load_state_dict(model.state_dict())
    reference = _output_and_grads(exact, exact, x.double())
    ours, old = _output_and_grads(now, model, x), _output_and_grads(before, model, x)
    assert torch.equal(ours[0], old[0])
    error = lambda got: (got.double() - reference[1]).norm().item()  # noqa: E731  (x.grad)
    assert error(ours[1]) <= error(old[1])
    for got, want in zip(ours, _output_and_grads(_autocast(model), model, x)):
        assert torch.equal(got, want.float())


def test_a_cut_thrown_away_says_which_node_it_would_have_changed(monkeypatch):
    """The safety net's report line names the node a cut would have changed, not "already minimal".

    The fault is injected: every node is treated as the model's own fixed cast, so no non-movable
    reader pins its inputs (the cast-placement mutant 23 of .ci/mutation.md). The min-cut then moves
    relu to fp32 under the policy-pinned tanh that reads it; the pass must keep the greedy paint and say why.
    """
    import amp_fx.ir.cast_placement as cast_placement

    class PinnedReader(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(16, 16)

        def forward(self, x):
            h = self.proj(x)
            r = F.relu(h)
            return torch.tanh(r), F.layer_norm(r, (16,)), torch.softmax(h, -1)

    model, example = PinnedReader(), (torch.randn(4, 16),)
    monkeypatch.setattr(cast_placement, "_fixed_model_cast", lambda node, decision, dtypes: True)
    gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16, example_inputs=example, cast_model_outputs=False,
                        policy={"op:tanh": "follow"})
    line = gm.amp_report.passes["minimize_casts"]["report_lines"][0]
    assert gm.amp_report.passes["minimize_casts"]["moved"] == 0
    assert "greedy placement kept, the min-cut one would change nodes it may not move (tanh" in line, line
    assert gm.amp_report.node("relu").dtype == "bfloat16"
