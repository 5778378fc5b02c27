"""Delayed scaling under activation checkpointing, and the step's pending amaxes in ``state_dict`` (issue 36 item 8).

Rules under test: a checkpointed delayed fp8 GEMM records each step's amaxes once (its recomputation inside
the backward records nothing and quantizes with the scales the forward used), so a checkpointed model trains
bit for bit as the plain one; and a checkpoint saved between a backward and the next forward under deferred
updates (``fp8_sync(gm, optimizer)`` or a process group) carries the pending amaxes, so the resumed run is
the uninterrupted one.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import amp_fx


class Net(nn.Module):
    def __init__(self, ckpt: bool):
        super().__init__()
        self.ckpt = ckpt
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 32)

    def block(self, x):
        return F.gelu(self.fc1(x))

    def forward(self, x):
        h = checkpoint(self.block, x, use_reentrant=False) if self.ckpt else self.block(x)
        return self.fc2(h)


def _convert(model):
    return amp_fx.convert(model, "O1", example_inputs=(torch.randn(8, 32),),
                          fp8={"recipe": "delayed", "size_rule": "all", "history_len": 4})


def _steps(gm, n=3, seed=0):
    torch.manual_seed(seed)
    optimizer = torch.optim.SGD(gm.parameters(), lr=0.1)
    outs = []
    for _ in range(n):
        x = torch.randn(8, 32) * 3
        out = gm(x)
        out.float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        outs.append(out.detach())
    return outs


def test_checkpointed_delayed_gemm_records_each_step_once():
    """One history entry per step, and outputs, weights and histories equal to the un-checkpointed model's."""
    torch.manual_seed(0)
    base = Net(ckpt=False)
    plain, ckpt = _convert(copy.deepcopy(base)), _convert(copy.deepcopy(Net(ckpt=True)))
    ckpt.load_state_dict(plain.state_dict())
    assert any("checkpoint" in name for name, _ in ckpt.named_children())  # the region is checkpointed
    outs_plain, outs_ckpt = _steps(plain), _steps(ckpt)
    history = amp_fx.fp8_states(ckpt)["fc1"].amax_history
    assert int((history[0] > 0).sum()) == 3  # three steps, three input amaxes (not six)
    for a, b in zip(outs_plain, outs_ckpt):
        assert torch.equal(a, b)
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        assert torch.equal(p, q), name
    for name, state in amp_fx.fp8_states(plain).items():
        assert torch.equal(state.amax_history, amp_fx.fp8_states(ckpt)[name].amax_history), name


def test_pending_amaxes_travel_in_state_dict():
    """Deferred updates (fp8_sync(gm, optimizer)): a checkpoint saved after the backward, before the step, resumes exactly."""
    torch.manual_seed(1)
    model = Net(ckpt=False)
    first = _convert(copy.deepcopy(model))
    optimizer = torch.optim.SGD(first.parameters(), lr=0.1)
    amp_fx.fp8_sync(first, optimizer)
    x = torch.randn(8, 32) * 3
    first(x).float().pow(2).mean().backward()
    saved = copy.deepcopy(first.state_dict())
    assert (saved["amp_fx_fp8.fc1.pending_amax"] > 0).all()  # input, weight and grad_output recorded, not synced
    second = _convert(copy.deepcopy(model))
    second.load_state_dict(saved)  # strict: the key is the model's own
    second_optimizer = torch.optim.SGD(second.parameters(), lr=0.1)
    for p, q in zip(first.parameters(), second.parameters()):
        q.grad = p.grad.clone()
    amp_fx.fp8_sync(second, second_optimizer)
    optimizer.step()
    second_optimizer.step()
    for name, state in amp_fx.fp8_states(first).items():
        other = amp_fx.fp8_states(second)[name]
        assert (state.amax_history[:, 0] > 0).all()
        assert torch.equal(state.amax_history, other.amax_history) and torch.equal(state.scale, other.scale), name
    y = torch.randn(8, 32)
    assert torch.equal(first(y), second(y))
    # tensorwise keeps no state: still no fp8 keys in its state_dict
    plain = amp_fx.convert(copy.deepcopy(model), "O1", example_inputs=(x,), fp8={"size_rule": "all"})
    assert list(plain.state_dict()) == list(model.state_dict())
