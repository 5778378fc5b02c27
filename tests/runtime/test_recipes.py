"""The AMP recipes of examples/ checked by number, through the GradScaler-style and the Apex-style API.

Each recipe trains the same tiny model (examples/_common.Net) on the same
batches in plain fp32 torch and with amp_fx at every level, with an inf/NaN
injected into a gradient at a chosen step. Checked for every (level, dtype):

- the injected steps, and only they, are skipped;
- the weights (the fp32 masters at O2) land within the dtype's tolerance of
  the fp32 run that skips the same steps, and O0 is bit-identical to it;
- both APIs give bit-identical weights where they do the same arithmetic;
- the weights are finite and moved far more than the tolerance (the
  comparison is not vacuous).
"""

from __future__ import annotations

import logging
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "examples"))

import _common  # noqa: E402
import recipe_accumulation  # noqa: E402
import recipe_clipping  # noqa: E402
import recipe_data_parallel  # noqa: E402
import recipe_gradient_penalty  # noqa: E402
import recipe_multiple_models  # noqa: E402
import train_plain  # noqa: E402

LEVEL_DTYPES = [("O0", torch.bfloat16), ("O1", torch.bfloat16), ("O1", torch.float16), ("O2", torch.bfloat16),
                ("O2", torch.float16), ("O3", torch.bfloat16), ("O3", torch.float16)]
IDS = [f"{level}-{str(dtype)[6:]}" for level, dtype in LEVEL_DTYPES]



def check(level, dtype, reference, initial, runs, inject_skips, apis_identical=True):
    """The checks every recipe shares (see the module docstring)."""
    tol = _common.tolerance(level, dtype)
    moved = _common.max_diff(reference, initial)
    # Not vacuous: the weights move much further than O1/O2 may drift, and well past O3's tolerance.
    assert moved > max(20 * _common.tolerance("O1", dtype), 2 * tol), f"weights moved only {moved:.2e}"
    for api, (got, skipped) in runs.items():
        assert skipped == inject_skips, api
        assert all(torch.isfinite(w).all() for w in got.values()), api
        diff = _common.max_diff(got, reference)
        if level == "O0":
            assert diff == 0.0, f"{api}: O0 must be bit-identical to fp32 torch"
        else:
            assert diff <= tol, f"{api}: {diff:.2e} from fp32, tolerance {tol:.1e}"
    # Apex's O3 preset is a static scale of 1.0; the GradScaler-style set-up scales fp16 dynamically.
    if apis_identical and not (level == "O3" and dtype == torch.float16):
        (a, _), (b, _) = runs.values()
        assert all(torch.equal(a[k], b[k]) for k in a), "GradScaler-style and Apex-style runs differ"


def run_both(module, make, batches, level, dtype, inject, **kwargs):
    return {
        "gradscaler": module.train_gradscaler(make(), batches, level, dtype, inject, **kwargs),
        "apex": module.train_apex(make(), batches, level, dtype, inject, **kwargs),
    }


@pytest.mark.parametrize("level,dtype", LEVEL_DTYPES, ids=IDS)
def test_plain_loop(level, dtype):
    """Plain loop: an inf at step 3 skips step 3 only; weights track fp32."""
    net, batches, inject = _common.make_net(), _common.make_batches(8), {3: "inf"}
    reference = train_plain.train_reference(_common.clone(net), batches, skip={3})
    runs = run_both(train_plain, lambda: _common.clone(net), batches, level, dtype, inject)
    check(level, dtype, reference, dict(net.named_parameters()), runs, [3])


@pytest.mark.parametrize("level,dtype", LEVEL_DTYPES, ids=IDS)
def test_gradient_clipping(level, dtype):
    """unscale_ then clip_grad_norm_ (Apex: clip master_params after the block) equals fp32 clipping."""
    net, batches, inject = _common.make_net(), _common.make_batches(8), {4: "nan"}
    model = _common.clone(net)
    x, y = batches[0]
    torch.nn.functional.mse_loss(model(x), y).backward()
    assert torch.nn.utils.clip_grad_norm_(model.parameters(), recipe_clipping.MAX_NORM) > 1.5 * recipe_clipping.MAX_NORM
    reference = recipe_clipping.train_reference(_common.clone(net), batches, skip={4})
    runs = run_both(recipe_clipping, lambda: _common.clone(net), batches, level, dtype, inject)
    check(level, dtype, reference, dict(net.named_parameters()), runs, [4])


@pytest.mark.parametrize("level,dtype", LEVEL_DTYPES, ids=IDS)
def test_gradient_accumulation(level, dtype):
    """N micro-batches per step; the inf in effective step 1 skips that whole effective step."""
    net, n = _common.make_net(), recipe_accumulation.N
    batches, inject = _common.make_batches(4 * n, batch=4), {1: "inf"}
    reference = recipe_accumulation.train_reference(_common.clone(net), batches, skip={1})
    runs = run_both(recipe_accumulation, lambda: _common.clone(net), batches, level, dtype, inject)
    check(level, dtype, reference, dict(net.named_parameters()), runs, [1])


@pytest.mark.parametrize("api", ["gradscaler", "apex"])
def test_accumulation_scale_is_fixed_per_effective_batch(api):
    """With growth at every clean update the scale per micro-batch reads s,s,s,s, 2s,2s,2s,2s, s,...:
    one update per effective batch and none in between; the inf in effective step 1 backs off at its end."""
    net, n = _common.make_net(), recipe_accumulation.N
    batches = _common.make_batches(4 * n, batch=4)
    scales: list = []
    # bf16 with scaling asked for explicitly: on, and its gradients never overflow by themselves.
    if api == "gradscaler":
        recipe_accumulation.train_gradscaler(_common.clone(net), batches, "O2", torch.bfloat16, {1: "inf"},
                                             scales=scales, init_scale=2.0**16, growth_interval=1)
    else:
        recipe_accumulation.train_apex(_common.clone(net), batches, "O2", torch.bfloat16, {1: "inf"}, scales=scales,
                                       growth_interval=1, loss_scale="dynamic")
    s = 2.0**16
    assert scales == [s] * n + [2 * s] * n + [s] * n + [2 * s] * n


@pytest.mark.parametrize("level,dtype", LEVEL_DTYPES, ids=IDS)
def test_gradient_penalty(level, dtype):
    """autograd.grad on the scaled loss (create_graph), unscaled by hand, penalty added: matches fp32."""
    net, batches, inject = _common.make_net(), _common.make_batches(8), {2: "inf"}
    reference = recipe_gradient_penalty.train_reference(_common.clone(net), batches, skip={2})
    plain = train_plain.train_reference(_common.clone(net), batches, skip={2})
    assert _common.max_diff(reference, plain) > 2 * _common.tolerance("O3", dtype)  # the penalty matters
    runs = run_both(recipe_gradient_penalty, lambda: _common.clone(net), batches, level, dtype, inject)
    check(level, dtype, reference, dict(net.named_parameters()), runs, [2])


@pytest.mark.parametrize("level,dtype", LEVEL_DTYPES, ids=IDS)
def test_multiple_models_losses_optimizers(level, dtype):
    """Two models, two losses, two optimizers, an inf in model 1 during loss 1's backward.

    GradScaler-style: optimizer 1 skips, optimizer 0 steps (each judges its own gradients).
    Apex-style: loss 1 was scaled into both optimizers, so both skip, as in Apex."""
    nets, batches, inject = (_common.make_net(0), _common.make_net(1)), _common.make_batches(8), {3: "inf"}
    runs = run_both(recipe_multiple_models, lambda: _common.clone(nets), batches, level, dtype, inject)
    initial = recipe_multiple_models.merged(*(dict(m.named_parameters()) for m in nets))
    for api, skips in (("gradscaler", [(3, 1)]), ("apex", [(3, 0), (3, 1)])):
        reference = recipe_multiple_models.train_reference(_common.clone(nets), batches, skip=set(skips))
        check(level, dtype, reference, initial, {api: runs[api]}, skips, apis_identical=False)


@pytest.mark.parametrize("level,dtype", [("O1", torch.bfloat16), ("O2", torch.float16), ("O3", torch.bfloat16)])
def test_data_parallel(level, dtype):
    """nn.DataParallel(converted): same skips and, without GPUs (DataParallel calls the module), the
    same weights bit for bit as the unwrapped module; within tolerance of fp32."""
    net, batches, inject = _common.make_net(), _common.make_batches(8), {5: "inf"}
    reference = recipe_data_parallel.train_reference(_common.clone(net), batches, skip={5})
    runs = run_both(recipe_data_parallel, lambda: _common.clone(net), batches, level, dtype, inject)
    check(level, dtype, reference, dict(net.named_parameters()), runs, [5])
    bare = recipe_data_parallel.train_gradscaler(_common.clone(net), batches, level, dtype, inject, parallel=False)
    wrapped = runs["gradscaler"][0]
    if torch.cuda.device_count() == 0:
        assert all(torch.equal(wrapped[k], bare[0][k]) for k in wrapped)
    else:
        assert _common.max_diff(wrapped, bare[0]) <= _common.tolerance(level, dtype)


def test_examples_print_their_tables(capsys):
    """The examples' main() runs and its table reports every level within tolerance."""
    logger = logging.getLogger("amp_fx.runtime")
    level = logger.level
    try:
        rows = train_plain.main()
    finally:
        logger.setLevel(level)  # main() quiets the skip reports; other tests read them
    assert len(rows) == 1 + 4 * 2 * 2
    for _, _, _, diff, tol, skipped in rows[1:]:
        assert float(diff) <= float(tol) and skipped == [3]
    assert "O3" in capsys.readouterr().out
