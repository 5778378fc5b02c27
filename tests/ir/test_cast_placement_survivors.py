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
    """

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        h = self.proj(x)
        r = F.relu(h)
        return torch.tanh(r), F.layer_norm(r, (16,)), torch.softmax(h, -1)


def test_a_policy_pinned_reader_keeps_its_input_where_it_was():
    model, example = PinnedReader(), (torch.randn(*X),)
    on = _convert(model, example, policy={"op:tanh": "follow"}, cast_model_outputs=torch.float32)
    tanh = on.amp_report.node("tanh")
    assert (tanh.decision, tanh.rule, tanh.dtype) == ("follow", "policy", "bfloat16")
    assert _dtype(on, "relu") == "bfloat16"
    assert _autocast(model, example)[0].dtype == LOW  # autocast: relu and tanh follow the low Linear
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
