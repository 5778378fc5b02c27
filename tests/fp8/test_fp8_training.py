"""Training with fp8 GEMMs at O1 and O2: the digits MLP reaches bf16 autocast's test accuracy within 1 point.

Rule under test: the fp8 recipes train as well as bf16 (torchao and TE report
this at scale; here 300 steps of a 64-256-256-10 MLP on sklearn's digits), with
``MasterWeightOptimizer`` at O2 unchanged.  The head (N=10) is no multiple of 16
and stays bf16; the two hidden GEMMs are fp8.

The 300-step runs use ``Fp8Config(emulate=True)``: the same fp8 operands, multiplied by
an fp32 ``mm`` instead of ``torch._scaled_mm``, which some CPUs emulate slowly (118-150 s
a run on an Intel CPU with AMX, issue 43).  That the emulated GEMM computes what
``torch._scaled_mm`` computes is checked once per configuration, on one training step
(:func:`test_emulated_gemms_match_scaled_mm`).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_fx

datasets = pytest.importorskip("sklearn.datasets")

STEPS = 300
# Each training configuration (level, recipe) the tests below run emulated.
CONFIGS = [("O1", "tensorwise"), ("O1", "rowwise"), ("O1", "delayed"), ("O2", "tensorwise"), ("O3", "tensorwise")]


def _data():
    digits = datasets.load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(x), generator=g)
    train, test = order[:1400], order[1400:]
    return x[train], y[train], x[test], y[test]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def _train(model, optimizer, forward, data):
    x, y, x_test, y_test = data
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        batch = torch.randint(0, len(x), (64,), generator=g)
        optimizer.zero_grad()
        F.cross_entropy(forward(x[batch]).float(), y[batch]).backward()
        optimizer.step()
    with torch.no_grad():
        return (forward(x_test).argmax(-1) == y_test).float().mean().item() * 100


def _autocast_accuracy(data):
    model = _model()

    def forward(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x)

    return _train(model, torch.optim.Adam(model.parameters(), lr=1e-3), forward, data)


@pytest.fixture(scope="module")
def data_and_reference():
    data = _data()
    return data, _autocast_accuracy(data)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "delayed"])
def test_o1_fp8_matches_bf16_autocast(recipe, data_and_reference):
    data, reference = data_and_reference
    model = _model()
    gm = amp_fx.convert(model, "O1", example_inputs=(data[0][:4],), fp8={"recipe": recipe, "size_rule": "all", "emulate": True})
    assert gm.amp_report.passes["fp8_gemms"]["fp8"] == 2
    accuracy = _train(gm, torch.optim.Adam(gm.parameters(), lr=1e-3), gm, data)
    assert accuracy >= reference - 1.0, (accuracy, reference)


def test_o2_fp8_with_master_weights(data_and_reference):
    data, reference = data_and_reference
    model = _model()
    gm = amp_fx.convert(model, "O2", example_inputs=(data[0][:4],), fp8={"size_rule": "all", "emulate": True})
    optimizer = amp_fx.MasterWeightOptimizer(torch.optim.Adam(gm.parameters(), lr=1e-3), gm)
    accuracy = _train(gm, optimizer, gm, data)
    assert accuracy >= reference - 1.0, (accuracy, reference)


def test_o3_fp8_with_low_precision_optimizer(data_and_reference):
    """bf16 weights updated by LowPrecisionOptimizer (stochastic rounding), their GEMMs fp8."""
    data, reference = data_and_reference
    model = _model()
    gm = amp_fx.convert(model, "O3", example_inputs=(data[0][:4],), fp8={"size_rule": "all", "emulate": True})
    optimizer = amp_fx.LowPrecisionOptimizer(torch.optim.Adam(gm.parameters(), lr=1e-3), gm)
    accuracy = _train(gm, optimizer, gm, data)
    assert accuracy >= reference - 1.0, (accuracy, reference)


@pytest.mark.parametrize("level,recipe", CONFIGS)
def test_emulated_gemms_match_scaled_mm(level, recipe, data_and_reference):
    """One training step, emulated and through ``torch._scaled_mm``: outputs and gradients agree to bf16 rounding.

    Both sides quantize the same operands to the same fp8 values; they differ only in the
    fp32 accumulation order (~K * 2**-24) and so, at most, in where a bf16 result rounds
    (2**-8 relative per element), once for the output and once for the gradient it feeds:
    a normwise bound of 2**-7.
    """
    x = data_and_reference[0][0][:64]
    results = []
    for emulate in (False, True):
        gm = amp_fx.convert(_model(), level, example_inputs=(x[:4],),
                            fp8={"recipe": recipe, "size_rule": "all", "emulate": emulate})
        assert gm.amp_report.passes["fp8_gemms"]["fp8"] == 2
        out = gm(x)
        out.float().square().sum().backward()
        results.append([out.detach(), *(p.grad for p in gm.parameters())])
    scaled, emulated = results
    assert len(scaled) == len(emulated) == 7  # the output and six gradients (3 weights, 3 biases)
    for ours, theirs in zip(emulated, scaled):
        error = (ours.float() - theirs.float()).norm() / theirs.float().norm()
        assert error <= 2**-7, error
