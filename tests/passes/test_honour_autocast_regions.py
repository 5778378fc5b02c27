"""honour_autocast_regions: the model's own autocast and grad-mode regions repaint the ops inside them.

``check`` runs the pass on the painted graph: autocast markers are erased
(the casts become explicit), the paint of every node is stable on a second
run, and with ``finish=True`` the finished graph's outputs and gradients
match the model's, which runs its own regions eagerly.
"""

import pytest
import torch
import torch.nn as nn

from amp_fx.ir import meta
from amp_fx.frontend.regions import marker_role
from amp_fx.passes.honour_autocast_regions import honour_autocast_regions
from pass_check import assert_matches, check, prepare, run_rest

PAINT = (meta.DECISION, meta.REASON, meta.RULE)
D = 8


class Regions(nn.Module):
    """``a`` low; inside ``autocast(enabled=False)``: ``b`` and the softmax fp32, ``c`` in a nested bf16 region."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(D, D) for _ in range(3))

    def forward(self, x):
        h = self.a(x)
        with torch.autocast("cpu", enabled=False):
            y = self.b(h.float()).softmax(-1)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                z = self.c(y)
        return z.float() + y


def _linears(gm):
    """{module path: node} of the graph's linears."""
    return {n.meta[meta.MODULE_PATH]: n for n in gm.graph.nodes if n.meta.get(meta.OP) == "linear"}


def _markers(gm):
    return [marker_role(n) for n in gm.graph.nodes if marker_role(n) is not None]


def test_a_disabled_region_pins_its_ops_to_fp32_and_its_markers_go():
    x = torch.randn(4, D)
    gm = check(honour_autocast_regions, Regions(), (x,), delta=-4, expect_modified=True, meta_keys=PAINT)
    assert _markers(gm) == []
    linears = _linears(gm)
    softmax = next(n for n in gm.graph.nodes if n.meta.get(meta.OP) == "softmax")
    for painted in (linears["b"].meta, softmax.meta):
        assert (painted[meta.DECISION], painted[meta.RULE]) == ("fp32", "autocast")
        assert "enabled=False" in painted[meta.REASON]
    assert (linears["a"].meta[meta.DECISION], linears["a"].meta[meta.RULE]) == ("low", "table")
    assert (linears["c"].meta[meta.DECISION], linears["c"].meta[meta.RULE]) == ("low", "autocast")


def test_a_nested_bf16_region_runs_bf16_inside_an_fp16_conversion():
    x = torch.randn(4, D)
    gm = check(honour_autocast_regions, Regions(), (x,), example_inputs=(x,), dtype=torch.float16, delta=-4,
               meta_keys=PAINT, finish=True)
    linears = _linears(gm)
    assert linears["c"].meta[meta.LOW_DTYPE] == torch.bfloat16 and meta.LOW_DTYPE not in linears["a"].meta
    # The finished graph computes each linear in its region's dtype.
    assert {m: meta.float_dtype(linears[m]) for m in "abc"} == {"a": torch.float16, "b": torch.float32, "c": torch.bfloat16}


def test_a_policy_rule_beats_the_region():
    x = torch.randn(4, D)
    gm = check(honour_autocast_regions, Regions(), (x,), delta=-4, meta_keys=PAINT, policy={"module:b": "low"})
    b = _linears(gm)["b"].meta
    assert (b[meta.DECISION], b[meta.RULE]) == ("low", "policy")


class NoGradTarget(nn.Module):
    """A ``torch.no_grad()`` branch that reads ``fc``'s weight, which the grad-mode branch reads too."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        with torch.no_grad():
            target = self.fc(x).softmax(-1)
        return self.fc(x) - target


def test_a_grad_mode_region_keeps_its_markers_and_a_weight_gets_one_read_per_mode():
    model, x = NoGradTarget(), torch.randn(4, D)
    gm, ctx = prepare(model, honour_autocast_regions, example_inputs=(x,))
    honour_autocast_regions(gm, ctx)
    assert _markers(gm) == [("enter", "grad"), ("exit", "grad")]
    inside = {n.meta[meta.OP]: n for n in gm.graph.nodes if n.meta.get(meta.RULE) == "grad-mode" and n.op != "get_attr"}
    assert {"linear", "softmax"} <= set(inside) and "no_grad" in inside["linear"].meta[meta.REASON]
    # The grad-mode linear reads the weight through its own view: a cast made under no_grad never feeds it.
    linears = [n for n in gm.graph.nodes if n.meta.get(meta.OP) == "linear"]
    assert linears[0].args[1] is not linears[1].args[1]
    # Finished, the gradients reach the weight only through the grad-mode branch, as the model's do.
    gm = run_rest(gm, ctx, honour_autocast_regions)
    assert_matches(gm, model, (x,))


class NoGradBranch(nn.Module):
    """A ``torch.no_grad()`` branch on its own weights: nothing to separate, only nodes to paint."""

    def __init__(self):
        super().__init__()
        self.g, self.fc = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        h = self.g(x)
        with torch.no_grad():
            target = self.fc(h.detach()).softmax(-1)
        return h - target


@pytest.mark.parametrize("model", [NoGradBranch, NoGradTarget])
def test_grad_mode_regions_keep_the_pass_contract(model):
    x = torch.randn(4, D)
    check(honour_autocast_regions, model(), (x,), example_inputs=(x,), meta_keys=PAINT, finish=True)


def test_a_graph_without_regions_is_left_alone():
    check(honour_autocast_regions, nn.Sequential(nn.Linear(D, D), nn.Softmax(-1)), (torch.randn(4, D),),
          delta=0, expect_modified=False, meta_keys=PAINT)
