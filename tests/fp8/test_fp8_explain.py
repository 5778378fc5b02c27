"""``amp_fx.explain(gm)`` and the warning of an fp8 request that converts nothing.

Rules under test: explain has one row per fp8-capable GEMM whose format is the conversion's decision (the
report's node decision ``fp8`` exactly where the row says an fp8 recipe), its predicted times are the cost
model's for its M, K, N, and its totals add up; every GEMM fp8 was asked for and not converted has a reason
and a rule; a request that converts nothing warns (``Fp8NothingConvertedWarning``, an ``AmpWarning``)
naming the rule that kept the GEMMs and the option that changes it.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import amp_fx
from amp_fx.errors import AmpTypeError
from amp_fx.ir.fp8_cost import DEVICES, DeviceProfile, layer_seconds

FAST_MEMORY = DeviceProfile("fast_memory", 1e15, 2e15, 1e18)


class Net(nn.Module):
    """Three Linears: 64 -> 128 -> 128 -> 48 (the last one's N is legal, its K too)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(64, 128), nn.Linear(128, 128), nn.Linear(128, 48)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def _x():
    torch.manual_seed(0)
    return torch.randn(4, 8, 64)


def test_explain_rows_follow_the_decisions():
    """Under auto: the first and last GEMMs bf16 by rule, the middle one fp8; rows, report and totals agree."""
    gm = amp_fx.convert(Net(), "O1", example_inputs=(_x(),), fp8=amp_fx.Fp8Config(recipe="auto", device=FAST_MEMORY))
    table = amp_fx.explain(gm)
    assert [r.module for r in table.rows] == ["a", "b", "c"]
    assert [r.format for r in table.rows] == ["bf16", "tensorwise", "bf16"]
    assert [r.rule for r in table.rows] == ["keep_first", "auto", "keep_last"]
    decisions = {r.name: r.decision for r in gm.amp_report.nodes}
    for row in table.rows:
        assert (decisions[row.name] == "fp8") == (row.format != "bf16")
        assert row.M == 32 and row.bf16_s == pytest.approx(layer_seconds("bf16", row.M, row.K, row.N, FAST_MEMORY))
        assert row.sensitivity is not None and 0 < row.sensitivity < 0.05
        assert row.why
    assert table.fp8 == 1 == gm.amp_report.count("fp8") and table.total == 3
    flops = [r.M * r.K * r.N for r in table.rows]
    assert table.fp8_flop_share == pytest.approx(flops[1] / sum(flops))
    assert table.plan_s == pytest.approx(table.rows[0].bf16_s + table.rows[1].fp8_s + table.rows[2].bf16_s)
    assert table.gain == pytest.approx(1 - table.plan_s / table.bf16_s) and table.gain > 0
    text = str(table)
    assert "1 of 3 GEMMs fp8" in text and "keep_last=True" in text and "tensorwise" in text


def test_explain_other_device_keeps_formats_changes_times():
    gm = amp_fx.convert(Net(), "O1", example_inputs=(_x(),), fp8=amp_fx.Fp8Config(recipe="auto", device=FAST_MEMORY))
    b200 = amp_fx.explain(gm, device="b200")
    assert b200.device == "b200"
    assert [r.format for r in b200.rows] == [r.format for r in amp_fx.explain(gm).rows]
    row = b200.rows[1]
    assert row.bf16_s == pytest.approx(layer_seconds("bf16", row.M, row.K, row.N, DEVICES["b200"]))
    with pytest.raises(AmpTypeError, match="device"):
        amp_fx.explain(gm, device="tpu")
    with pytest.raises(AmpTypeError, match="convert"):
        amp_fx.explain(Net())


def test_explain_of_a_fixed_recipe_predicts_times_without_measuring():
    """fp8='tensorwise' with size_rule='all': every row fp8 tensorwise, times from the model, no measured error."""
    gm = amp_fx.convert(Net(), "O1", example_inputs=(_x(),), fp8=amp_fx.Fp8Config(size_rule="all"))
    table = amp_fx.explain(gm)
    assert [r.format for r in table.rows] == ["tensorwise"] * 3
    assert all(r.sensitivity is None and r.fp8_s is not None and r.rule == "size_rule" for r in table.rows)
    assert table.fp8 == 3


def test_request_that_converts_nothing_warns_naming_the_rule():
    """fp8=True on small GEMMs: all kept by the default size rule; the warning names it and size_rule='all'."""
    with pytest.warns(amp_fx.Fp8NothingConvertedWarning) as caught:
        gm = amp_fx.convert(Net(), "O1", example_inputs=(_x(),), fp8=True)
    message = str(caught[0].message)
    assert "none of the 3 GEMMs" in message and "3 by size_rule" in message and "size_rule='all'" in message
    assert issubclass(amp_fx.Fp8NothingConvertedWarning, amp_fx.AmpWarning)
    # and the report says why for each GEMM
    for row in gm.amp_report.passes["fp8_gemms"]["gemms"]:
        assert not row["fp8"] and row["rule"] == "size_rule" and "too small to gain" in row["why"]
    assert any("kept bfloat16 (too small to gain" in line for line in gm.amp_report.passes["fp8_gemms"]["report_lines"])


def test_auto_converting_nothing_warns_with_each_rule():
    """recipe='auto' on one-layer nets: the warning counts the GEMMs per rule with the option for each."""

    class One(nn.Module):
        def __init__(self):
            super().__init__()
            self.only = nn.Linear(64, 64)

        def forward(self, x):
            return self.only(x)

    with pytest.warns(amp_fx.Fp8NothingConvertedWarning, match=r"1 by keep_last .*keep_last=False"):
        amp_fx.convert(One(), "O1", example_inputs=(_x(),), fp8="auto")


def test_a_request_that_converts_something_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error", amp_fx.Fp8NothingConvertedWarning)
        gm = amp_fx.convert(Net(), "O1", example_inputs=(_x(),), fp8=amp_fx.Fp8Config(size_rule="all"))
    assert gm.amp_report.count("fp8") == 3


def test_policy_fp8_on_illegal_gemm_warns_naming_legality():
    """A policy asks fp8 for a GEMM whose N is not a multiple of 16: kept bf16, the warning says legality."""

    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.odd = nn.Linear(64, 40)

        def forward(self, x):
            return self.odd(x)

    with pytest.warns(amp_fx.Fp8NothingConvertedWarning, match="1 by legality .*multiple of 16"):
        amp_fx.convert(Odd(), "O1", example_inputs=(_x(),), policy={"module:odd": "fp8"})
