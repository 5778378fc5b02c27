"""cache_weight_casts: weight casts served from the cache under no_grad, recomputed after any in-place update.

``check`` runs the pass on the finished O1 graph (``cache_casts=True``) and
compares outputs and gradients with the fp32 model's: in training the cached
cast is an ordinary autograd cast.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from amp_fx.graph_ops.cast_cache import cached_cast, clear_cast_cache
from amp_fx.ir.cast_nodes import cast_source, is_inserted_cast
from amp_fx.passes.cache_weight_casts import cache_weight_casts
from pass_check import check, prepare
from probes import CAST_OPS, OpRecorder

D = 8


@pytest.fixture(autouse=True)
def _empty_cache():
    clear_cast_cache()
    yield
    clear_cast_cache()


def _casts(run):
    """How many casts (``_to_copy``) ``run()`` dispatches; the MLP's input cast is one of them each time."""
    with OpRecorder() as probe:
        run()
    return probe.count(CAST_OPS)


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


def test_served_again_under_no_grad_and_recomputed_after_an_in_place_update():
    model, x = _mlp().eval(), torch.randn(2, D)
    cached = check(cache_weight_casts, model, (x,), example_inputs=(x,), cache_casts=True)
    plain, _ = prepare(model, cache_weight_casts, example_inputs=(x,), cache_casts=True)  # same parameters, no cache
    with torch.no_grad():
        # The input and the 4 weights, then the input only: the weights' casts are served from the cache.
        assert [_casts(lambda: cached(x)) for _ in range(3)] == [5, 1, 1]
        out = cached(x)
        model[0].weight.add_(1.0)  # bumps the version counter: that weight's cached cast is stale
        assert _casts(lambda: cached(x)) == 2  # the input and the updated weight
        out_after = cached(x)
        assert not torch.equal(out_after, out)
        torch.testing.assert_close(out_after, plain(x), rtol=0, atol=0)


def test_training_casts_every_forward_and_gradients_reach_the_weights():
    model, x = _mlp(), torch.randn(2, D)
    gm = check(cache_weight_casts, model, (x,), example_inputs=(x,), cache_casts=True)
    with torch.no_grad():
        gm(x)  # fills the cache
    # With grad enabled every forward casts the input and the 4 weights as autograd ops: nothing is served.
    assert [_casts(lambda: gm(x)) for _ in range(2)] == [5, 5]
    gm(x).sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


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
