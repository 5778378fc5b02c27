"""fold_casts and dedupe_casts: no chains, no no-op casts, one cast per parameter even through views."""

import torch
import torch.nn as nn

from amp_fx.core.cast_nodes import cast_source, is_inserted_cast
from amp_fx.passes.dedupe_casts import dedupe_casts
from amp_fx.passes.fold_casts import fold_casts
from pass_check import check


class UserCastThenLow(nn.Module):
    """The model widens (x.float()) right before a low op: the inserted cast reads x directly."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x.float())


def test_cast_of_a_widening_model_cast_reads_the_original_value():
    x = torch.randn(2, 4, dtype=torch.bfloat16)
    gm = check(fold_casts, UserCastThenLow(), (x,), example_inputs=(x,), delta=-2, cast_model_outputs=False)
    # x is already bf16: the inserted cast of x.float() back to bf16 is gone,
    # and so is the model's x.float(), which nothing reads any more.
    assert [cast_source(n).op for n in gm.graph.nodes if is_inserted_cast(n)] == ["get_attr", "get_attr"]


def test_fold_is_a_no_op_on_a_clean_graph():
    check(fold_casts, nn.Sequential(nn.Linear(4, 4), nn.ReLU()), (torch.randn(2, 4),), delta=0, expect_modified=False)


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
