"""torch.compile and convert, in either order: ``convert(torch.compile(model))`` and ``torch.compile(convert(model))``.

A compiled model is converted inside and stays compiled with its own settings. Under Dynamo, the conversion that
builds a converted module's graph for a new mode (``eval()`` on the torch.export route, at its first call) runs
eagerly instead of being traced op by op.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_fx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "frontend"))
from routes import Untraceable  # noqa: E402


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))


def _batches(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)]


def _train_o2(gm: nn.Module, model: nn.Module) -> list[float]:
    """Three O2 steps, clipping the converted module's parameters (docs/training.md's recipe)."""
    opt = amp_fx.MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), gm, compiled_update=False)
    scaler, losses = amp_fx.LossScaler(dtype=torch.bfloat16), []
    for x, y in _batches():
        opt.zero_grad()
        loss = F.cross_entropy(gm(x).float(), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(gm.parameters(), 0.1)
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    return losses


def test_converting_a_compiled_model_converts_the_module_inside():
    """The result is the converted module compiled the same way; what it lists is what its forward reads: every
    parameter gets a gradient and O2 training (with a clip of gm.parameters()) equals the uncompiled run."""
    model, reference = _mlp(), _mlp()
    gm = amp_fx.convert(torch.compile(model, backend="aot_eager"), "O2", dtype=torch.bfloat16)
    assert type(gm).__name__ == "OptimizedModule" and isinstance(gm._orig_mod, amp_fx.AmpGraphModule)
    x, y = _batches(1)[0]
    F.cross_entropy(gm(x).float(), y).backward()
    params = list(gm.parameters())
    assert len(params) == 6 and all(p.grad is not None for p in params)
    for p in params:
        p.grad = None
    expected = _train_o2(amp_fx.convert(reference, "O2", dtype=torch.bfloat16), reference)
    assert _train_o2(gm, model) == expected
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        assert torch.equal(ours, theirs)


def test_o3_optimizer_over_a_converted_compiled_model_trains_it():
    model = _mlp()
    gm = amp_fx.convert(torch.compile(model, backend="aot_eager"), "O3", dtype=torch.bfloat16)
    opt = torch.optim.SGD(gm.parameters(), lr=0.5)
    x, y = _batches(1)[0]
    before = gm(x).detach().clone()
    F.cross_entropy(gm(x).float(), y).backward()
    opt.step()
    assert not torch.equal(gm(x), before)


class _BatchNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn, self.drop, self.head = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.bn(self.fc(x))))


def test_a_mode_switch_under_compile_converts_eagerly():
    """torch.export route: the eval graph is built at the first eval call. Under torch.compile that build runs
    eagerly (before, Dynamo traced the conversion: several graphs and breaks, tens of seconds on GPT-2), and the
    compiled eval output equals the uncompiled module's."""
    torch.manual_seed(0)
    x = torch.randn(8, 8)
    wrapped = Untraceable(_BatchNormNet().train())
    gm = amp_fx.convert(wrapped, "O2", dtype=torch.bfloat16, example_inputs=(x,))
    assert gm.amp_report.route == "torch.export"
    twin = copy.deepcopy(gm)
    graphs: list[torch.fx.GraphModule] = []

    def backend(graph: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(graph)
        return graph.forward

    torch._dynamo.reset()
    compiled = torch.compile(gm, backend=backend)
    compiled(x), twin(x)  # train: the batch norm's running statistics move alike (dropout follows it)
    gm.eval(), twin.eval()
    out = compiled(x)
    assert len(graphs) == 2  # one per mode, nothing traced of the conversion between them
    assert torch.equal(out, twin(x))


def test_a_module_compiled_twice_is_refused_naming_the_fix():
    """torch.compile(torch.compile(m)) is a function in torch 2.13: the refusal says so, not "wrap a function"."""
    twice = torch.compile(torch.compile(_mlp(), backend="aot_eager"), backend="aot_eager")
    if isinstance(twice, nn.Module):  # a torch that returns a module again: it converts like a compiled one
        assert isinstance(amp_fx.convert(twice, "O1")._orig_mod, amp_fx.AmpGraphModule)
        return
    with pytest.raises(amp_fx.AmpTypeError, match="Compile once"):
        amp_fx.convert(twice, "O1")
