"""The weight-cast cache (amp_fx/graph_ops/cast_cache.py) at run time: inference reuses each weight's cast across
forwards; any change to a parameter is seen; training is unchanged.

This is the cache's layer, through ``convert(cache_casts=True)``.  Which casts the pass turns into cached casts
(weights', not inputs', nor one that reaches the output), and the pass contract, are the pass's layer:
tests/passes/test_cache_weight_casts.py.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn as nn

import amp_fx
from cast_cache_probes import MODELS, ParamCasts, _mlp
from amp_fx.graph_ops.cast_cache import cached_cast, cast_cache_size
from probes import CAST_OPS, OpRecorder


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_no_parameter_cast_after_the_first_forward(name, batch, mode):
    build, make = MODELS[name]
    torch.manual_seed(0)
    model = build().eval()
    gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16, cache_casts=True)
    x = make(batch)
    region = torch.no_grad if mode == "no_grad" else torch.inference_mode
    counts = []
    for _ in range(3):
        with region(), ParamCasts(model.parameters()) as probe:
            out = gm(x)
        counts.append(probe.count)
    assert counts[0] > 0 and counts[1:] == [0, 0], counts
    with torch.no_grad():
        torch.testing.assert_close(out, amp_fx.convert(model, "O1", dtype=torch.bfloat16, cache_casts=False)(x))
        torch.testing.assert_close(out, model(x), rtol=0.05, atol=0.05)


def _fresh_reference(model, x):
    with torch.no_grad():
        return amp_fx.convert(model, "O1", dtype=torch.bfloat16, cache_casts=False)(x)


def test_an_in_place_update_recasts_that_weight_only_and_matches_a_fresh_conversion_bit_for_bit():
    """Under no_grad every weight's cast is served after the first forward; an in-place update bumps the version
    counter, so that weight alone is cast again, and the output is a fresh conversion's bit for bit (the same casts
    and GEMMs run on both sides)."""
    torch.manual_seed(0)
    model = _mlp()
    gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16, cache_casts=True)
    x = torch.randn(8, 16)
    counts = []
    with torch.no_grad():
        for _ in range(3):
            with ParamCasts(model.parameters()) as probe, OpRecorder() as every:
                before = gm(x)
            counts.append((probe.count, every.count(CAST_OPS)))
        # Three Linear layers, weight and bias, then all served; the other four casts (the input's, the
        # output's, the LayerNorm's) run on every forward.
        assert counts == [(6, 10), (0, 4), (0, 4)], counts
        model[0].weight.mul_(-2.0)
        with ParamCasts(model.parameters()) as probe, OpRecorder() as every:
            after = gm(x)
        assert (probe.count, every.count(CAST_OPS)) == (1, 5)  # the updated weight only
    assert not torch.equal(after, before)
    assert torch.equal(after, _fresh_reference(model, x))


@pytest.mark.parametrize("change", ["load_state_dict", "optimizer_step", "data_swap", "new_parameter"])
def test_a_changed_parameter_is_never_served_a_stale_cast(change):
    torch.manual_seed(0)
    model = _mlp()
    gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16, cache_casts=True)
    x = torch.randn(8, 16)
    with torch.no_grad():
        before = gm(x)
        gm(x)  # served from the cache
    first = model[0]
    if change == "load_state_dict":
        state = {k: v * 0.5 for k, v in model.state_dict().items()}
        gm.load_state_dict(state)
    elif change == "optimizer_step":
        opt = torch.optim.SGD(gm.parameters(), lr=0.5)
        gm(x).square().sum().backward()
        opt.step()
    elif change == "data_swap":
        first.weight.data = torch.randn_like(first.weight)  # no version bump: caught by the storage check
    else:
        gm.get_submodule("0").weight = nn.Parameter(torch.randn_like(first.weight))  # a new object
        model = gm  # the reference reads the converted module's own parameters now
    with torch.no_grad():
        after = gm(x)
    assert not torch.equal(after, before)
    torch.testing.assert_close(after, _fresh_reference(model if change != "new_parameter" else _mlp_like(gm), x))


def _mlp_like(gm):
    model = _mlp()
    model.load_state_dict(gm.state_dict())
    return model


def test_training_gets_gradients_and_frees_the_inference_copies():
    torch.manual_seed(0)
    model = _mlp()
    gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16, cache_casts=True)
    x = torch.randn(8, 16)
    with torch.no_grad():
        gm(x)
    assert cast_cache_size() == 6  # three Linear layers, weight and bias
    counts = []
    for _ in range(2):
        with ParamCasts(model.parameters()) as probe, OpRecorder() as every:
            loss = gm(x).square().sum()
        counts.append((probe.count, every.count(CAST_OPS)))
    # Training casts every weight on every forward, as an autograd op (nothing is served), and the other four casts.
    assert counts == [(6, 10), (6, 10)], counts
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 and p.grad.abs().sum() > 0 for p in model.parameters())
    assert cast_cache_size() == 0  # the autograd path dropped what inference cached
    reference = _mlp()
    reference.load_state_dict(model.state_dict())
    reference(x).square().sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0.05, atol=0.05)


def test_the_cache_is_bounded_and_dies_with_the_parameters():
    model = _mlp()
    gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16, cache_casts=True)
    gm16 = amp_fx.convert(model, "O1", dtype=torch.float16, cache_casts=True)
    with torch.no_grad():
        for step in range(5):
            gm(torch.randn(4, 16))
            gm16(torch.randn(4, 16))
            with torch.no_grad():
                model[0].bias.add_(0.1)  # a new version each time: the entry is replaced, not added
    assert cast_cache_size() == 12  # one per (parameter, dtype)
    del model, gm, gm16
    gc.collect()
    assert cast_cache_size() == 0


def test_inference_mode_casts_are_not_served_outside_inference_mode():
    torch.manual_seed(0)
    model = _mlp()
    for p in model.parameters():
        p.requires_grad_(False)  # frozen: cached even with grad enabled
    gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16, cache_casts=True)
    x = torch.randn(4, 16, requires_grad=True)
    with torch.inference_mode():
        gm(x.detach())
    gm(x).sum().backward()  # an inference tensor here would fail "cannot be saved for backward"
    assert x.grad is not None


def test_helper_cases_and_compiled_use():
    p = nn.Parameter(torch.randn(3, 3))
    assert cached_cast(p, torch.float32) is p
    labels = torch.arange(3)
    assert cached_cast(labels, torch.bfloat16) is labels
    gm = amp_fx.convert(_mlp(), "O1", dtype=torch.bfloat16, cache_casts=True)
    compiled = torch.compile(gm, backend="eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(torch.ones(2, 16)), gm(torch.ones(2, 16)))
    report = str(gm.amp_report)
    assert "reused across forwards" in report
    again = amp_fx.convert(gm, "O1", dtype=torch.bfloat16, cache_casts=True)
    assert again.code == gm.code


def test_the_cache_is_off_unless_asked_because_data_writes_bypass_the_version_counter():
    """``p.data.mul_()`` does not bump the parameter's version: a cached cast would be served stale, so the default
    converted module re-casts on every forward and sees the write."""
    model = _mlp()
    x = torch.randn(4, 16)
    gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16)
    with torch.no_grad():
        before = gm(x)
        for p in model.parameters():
            p.data.mul_(-1)
        after = gm(x)
    assert not torch.allclose(before, after)


def test_a_write_through_data_is_served_stale_until_clear_cast_cache():
    """The documented hazard (README, convert's docstring): ``p.data.mul_()`` bumps nothing the cache checks, so
    the old cast is served; ``gm.clear_cast_cache()`` drops this module's casts and the next forward equals a fresh
    conversion's bit for bit (the same casts and GEMMs run on both sides)."""
    torch.manual_seed(0)
    model, other = _mlp(), _mlp()
    gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16, cache_casts=True)
    gm_other = amp_fx.convert(other, "O1", dtype=torch.bfloat16, cache_casts=True)
    x = torch.randn(8, 16)
    with torch.no_grad():
        before = gm(x)
        gm_other(x)
        model[0].weight.data.mul_(0.5)
        stale = gm(x)
        fresh = _fresh_reference(model, x)
        assert torch.equal(stale, before)  # the first layer's cast is from before the write
        assert (stale - fresh).abs().max() > 0.05
        assert cast_cache_size() == 12
        gm.clear_cast_cache()
        assert cast_cache_size() == 6  # the other module's casts are kept
        assert torch.equal(gm(x), fresh)
        amp_fx.clear_cast_cache()
        assert cast_cache_size() == 0
