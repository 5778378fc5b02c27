"""Several MasterWeightOptimizers over one converted module (torch's "one optimizer per part" recipe)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_fx
from amp_fx.errors import AmpValueError


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(F.relu(self.body(x)))


X, Y = torch.randn(8, 8, generator=torch.Generator().manual_seed(1)), torch.arange(8) % 4


def one_step(optimizers, gm):
    scaler = amp_fx.LossScaler(dtype=torch.bfloat16)
    for opt in optimizers:
        opt.zero_grad()
    scaler.scale(F.cross_entropy(gm(X), Y)).backward()
    for opt in optimizers:
        assert scaler.step(opt)
    scaler.update()


def converted():
    torch.manual_seed(0)
    model = Net()
    return model, amp_fx.convert(model, "O2", dtype=torch.bfloat16)


def test_two_optimizers_over_disjoint_parts_step_as_each_alone():
    model, gm = converted()
    body = amp_fx.MasterWeightOptimizer(torch.optim.SGD(model.body.parameters(), lr=0.1, momentum=0.9), gm)
    head = amp_fx.MasterWeightOptimizer(torch.optim.AdamW(model.head.parameters(), lr=1e-2), gm)
    one_step([body, head], gm)
    # References: one optimizer of each kind over the whole module, on the same first gradients.
    sgd_model, sgd_gm = converted()
    one_step([amp_fx.MasterWeightOptimizer(torch.optim.SGD(sgd_model.parameters(), lr=0.1, momentum=0.9), sgd_gm)],
             sgd_gm)
    adam_model, adam_gm = converted()
    one_step([amp_fx.MasterWeightOptimizer(torch.optim.AdamW(adam_model.parameters(), lr=1e-2), adam_gm)], adam_gm)
    for part, ref in (("body", sgd_model), ("head", adam_model)):
        for (name, mine), theirs in zip(getattr(model, part).named_parameters(), getattr(ref, part).parameters()):
            assert torch.equal(mine.detach(), theirs.detach()), (part, name)
    for low, master in zip(gm.parameters(), model.parameters()):
        assert torch.equal(low.detach(), master.detach().to(torch.bfloat16))


def test_gradient_no_optimizer_holds_is_refused_at_the_step():
    model, gm = converted()
    body = amp_fx.MasterWeightOptimizer(torch.optim.SGD(model.body.parameters(), lr=0.1), gm)
    with pytest.raises(AmpValueError, match=r"\['head.weight', 'head.bias'\] have gradients but no "
                                            r"MasterWeightOptimizer over this module holds them"):
        one_step([body], gm)
    for p in gm.head.parameters():
        p.requires_grad_(False)
        p.grad = None  # (the refused step's)
    one_step([body], gm)  # frozen: nothing to apply
