"""Decisions of the cast placement (amp_fx/ir/cast_placement.py) that its mutation survivors would get wrong.

Each model here is built so that one rule of the cut problem changes which dtype a node runs in:
a model's own fixed cast reads whatever arrives (it pins nothing), a non-movable reader pins its
inputs, a low model output lets a free fp32 node move low, and a policy-pinned node never moves.
Everything is read through the public API: ``amp_fx.convert``'s report (decision, rule, dtype per
node), checked against the fp32 model and, where the placement keeps autocast's decision, against
``torch.autocast``.  (Issue 43: these are the survivors listed in .ci/mutation.md, now killed.)
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_fx

X = (4, 16)
LOW = torch.bfloat16


def _convert(model: nn.Module, example: tuple, minimize: bool = True, **kwargs) -> amp_fx.AmpGraphModule:
    return amp_fx.convert(model, "O1", dtype=LOW, example_inputs=example, minimize_casts=minimize,
                          **{"cast_model_outputs": False, **kwargs})


def _dtype(converted: amp_fx.AmpGraphModule, name: str) -> str:
    return converted.amp_report.node(name).dtype


def _autocast(model: nn.Module, example: tuple):
    with torch.autocast("cpu", dtype=LOW):
        return model(*example)


def _close_to_fp32(converted, model, example, tol=0.05):
    got, want = converted(*example), model(*example)
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g.float() - w).abs().max().item() <= tol * (1.0 + w.abs().max().item())


# --------------------------------------------------------------------------
# A model's own fixed cast reads whatever arrives; a cast to another tensor's dtype pins its input
# --------------------------------------------------------------------------
class OwnCast(nn.Module):
    """relu of a low Linear, read by the model's own ``.float()`` and by two fp32 ops.

    Greedy: relu follows the Linear (low); softmax casts h up, layer_norm casts relu up.  Moving
    relu to fp32 shares h's cast: one cast fewer, as long as the model's ``.float()`` does not pin
    relu (it reads whatever arrives).  The model's cast comes first in the graph, the fp32 readers
    after it, so a placement that stopped at the model's cast would miss them.
    """

    def __init__(self, to_other_tensor: bool = False):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.to_other_tensor = to_other_tensor

    def forward(self, x):
        h = self.proj(x)
        r = F.relu(h)
        y = r.to(x) if self.to_other_tensor else r.float()
        return y * 2, F.layer_norm(r, (16,)), torch.softmax(h, -1)


def test_the_models_own_cast_pins_nothing_so_its_input_moves_to_fp32():
    model, example = OwnCast(), (torch.randn(*X),)
    on, off = _convert(model, example), _convert(model, example, minimize=False)
    assert _dtype(off, "relu") == "bfloat16" == _dtype(on, "linear")
    assert (on.amp_report.node("relu").decision, _dtype(on, "relu")) == ("fp32", "float32")
    assert on.amp_report.passes["minimize_casts"]["moved"] == 1
    assert on.amp_report.cast_bytes < off.amp_report.cast_bytes
    _close_to_fp32(on, model, example)


def test_a_cast_to_another_tensors_dtype_pins_its_input():
    """``r.to(x)`` is no fixed cast (its target is a value): it pins relu, which keeps autocast's dtype."""
    model, example = OwnCast(to_other_tensor=True), (torch.randn(*X),)
    on = _convert(model, example)
    assert _dtype(on, "relu") == "bfloat16" and on(*example)[0].dtype == torch.float32
    assert on.amp_report.passes["minimize_casts"]["moved"] == 0
    _close_to_fp32(on, model, example)


# --------------------------------------------------------------------------
# A non-movable reader pins its inputs: moving one would change the reader's dtype
# --------------------------------------------------------------------------
class PinnedReader(nn.Module):
    """relu of a low Linear, read by a policy-pinned tanh and by an fp32 layer_norm; softmax casts h up.

    With fp32 outputs, moving relu (and tanh) to fp32 saves casts (h's cast is shared); with tanh pinned
    it would make tanh, which follows its input, run fp32: relu stays low, and both keep autocast's dtype.
    Beside it, an independent branch where relu_1 moves low (ReluReadByLowOps): a cut that ignored the
    pin would change tanh's dtype, the pass would throw the whole placement away, and relu_1 would not move.
    """

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.a = nn.Linear(16, 8)
        self.b = nn.Linear(16, 8)

    def forward(self, x):
        h = self.proj(x)
        r = F.relu(h)
        g = F.layer_norm(x, (16,))
        return torch.tanh(r), F.layer_norm(r, (16,)), torch.softmax(h, -1), self.a(g) + self.b(F.relu(g))


def test_a_policy_pinned_reader_keeps_its_input_where_it_was():
    model, example = PinnedReader(), (torch.randn(*X),)
    on = _convert(model, example, policy={"op:tanh": "follow"}, cast_model_outputs=torch.float32)
    tanh = on.amp_report.node("tanh")
    assert (tanh.decision, tanh.rule, tanh.dtype) == ("follow", "policy", "bfloat16")
    assert _dtype(on, "relu") == "bfloat16"
    assert _autocast(model, example)[0].dtype == LOW  # autocast: relu and tanh follow the low Linear
    assert (on.amp_report.node("relu_1").decision, _dtype(on, "relu_1")) == ("low", "bfloat16")
    assert on.amp_report.passes["minimize_casts"]["moved"] == 1
    _close_to_fp32(on, model, example)
    # Without the pin, the same graph moves relu (and tanh with it) to fp32: the pin is what holds it.
    free = _convert(model, example, cast_model_outputs=torch.float32)
    assert (_dtype(free, "relu"), _dtype(free, "tanh")) == ("float32", "float32")


# --------------------------------------------------------------------------
# cast_model_outputs=low: a free fp32 node at the output may move low
# --------------------------------------------------------------------------
class ReluAtLowOutput(nn.Module):
    """An fp32 layer_norm read by a Linear (low) and by relu, whose result is a model output.

    With outputs cast to bf16 the output rounds relu anyway: relu moves low and reads the Linear's
    cast of h, one cast instead of two.  With fp32 outputs, or with none cast, relu stays fp32.
    """

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 8)

    def forward(self, x):
        h = F.layer_norm(x, (16,))
        return self.proj(h), F.relu(h)


def test_a_free_node_at_a_low_output_moves_low():
    model, example = ReluAtLowOutput(), (torch.randn(*X),)
    on = _convert(model, example, cast_model_outputs=LOW)
    off = _convert(model, example, minimize=False, cast_model_outputs=LOW)
    assert _dtype(off, "relu") == "float32" and _dtype(on, "layer_norm") == "float32"
    assert (on.amp_report.node("relu").decision, _dtype(on, "relu")) == ("low", "bfloat16")
    assert on.amp_report.passes["minimize_casts"]["moved"] == 1
    assert on.amp_report.cast_bytes < off.amp_report.cast_bytes
    # relu commutes with rounding: the low output is bit for bit autocast's (fp32 relu, then cast down).
    out, reference = on(*example), _autocast(model, example)
    assert out[1].dtype == LOW
    torch.testing.assert_close(out[1], reference[1].to(LOW), rtol=0, atol=0)
    _close_to_fp32(on, model, example)


@pytest.mark.parametrize("outputs", [False, torch.float32], ids=["uncast", "fp32"])
def test_a_free_node_at_an_output_not_cast_low_stays_fp32(outputs):
    model, example = ReluAtLowOutput(), (torch.randn(*X),)
    on = _convert(model, example, cast_model_outputs=outputs)
    assert _dtype(on, "relu") == "float32" and on.amp_report.passes["minimize_casts"]["moved"] == 0
    assert on(*example)[1].dtype == torch.float32


class ReluReadByLowOps(nn.Module):
    """An fp32 layer_norm read by a Linear and by relu, which feeds a second Linear: relu moves low."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 8)
        self.b = nn.Linear(16, 8)

    def forward(self, x):
        h = F.layer_norm(x, (16,))
        return self.a(h) + self.b(F.relu(h))


def test_a_free_fp32_node_read_only_by_low_ops_moves_low():
    model, example = ReluReadByLowOps(), (torch.randn(*X),)
    on, off = _convert(model, example), _convert(model, example, minimize=False)
    assert _dtype(off, "relu") == "float32"
    assert (on.amp_report.node("relu").decision, _dtype(on, "relu")) == ("low", "bfloat16")
    assert on.amp_report.cast_bytes < off.amp_report.cast_bytes
    _close_to_fp32(on, model, example)


class MethodRelu(ReluReadByLowOps):
    """ReluReadByLowOps with ``h.relu()``, a call_method node: it moves as the function does."""

    def forward(self, x):
        h = F.layer_norm(x, (16,))
        return self.a(h) + self.b(h.relu())


def test_a_method_call_moves_as_the_function_does():
    model, example = MethodRelu(), (torch.randn(*X),)
    on = _convert(model, example)
    assert (on.amp_report.node("relu").decision, _dtype(on, "relu")) == ("low", "bfloat16")
    _close_to_fp32(on, model, example)


# --------------------------------------------------------------------------
# Which nodes may move at all (_free_kind): policy pins, promote ops, undecided custom ops
# --------------------------------------------------------------------------
class FanIn32(nn.Module):
    """A low Linear read by relu and tanh that feed fp32 ops, and by softmax: greedy casts each branch up.

    The cut moves relu and tanh to fp32 (they read softmax's cast of h); pin relu, and tanh moves alone.
    """

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 8)

    def forward(self, x):
        h = self.proj(x)
        return torch.softmax(F.relu(h), -1) + F.layer_norm(torch.tanh(h), (8,)), torch.softmax(h, -1)


def test_a_policy_pinned_node_keeps_its_paint_while_its_sibling_moves():
    model, example = FanIn32(), (torch.randn(*X),)
    free = _convert(model, example)
    assert (_dtype(free, "relu"), _dtype(free, "tanh")) == ("float32", "float32")
    pinned = _convert(model, example, policy={"op:relu": "follow"})
    relu, tanh = pinned.amp_report.node("relu"), pinned.amp_report.node("tanh")
    assert (relu.decision, relu.rule, relu.dtype) == ("follow", "policy", "bfloat16")
    assert (tanh.decision, tanh.dtype) == ("fp32", "float32")
    _close_to_fp32(pinned, model, example)


class CatOfFollowers(nn.Module):
    """relu and tanh of a low Linear, concatenated (a PROMOTE op, low here) and read by softmax (fp32).

    Greedy casts the cat up (2 x 4 x 8 elements); moving relu, tanh and the cat to fp32 casts the
    Linear's output instead (4 x 8), which softmax(h) casts up anyway.
    """

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 8)

    def forward(self, x):
        h = self.proj(x)
        return torch.softmax(torch.cat([F.relu(h), torch.tanh(h)], -1), -1), torch.softmax(h, -1)


def test_a_promote_op_moves_to_fp32_with_its_inputs():
    model, example = CatOfFollowers(), (torch.randn(*X),)
    on, off = _convert(model, example), _convert(model, example, minimize=False)
    assert (off.amp_report.node("cat").decision, _dtype(off, "cat")) == ("promote", "bfloat16")
    assert {name: _dtype(on, name) for name in ("relu", "tanh", "cat")} == dict.fromkeys(("relu", "tanh", "cat"), "float32")
    assert on.amp_report.passes["minimize_casts"]["moved"] == 3
    assert on.amp_report.cast_bytes < off.amp_report.cast_bytes
    _close_to_fp32(on, model, example)


@torch.library.custom_op("amp_fx_test_survivors::twice", mutates_args=())
def twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@twice.register_fake
def _(x):
    return torch.empty_like(x)


twice.register_autograd(lambda ctx, grad: grad * 2)


class UndecidedCustomOp(CatOfFollowers):
    """CatOfFollowers with an op in no amp_fx table in the cat's place: assign_precision makes it promote."""

    def forward(self, x):
        h = self.proj(x)
        return torch.softmax(twice(F.relu(h)), -1), torch.softmax(h, -1)


def test_an_undecided_custom_op_made_to_promote_never_moves():
    """It computes in the dtype it gets under autocast (which leaves custom ops alone), and so does its input."""
    model, example = UndecidedCustomOp(), (torch.randn(*X),)
    on = _convert(model, example)
    record = next(r for r in on.amp_report.nodes if "twice" in r.name)
    assert (record.decision, record.rule, record.dtype) == ("promote", "unknown", "bfloat16")
    assert _dtype(on, "relu") == "bfloat16" and on.amp_report.passes["minimize_casts"]["moved"] == 0
    with torch.autocast("cpu", dtype=LOW):
        assert twice(F.relu(model.proj(example[0]))).dtype == LOW
    _close_to_fp32(on, model, example)


# --------------------------------------------------------------------------
# The network: a saving of one cast beats any number of tie-breaking edges; a tie keeps the greedy paint
# --------------------------------------------------------------------------
class TinyChainLow(nn.Module):
    """A two-element fp32 layer_norm read by a Linear and by four relus in a chain into a second Linear.

    Moving the chain low saves one cast of two elements (12 bytes): less than the four nodes moved if
    the bytes were not scaled above the unit edges that break ties.
    """

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.b = nn.Linear(2, 2)

    def forward(self, x):
        h = F.layer_norm(x, (2,))
        return self.a(h), self.b(F.relu(F.relu(F.relu(F.relu(h)))))


class TinyChainUp(nn.Module):
    """A two-element low Linear read by softmax and by four relus in a chain into layer_norm: the chain moves to fp32."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(2, 2)

    def forward(self, x):
        h = self.proj(x)
        return torch.softmax(h, -1), F.layer_norm(F.relu(F.relu(F.relu(F.relu(h)))), (2,))


@pytest.mark.parametrize("factory,dtype", [(TinyChainLow, "bfloat16"), (TinyChainUp, "float32")],
                         ids=["to_low", "to_fp32"])
def test_a_one_cast_saving_moves_a_chain_of_free_nodes(factory, dtype):
    model, example = factory(), (torch.randn(1, 2),)
    on, off = _convert(model, example), _convert(model, example, minimize=False)
    relus = [r for r in on.amp_report.nodes if r.name.startswith("relu")]
    assert len(relus) == 4 and {r.dtype for r in relus} == {dtype}
    assert {_dtype(off, r.name) for r in relus} != {dtype}
    assert off.amp_report.cast_bytes - on.amp_report.cast_bytes == 2 * 6
    _close_to_fp32(on, model, example)


class TieFanIn32(nn.Module):
    """A low Linear read by abs (into softmax) and tanh (into layer_norm): moving tanh alone costs what it saves.

    Beside it, an independent branch where relu moves low and saves a cast (ReluReadByLowOps), so the
    placement is taken: a tie broken the other way would move tanh with it.
    """

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 8)
        self.a = nn.Linear(16, 8)
        self.b = nn.Linear(16, 8)

    def forward(self, x):
        h = self.proj(x)
        g = F.layer_norm(x, (16,))
        return (torch.softmax(torch.abs(h), -1) + F.layer_norm(torch.tanh(h), (8,)),
                self.a(g) + self.b(F.relu(g)))


def test_a_tie_keeps_the_greedy_paint_and_autocasts_dtype():
    """abs pinned by the policy: tanh moved to fp32 would cast h instead of tanh, a tie; it stays low as autocast has it."""
    model, example = TieFanIn32(), (torch.randn(*X),)
    on = _convert(model, example, policy={"op:abs": "follow"})
    assert (on.amp_report.node("tanh").decision, _dtype(on, "tanh")) == ("follow", "bfloat16")
    assert (on.amp_report.node("relu").decision, _dtype(on, "relu")) == ("low", "bfloat16")
    assert on.amp_report.passes["minimize_casts"]["moved"] == 1
    with torch.autocast("cpu", dtype=LOW):
        assert torch.tanh(model.proj(example[0])).dtype == LOW
    _close_to_fp32(on, model, example)


# --------------------------------------------------------------------------
# Readers that pin nothing (a comparison) and readers that pin (an uncast model output)
# --------------------------------------------------------------------------
class ComparedRelu(nn.Module):
    """OwnCast with a comparison in the model cast's place: it reads any float dtype, so relu still moves."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        h = self.proj(x)
        r = F.relu(h)
        return r > 0.5, F.layer_norm(r, (16,)), torch.softmax(h, -1)


def test_a_comparison_pins_nothing_so_its_input_moves_to_fp32():
    model, example = ComparedRelu(), (torch.randn(*X),)
    on = _convert(model, example)
    assert (on.amp_report.node("relu").decision, _dtype(on, "relu")) == ("fp32", "float32")
    mask = on(*example)[0]
    assert mask.dtype == torch.bool
    # relu of the Linear's bf16 result is exact in either dtype: the mask is autocast's, bit for bit.
    assert torch.equal(mask, _autocast(model, example)[0])


class ReluAtUncastOutput(ComparedRelu):
    """relu of a low Linear is a model output itself: it must keep the dtype it returns (autocast's, bf16)."""

    def forward(self, x):
        h = self.proj(x)
        r = F.relu(h)
        return r, F.layer_norm(r, (16,)), torch.softmax(h, -1)


def test_an_uncast_model_output_pins_its_value():
    model, example = ReluAtUncastOutput(), (torch.randn(*X),)
    on = _convert(model, example)
    assert _dtype(on, "relu") == "bfloat16" and on.amp_report.passes["minimize_casts"]["moved"] == 0
    assert on(*example)[0].dtype == _autocast(model, example)[0].dtype == LOW


class ReadBeforeAWrite(nn.Module):
    """relu reads h before a view of h is scaled in place; a Linear reads h after: a shared cast would read the write."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 8)
        self.c = nn.Linear(16, 8)

    def forward(self, x):
        h = F.layer_norm(x, (16,))
        r = F.relu(h)
        h.view(4, 16).mul_(2)
        return self.a(r) + self.c(h)


def test_a_reader_of_a_value_written_in_place_never_moves():
    """Moving relu low would save a cast by sharing the Linear's cast of h, made after the write: relu stays fp32."""
    model, example = ReadBeforeAWrite(), (torch.randn(*X),)
    on = _convert(model, example)
    assert _dtype(on, "relu") == "float32" and on.amp_report.passes["minimize_casts"]["moved"] == 0
    _close_to_fp32(on, model, example)
