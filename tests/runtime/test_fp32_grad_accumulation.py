"""O2 with ``MasterWeightOptimizer(fp32_grad_accumulation=True)``: low gradients are added into the fp32 master
gradients as backward makes them, and freed.

Tests: after k micro-batches the master gradients are the fp32 sum of the low gradients bit for bit, closer to the
exact sum than bf16 accumulation; the wrapper keeps working (LossScaler with fp16 scaling and a skipped step,
clipping through ``master_parameters()``, zero_grad, state_dict), equal to the default path bit for bit where both
do the same arithmetic (one micro-batch); losses with k micro-batches stay within a derived bound of the bf16
accumulating path; refusals.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch.nn as nn

import amp_fx
from amp_fx.errors import AmpNotImplementedError, AmpValueError
from amp_fx.runtime import LossScaler, MasterWeightOptimizer

K = 4


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.LayerNorm(16), nn.Linear(16, 4))


def _batches(n, seed=1, batch=8):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 16, generator=gen), torch.randn(batch, 4, generator=gen)) for _ in range(n)]


def _loss(gm, x, y, k=1):
    return nn.functional.mse_loss(gm(x), y) / k


def _setup(dtype=torch.bfloat16, accumulate=True, opt=None):
    model = _mlp()
    gm = amp_fx.convert(model, "O2", dtype=dtype)
    inner = (opt or (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True)))(model.parameters())
    return model, gm, MasterWeightOptimizer(inner, gm, fp32_grad_accumulation=accumulate)


def _low_grads_one_at_a_time(batches, k=K):
    """Each micro-batch's low gradients on its own (an identical conversion, gradients cleared between)."""
    _, gm, _ = _setup(accumulate=False)
    out = []
    for x, y in batches:
        gm.zero_grad(set_to_none=True)
        _loss(gm, x, y, k).backward()
        out.append({n: p.grad.clone() for n, p in gm.named_parameters()})
    return out


def test_master_grads_are_the_fp32_sum_of_the_low_grads_bit_for_bit():
    """Each add is one correctly rounded fp32 operation (the first is an exact widening), and the low gradients come
    from the same kernels on the same inputs, so the master gradient is ``((g1 + g2) + g3) + g4`` in fp32 exactly."""
    batches = _batches(K)
    lows = _low_grads_one_at_a_time(batches)
    _, gm, mw = _setup()
    for x, y in batches:
        _loss(gm, x, y, K).backward()
        assert all(p.grad is None for p in gm.parameters())  # each low gradient freed as it arrives
    masters = gm.amp_fx_masters
    for name, low in gm.named_parameters():
        expected = lows[0][name].float()
        for grads in lows[1:]:
            expected = expected + grads[name].float()
        assert masters[name].grad.dtype == torch.float32
        assert torch.equal(masters[name].grad, expected), name
    mw.step()
    assert all(m.grad is None for m in masters.values())  # the 4 bytes/param are freed at the step


def test_fp32_accumulation_is_closer_to_the_exact_sum_than_bf16_accumulation():
    """Against the float64 sum of the same low gradients: bf16 accumulation rounds each partial sum to 8 bits, fp32
    to 24, so its error is at most (k - 1) * 2**-24 * sum|g| elementwise; bf16 accumulation's is far larger."""
    k = 8
    batches = _batches(k, seed=3)
    lows = _low_grads_one_at_a_time(batches, k)
    _, fp32_gm, fp32_mw = _setup()  # (the wrapper must live: its hooks serve it only)
    _, bf16_gm, bf16_mw = _setup(accumulate=False)
    for x, y in batches:
        _loss(fp32_gm, x, y, k).backward()
        _loss(bf16_gm, x, y, k).backward()
    bf16_mw._sync_grads_to_masters()  # what scaler.unscale_/step() do: the bf16 sum copied into the masters
    worse = 0
    for name, _ in fp32_gm.named_parameters():
        exact = sum(g[name].double() for g in lows)
        magnitude = sum(g[name].double().abs() for g in lows)
        fp32_err = (fp32_gm.amp_fx_masters[name].grad.double() - exact).abs()
        bf16_err = (bf16_gm.amp_fx_masters[name].grad.double() - exact).abs()
        assert (fp32_err <= (k - 1) * 2.0**-24 * magnitude).all(), name
        worse += int(bf16_err.max() > 16 * fp32_err.max())
    assert worse >= 6  # the bf16 weights and biases (the fp32 LayerNorm's are exact either way)


def _train(accumulate, *, k, steps, dtype=torch.bfloat16, poison_step=None, clip=None, opt=None, save_at=None):
    """k micro-batches per step through scaler.step(mw); returns (losses, masters, scaler, saved state)."""
    model, gm, mw = _setup(dtype, accumulate, opt)
    scaler = LossScaler(dtype=dtype)
    losses, saved = [], None
    batches = _batches(steps * k, seed=5)
    for step in range(steps):
        mw.zero_grad()
        for i in range(k):
            x, y = batches[step * k + i]
            loss = _loss(gm, x, y, k)
            if step == poison_step and i == k - 1:
                loss = loss * float("inf")
            losses.append(float(loss.detach()))
            scaler.scale(loss).backward()
        if clip is not None:
            scaler.unscale_(mw)
            torch.nn.utils.clip_grad_norm_(mw.master_parameters(), clip)
        scaler.step(mw)
        scaler.update()
        if step == save_at:
            saved = copy.deepcopy(mw.state_dict())  # (state_dict() holds references, as torch's)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, scaler, saved


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_micro_batch_trains_bit_for_bit_as_the_default_path(dtype):
    """With one micro-batch both paths do the same arithmetic (the master gradient is the low one widened, exactly),
    so a run with fp16 loss scaling, a poisoned step the scaler skips, clipping through ``master_parameters()`` and
    AdamW (the same fused kernel on both sides: prefer_fast_step chooses it for both) equals the default bit for bit."""
    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-2)  # noqa: E731
    on = _train(True, k=1, steps=5, dtype=dtype, poison_step=2, clip=0.5, opt=adamw)
    off = _train(False, k=1, steps=5, dtype=dtype, poison_step=2, clip=0.5, opt=adamw)
    assert on[2].skipped_steps == off[2].skipped_steps == 1
    assert on[0] == off[0]  # (the poisoned loss is inf on both)
    for name in on[1]:
        assert torch.equal(on[1][name], off[1][name]), name


def test_a_skipped_step_drops_the_sum_and_zero_grad_clears_it():
    model, gm, mw = _setup(torch.float16)
    scaler = LossScaler(dtype=torch.float16)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = _batches(1)[0]
    scaler.scale(_loss(gm, x, y) * float("inf")).backward()
    assert not scaler.step(mw)
    scaler.update()
    assert all(m.grad is None for m in gm.amp_fx_masters.values())  # not carried into the next step
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    _loss(gm, x, y).backward()
    mw.zero_grad()
    assert all(m.grad is None for m in gm.amp_fx_masters.values())
    mw.zero_grad(set_to_none=False)  # (no gradient yet: stays None, as torch's zero_grad)
    _loss(gm, x, y).backward()
    mw.zero_grad(set_to_none=False)
    assert all(float(m.grad.abs().sum()) == 0 for m in gm.amp_fx_masters.values())


def test_k_micro_batches_train_within_a_derived_bound_of_the_bf16_accumulating_path():
    """The first step's losses are the same computation (bit for bit).  After it, the runs differ only by the
    gradient sums: bf16 accumulation is off the fp32 sum by at most (k - 1) * 2**-9 * sum|g| (half an ulp of each
    partial sum), so each step's update differs by at most that fraction of it (twice that, allowing the
    micro-batches' gradients to cancel to half their absolute sum), and so does the training's total change of
    the weights (SGD with momentum is linear in the gradients).  The masters then differ by far less than a bf16
    ulp of the weights, so few low copies round differently, and each loss stays within one bf16 ulp (2**-8) of
    the other run's."""
    init = {n: p.detach().clone() for n, p in _mlp().named_parameters()}
    on = _train(True, k=K, steps=4)
    off = _train(False, k=K, steps=4)
    assert on[0][:K] == off[0][:K]
    for a, b in zip(on[0], off[0]):
        assert abs(a - b) <= 2.0**-8 * abs(b), (a, b)
    bound = 2 * (K - 1) * 2.0**-9
    for name in on[1]:
        apart, moved = (on[1][name] - off[1][name]).norm(), (on[1][name] - init[name]).norm()
        assert 0 < apart <= bound * moved, (name, float(apart / moved))  # (> 0: the paths really differ)


def test_state_dict_resumes_exactly_and_a_gradient_set_by_hand_is_used():
    full = _train(True, k=2, steps=4, save_at=1)
    _, masters_full, _, saved = full
    model, gm, mw = _setup()
    mw.load_state_dict(saved)
    scaler = LossScaler(dtype=torch.bfloat16)
    batches = _batches(8, seed=5)
    for step in (2, 3):
        mw.zero_grad()
        for i in range(2):
            x, y = batches[step * 2 + i]
            scaler.scale(_loss(gm, x, y, 2)).backward()
        scaler.step(mw)
        scaler.update()
    for name, p in model.named_parameters():
        assert torch.equal(p, masters_full[name]), name
    # A low gradient written by hand (no backward ran, so no hook did) is added in at the step.
    model, gm, mw = _setup(opt=lambda ps: torch.optim.SGD(ps, lr=0.5, foreach=True))
    low, master = gm.get_parameter("0.weight"), gm.amp_fx_masters["0.weight"]
    low.grad = torch.ones_like(low)
    expected = master.detach() - 0.5  # w - 0.5 * 1: one rounding, however SGD's kernel fuses it
    mw.step()
    assert low.grad is None and master.grad is None
    assert torch.equal(master.detach(), expected)


def test_a_newer_wrapper_takes_the_route_over_and_refusals():
    model, gm, mw = _setup()
    x, y = _batches(1)[0]
    plain = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), gm)  # built without the option
    _loss(gm, x, y).backward()
    assert all(p.grad is not None for p in gm.parameters())  # the default path again: low gradients kept
    mw = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), gm, fp32_grad_accumulation=True)
    mw.zero_grad()
    del mw
    gc.collect()
    _loss(gm, x, y).backward()
    assert all(p.grad is not None for p in gm.parameters())  # a dead wrapper's hooks do nothing
    with pytest.raises(AmpValueError, match="fp32_grad_accumulation must be True or False"):
        MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), gm, fp32_grad_accumulation=1)
    emb = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    gm2 = amp_fx.convert(emb, "O2", dtype=torch.bfloat16)
    sparse = MasterWeightOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1), gm2, fp32_grad_accumulation=True)
    with pytest.raises(AmpNotImplementedError, match="sparse"):
        gm2(torch.arange(3)).sum().backward()
    del plain, sparse


def test_refused_under_torch_distributed(monkeypatch):
    model, gm, _ = _setup(accumulate=False)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    with pytest.raises(AmpValueError, match="DDP and FSDP"):
        MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), gm, fp32_grad_accumulation=True)


def test_clipping_the_freed_low_gradients_after_unscale_warns_once():
    """fp32_grad_accumulation frees the low gradients: clip_grad_norm_(gm.parameters()) after unscale_ returns 0 and
    clips nothing. The step says so (once); a clip of the masters, the recipe, moves their versions and is silent."""
    import warnings

    import torch.nn.functional as F

    import amp_fx

    def step(target):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        gm = amp_fx.convert(model, "O2", dtype=torch.float16)
        opt = amp_fx.MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), gm, fp32_grad_accumulation=True)
        scaler = amp_fx.LossScaler(dtype=torch.float16)
        caught = []
        for _ in range(2):
            with warnings.catch_warnings(record=True) as record:
                warnings.simplefilter("always")
                scaler.scale(F.mse_loss(gm(torch.ones(4, 8)).float(), torch.zeros(4, 4))).backward()
                scaler.unscale_(opt)
                norm = torch.nn.utils.clip_grad_norm_(target(gm, opt), 1e-3)
                assert scaler.step(opt)
                scaler.update()
            caught.append([w for w in record if issubclass(w.category, amp_fx.NoLowGradientsWarning)])
        return norm, caught

    norm, caught = step(lambda gm, opt: gm.parameters())
    assert float(norm) == 0.0 and [len(c) for c in caught] == [1, 0]  # once per optimizer
    assert "master_parameters()" in str(caught[0][0].message)
    norm, caught = step(lambda gm, opt: opt.master_parameters())
    assert float(norm) > 1e-3 and caught == [[], []]
