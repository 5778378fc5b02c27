"""Which GEMMs run in fp8: ``can_fp8`` (legal), ``should_fp8`` (worth it), the policy, and what the report says.

Rules under test (amp_fx/ir/fp8_rules.py): legal are linear and matmul/mm with a
2-D parameter operand, K and N multiples of 16, painted low; worth it by
torchao's size thresholds unless ``size_rule="all"``; a policy's ``"fp8"``
forces a legal GEMM, its ``"low"`` / ``"fp32"`` keeps one out.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import amp_fx
from amp_fx.errors import AmpTypeError, AmpValueError
from amp_fx.ir.fp8_rules import Fp8Config, can_fp8, parse_fp8, should_fp8


def _legal(**overrides):
    args = dict(decision="low", K=32, N=64, act_dims=2, weight_is_param=True)
    return can_fp8(overrides.pop("op", "linear"), **{**args, **overrides})


@pytest.mark.parametrize("overrides,why", [
    ({}, ""),
    ({"op": "matmul"}, ""),
    ({"op": "bmm"}, "not an fp8 GEMM"),
    ({"op": "conv2d"}, "not an fp8 GEMM"),
    ({"K": 40}, "multiple of 16"),
    ({"N": 24}, "multiple of 16"),
    ({"decision": "fp32"}, "runs fp32"),
    ({"weight_is_param": False}, "not a 2-D parameter"),
    ({"K": None}, "not static"),
    ({"act_dims": 1}, "1-D activation"),
])
def test_can_fp8(overrides, why):
    """Each condition of legality, one at a time."""
    legal, reason = _legal(**overrides)
    assert legal == (why == "")
    assert why in reason


@pytest.mark.parametrize("recipe,K,N,worth_it", [
    ("tensorwise", 4096, 1024, False),  # both at the thresholds: too small
    ("tensorwise", 4112, 64, True),  # K past 4096
    ("tensorwise", 64, 1040, True),  # N past 1024
    ("delayed", 4096, 1024, False),
    ("rowwise", 8192, 2048, False),  # N <= 2048
    ("rowwise", 1024, 8192, False),  # K <= 1024
    ("rowwise", 2048, 4096, False),  # N <= 4096 and K <= 2048
    ("rowwise", 2064, 4096, True),
    ("rowwise", 1040, 4112, True),
])
def test_should_fp8_auto(recipe, K, N, worth_it):
    """size_rule='auto': torchao's measured thresholds per recipe."""
    ok, why = should_fp8(K, N, Fp8Config(recipe=recipe))
    assert ok == worth_it
    assert ok or "too small" in why
    assert should_fp8(K, N, Fp8Config(recipe=recipe, size_rule="all")) == (True, "")


def test_parse_fp8_spellings_and_errors():
    assert parse_fp8(None) is None and parse_fp8(False) is None
    assert parse_fp8(True) == Fp8Config()
    assert parse_fp8("rowwise").recipe == "rowwise"
    assert parse_fp8({"recipe": "delayed", "history_len": 4}).history_len == 4
    with pytest.raises(AmpValueError, match="recipe 'mx'"):
        parse_fp8("mx")
    with pytest.raises(AmpValueError, match="unknown"):
        parse_fp8({"recipie": "delayed"})
    with pytest.raises(AmpTypeError, match="fp8 takes"):
        parse_fp8(3)
    with pytest.raises(AmpValueError, match="amax_compute"):
        Fp8Config(recipe="delayed", amax_compute="mean")


class Net(nn.Module):
    """A body the size rule keeps out of fp8 (small), a wide GEMM it takes, a misaligned one, and a head."""

    def __init__(self):
        super().__init__()
        self.small = nn.Linear(32, 64)
        self.wide = nn.Linear(64, 1040)
        self.odd = nn.Linear(1040, 40)
        self.head = nn.Linear(40, 32)
        self.proj = nn.Parameter(torch.randn(32, 48) / 8)

    def forward(self, x):
        return self.head(self.odd(self.wide(self.small(x)))) @ self.proj


def _decisions(gm):
    return {g["module"] or g["node"]: (g["fp8"], g["why"]) for g in gm.amp_report.passes["fp8_gemms"]["gemms"]}


def test_auto_takes_the_wide_gemm_only_and_the_report_names_every_gemm():
    x = torch.randn(4, 32)
    gm = amp_fx.convert(Net(), "O1", example_inputs=(x,), fp8=True)
    decided = _decisions(gm)
    assert decided["wide"][0] and not decided["small"][0]
    assert "too small" in decided["small"][1]
    assert "multiple of 16" in decided["odd"][1] and "multiple of 16" in decided["head"][1]
    assert not decided["matmul"][0]  # x @ proj: legal, but too small
    assert [r.name for r in gm.amp_report.nodes if r.decision == "fp8"] == ["linear_1"]
    text = str(gm.amp_report)
    assert "fp8 1 nodes" in text
    for name in ("small", "wide", "odd", "head"):
        assert f"({name}):" in text  # one report line per GEMM, fp8 or kept
    assert gm(x).shape == (4, 48)


def test_policy_forces_and_forbids():
    """'fp8' on a module forces its legal GEMMs (any size), 'low' keeps one bf16, 'fp8' on a misaligned GEMM cannot."""
    x = torch.randn(4, 32)
    policy = {"module:small": "fp8", "module:wide": "low", "module:odd": "fp8", "op:matmul": "fp8"}
    gm = amp_fx.convert(Net(), "O1", example_inputs=(x,), fp8=True, policy=policy)
    decided = _decisions(gm)
    assert decided["small"] == (True, "policy module 'small' -> fp8")
    assert not decided["wide"][0] and "keeps it out of fp8" in decided["wide"][1]
    assert not decided["odd"][0] and "multiple of 16" in decided["odd"][1]
    assert decided["matmul"][0]  # x @ proj (a parameter), forced by op
    assert gm.amp_report.passes["fp8_gemms"]["fp8"] == 2
    y = gm(x)
    y.sum().backward()
    assert gm.get_parameter("proj").grad is not None and gm.get_parameter("small.weight").grad is not None


def test_policy_fp8_without_fp8_option_uses_tensorwise_and_nothing_else_changes():
    """fp8=None: only the policy's GEMMs are fp8 (tensorwise); a plain conversion has no fp8 lines or state."""
    x = torch.randn(4, 32)
    gm = amp_fx.convert(Net(), "O1", example_inputs=(x,), policy={"module:small": "fp8"})
    gemms = gm.amp_report.passes["fp8_gemms"]["gemms"]
    assert [(g["module"], g["recipe"]) for g in gemms if g["fp8"]] == [("small", "tensorwise")]
    plain = amp_fx.convert(Net(), "O1", example_inputs=(x,))
    assert "fp8" not in str(plain.amp_report).replace("fp8_gemms", "")
    assert amp_fx.fp8_states(plain) == {}
    assert all(r.decision != "fp8" for r in plain.amp_report.nodes)


def test_fp32_region_gemm_is_not_fp8():
    """A GEMM a policy pins fp32 is not legal for fp8 even with size_rule='all'."""
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    gm = amp_fx.convert(model, "O1", example_inputs=(torch.randn(4, 32),), fp8={"size_rule": "all"},
                        policy={"module:1": "fp32"})
    decided = _decisions(gm)
    assert decided["0"][0] and not decided["1"][0]


def test_flop_share():
    """The share of GEMM FLOPs in fp8: 2*M*K*N of the fp8 GEMMs over all GEMMs'."""
    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 48))
    gm = amp_fx.convert(model, "O1", example_inputs=(torch.randn(4, 32),), policy={"module:0": "fp8"})
    stats = gm.amp_report.passes["fp8_gemms"]
    assert stats["fp8_flop_share"] == pytest.approx((32 * 64) / (32 * 64 + 64 * 48))


class Conv1D(nn.Module):
    """Hugging Face GPT-2's Conv1D: ``addmm(bias, x, weight)`` with a K x N weight."""

    def __init__(self, k=32, n=48):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(k, n) * 0.1)
        self.bias = nn.Parameter(torch.randn(n) * 0.1)

    def forward(self, x):
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(*x.shape[:-1], -1)


def test_addmm_with_a_parameter_is_fp8_as_matmul_plus_bias():
    """Conv1D's addmm becomes fp8_matmul(x, W) + bias: the same as an fp8 Linear with weight W.t()."""
    x = torch.randn(2, 4, 32)
    module = Conv1D()
    gm = amp_fx.convert(module, "O1", example_inputs=(x,), fp8={"size_rule": "all"})
    assert [r.op for r in gm.amp_report.nodes if r.decision == "fp8"] == ["fp8_matmul"]
    linear = nn.Linear(32, 48)
    linear.weight.data, linear.bias.data = module.weight.detach().t().contiguous(), module.bias.detach().clone()
    ref = amp_fx.convert(linear, "O1", example_inputs=(x,), fp8={"size_rule": "all"})
    assert torch.equal(gm(x), ref(x))
