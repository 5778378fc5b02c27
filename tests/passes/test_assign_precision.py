"""assign_precision: the tables, the level and the policy paint each node; banned ops are refused with the fix.

An analysis: ``check`` asserts no code changes, every node carries a
decision, reason and rule, and a second run paints the same.
"""

import math
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_fx

from amp_fx.ir import meta, tables
from amp_fx.errors import BannedOpError, UnknownOpError
from amp_fx.passes.assign_precision import assign_precision
from pass_check import check, prepare

PAINT = (meta.DECISION, meta.REASON, meta.RULE)


class Head(nn.Module):
    """linear (LOW table) -> softmax (FP32 table) -> layer_norm (FP32 table)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x):
        return self.norm(F.softmax(self.fc(x), -1))


def _paint(gm, name):
    """(decision, reason, rule) of the node called ``name``."""
    return next(tuple(n.meta[k] for k in PAINT) for n in gm.graph.nodes if n.name == name)


def _reason(table, op):
    """The reason the tables give for ``op``."""
    return tables.all_tables()[table][op]


def test_o1_tables_paint_low_and_fp32_ops_with_their_reason():
    gm = check(assign_precision, Head(), (torch.randn(2, 4),), delta=0, expect_modified=False, meta_keys=PAINT)
    assert _paint(gm, "linear") == ("low", "low: " + _reason("low", "linear"), "table")
    decision, reason, rule = _paint(gm, "softmax")
    assert (decision, rule) == ("fp32", "table") and reason == "fp32: " + _reason("fp32", "softmax")
    assert _paint(gm, "x")[0] == "none" and _paint(gm, "output")[0] == "none"


def test_a_policy_rule_beats_the_tables():
    policy = {"op:softmax": "low", "module:fc": "fp32"}
    gm = check(assign_precision, Head(), (torch.randn(2, 4),), delta=0, meta_keys=PAINT, policy=policy)
    assert _paint(gm, "softmax") == ("low", "policy op 'softmax' -> low", "policy")
    assert _paint(gm, "linear") == ("fp32", "policy module 'fc' -> fp32", "policy")
    assert _paint(gm, "layer_norm")[2] == "table"  # what no rule names is still the tables'


def test_o2_runs_the_graph_low_and_keeps_normalisation_fp32():
    gm = check(assign_precision, Head(), (torch.randn(2, 4),), level="O2", delta=0, meta_keys=PAINT, atol=0.1)
    assert _paint(gm, "softmax")[::2] == ("low", "level") and _paint(gm, "linear")[::2] == ("low", "level")
    decision, reason, rule = _paint(gm, "layer_norm")
    assert (decision, rule) == ("fp32", "level") and "keep_batchnorm_fp32=True" in reason
    assert _paint(gm, "x")[0] == "entry"


class BCE(nn.Module):
    def forward(self, x, y):
        return F.binary_cross_entropy(torch.sigmoid(x), y)


def test_a_banned_op_is_refused_with_the_fix_named():
    inputs = (torch.randn(4), torch.rand(4))
    gm, ctx = prepare(BCE(), assign_precision)
    with pytest.raises(BannedOpError) as info:
        assign_precision(gm, ctx)
    message = str(info.value)
    assert "binary_cross_entropy_with_logits" in message and "allow_banned=True" in message
    assert "node 'binary_cross_entropy'" in message  # and names the node it met
    # ... and a policy cannot make it low either.
    gm, ctx = prepare(BCE(), assign_precision, policy={"op:binary_cross_entropy": "low"})
    with pytest.raises(BannedOpError, match="-> low"):
        assign_precision(gm, ctx)
    allowed = check(assign_precision, BCE(), inputs, delta=0, meta_keys=PAINT, allow_banned=True)
    assert _paint(allowed, "binary_cross_entropy")[::2] == ("fp32", "banned")


class Unknown(nn.Module):
    def forward(self, x):
        return torch.special.entr(x.abs())


def test_unknown_op_errors_only_when_asked_and_says_how_to_decide_it():
    gm = check(assign_precision, Unknown(), (torch.rand(4),), delta=0, meta_keys=PAINT)
    op = next(n.meta[meta.OP] for n in gm.graph.nodes if n.meta.get(meta.RULE) == "unknown")
    assert _paint(gm, "special_entr")[0] == "follow"
    gm, ctx = prepare(Unknown(), assign_precision, on_unknown_op="error")
    with pytest.raises(UnknownOpError, match=re.escape(f"policy={{'op:{op}'")):
        assign_precision(gm, ctx)


# -- O2 keeps losses fp32 (keep_losses_fp32), as it keeps norms ----------------------------------------
class _ClassifierWithLoss(torch.nn.Module):
    """Logits over 100 classes and their cross-entropy, computed inside the model (as HF heads do)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 100)

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.fc(x), y)


def _loss_rows(gm):
    return {r.op: r.decision for r in gm.amp_report.nodes if r.op in ("cross_entropy", "log_softmax", "nll_loss")}


def test_O2_keeps_a_loss_inside_the_model_fp32_and_keep_losses_fp32_False_runs_it_low_as_Apex_did():
    torch.manual_seed(0)
    model, x, y = _ClassifierWithLoss(), torch.randn(64, 16) * 4, torch.randint(0, 100, (64,))
    kept = amp_fx.convert(model, "O2", dtype=torch.bfloat16)
    apex = amp_fx.convert(model, "O2", dtype=torch.bfloat16, keep_losses_fp32=False)
    assert _loss_rows(kept) == {"cross_entropy": "fp32"} and _loss_rows(apex) == {"cross_entropy": "low"}
    assert kept(x, y).dtype == torch.float32
    # Both read the same bf16 logits; the fp32 loss rounds once at the end, the low one in its softmax sums.
    logits = F.linear(x.bfloat16(), model.fc.weight.bfloat16(), model.fc.bias.bfloat16())
    exact = F.cross_entropy(logits.double(), y)
    assert abs(kept(x, y).double() - exact) <= 1e-6 * exact.abs()
    assert abs(apex(x, y).double() - exact) > abs(kept(x, y).double() - exact)


def test_O3_runs_losses_low_unless_asked_and_O1_keeps_them_fp32_from_its_tables():
    model = _ClassifierWithLoss()
    assert _loss_rows(amp_fx.convert(model, "O3", dtype=torch.bfloat16)) == {"cross_entropy": "low"}
    assert _loss_rows(amp_fx.convert(model, "O3", dtype=torch.bfloat16, keep_losses_fp32=True)) == {"cross_entropy": "fp32"}
    assert _loss_rows(amp_fx.convert(model, "O1", dtype=torch.bfloat16)) == {"cross_entropy": "fp32"}


# -- O2/O3 keep the tensors the model makes in fp32 itself, as they keep its x.float() -----------------
class _TimestepEmbedding(nn.Module):
    """The sinusoidal timestep embedding of DDPM/diffusers: fp32 frequencies from an ``arange(dtype=float32)``."""

    def __init__(self, check_shape=False):
        super().__init__()
        self.check_shape = check_shape

    def forward(self, t):
        if self.check_shape:
            assert t.dim() == 1  # no whole graph: convert() captures the call with Dynamo
        half = 16
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        angles = t.float()[:, None] * freqs[None]
        return torch.cat([angles.sin(), angles.cos()], -1)


@pytest.mark.parametrize("level", ["O2", "O3"])
@pytest.mark.parametrize("route", ["symbolic_trace", "dynamo"])
def test_O2_O3_keep_a_factory_the_model_asks_fp32_of_and_what_computes_from_it(level, route):
    model = _TimestepEmbedding(check_shape=route == "dynamo")
    t = torch.tensor([10, 500, 999])
    converted = amp_fx.convert(model, level, dtype=torch.bfloat16)
    out, exact = converted(t), model(t)
    assert converted.amp_report.route == route
    # bf16 frequencies (a step of 2^-8 relative) put sin/cos of t=999 several percent off; fp32 ones are exact
    # up to fp32 rounding of t * freq (about 1e-4 radians).
    assert ((out[-1] - exact[-1]).norm() / exact[-1].norm()).item() < 5e-3


class _FactoryBesideAnActivation(nn.Module):
    def forward(self, x):
        scale = torch.exp(torch.ones(x.shape[-1], dtype=torch.float32) * 0.5)
        return torch.relu(x) + scale


def test_O2_runs_low_an_op_that_reads_a_low_value_beside_an_fp32_factory():
    converted = amp_fx.convert(_FactoryBesideAnActivation(), "O2", dtype=torch.bfloat16)
    rows = {r.op: (r.decision, r.reason) for r in converted.amp_report.nodes}
    assert rows["ones"] == ("follow", "O2: the model makes this tensor in float32")
    assert rows["exp"] == ("follow", "O2: computes from tensors the model makes in full precision")
    assert rows["add"] == ("low", "O2: whole graph in low precision")  # only what computes from it alone keeps fp32
    assert _paint(amp_fx.convert(_FactoryBesideAnActivation(), "O1"), "exp")[0] == "fp32"  # O1: autocast's table
