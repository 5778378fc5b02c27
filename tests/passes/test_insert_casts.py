"""insert_casts: casts only where a consumer needs another dtype; one per (value, dtype)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

import zoo
from amp_fx.ir.cast_nodes import cast_source, is_inserted_cast
from amp_fx.graph_ops.casts import amp_cast
from amp_fx.passes.insert_casts import insert_casts
from pass_check import check


class LowThenFp32(nn.Module):
    """linear (low) -> softmax (fp32) -> linear (low): node names say their expected colour."""

    def __init__(self):
        super().__init__()
        self.low_a = nn.Linear(4, 4)
        self.low_b = nn.Linear(4, 4)

    def forward(self, x):
        return self.low_b(self.low_a(x).softmax(-1))


def test_casts_exactly_where_dtypes_change():
    # x->low, 4 weight/bias casts, low_a->fp32 for softmax, softmax->low for low_b.
    gm = check(insert_casts, LowThenFp32(), (torch.randn(2, 4),), delta=7, expect_modified=True, cast_model_outputs=False)
    casts = [n for n in gm.graph.nodes if is_inserted_cast(n)]
    assert sorted(cast_source(c).name for c in casts) == sorted(
        ["x", "low_a_weight", "low_a_bias", "linear", "softmax", "low_b_weight", "low_b_bias"])


def test_unknown_input_dtype_uses_the_guarded_helper_and_known_values_use_to():
    gm = check(insert_casts, LowThenFp32(), (torch.randn(2, 4),))
    x_cast = next(n for n in gm.graph.nodes if is_inserted_cast(n) and cast_source(n).name == "x")
    assert x_cast.target is amp_cast
    weight_cast = next(n for n in gm.graph.nodes if is_inserted_cast(n) and cast_source(n).name == "low_a_weight")
    assert weight_cast.op == "call_method" and weight_cast.target == "to"


def test_example_inputs_make_every_cast_a_plain_to():
    x = torch.randn(2, 4)
    gm = check(insert_casts, LowThenFp32(), (x,), example_inputs=(x,))
    assert all(n.target == "to" for n in gm.graph.nodes if is_inserted_cast(n))


def test_consumers_share_one_cast():
    class TwoReaders(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4))

        def forward(self, x):
            return F.linear(x, self.w) + F.linear(x, self.w).relu()

    # one cast of x, one of w, shared by both linears
    check(insert_casts, TwoReaders(), (torch.randn(2, 4),), delta=2, cast_model_outputs=False)


def test_follow_only_graph_is_left_alone():
    class Follow(nn.Module):
        def forward(self, x):
            return (x.relu() + 1).view(-1)

    check(insert_casts, Follow(), (torch.randn(2, 4),), delta=0, expect_modified=False,
          cast_model_outputs=False)


def test_o2_casts_inputs_at_entry_and_outputs_at_exit():
    gm = check(insert_casts, zoo.MLP(), zoo.MLP.example(), level="O2", atol=0.1)
    first_user = next(iter(next(n for n in gm.graph.nodes if n.op == "placeholder").users))
    assert is_inserted_cast(first_user)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    assert is_inserted_cast(output.args[0])


def test_leaf_module_that_must_run_low_gets_cast_parameters_for_the_call():
    gm = check(insert_casts, zoo.LSTMTagger(), zoo.LSTMTagger.example())
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target.__name__ == "call_with_params"]
    assert len(calls) == 1 and len(calls[0].args[1]) == 4  # weight_ih, weight_hh, bias_ih, bias_hh
