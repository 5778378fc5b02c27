"""cache_weight_casts: the pass turns weight casts into cached casts, and leaves every other cast alone.

``check`` runs the pass on the finished O1 graph (``cache_casts=True``) and
compares outputs and gradients with the fp32 model's: in training the cached
cast is an ordinary autograd cast.

This is the pass's layer.  The cache itself at run time (a weight's cast
served under no_grad, cast again after an in-place update, every forward cast
in training, the cache's bounds) is tested in
tests/graph_ops/test_cast_cache.py.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from amp_fx.graph_ops.cast_cache import cached_cast, clear_cast_cache
from amp_fx.ir.cast_nodes import cast_source, is_inserted_cast
from amp_fx.passes.cache_weight_casts import cache_weight_casts
from pass_check import check

D = 8


@pytest.fixture(autouse=True)
def _empty_cache():
    clear_cast_cache()
    yield
    clear_cast_cache()


def _mlp():
    return nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, 4))


def _weight_casts(gm):
    return [n for n in gm.graph.nodes if is_inserted_cast(n) and cast_source(n).op == "get_attr"]


def test_weight_casts_become_cached_casts_and_input_casts_do_not():
    x = torch.randn(2, D)
    gm = check(cache_weight_casts, _mlp(), (x,), example_inputs=(x,), cache_casts=True, delta=0, expect_modified=True)
    weights = _weight_casts(gm)
    assert len(weights) == 4 and all(n.target is cached_cast for n in weights)
    others = [n for n in gm.graph.nodes if is_inserted_cast(n) and n not in weights]
    assert others and all(n.target is not cached_cast for n in others)


class ReturnsAView(nn.Module):
    """The weight's cast feeds the linear and, through ``.t()``, the output: a cached tensor must not escape."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return F.linear(x, self.w), self.w.t()


def test_a_cast_that_reaches_the_output_is_left_alone_and_the_pass_is_off_by_default():
    x = torch.randn(2, 4)
    gm = check(cache_weight_casts, ReturnsAView(), (x,), example_inputs=(x,), cache_casts=True,
               cast_model_outputs=torch.bfloat16, delta=0, expect_modified=False)
    assert [n.target for n in _weight_casts(gm)] == ["to"]
    off = check(cache_weight_casts, _mlp(), (torch.randn(2, D),), delta=0, expect_modified=False)
    assert not [n for n in off.graph.nodes if n.target is cached_cast]
