"""The model's own torch.autocast regions under backend=amp_fx (passes/honour_autocast_regions.py)."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import amp_fx
from amp_fx.ir.config import make_config
from amp_fx.ir.pass_manager import PassContext
from amp_fx.passes.assign_precision import assign_precision
from amp_fx.passes.honour_autocast_regions import honour_autocast_regions, is_autocast_enter, is_autocast_exit
from amp_fx.passes.propagate_meta import propagate_meta
from amp_fx.ir.policy import Policy


class Regions(nn.Module):
    """fc1 outside any region, fc2 + softmax in autocast(enabled=False), fc3 in autocast(bf16)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        x = self.fc1(x)
        with torch.autocast("cpu", enabled=False):
            x = self.fc2(x.float()).softmax(-1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            x = self.fc3(x)
        return x


def _dynamo_graph(model, x):
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(copy.deepcopy(gm))
        return gm.forward

    torch.compile(model, backend=keep)(x)
    torch._dynamo.reset()
    return graphs[0]


def _paint(gm, policy=None):
    ctx = PassContext(config=make_config("O1", dtype=torch.bfloat16), policy=Policy.coerce(policy), route="dynamo")
    propagate_meta(gm, ctx)
    assign_precision(gm, ctx)
    return ctx


def _by_op(gm, op):
    return [n for n in gm.graph.nodes if n.meta.get("amp_fx.op") == op]


def test_disabled_region_pinned_fp32_and_region_nodes_removed():
    """Ops in autocast(enabled=False) are fp32 (rule "autocast"); enter/exit nodes go; a second run changes nothing."""
    gm = _dynamo_graph(Regions(), torch.randn(2, 8))
    assert sum(map(is_autocast_enter, gm.graph.nodes)) == 2
    ctx = _paint(gm)
    before = len(gm.graph.nodes)
    result = honour_autocast_regions(gm, ctx)
    gm.graph.lint()
    assert result.modified and len(gm.graph.nodes) == before - 4
    assert not any(is_autocast_enter(n) or is_autocast_exit(n) for n in gm.graph.nodes)
    fc1, fc2, fc3 = _by_op(gm, "linear")
    (softmax,) = _by_op(gm, "softmax")
    assert [fc1.meta["amp_fx.decision"], fc2.meta["amp_fx.decision"], fc3.meta["amp_fx.decision"]] == ["low", "fp32", "low"]
    assert fc2.meta["amp_fx.rule"] == softmax.meta["amp_fx.rule"] == "autocast"
    assert "enabled=False" in fc2.meta["amp_fx.reason"]
    assert result.stats["regions"] == 2 and result.stats["pinned_fp32"] == 2
    again = honour_autocast_regions(gm, ctx)
    assert not again.modified and again.stats["regions"] == 0


def test_policy_beats_a_region():
    """A policy rule given to the backend outranks the model's autocast(enabled=False)."""
    gm = _dynamo_graph(Regions(), torch.randn(2, 8))
    ctx = _paint(gm, policy={"module:fc2": "low"})
    honour_autocast_regions(gm, ctx)
    fc2 = _by_op(gm, "linear")[1]
    assert fc2.meta["amp_fx.decision"] == "low" and fc2.meta["amp_fx.rule"] == "policy"


def test_graph_without_regions_is_untouched():
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    ctx = _paint(gm)
    result = honour_autocast_regions(gm, ctx)
    assert not result.modified and result.stats["regions"] == 0


def test_regions_compiled_match_eager_autocast_and_cast_once():
    """End to end: the AOT forward graph runs fc2 in fp32, fc1/fc3 low, and never casts a cast."""
    fw = []

    def keep(gm, example_inputs):
        fw.append(gm)
        return make_boxed_func(gm.forward)

    model = Regions()
    x = torch.randn(2, 8)
    out = torch.compile(model, backend=amp_fx.backend(inner=aot_autograd(fw_compiler=keep), cast_model_outputs=False))(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x)
    assert out.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, atol=1e-2, rtol=1e-2)
    (forward,) = fw
    gemms = [n for n in forward.graph.nodes if n.target == torch.ops.aten.addmm.default]
    assert [g.meta["val"].dtype for g in gemms] == [torch.bfloat16, torch.float32, torch.bfloat16]
    casts = [n for n in forward.graph.nodes if n.target == torch.ops.aten._to_copy.default]
    assert not any(c.args[0] in casts for c in casts)  # no cast of a cast: nothing is cast twice
    report = amp_fx.last_report()[0]
    assert report.node("linear_1").rule == "autocast"
