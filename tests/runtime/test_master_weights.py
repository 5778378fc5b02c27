"""Tests for amp_fx.runtime.MasterWeightOptimizer (Apex O2 fp32 masters) and its LossScaler path."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from amp_fx.runtime import LossScaler, MasterWeightOptimizer

LOW = torch.bfloat16


class Net(nn.Module):
    """Two linears and a LayerNorm: the norm stays fp32 under O2, the linears go low."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        h = self.norm(h.float()).to(self.fc2.weight.dtype)
        return self.fc2(h).float()


def make(seed=0, dtype=LOW):
    """Return (fp32 model, its O2-style copy: low linears, fp32 norm)."""
    torch.manual_seed(seed)
    model = Net()
    low = copy.deepcopy(model)
    low.fc1.to(dtype)
    low.fc2.to(dtype)
    return model, low


def batches(n, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen)) for _ in range(n)]


def train_step(module, opt, x, y, scaler=None, clip=None, poison=False):
    opt.zero_grad()
    loss = nn.functional.mse_loss(module(x.to(module.fc1.weight.dtype)), y)
    if poison:
        loss = loss * float("inf")
    if scaler is None:
        loss.backward()
        return opt.step()
    scaler.scale(loss).backward()
    if clip is not None:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(opt.master_parameters(), clip)
    stepped = scaler.step(opt)
    scaler.update()
    return stepped


def assert_module_is_cast_masters(mw, module):
    for name, p in module.named_parameters():
        master = mw._masters[name]
        assert master.dtype == torch.float32
        if p.dtype == torch.float32:
            assert master is p  # fp32 params are their own masters
        else:
            assert torch.equal(p, master.to(p.dtype))


def test_masters_follow_fp32_training_and_keep_small_updates():
    """Updates far below bf16's resolution accumulate in the masters, as in fp32 training."""
    _, low = make()
    model = copy.deepcopy(low).float()  # the fp32 reference starts from the same values
    naive = copy.deepcopy(low)
    start = dict(copy.deepcopy(low).named_parameters())
    ref_opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    mw = MasterWeightOptimizer(torch.optim.SGD(low.parameters(), lr=1e-4), low)
    naive_opt = torch.optim.SGD(naive.parameters(), lr=1e-4)
    for x, y in batches(30):
        train_step(model, ref_opt, x, y)
        train_step(low, mw, x, y, scaler=LossScaler(dtype=LOW))
        train_step(naive, naive_opt, x, y)
    naive_params = dict(naive.named_parameters())
    for name, p in model.named_parameters():
        ref_delta = p - start[name].float()
        master_delta = mw._masters[name] - start[name].float()
        naive_delta = naive_params[name].float() - start[name].float()
        assert ref_delta.norm() > 0
        # bf16 forward/backward noise only: the displacement matches within 2%.
        assert (master_delta - ref_delta).norm() < 0.02 * ref_delta.norm(), name
        if naive_params[name].dtype == LOW:
            # Plain bf16 training rounds the updates away.
            assert (naive_delta - ref_delta).norm() > 0.5 * ref_delta.norm(), name
    assert_module_is_cast_masters(mw, low)


def test_optimizer_over_low_params_is_swapped_to_masters_keeping_groups():
    _, low = make()
    opt = torch.optim.Adam(
        [{"params": low.fc1.parameters(), "lr": 0.1}, {"params": [*low.norm.parameters(), *low.fc2.parameters()]}],
        lr=0.01, betas=(0.8, 0.9),
    )
    mw = MasterWeightOptimizer(opt, low)
    assert mw.param_groups is opt.param_groups and mw.state is opt.state
    assert mw.defaults is opt.defaults
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.01]
    assert all(g["betas"] == (0.8, 0.9) for g in opt.param_groups)
    held = [p for g in opt.param_groups for p in g["params"]]
    assert all(p.dtype == torch.float32 for p in held) and len(held) == 6
    assert held[0] is mw._masters["fc1.weight"] and held[0] is not low.fc1.weight
    assert held[2] is low.norm.weight
    assert list(mw.master_parameters()) == held


def test_optimizer_over_given_masters_makes_no_copies():
    model, low = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    low.amp_fx_masters = dict(model.named_parameters())  # what the converter sets
    mw = MasterWeightOptimizer(opt, low)
    assert all(a is b for a, b in zip(mw.master_parameters(), model.parameters()))
    x, y = batches(1)[0]
    train_step(low, mw, x, y)
    # The fp32 norm of the converted copy is a distinct tensor: it is copied back too.
    assert torch.equal(low.norm.weight, model.norm.weight)
    assert torch.equal(low.fc1.weight, model.fc1.weight.to(LOW))
    # Explicit masters= wins over the attribute.
    other = {n: nn.Parameter(p.detach().float()) for n, p in low.named_parameters()}
    mw2 = MasterWeightOptimizer(torch.optim.SGD(low.parameters(), lr=0.1), low, masters=other)
    assert mw2._masters["fc2.bias"] is other["fc2.bias"]


def test_parameter_outside_the_module_is_refused():
    _, low = make()
    stray = nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([*low.parameters(), stray], lr=0.1)
    with pytest.raises(ValueError, match="optimizer does not own the model's parameters.*shape \\(3,\\)"):
        MasterWeightOptimizer(opt, low)
    # add_param_group takes tensors of other modules, as Apex did (tested in test_gradscaler_semantics).


def test_parameter_in_no_group_is_refused_at_the_step_unless_frozen():
    _, low = make()
    opt = torch.optim.SGD([*low.fc1.parameters(), *low.norm.parameters()], lr=0.1)
    mw = MasterWeightOptimizer(opt, low)  # (another optimizer may hold the rest: tests/runtime/test_master_weights_split.py)
    x, y = batches(1)[0]
    with pytest.raises(ValueError, match="\\['fc2.weight', 'fc2.bias'\\] have gradients but no MasterWeightOptimizer"):
        train_step(low, mw, x, y)
    low.fc2.requires_grad_(False)
    low.fc2.zero_grad()  # (the refused step's gradients: mw does not hold them, so its zero_grad leaves them)
    train_step(low, mw, x, y)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_clears_both_copies(set_to_none):
    _, low = make()
    mw = MasterWeightOptimizer(torch.optim.SGD(low.parameters(), lr=0.1), low)
    x, y = batches(1)[0]
    nn.functional.mse_loss(low(x.to(LOW)), y).backward()
    mw._sync_grads_to_masters()
    assert mw._masters["fc1.weight"].grad is not None
    mw.zero_grad(set_to_none=set_to_none)
    for tensor in [*low.parameters(), *mw.master_parameters()]:
        if set_to_none:
            assert tensor.grad is None
        else:
            assert tensor.grad is not None and not tensor.grad.any()


def test_lr_schedulers_drive_the_wrapped_optimizer():
    _, low = make()
    inner = torch.optim.SGD(low.parameters(), lr=1.0)
    mw = MasterWeightOptimizer(inner, low)
    sched = torch.optim.lr_scheduler.StepLR(mw, step_size=2, gamma=0.1)
    scaler = LossScaler(dtype=LOW)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i, (x, y) in enumerate(batches(5)):
            assert train_step(low, mw, x, y, scaler=scaler, poison=(i == 0)) is (i != 0)
            scaler.step_scheduler(sched)
    assert inner.param_groups[0]["lr"] == pytest.approx(0.01)  # 4 real steps
    # A scheduler built over the inner optimizer works with the scaler helper too.
    sched2 = torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5)
    x, y = batches(1)[0]
    train_step(low, mw, x, y, scaler=scaler)
    assert scaler.step_scheduler(sched2) and inner.param_groups[0]["lr"] == pytest.approx(0.005)


def test_add_param_group_creates_masters():
    _, low = make()
    low.fc2.requires_grad_(False)
    mw = MasterWeightOptimizer(
        torch.optim.SGD([*low.fc1.parameters(), *low.norm.parameters()], lr=0.1), low
    )
    low.fc2.requires_grad_(True)
    mw.add_param_group({"params": low.fc2.parameters(), "lr": 0.5})
    group = mw.param_groups[1]
    assert group["lr"] == 0.5 and all(p.dtype == torch.float32 for p in group["params"])
    before = low.fc2.weight.detach().clone()
    x, y = batches(1)[0]
    train_step(low, mw, x, y)
    assert not torch.equal(low.fc2.weight, before)
    assert_module_is_cast_masters(mw, low)


@pytest.mark.parametrize("impl", [{"foreach": True}, {"fused": True}])
def test_foreach_and_fused_adam(impl):
    runs = {}
    for key, kw in (("loop", {"foreach": False}), ("impl", impl)):
        _, low = make()
        mw = MasterWeightOptimizer(torch.optim.AdamW(low.parameters(), lr=1e-2, **kw), low)
        scaler = LossScaler(init_scale=256.0)
        for x, y in batches(5):
            assert train_step(low, mw, x, y, scaler=scaler)
        assert_module_is_cast_masters(mw, low)
        runs[key] = [m.detach().clone() for m in mw.master_parameters()]
    for a, b in zip(runs["loop"], runs["impl"]):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)


def test_clipping_master_grads_after_unscale():
    _, low = make()
    mw = MasterWeightOptimizer(torch.optim.SGD(low.parameters(), lr=1.0), low)
    scaler = LossScaler(init_scale=1024.0)
    x, y = batches(1)[0]
    masters_before = [m.detach().clone() for m in mw.master_parameters()]
    mw.zero_grad()
    scaler.scale(nn.functional.mse_loss(low(x.to(LOW)), y)).backward()
    expected = torch.cat([p.grad.float().flatten() / 1024.0 for p in low.parameters()])
    scaler.unscale_(mw)
    norm = torch.nn.utils.clip_grad_norm_(mw.master_parameters(), 0.1)
    assert norm == pytest.approx(expected.norm().item(), rel=1e-6) and norm > 0.1
    clipped = [m.grad.clone() for m in mw.master_parameters()]
    assert torch.cat([g.flatten() for g in clipped]).norm() == pytest.approx(0.1, rel=1e-4)
    assert scaler.step(mw) is True  # must not re-copy the scaled module grads
    scaler.update()
    for m, b, g in zip(mw.master_parameters(), masters_before, clipped):
        assert torch.equal(m, b - g)


def test_checkpoint_resume_is_bit_identical(tmp_path):
    data = batches(15)

    def build(seed):
        _, low = make(seed)
        mw = MasterWeightOptimizer(torch.optim.AdamW(low.parameters(), lr=1e-2), low)
        return low, mw, LossScaler(init_scale=64.0, growth_interval=3)

    low, mw, scaler = build(0)
    for x, y in data[:5]:
        train_step(low, mw, x, y, scaler=scaler)
    path = tmp_path / "ckpt.pt"
    torch.save({"mw": mw.state_dict(), "scaler": scaler.state_dict()}, path)
    for x, y in data[5:]:
        train_step(low, mw, x, y, scaler=scaler)

    low2, mw2, scaler2 = build(123)  # a fresh process: different initial weights
    ckpt = torch.load(path)
    mw2.load_state_dict(ckpt["mw"])
    scaler2.load_state_dict(ckpt["scaler"])
    for x, y in data[5:]:
        train_step(low2, mw2, x, y, scaler=scaler2)
    for a, b in zip([*low.parameters(), *mw.master_parameters()], [*low2.parameters(), *mw2.master_parameters()]):
        assert torch.equal(a, b)
    assert scaler.get_scale() == scaler2.get_scale()
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(mw.state[mw.param_groups[0]["params"][0]][key], mw2.state[mw2.param_groups[0]["params"][0]][key])


def test_load_state_dict_names_mismatched_masters():
    _, low = make()
    mw = MasterWeightOptimizer(torch.optim.SGD(low.parameters(), lr=0.1), low)
    state = mw.state_dict()
    del state["masters"]["fc2.bias"]
    with pytest.raises(KeyError, match="missing \\['fc2.bias'\\]"):
        mw.load_state_dict(state)


@pytest.mark.parametrize("scaler_kw", [{"dtype": LOW}, {"init_scale": 32.0}])
def test_skipped_step_changes_nothing(scaler_kw):
    _, low = make()
    mw = MasterWeightOptimizer(torch.optim.Adam(low.parameters(), lr=1e-2), low)
    scaler = LossScaler(**scaler_kw)
    data = batches(3)
    for x, y in data[:2]:
        assert train_step(low, mw, x, y, scaler=scaler) is True
    snapshot = copy.deepcopy((list(low.parameters()), list(mw.master_parameters()), mw.state_dict()["optimizer"]["state"]))
    assert train_step(low, mw, *data[2], scaler=scaler, poison=True) is False
    assert scaler.skipped_steps == 1
    params, masters, state = snapshot
    assert all(torch.equal(a, b) for a, b in zip(params, low.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(masters, mw.master_parameters()))
    now = mw.state_dict()["optimizer"]["state"]
    for i in state:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(state[i][key], now[i][key])
    # And the next, finite step syncs fresh grads (nothing stale from the skipped one).
    assert train_step(low, mw, *data[0], scaler=scaler) is True
    assert all(torch.isfinite(m).all() for m in mw.master_parameters())


def test_direct_step_with_scaler_apex_style():
    """Given scaler=, calling mw.step() checks, unscales and skips through it."""
    _, low = make()
    scaler = LossScaler(init_scale=16.0)
    mw = MasterWeightOptimizer(torch.optim.SGD(low.parameters(), lr=0.1), low, scaler=scaler)
    x, y = batches(1)[0]
    for poison, expected in ((True, False), (False, True)):
        mw.zero_grad()
        loss = nn.functional.mse_loss(low(x.to(LOW)), y) * (float("inf") if poison else 1.0)
        scaler.scale(loss).backward()
        unscaled = mw.master_parameters()
        assert mw.step() is expected
        scaler.update()
    assert scaler.skipped_steps == 1 and scaler.get_scale() == 8.0
    assert all(torch.isfinite(m).all() for m in unscaled)
    assert_module_is_cast_masters(mw, low)
    # scaler.step(mw) on the same wrapper checks once, not twice.
    mw.zero_grad()
    scaler.scale(nn.functional.mse_loss(low(x.to(LOW)), y)).backward()
    assert scaler.step(mw) is True
    scaler.update()
    assert scaler.skipped_steps == 1


def test_skip_forgets_the_grad_sync_and_step_hooks_run():
    """After a skipped step the next step copies fresh grads even without zero_grad()."""
    _, low = make()
    mw = MasterWeightOptimizer(torch.optim.SGD(low.parameters(), lr=0.1), low)
    calls = []
    mw.register_step_post_hook(lambda opt, args, kwargs: calls.append(opt))
    scaler = LossScaler(dtype=LOW)
    x, y = batches(1)[0]
    assert train_step(low, mw, x, y, scaler=scaler, poison=True) is False
    for p in low.parameters():
        p.grad = torch.full_like(p, 0.5)
    before = [m.detach().clone() for m in mw.master_parameters()]
    assert scaler.step(mw) is True
    scaler.update()
    assert all(torch.equal(m, b - 0.05) for m, b in zip(mw.master_parameters(), before))
    assert calls == [mw]


def test_step_with_closure():
    _, low = make()
    mw = MasterWeightOptimizer(torch.optim.SGD(low.parameters(), lr=0.1), low)
    x, y = batches(1)[0]

    def closure():
        mw.zero_grad()
        loss = nn.functional.mse_loss(low(x.to(LOW)), y)
        loss.backward()
        return loss

    first = mw.step(closure)
    second = mw.step(closure)
    assert second < first
    assert_module_is_cast_masters(mw, low)


def test_fp16_o2_with_dynamic_scaling():
    """fp16 module, default scale 2**16: early overflows back off, then real steps happen."""
    _, low = make(dtype=torch.float16)
    mw = MasterWeightOptimizer(torch.optim.SGD(low.parameters(), lr=1e-3), low)
    scaler = LossScaler(dtype=torch.float16)
    # Targets of ~30 make the fp16 output grad overflow at scales above ~2**11.
    results = [train_step(low, mw, x, y * 30, scaler=scaler) for x, y in batches(10)]
    assert results[0] is False and all(results[-3:])
    assert scaler.get_scale() == 2.0**16 * 0.5 ** results.count(False) < 2.0**16
    assert all(p.dtype == torch.float16 for p in low.fc1.parameters())
    assert_module_is_cast_masters(mw, low)


def test_one_host_sync_per_step_through_the_wrapper(count_host_syncs):
    _, low = make()
    mw = MasterWeightOptimizer(torch.optim.SGD(low.parameters(), lr=0.1), low)
    scaler = LossScaler(init_scale=8.0)
    x, y = batches(1)[0]
    mw.zero_grad()
    scaler.scale(nn.functional.mse_loss(low(x.to(LOW)), y)).backward()
    with count_host_syncs() as counter:
        scaler.step(mw)
        scaler.update()
    assert counter.count == 1
