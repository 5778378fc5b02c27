"""fold_casts: no cast chains, no casts to a value's own dtype, one cast per (value, dtype)."""

import torch
import torch.nn as nn

from amp_fx.ir.cast_nodes import cast_source, is_inserted_cast
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


class UserNarrowsThenWidens(nn.Module):
    """``x.half().float()``: the widening is read through, the rounding to fp16 the user asked for is kept."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x.half().float())


def test_a_narrowing_cast_the_model_wrote_is_kept():
    x = torch.randn(2, 4)
    gm = check(fold_casts, UserNarrowsThenWidens(), (x,), example_inputs=(x,), delta=-1, expect_modified=True)
    x_cast = next(n for n in gm.graph.nodes if is_inserted_cast(n) and cast_source(n).op != "get_attr")
    assert cast_source(x_cast).target == "half"  # reads the fp16 value, not x
