"""The lean O2 update (issue 27 item 3): fused SGD where unset, kept fp32 gradient buffers.

1. SGD left unset now steps with torch's fused kernel (bitwise equal to ``torch.optim.SGD(fused=True)`` on the
   masters: tests/runtime/test_lean_step.py). Against the foreach step the wrapper chose before it differs by at
   most one rounding per step (an FMA where foreach rounds twice, on some elements), for momentum, dampening,
   nesterov and weight decay, bf16 and fp16.
2. A parameter that gets its first gradient after the others (its momentum buffer missing while the others have
   one) still steps: that one step runs foreach, and the group is fused again afterwards.
3. The masters' fp32 gradients are copied into buffers kept from step to step (same tensors after
   ``zero_grad()``), with the values of freshly allocated ones, bit for bit (the same kernels run);
   ``keep_grad_buffers=False`` allocates afresh.
   A parameter without a gradient still gets none (the optimizer skips it), and add_param_group keeps the buffers.
4. A step skipped on inf/NaN still skips (masters, weights, state untouched), and the next finite step equals a
   run that never saw the bad step.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_fx
from amp_fx.errors import AmpValueError

LOW = [torch.bfloat16, torch.float16]
SGD_OPTIONS = {
    "momentum": {"momentum": 0.9},
    "dampening": {"momentum": 0.9, "dampening": 0.3},
    "nesterov": {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
    "plain": {},
}


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))


def batches(count: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 8, generator=gen), torch.randint(0, 4, (6,), generator=gen)) for _ in range(count)]


def setup(dtype: torch.dtype, sgd: dict, impl: dict | None = None, **mw_kw):
    model = make_model()
    gm = amp_fx.convert(model, "O2", dtype=dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, **sgd, **(impl or {}))
    mw = amp_fx.MasterWeightOptimizer(opt, gm, **mw_kw)
    # fp16 scales by 2**8 (a power of two: both sides unscale exactly alike)
    scaler = amp_fx.LossScaler(dtype=dtype, **({"init_scale": 2.0**8} if dtype == torch.float16 else {}))
    return gm, mw, scaler


def train(gm, mw, scaler, data, poison_at: int | None = None) -> list[bool]:
    taken = []
    for i, (x, y) in enumerate(data):
        mw.zero_grad()
        scaler.scale(F.cross_entropy(gm(x), y)).backward()
        if i == poison_at:
            next(gm.parameters()).grad.view(-1)[0] = float("inf")
        taken.append(scaler.step(mw))
        scaler.update()
    return taken


def state_of(gm, mw):
    """Module weights, masters and momentum buffers, copied."""
    buffers = [mw.optimizer.state.get(m, {}).get("momentum_buffer") for m in mw.master_parameters()]
    return ([p.detach().clone() for p in gm.parameters()], [m.detach().clone() for m in mw.master_parameters()],
            [None if b is None else b.clone() for b in buffers])


def assert_bitwise(a, b) -> None:
    for xs, ys in zip(a, b):
        assert len(xs) == len(ys)
        for x, y in zip(xs, ys):
            assert (x is None) == (y is None)
            if x is not None:
                assert x.dtype == y.dtype and torch.equal(x, y)


# ------------------------------------------------------------------ 1
def feed(gm, mw, grads) -> None:
    """Set the module's low gradients to ``grads`` (the same values on both sides) and step without a scaler."""
    mw.zero_grad()
    for p, g in zip(gm.parameters(), grads):
        p.grad = g.to(p.dtype)
    mw.step()


def within_fma_bound(fused, foreach, steps: int, lr: float) -> None:
    """Fused SGD vs foreach: the same fp32 math, but the fused kernel rounds ``buf * m + g`` (and ``p - lr * buf``)
    once where foreach rounds twice (``mul_`` then ``add_``) on some elements (the vector loop's tail), so each
    step may differ by 1 ulp in ``buf`` and in ``p``. After k steps: |d buf| <= k ulp(max|buf|) (momentum < 1 only
    shrinks older differences) and |d p| <= k ulp(max|p|) + lr * k^2 ulp(max|buf|); bounded here with a factor 2."""
    eps = torch.finfo(torch.float32).eps
    (_, masters_a, bufs_a), (_, masters_b, bufs_b) = fused, foreach
    for a, b, ba, bb in zip(masters_a, masters_b, bufs_a, bufs_b):
        assert (ba is None) == (bb is None)
        db = 0.0 if bb is None else 2 * steps * eps * bb.abs().max().item()
        if bb is not None:
            torch.testing.assert_close(ba, bb, rtol=0, atol=db)
        torch.testing.assert_close(a, b, rtol=0, atol=2 * steps * eps * b.abs().max().item() + lr * steps * db)


@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
@pytest.mark.parametrize("sgd", SGD_OPTIONS.values(), ids=SGD_OPTIONS.keys())
def test_fused_sgd_matches_the_foreach_step_within_one_rounding_per_step(dtype, sgd):
    gm, mw, _ = setup(dtype, sgd)
    assert mw.param_groups[0]["fused"] is True  # chosen where left unset (CPU fp32 masters)
    ref_gm, ref_mw, _ = setup(dtype, sgd, {"foreach": True}, keep_grad_buffers=False)  # the update before issue 27
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):
        grads = [torch.randn(p.shape, generator=gen) for p in gm.parameters()]
        feed(gm, mw, grads)
        feed(ref_gm, ref_mw, grads)
    got, want = state_of(gm, mw), state_of(ref_gm, ref_mw)
    within_fma_bound(got, want, 4, 0.1)
    for low, ref in zip(got[0], want[0]):  # the low weights: the masters rounded, so at most one low ulp apart
        torch.testing.assert_close(low.float(), ref.float(), rtol=2 * torch.finfo(dtype).eps, atol=1e-3)
    assert not torch.equal(want[1][0], state_of(*setup(dtype, sgd)[:2])[1][0])  # it trained


# ------------------------------------------------------------------ 2
def test_a_late_first_gradient_steps_foreach_once_then_fused_again():
    gm, mw, _ = setup(torch.bfloat16, {"momentum": 0.9})
    ref_gm, ref_mw, _ = setup(torch.bfloat16, {"momentum": 0.9}, {"foreach": True})
    gen = torch.Generator().manual_seed(4)
    for step in range(3):
        grads = [torch.randn(p.shape, generator=gen) for p in gm.parameters()]
        for g, w in ((gm, mw), (ref_gm, ref_mw)):
            w.zero_grad()
            for p, grad in zip(g.parameters(), grads):
                p.grad = grad.to(p.dtype)
            if step == 0:
                list(g.parameters())[-1].grad = None  # the head's bias gets its first gradient at step 1
            w.step()  # at step 1 fused SGD alone would raise: the other momentum buffers exist, this one does not
        assert mw.param_groups[0]["fused"] is True and mw.param_groups[0]["foreach"] is None
        assert len(mw.optimizer.state) == (len(grads) - 1 if step == 0 else len(grads))
    within_fma_bound(state_of(gm, mw), state_of(ref_gm, ref_mw), 3, 0.1)


# ------------------------------------------------------------------ 3
def grads_are_the_low_ones(mw) -> bool:
    # (a function, not inline asserts: pytest's rewritten asserts keep the tensors they read alive, and a
    # gradient buffer somebody holds is rightly not reused)
    return all(torch.equal(m.grad, p.grad.float()) for m, p in zip(mw.master_parameters(), mw.module_parameters()))


def test_master_gradients_reuse_their_buffers_and_equal_fresh_ones():
    gm, mw, scaler = setup(torch.bfloat16, {"momentum": 0.9})
    fresh_gm, fresh_mw, fresh_scaler = setup(torch.bfloat16, {"momentum": 0.9}, keep_grad_buffers=False)
    masters = [m for m in mw.master_parameters() if m.dtype == torch.float32 and m not in set(gm.parameters())]
    assert masters  # the Linears' masters (the LayerNorm is its own master)
    seen, fresh_seen = [], []
    for x, y in batches(3):
        for g, w, s, log in ((gm, mw, scaler, seen), (fresh_gm, fresh_mw, fresh_scaler, fresh_seen)):
            w.zero_grad()
            assert all(m.grad is None for m in w.master_parameters())  # zero_grad still sets them to None
            s.scale(F.cross_entropy(g(x), y)).backward()
            s.unscale_(w)
            log.append([id(m.grad) for m in w.master_parameters()])  # (ids: a held tensor would not be reused)
            assert grads_are_the_low_ones(w)
            s.step(w)
            s.update()
    lows = {id(m) for m in masters}
    kept = [i for i, m in enumerate(mw.master_parameters()) if id(m) in lows]
    for i in kept:
        assert seen[0][i] == seen[1][i] == seen[2][i]  # the same buffer every step
    assert all(b is None for g in fresh_mw._copy_groups() for b in g.buffers)  # nothing kept: fresh every step
    assert mw.grad_buffer_bytes() == 0  # each buffer is a master's .grad right now
    mw.zero_grad()
    assert mw.grad_buffer_bytes() == 4 * sum(m.numel() for m in mw.master_parameters()) > 0  # held, and counted
    assert fresh_mw.grad_buffer_bytes() == 0
    assert_bitwise(state_of(gm, mw), state_of(fresh_gm, fresh_mw))


def test_a_master_gradient_somebody_still_holds_is_not_overwritten():
    """Apex's scale_loss stashes the masters' gradients between loss blocks; a user may keep one too.

    (foreach: the plain route, which copies into the kept buffers; bf16's chunked step keeps no fp32 gradient.)"""
    gm, mw, scaler = setup(torch.bfloat16, {"momentum": 0.9}, {"foreach": True})
    train(gm, mw, scaler, batches(1))
    train(gm, mw, scaler, batches(1, seed=2))  # the buffers exist now
    master = next(m for m in mw.master_parameters() if m.grad is not None and m not in set(gm.parameters()))
    held, view = master.grad, None
    snapshot = held.clone()
    train(gm, mw, scaler, batches(1, seed=3))
    assert torch.equal(held, snapshot) and master.grad is not held  # a new buffer took its place
    view, held = master.grad.view(-1), None
    snapshot = view.clone()
    train(gm, mw, scaler, batches(1, seed=4))
    assert torch.equal(view, snapshot)  # a view of the buffer counts as holding it


def test_a_parameter_without_gradient_gets_none_and_is_not_stepped():
    gm, mw, scaler = setup(torch.bfloat16, {"momentum": 0.9, "weight_decay": 0.1})
    train(gm, mw, scaler, batches(1))
    head = list(gm.parameters())[-1]
    master = list(mw.master_parameters())[-1]
    before, buf = master.detach().clone(), mw.optimizer.state[master]["momentum_buffer"].clone()
    x, y = batches(1, seed=5)[0]
    mw.zero_grad()
    scaler.scale(F.cross_entropy(gm(x), y)).backward()
    head.grad = None
    assert scaler.step(mw) is True
    scaler.update()
    assert master.grad is None
    assert torch.equal(master, before) and torch.equal(mw.optimizer.state[master]["momentum_buffer"], buf)


def test_add_param_group_keeps_the_buffers_and_the_option_is_checked():
    gm, mw, scaler = setup(torch.bfloat16, {"momentum": 0.9}, {"foreach": True})  # (the plain route keeps buffers)
    train(gm, mw, scaler, batches(1))
    first = next(g for g in mw._copy_groups() if any(b is not None for b in g.buffers))
    before = {id(m): b for m, b in zip(first.masters, first.buffers) if b is not None}
    other = amp_fx.convert(make_model(1), "O2", dtype=torch.bfloat16)
    mw.add_param_group({"params": list(other.parameters())})
    after = {id(m): b for g in mw._copy_groups() for m, b in zip(g.masters, g.buffers) if b is not None}
    assert all(after[k] is b for k, b in before.items())
    with pytest.raises(AmpValueError, match="keep_grad_buffers"):
        amp_fx.MasterWeightOptimizer(torch.optim.SGD(make_model().parameters(), lr=0.1),
                                     amp_fx.convert(make_model(), "O2", dtype=torch.bfloat16), keep_grad_buffers=1)


# ------------------------------------------------------------------ 4
@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
def test_a_skipped_step_still_skips_and_the_next_one_is_exact(dtype):
    data = batches(3)
    gm, mw, scaler = setup(dtype, {"momentum": 0.9})
    train(gm, mw, scaler, data[:1])
    before = state_of(gm, mw)
    assert train(gm, mw, scaler, data[1:2], poison_at=0) == [False]
    assert_bitwise(state_of(gm, mw), before)
    assert train(gm, mw, scaler, data[2:]) == [True]
    ref_gm, ref_mw, ref_scaler = setup(dtype, {"momentum": 0.9}, keep_grad_buffers=False)
    train(ref_gm, ref_mw, ref_scaler, data[:1])
    if dtype == torch.float16:  # the skip halved the scale: so must the reference's (2**7: still exact)
        ref_scaler.update(new_scale=scaler.get_scale())
    train(ref_gm, ref_mw, ref_scaler, data[2:])
    assert_bitwise(state_of(gm, mw), state_of(ref_gm, ref_mw))


# ------------------------------------------------------------------ 5
def test_copy_then_check_each_gradient_gives_the_bits_of_one_check_over_all():
    """fp16, scale 1000 (its reciprocal is not a power of two): the masters' gradients are the low ones times
    fp32(1/1000), rounded once, as GradScaler's kernel over all of them gives."""
    model = make_model()
    gm = amp_fx.convert(model, "O2", dtype=torch.float16)
    mw = amp_fx.MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), gm)
    scaler = amp_fx.LossScaler(init_scale=1000.0, dtype=torch.float16)
    x, y = batches(1)[0]
    scaler.scale(F.cross_entropy(gm(x), y)).backward()
    lows = [p.grad.float().clone() for p in mw.module_parameters()]  # (clone: fp32 LayerNorm grads too)
    found, inv = torch.zeros(()), torch.full((), 1.0 / 1000.0)
    torch._amp_foreach_non_finite_check_and_unscale_(lows, found, inv)  # the reference: one call over all
    scaler.unscale_(mw)
    assert found.item() == 0
    for master, want in zip(mw.master_parameters(), lows):
        assert torch.equal(master.grad, want)


@pytest.mark.parametrize("where", ["low", "own master"])
def test_inf_is_found_in_copied_and_in_own_master_gradients(where):
    """With masters={} the fp32 LayerNorm parameters are their own masters (not copied): they are checked too."""
    model = make_model()
    gm = amp_fx.convert(model, "O2", dtype=torch.bfloat16)
    mw = amp_fx.MasterWeightOptimizer(torch.optim.SGD(gm.parameters(), lr=0.1, momentum=0.9), gm, masters={})
    own = [p for p in gm.parameters() if p.dtype == torch.float32]
    assert own and all(any(p is m for m in mw.master_parameters()) for p in own)
    scaler = amp_fx.LossScaler(dtype=torch.bfloat16)
    x, y = batches(1)[0]
    F.cross_entropy(gm(x), y).backward()
    target = own[0] if where == "own master" else next(p for p in gm.parameters() if p.dtype == torch.bfloat16)
    target.grad.view(-1)[0] = float("nan")
    before = [m.detach().clone() for m in mw.master_parameters()]
    assert scaler.step(mw) is False
    assert all(torch.equal(m, b) for m, b in zip(mw.master_parameters(), before))
