"""LossScaler(on_collapse="diagnose") names the node that overflowed when the scale collapses."""

import pytest
import torch

import amp_fx
from amp_fx.runtime import LossScaleCollapseError
from planted_models import BigBackward


def _train_until_collapse(scaler, gm, x):
    opt = torch.optim.SGD(gm.parameters(), lr=0.0)
    for _ in range(10):
        opt.zero_grad()
        loss = gm(x).float().pow(2).sum()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def test_diagnosis_names_the_overflowing_node_and_the_policy_fix():
    torch.manual_seed(0)
    gm = amp_fx.convert(BigBackward(), "O1", dtype=torch.float16)
    x = torch.randn(4, 16) * 30
    scaler = amp_fx.LossScaler(init_scale=2048.0, min_scale=1024.0, dtype=torch.float16,
                               on_collapse="diagnose", reproduce=lambda: (gm, (x,)))
    with pytest.raises(LossScaleCollapseError) as info:
        _train_until_collapse(scaler, gm, x)
    assert info.value.diagnosis is not None
    assert "module:fc2" in str(info.value)
    assert "bfloat16" in str(info.value)  # the generic advice is still there


def test_plain_collapse_raises_without_a_diagnosis():
    torch.manual_seed(0)
    gm = amp_fx.convert(BigBackward(), "O1", dtype=torch.float16)
    scaler = amp_fx.LossScaler(init_scale=2048.0, min_scale=1024.0, dtype=torch.float16)
    with pytest.raises(LossScaleCollapseError) as info:
        _train_until_collapse(scaler, gm, torch.randn(4, 16) * 30)
    assert info.value.diagnosis is None


def test_diagnose_without_a_way_to_reproduce_is_refused():
    with pytest.raises(ValueError, match="reproduce="):
        amp_fx.LossScaler(on_collapse="diagnose")
