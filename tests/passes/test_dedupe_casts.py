"""dedupe_casts: one cast per parameter even through views; casts of views of activations are left alone."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from amp_fx.ir.cast_nodes import cast_source, is_inserted_cast
from amp_fx.passes.dedupe_casts import dedupe_casts
from pass_check import check


def _casts(gm):
    """(source op, source name) of every inserted cast."""
    return sorted((cast_source(n).op, cast_source(n).name) for n in gm.graph.nodes if is_inserted_cast(n))


class ViewsOfOneWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return x @ self.w + x @ self.w.t() + x @ self.w.t().contiguous()


def test_casts_of_views_of_a_weight_are_hoisted_to_one_weight_cast():
    gm = check(dedupe_casts, ViewsOfOneWeight(), (torch.randn(2, 4),), expect_modified=True)
    weight_casts = [n for n in gm.graph.nodes if is_inserted_cast(n) and cast_source(n).op == "get_attr"]
    assert len(weight_casts) == 1
    assert not [n for n in gm.graph.nodes if is_inserted_cast(n) and cast_source(n).op == "call_method"]


class ViewOfAnActivation(nn.Module):
    """``x.t()`` is cast for the linear, and ``x`` itself is cast nowhere: nothing to share."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return F.linear(x.t(), self.w)


def test_a_view_of_an_activation_cast_nowhere_else_keeps_its_cast():
    x = torch.randn(4, 4)
    gm = check(dedupe_casts, ViewOfAnActivation(), (x,), example_inputs=(x,), delta=0, expect_modified=False)
    assert _casts(gm) == [("call_method", "t"), ("get_attr", "w")]


class ActivationAndItsView(nn.Module):
    """``x`` is cast for one linear and ``x.t()`` for another: the view reads the shared cast of ``x``."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return F.linear(x, self.w) + F.linear(x.t(), self.w)


def test_a_view_of_an_activation_cast_anyway_reads_that_cast():
    # cast(x.t()) and the fp32 x.t() give way to one x.t() of the cast of x (example inputs: x is known floating).
    x = torch.randn(4, 4)
    gm = check(dedupe_casts, ActivationAndItsView(), (x,), example_inputs=(x,), delta=-1, expect_modified=True)
    assert _casts(gm) == [("get_attr", "w"), ("placeholder", "x")]
