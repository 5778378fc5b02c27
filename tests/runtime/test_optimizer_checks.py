"""A plain Adam over fp16 parameters is warned about: its eps is 0 in fp16 and the step makes NaN weights."""

import warnings

import pytest
import torch
import torch.nn as nn

import amp_fx
from amp_fx.runtime.optimizer_checks import EpsUnderflowWarning


def _o3(dtype):
    torch.manual_seed(0)
    return amp_fx.convert(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), "O3", dtype=dtype)


def _step(gm, optimizer, scaler):
    loss = gm(torch.randn(4, 8)).float().pow(2).mean()
    scaler.scale(loss).backward()
    stepped = scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    return stepped


def test_adam_with_default_eps_over_fp16_parameters_warns_once_and_names_the_fix():
    gm = _o3(torch.float16)
    optimizer, scaler = torch.optim.AdamW(gm.parameters(), lr=1e-2), amp_fx.LossScaler(dtype=torch.float16)
    with pytest.warns(EpsUnderflowWarning, match="LowPrecisionOptimizer"):
        _step(gm, optimizer, scaler)
    # What it warns about is real: the ReLU's dead units got zero gradients and their weights are NaN now.
    assert any(not torch.isfinite(p).all() for p in gm.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error", EpsUnderflowWarning)
        _step(gm, optimizer, scaler)  # once per optimizer


@pytest.mark.parametrize("case", ["bf16", "eps_1e-4", "low_precision_optimizer", "sgd"])
def test_settings_that_train_are_not_warned_about(case):
    gm = _o3(torch.bfloat16 if case == "bf16" else torch.float16)
    if case == "low_precision_optimizer":
        optimizer = amp_fx.LowPrecisionOptimizer(torch.optim.AdamW(gm.parameters(), lr=1e-2), gm)
    elif case == "sgd":
        optimizer = torch.optim.SGD(gm.parameters(), lr=1e-2)
    else:
        optimizer = torch.optim.AdamW(gm.parameters(), lr=1e-2, eps=1e-8 if case == "bf16" else 1e-4)
    scaler = amp_fx.LossScaler(dtype=torch.bfloat16 if case == "bf16" else torch.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", EpsUnderflowWarning)
        for _ in range(3):
            _step(gm, optimizer, scaler)
    assert all(torch.isfinite(p).all() for p in gm.parameters())
