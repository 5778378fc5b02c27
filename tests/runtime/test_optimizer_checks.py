"""A plain Adam over fp16 parameters is warned about: its eps is 0 in fp16 and the step makes NaN weights."""

import warnings

import pytest
import torch
import torch.nn as nn

import amp_fx
from amp_fx.runtime.optimizer_checks import EpsUnderflowWarning, MomentUnderflowWarning


def _o3(dtype):
    torch.manual_seed(0)
    return amp_fx.convert(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), "O3", dtype=dtype)


def _step(gm, optimizer, scaler):
    loss = gm(torch.randn(4, 8)).float().pow(2).mean()
    scaler.scale(loss).backward()
    stepped = scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    return stepped


def test_adam_with_default_eps_over_fp16_parameters_warns_once_and_names_the_fix():
    gm = _o3(torch.float16)
    optimizer, scaler = torch.optim.AdamW(gm.parameters(), lr=1e-2), amp_fx.LossScaler(dtype=torch.float16)
    with pytest.warns(EpsUnderflowWarning, match="LowPrecisionOptimizer"):
        _step(gm, optimizer, scaler)
    # What it warns about is real: the ReLU's dead units got zero gradients and their weights are NaN now.
    assert any(not torch.isfinite(p).all() for p in gm.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error", EpsUnderflowWarning)
        _step(gm, optimizer, scaler)  # once per optimizer


@pytest.mark.parametrize("case", ["bf16", "low_precision_optimizer", "sgd"])
def test_settings_that_train_are_not_warned_about(case):
    gm = _o3(torch.bfloat16 if case == "bf16" else torch.float16)
    if case == "low_precision_optimizer":
        optimizer = amp_fx.LowPrecisionOptimizer(torch.optim.AdamW(gm.parameters(), lr=1e-2), gm)
    elif case == "sgd":
        optimizer = torch.optim.SGD(gm.parameters(), lr=1e-2)
    else:
        optimizer = torch.optim.AdamW(gm.parameters(), lr=1e-2)
    scaler = amp_fx.LossScaler(dtype=torch.bfloat16 if case == "bf16" else torch.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", EpsUnderflowWarning)
        for _ in range(3):
            _step(gm, optimizer, scaler)
    assert all(torch.isfinite(p).all() for p in gm.parameters())


def test_adam_over_fp16_parameters_with_an_eps_that_fits_fp16_warns_its_moment_underflows():
    """A plain Adam on O3 fp16 weights keeps exp_avg_sq in fp16: (1 - beta2) g**2 is 0 for small gradients, and the
    step is lr * m / eps. A README-only tester measured eps=1e-4 ~10x fp32's update with no warning; this one says so
    (once) and names the fixes. The step it warns about is measured here too: far from fp32 Adam's."""
    gm = _o3(torch.float16)
    optimizer, scaler = torch.optim.Adam(gm.parameters(), lr=1e-2, eps=1e-4), amp_fx.LossScaler(dtype=torch.float16)
    before = [p.detach().float().clone() for p in gm.parameters()]
    with pytest.warns(MomentUnderflowWarning, match="LowPrecisionOptimizer") as caught:
        _step(gm, optimizer, scaler)
    assert len([w for w in caught if issubclass(w.category, EpsUnderflowWarning)]) == 1
    update = torch.cat([(p.detach().float() - b).flatten() for p, b in zip(gm.parameters(), before)])
    # fp32 Adam's first step moves each weight by at most lr (m / sqrt(v) = sign(g)); here some move 10x that.
    assert float(update.abs().max()) > 5 * 1e-2
    with warnings.catch_warnings():
        warnings.simplefilter("error", EpsUnderflowWarning)
        _step(gm, optimizer, scaler)  # once per optimizer


# ------------------------------------------- a plain optimizer over O2's low weights (issue 22)
# At O2 the module holds bf16 copies and the model's fp32 parameters are the masters: a plain optimizer
# over gm.parameters() rounds most updates away (measured: 7 of 676 weights changed in 20 SGD steps) and
# never moves the masters. Its first step is refused, naming the parameter, the level and both fixes.

class Net(nn.Module):
    """Linear -> LayerNorm -> Linear: at O2 the Linears are bf16 copies with masters, the norm stays fp32."""

    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


def _batch(seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen)


def _loss(module, seed=1):
    x, y = _batch(seed)
    return torch.nn.functional.mse_loss(module(x).float(), y)


def _o2(seed=0):
    torch.manual_seed(seed)
    model = Net()
    return model, amp_fx.convert(model, "O2", dtype=torch.bfloat16)


def _snapshot(module):
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def _assert_refusal(error, name="fc1.weight", level="O2"):
    message = str(error.value)
    assert repr(name) in message and f"amp_fx.convert(model, {level!r})" in message
    assert "amp_fx.MasterWeightOptimizer(opt, gm)" in message
    assert "amp_fx.LowPrecisionOptimizer(opt, gm" in message and '"O1"' in message


@pytest.mark.parametrize("build", [
    lambda p: torch.optim.SGD(p, lr=0.1), lambda p: torch.optim.AdamW(p, lr=1e-3), lambda p: torch.optim.Adam(p, fused=True),
], ids=["sgd", "adamw", "adam_fused"])
def test_a_plain_optimizer_over_o2_low_weights_is_refused_at_its_first_step_and_steps_nothing(build):
    model, gm = _o2()
    opt = build(gm.parameters())
    # Neither an LR scheduler nor zero_grad is a step: building and calling them is not refused.
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    opt.zero_grad()
    _loss(gm).backward()
    before, masters = _snapshot(gm), _snapshot(model)
    with pytest.raises(amp_fx.AmpRuntimeError, match="would silently stop training") as error:
        opt.step()
    _assert_refusal(error)
    assert all(torch.equal(p, before[n]) for n, p in gm.named_parameters())  # refused before anything moved
    assert all(torch.equal(p, masters[n]) for n, p in model.named_parameters())
    assert opt.state == {} or all(not s for s in opt.state.values())
    with pytest.raises(amp_fx.AmpRuntimeError):
        opt.step()  # refused at every step, not only once
    assert scheduler.last_epoch == 0


def test_the_refusal_comes_through_loss_scaler_step_too():
    _, gm = _o2()
    opt, scaler = torch.optim.SGD(gm.parameters(), lr=0.1), amp_fx.LossScaler(dtype=torch.bfloat16)
    scaler.scale(_loss(gm)).backward()
    before = _snapshot(gm)
    with pytest.raises(amp_fx.AmpRuntimeError) as error:
        scaler.step(opt)
    _assert_refusal(error)
    assert all(torch.equal(p, before[n]) for n, p in gm.named_parameters())


def _steps(gm, opt, n=3, scaler=None):
    for step in range(n):
        opt.zero_grad()
        loss = _loss(gm, seed=step)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()


def test_the_two_documented_ways_and_apex_initialize_train_o2_without_refusal():
    """Each way trains: the low weights move, and MasterWeightOptimizer's equal their fp32 masters rounded."""
    model, gm = _o2()
    before = _snapshot(gm)
    _steps(gm, amp_fx.MasterWeightOptimizer(torch.optim.SGD(gm.parameters(), lr=0.1), gm),
           scaler=amp_fx.LossScaler(dtype=torch.bfloat16))
    assert not torch.equal(gm.fc1.weight, before["fc1.weight"])
    assert torch.equal(gm.fc1.weight, model.fc1.weight.detach().to(torch.bfloat16))
    # Against autocast + fp32 SGD on the same data: the updates are ~0.05; O2's gradients differ from
    # autocast's by bf16 roundings of activations (relative 2**-8), so the masters agree within ~2e-4.
    torch.manual_seed(0)
    reference = Net()
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        plain.zero_grad()
        with torch.autocast("cpu", torch.bfloat16):
            loss = _loss(reference, seed=step)
        loss.backward()
        plain.step()
    for (name, master), expected in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(master, expected, rtol=0, atol=1e-3, msg=name)

    _, gm = _o2()
    before = _snapshot(gm)
    # Small chunks: the wrapped AdamW steps once per chunk, each step its own pass through the hook.
    _steps(gm, amp_fx.LowPrecisionOptimizer(torch.optim.AdamW(gm.parameters(), lr=1e-2), gm, update="kahan",
                                            chunk_numel=100))
    assert not torch.equal(gm.fc1.weight, before["fc1.weight"])

    torch.manual_seed(0)
    model = Net()
    gm, opt = amp_fx.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2",
                                dtype=torch.bfloat16, verbosity=0)
    before = _snapshot(gm)
    for step in range(3):
        opt.zero_grad()
        with amp_fx.scale_loss(_loss(gm, seed=step), opt) as scaled:
            scaled.backward()
        opt.step()
    assert not torch.equal(gm.fc1.weight, before["fc1.weight"])
    assert torch.equal(gm.fc1.weight, model.fc1.weight.detach().to(torch.bfloat16))


@pytest.mark.parametrize("level", ["O1", "O3"])
def test_plain_optimizers_at_o1_and_o3_are_not_refused(level):
    """O1's parameters are the model's fp32 ones; O3 has no masters (its low weights are what it trains)."""
    _o2()  # an O2 module exists in the process: the hook is installed
    torch.manual_seed(0)
    gm = amp_fx.convert(Net(), level, dtype=torch.bfloat16)
    before = _snapshot(gm)
    _steps(gm, torch.optim.SGD(gm.parameters(), lr=0.5), scaler=amp_fx.LossScaler(dtype=torch.bfloat16))
    assert not torch.equal(gm.fc1.weight, before["fc1.weight"])


def test_frozen_low_weights_and_o2_fp32_norms_in_a_plain_optimizer_are_not_refused():
    """A frozen weight is never changed by a step, and O2's fp32 norm trains as it is (adapter-style fine-tuning)."""
    _, gm = _o2()
    for name, p in gm.named_parameters():
        p.requires_grad_(p.dtype == torch.float32)
    before = _snapshot(gm)
    _steps(gm, torch.optim.SGD(gm.parameters(), lr=0.5))
    assert not torch.equal(gm.norm.weight, before["norm.weight"])
    assert torch.equal(gm.fc1.weight, before["fc1.weight"])


def test_an_o2_low_weight_added_to_an_optimizer_that_already_stepped_is_caught_at_the_next_step():
    _, gm = _o2()
    opt = torch.optim.SGD([gm.norm.weight, gm.norm.bias], lr=0.1)  # fp32 at O2: passes
    _steps(gm, opt, n=1)
    opt.add_param_group({"params": [gm.fc2.weight], "lr": 0.01})
    _loss(gm).backward()
    with pytest.raises(amp_fx.AmpRuntimeError) as error:
        opt.step()
    _assert_refusal(error, name="fc2.weight")


@pytest.mark.parametrize("build", [lambda p: torch.optim.AdamW(p, lr=1e-2), lambda p: torch.optim.SGD(p, lr=0.1)],
                         ids=["adamw", "sgd"])
def test_a_plain_optimizer_over_the_models_o2_masters_is_refused_when_gm_got_the_gradients(build):
    torch.manual_seed(0)
    model = Net()
    opt = build(model.parameters())  # built before convert, the torch.amp habit
    gm = amp_fx.convert(model, "O2", dtype=torch.bfloat16)
    _loss(gm).backward()
    masters = _snapshot(model)
    with pytest.raises(amp_fx.AmpRuntimeError, match="silently not train") as error:
        opt.step()
    message = str(error.value)
    assert "'fc1.weight'" in message and "amp_fx.MasterWeightOptimizer(opt, gm)" in message
    assert all(torch.equal(p, masters[n]) for n, p in model.named_parameters())
    # The fix the message names trains the masters with the same optimizer object.
    mw = amp_fx.MasterWeightOptimizer(opt, gm)
    mw.step()
    assert not torch.equal(model.fc1.weight, masters["fc1.weight"])


def test_training_the_original_model_in_fp32_beside_an_o2_conversion_is_not_refused():
    torch.manual_seed(0)
    model = Net()
    gm = amp_fx.convert(model, "O2", dtype=torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = _snapshot(model)
    for _ in range(2):
        opt.zero_grad()
        _loss(model).backward()  # the masters get their own gradients
        opt.step()
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    # gm follows the trained masters (an in-place write it sees by version): as a fresh conversion does.
    x, _ = _batch()
    assert torch.equal(gm(x), amp_fx.convert(model, "O2", dtype=torch.bfloat16)(x))


def test_a_deepcopy_of_an_o2_module_keeps_the_refusal_and_saves_its_masters():
    import copy

    model, gm = _o2()
    gm2 = copy.deepcopy(gm)
    opt = torch.optim.SGD(gm2.parameters(), lr=0.1)
    _loss(gm2).backward()
    before = _snapshot(gm2)
    with pytest.raises(amp_fx.AmpRuntimeError, match="would silently stop training") as error:
        opt.step()
    _assert_refusal(error)
    assert all(torch.equal(p, before[n]) for n, p in gm2.named_parameters())
    # state_dict gives the copy's fp32 masters exactly (equal to the model's: nothing trained), not bf16 widened.
    sd = gm2.state_dict()
    for name, p in model.named_parameters():
        assert sd[name].dtype == torch.float32 and torch.equal(sd[name], p.detach()), name
    # The copy's masters are its own: MasterWeightOptimizer over the copy trains them, not the model's.
    originals = _snapshot(model)
    mw = amp_fx.MasterWeightOptimizer(torch.optim.SGD(gm2.parameters(), lr=0.1), gm2)
    mw.step()
    assert all(torch.equal(p, originals[n]) for n, p in model.named_parameters())
    assert not torch.equal(gm2.state_dict()["fc1.weight"], model.fc1.weight)
