"""Train/eval follows the converted module, and the original model's flags never change (issue 12, point 3)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_fx
from amp_fx.converter.graph_module import FrozenTrainingWarning
from routes import convert, eager_autocast

D = 8


class Block(nn.Module):
    """A traced-through module whose functional dropout reads ``self.training``."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        return F.dropout(self.fc(x), 0.5, training=self.training)


class Net(nn.Module):
    """Functional dropout (traced), then BatchNorm and Dropout leaves."""

    def __init__(self):
        super().__init__()
        self.block = Block()
        self.bn = nn.BatchNorm1d(D)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(D, D)

    def forward(self, x):
        return self.head(self.drop(self.bn(self.block(x)))), self.block(x)


def _flags(model):
    return {name: m.training for name, m in model.named_modules()}


def _dropped(out) -> bool:
    return bool((out == 0).any())


@pytest.mark.parametrize("order", ["eval_then_train", "train_then_eval"])
@pytest.mark.parametrize("route", ["symbolic", "symbolic+examples", "backend"])
def test_dropout_follows_the_converted_module(route, order):
    """F.dropout(training=self.training) drops after .train() and is deterministic after .eval(), either order."""
    model, x = Net(), torch.randn(16, D)
    model.train(order == "train_then_eval")
    conv = convert(model, route, x)
    fn = conv.fn
    modes = ["train", "eval"] if order == "eval_then_train" else ["eval", "train"]
    if order == "train_then_eval":
        modes = ["train", "eval", "train"]
    for mode in modes:
        getattr(fn, mode)()
        (_, first), (_, second) = fn(x), fn(x)
        if mode == "train":
            assert _dropped(first) and not torch.equal(first, second)
        else:
            assert not _dropped(first) and torch.equal(first, second)
            model.eval()
            _, expected = eager_autocast(model, x)
            torch.testing.assert_close(first.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("start", [True, False])
def test_original_model_flags_never_change(level, start):
    """.train()/.eval() on the converted module leave every flag of the model as it was; the leaves are its own."""
    model = Net().train(start)
    before = _flags(model)
    gm = amp_fx.convert(model, level, dtype=torch.bfloat16)
    for mode in (True, False, True, not start):
        gm.train(mode)
        assert _flags(model) == before
        assert all(m.training == mode for m in gm.modules())
    assert gm.bn is not model.bn and gm.drop is not model.drop
    if level == "O1":  # O1 trains the model's own tensors: the clones hold the same ones
        assert gm.bn.weight is model.bn.weight and gm.bn.running_mean is model.bn.running_mean
        gm.train()
        gm(torch.randn(16, D))
        assert model.bn.num_batches_tracked.item() == 1
    # and the other way round: changing the model does not change the converted module
    model.train(not start)
    assert gm.training == (not start) or all(m.training == gm.training for m in gm.modules())
    gm.eval()
    model.train()
    assert not any(m.training for m in gm.modules())


def test_each_module_keeps_its_own_flag():
    """A model in train mode with a frozen (eval) BatchNorm converts to the same mix; the model is untouched."""
    model = Net().train()
    model.bn.eval()
    before = _flags(model)
    gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16)
    assert gm.training and gm.block.training and not gm.bn.training and gm.drop.training
    x = torch.randn(16, D)
    gm(x)
    assert model.bn.num_batches_tracked.item() == 0  # eval BatchNorm: no statistics update
    assert _flags(model) == before


class Branches(nn.Module):
    """Python control flow on ``self.training``: one graph can only keep one branch."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        if self.training:
            x = x * 2
        return self.fc(x)


def test_a_branch_on_training_is_reported_and_warns_once():
    model = Branches().eval()
    gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16)
    assert "the graph keeps training=False" in str(gm.amp_report)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gm.eval()  # the mode it was specialised to: nothing to say
    with pytest.warns(FrozenTrainingWarning, match="test_train_eval.py"):
        gm.train()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gm.eval()
        gm.train()  # once is enough


def test_export_route_switches_graphs_without_warning():
    """torch.export specialises every train/eval branch: .train() switches to a graph for train mode (no warning).

    (tests/frontend/test_one_conversion_modes.py tests the switch in depth.)
    """
    model, x = Net().eval(), torch.randn(16, D)
    conv = convert(model, "export", x)
    assert "switch to a graph specialised to the other mode" in str(conv.report())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        conv.fn.train()
    (_, first), (_, second) = conv.fn(x), conv.fn(x)
    assert _dropped(first) and not torch.equal(first, second)


def test_no_warning_when_nothing_is_frozen():
    gm = amp_fx.convert(Net().eval(), "O1", dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gm.train()
        gm.eval()
        gm.train()
