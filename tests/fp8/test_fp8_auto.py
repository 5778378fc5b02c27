"""``Fp8Config(recipe="auto")``: per GEMM bf16 or an fp8 recipe, from the roofline model, a calibration and the rules.

Rules under test (amp_fx/ir/fp8_cost.py, fp8_sensitivity.py, fp8_choice.py, ir/fp8_plan.py): large GEMMs
(K, N and M) go fp8 and small ones stay bf16 on the h100 profile; a GEMM whose input has heavy outlier rows
stays bf16 or goes rowwise, its measured error in the reason; a tighter budget never converts more; the first
GEMM, the one feeding the output and MoE routers stay bf16 unless switched off; no example inputs, no decision.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings, strategies as st

import amp_fx
from amp_fx.errors import AmpValueError
from amp_fx.ir.fp8_choice import choose, is_router
from amp_fx.ir.fp8_cost import DEVICES, DeviceProfile, layer_seconds
from amp_fx.ir.fp8_sensitivity import operand_errors

# Memory almost free: every fp8 GEMM gains ~half its time, so small test GEMMs are decided by their errors alone.
FAST_MEMORY = DeviceProfile("fast_memory", 1e15, 2e15, 1e18)


class Chain(nn.Module):
    """Linears in a row (widths given), ReLU between."""

    def __init__(self, *widths: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x) if i == 0 else layer(torch.relu(x))
        return x


def _auto(model, x, **options):
    config = amp_fx.Fp8Config(recipe="auto", **options)
    return amp_fx.convert(model, "O1", example_inputs=(x,), fp8=config)


def _formats(gm):
    return {row["module"]: row["recipe"] for row in gm.amp_report.passes["fp8_gemms"]["gemms"]}


def _outliers(rows=32, k=64, seed=0):
    torch.manual_seed(seed)
    x = torch.randn(rows, k)
    x[:3] *= 1e5  # a few tokens 1e5 x the rest: one tensorwise scale rounds the other rows to e4m3 subnormals
    return x


def test_large_gemms_go_fp8_small_stay_bf16_on_h100():
    """At M = 32768 on h100 the 2048 x 2048 GEMM is predicted faster in fp8 and converted; the 64-wide ones are not."""
    torch.manual_seed(0)
    model = Chain(64, 2048, 2048, 64)
    gm = _auto(model, torch.randn(8, 64), tokens=32768, keep_first=False, keep_last=False)
    formats = _formats(gm)
    assert formats == {"layers.0": None, "layers.1": "tensorwise", "layers.2": None}, gm.amp_report
    rows = {r["module"]: r for r in gm.amp_report.passes["fp8_gemms"]["gemms"]}
    assert rows["layers.1"]["seconds"]["tensorwise"] < rows["layers.1"]["seconds"]["bf16"]
    assert rows["layers.0"]["rule"] == "min_gain" and "min_gain" in rows["layers.0"]["why"]
    # the same GEMM at a small M is predicted slower in fp8 (the casts do not pay): bf16
    with pytest.warns(amp_fx.Fp8NothingConvertedWarning, match="min_gain"):
        small = _auto(model, torch.randn(8, 64), tokens=64, keep_first=False, keep_last=False)
    assert _formats(small)["layers.1"] is None
    out = gm(torch.randn(8, 64))
    out.sum().backward()
    assert gm.amp_report.count("fp8") == 1


def test_cost_model_grows_with_m_k_n():
    """The predicted fp8 gain grows along M, K and N (h100), negative for small GEMMs and positive for large."""
    p = DEVICES["h100"]

    def gain(M, K, N):
        return 1 - layer_seconds("tensorwise", M, K, N, p) / layer_seconds("bf16", M, K, N, p)

    sizes = [256, 1024, 4096, 16384]
    for a, b in zip(sizes, sizes[1:]):
        assert gain(b, 4096, 4096) > gain(a, 4096, 4096)
        assert gain(16384, b, 4096) > gain(16384, a, 4096)
        assert gain(16384, 4096, b) > gain(16384, 4096, a)
    assert gain(64, 64, 64) < 0 < gain(16384, 8192, 8192)
    # the faster memory of h200 makes the casts cheaper: never a smaller gain
    assert (1 - layer_seconds("tensorwise", 8192, 2048, 2048, DEVICES["h200"])
            / layer_seconds("bf16", 8192, 2048, 2048, DEVICES["h200"])) > gain(8192, 2048, 2048)


def test_outlier_input_goes_rowwise_with_its_measured_error():
    """Heavy outlier rows: tensorwise's measured error is far past the budget, so the GEMM goes rowwise_with_gw_hp."""
    x = _outliers()
    gm = _auto(Chain(64, 64, 32), x, device=FAST_MEMORY, keep_first=False, keep_last=False)
    row = amp_fx.explain(gm).rows[0]
    assert row.errors["tensorwise"] > 0.2, row.errors  # measured: ~0.5
    assert row.errors["rowwise_with_gw_hp"] < 0.05
    assert row.format in ("rowwise", "rowwise_with_gw_hp")
    assert f"error {row.errors[row.format]:.1%}" in row.why
    # offered tensorwise only, the same GEMM stays bf16, and the reason names the measured error
    with pytest.warns(amp_fx.Fp8NothingConvertedWarning, match="error_budget"):
        only = _auto(Chain(64, 64, 32), x, device=FAST_MEMORY, keep_first=False, keep_last=False, choices=("tensorwise",))
    kept = amp_fx.explain(only).rows[0]
    assert kept.format == "bf16" and kept.rule == "error_budget"
    assert f"tensorwise {kept.errors['tensorwise']:.1%} > error_budget 5.0%" in kept.why
    # the second GEMM reads relu(x W1) whose rows carry the outliers too; both stay out of tensorwise
    assert amp_fx.explain(gm).rows[1].format != "tensorwise"


def test_operand_errors_see_the_outliers():
    """The per-row error: ~e4m3's 2.6% on Gaussian values, many times that for tensorwise with outlier rows."""
    torch.manual_seed(0)
    plain = operand_errors(torch.randn(64, 128), torch.randn(128, 32))
    assert all(0.01 < e["input"] < 0.04 for e in plain.values()), plain
    heavy = operand_errors(_outliers(64, 128), torch.randn(128, 32))
    assert heavy["tensorwise"]["input"] > 5 * plain["tensorwise"]["input"]
    assert heavy["rowwise"]["input"] > 5 * plain["rowwise"]["input"]  # grad_weight's per-column scales
    assert heavy["rowwise_with_gw_hp"]["input"] < 0.04  # no per-column quantization of x


def test_tighter_budget_never_converts_more_through_convert():
    """Over several error budgets and min gains, each tighter conversion's fp8 GEMMs are a subset of a looser one's."""
    torch.manual_seed(1)
    model = Chain(64, 64, 64, 64, 32)
    x = _outliers(24, 64)
    sets = []
    for budget, gain in [(1.0, -10.0), (0.1, -10.0), (0.04, 0.0), (0.03, 0.3), (0.026, 0.45), (0.0, 0.45)]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", amp_fx.Fp8NothingConvertedWarning)  # the tightest convert nothing
            gm = _auto(model, x, device=FAST_MEMORY, keep_first=False, keep_last=False, error_budget=budget,
                       min_gain=gain)
        sets.append({name for name, recipe in _formats(gm).items() if recipe})
    assert sets[0] == {"layers.0", "layers.1", "layers.2", "layers.3"}
    assert sets[-1] == set()
    for looser, tighter in zip(sets, sets[1:]):
        assert tighter <= looser, sets


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0, 0.2), min_size=3, max_size=3), st.floats(0, 0.2), st.floats(0, 0.2),
       st.floats(-1, 0.6), st.floats(-1, 0.6), st.sampled_from([16, 256, 4096, 65536]),
       st.sampled_from([64, 1024, 8192]), st.sampled_from([64, 1024, 8192]))
def test_choose_is_monotone_in_the_budget(errs, b1, b2, g1, g2, M, K, N):
    """choose(): a tighter (error_budget, min_gain) converts only if the looser one converts (property)."""
    errors = dict(zip(("tensorwise", "rowwise", "rowwise_with_gw_hp"), errs))
    loose = amp_fx.Fp8Config(recipe="auto", error_budget=max(b1, b2), min_gain=min(g1, g2))
    tight = amp_fx.Fp8Config(recipe="auto", error_budget=min(b1, b2), min_gain=max(g1, g2))
    a = choose(M, K, N, errors, DEVICES["h100"], loose)
    b = choose(M, K, N, errors, DEVICES["h100"], tight)
    assert b.recipe is None or a.recipe is not None
    if a.recipe is not None:
        assert errors[a.recipe] <= loose.error_budget and a.gain() >= loose.min_gain


def test_structural_rules_first_last_and_routers_switchable():
    """The first GEMM and the one feeding the output stay bf16; a router named 'gate' too; each rule switches off."""

    class MoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.gate, self.expert, self.head = nn.Linear(32, 64), nn.Linear(64, 16), nn.Linear(64, 64), nn.Linear(64, 32)

        def forward(self, x):
            h = torch.relu(self.inp(x))
            weights = self.gate(h).softmax(-1)[..., :1]
            return self.head(torch.relu(self.expert(h)) * weights)

    torch.manual_seed(0)
    x = torch.randn(16, 32)
    rules = {r["module"]: r["rule"] for r in _auto(MoE(), x, device=FAST_MEMORY).amp_report.passes["fp8_gemms"]["gemms"]}
    assert rules == {"inp": "keep_first", "gate": "keep_routers", "expert": "auto", "head": "keep_last"}
    off = _auto(MoE(), x, device=FAST_MEMORY, keep_first=False, keep_last=False, keep_routers=False)
    assert all(recipe for recipe in _formats(off).values()), off.amp_report
    assert is_router("model.layers.0.block_sparse_moe.gate", 4096) and is_router("mlp.shared_expert_gate", 4096)
    assert not is_router("model.layers.0.mlp.gate_proj", 11008) and not is_router("mlp.up_proj", 11008)


def test_auto_without_example_inputs_is_refused():
    with pytest.raises(AmpValueError, match="example_inputs"):
        amp_fx.convert(Chain(64, 64), "O1", fp8="auto")


def test_auto_config_is_checked():
    with pytest.raises(AmpValueError, match="device 'tpu'"):
        amp_fx.Fp8Config(recipe="auto", device="tpu")
    with pytest.raises(AmpValueError, match="choices"):
        amp_fx.Fp8Config(recipe="auto", choices=("delayed",))
    with pytest.raises(AmpValueError, match="tokens"):
        amp_fx.Fp8Config(recipe="auto", tokens=0)


def test_auto_gemms_compute_what_their_recipe_computes():
    """An auto conversion's fp8 GEMMs are the recipe chosen by hand, bit for bit: forward, input and weight grads."""
    torch.manual_seed(2)
    model = Chain(64, 64, 32)
    x = _outliers(16, 64)
    gm = _auto(model, x, device=FAST_MEMORY, keep_first=False, keep_last=False)
    assert _formats(gm) == {"layers.0": "rowwise_with_gw_hp", "layers.1": "rowwise_with_gw_hp"}
    by_hand = amp_fx.convert(model, "O1", example_inputs=(x,),
                             fp8=amp_fx.Fp8Config(recipe="rowwise_with_gw_hp", size_rule="all"))
    results = []
    for converted in (gm, by_hand):
        xi = x.clone().requires_grad_()
        out = converted(xi)
        out.sum().backward()
        results.append((out.detach(), xi.grad, [p.grad for p in converted.parameters()]))
    (a, ga, pa), (b, gb, pb) = results
    assert torch.equal(a, b) and torch.equal(ga, gb)
    assert all(torch.equal(p, q) for p, q in zip(pa, pb))
