"""Tests for amp_fx.runtime.LossScaler: GradScaler parity, scale dynamics, skipping, errors, state."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from torch import nn

from amp_fx.runtime import LossScaleCollapseError, LossScaler, LossScalerStateError

INF = float("inf")


def _params(n=4, dtype=torch.float32):
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(3, dtype=dtype)) for _ in range(n)]


def _iteration(scaler, opt, params, overflow=False, grad=1.0):
    """One iteration with grads set by hand: ``grad * scale`` everywhere, inf in the first if asked."""
    scale = scaler.get_scale()
    scaler.scale(torch.ones((), requires_grad=True))  # marks the loss as scaled
    for p in params:
        p.grad = torch.full_like(p, grad * scale)
    if overflow:
        params[0].grad[1] = INF
    stepped = scaler.step(opt)
    scaler.update()
    return stepped


def _run_pattern(scaler, pattern, params=None):
    params = params or _params()
    opt = torch.optim.SGD(params, lr=0.1)
    scales = []
    for overflow in pattern:
        _iteration(scaler, opt, params, overflow)
        scales.append(scaler.get_scale())
    return scales, params


# A pattern with growth, backoff, back-to-back overflows and regrowth.
PATTERN = [False] * 5 + [True] + [False] * 4 + [True, True] + [False] * 7 + [True] + [False] * 3


@pytest.mark.parametrize("growth,backoff", [(2.0, 0.5), (1.7, 0.3)])
def test_scale_sequence_and_params_match_gradscaler(growth, backoff):
    """Same injected overflows give GradScaler's exact scale sequence and parameters."""
    kw = dict(init_scale=1024.0, growth_factor=growth, backoff_factor=backoff, growth_interval=3)
    ours, ours_params = _run_pattern(LossScaler(**kw, max_scale=INF), PATTERN)
    ref = torch.amp.GradScaler("cpu", **kw)
    theirs, ref_params = _run_pattern(ref, PATTERN)
    assert ours == theirs
    assert len(set(ours)) >= 3  # the sequence really moved both ways
    for a, b in zip(ours_params, ref_params):
        assert torch.equal(a, b)


def test_training_matches_gradscaler_bitwise_on_fp32_model():
    """An fp32 model trained with either scaler (with an overflow mid-way) ends bit-identical."""
    def train(make_scaler):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        scaler = make_scaler()
        gen = torch.Generator().manual_seed(1)
        for i in range(12):
            opt.zero_grad()
            x = torch.randn(5, 6, generator=gen)
            loss = model(x).pow(2).mean()
            if i == 4:
                loss = loss * INF
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        return [p.detach().clone() for p in model.parameters()], scaler.get_scale()

    ours, ours_scale = train(lambda: LossScaler(growth_interval=3))
    ref, ref_scale = train(lambda: torch.amp.GradScaler("cpu", growth_interval=3))
    assert ours_scale == ref_scale == 2.0**18  # grew at iterations 2, 7, 10; halved at 4
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)


def test_growth_only_after_growth_interval_clean_steps():
    scales, _ = _run_pattern(LossScaler(init_scale=8.0, growth_interval=4), [False] * 9)
    assert scales == [8.0, 8.0, 8.0, 16.0, 16.0, 16.0, 16.0, 32.0, 32.0]


def test_backoff_resets_growth_tracker():
    scales, _ = _run_pattern(
        LossScaler(init_scale=8.0, growth_interval=3), [False, False, True, False, False, False]
    )
    assert scales == [8.0, 8.0, 4.0, 4.0, 4.0, 8.0]


def test_hysteresis_backs_off_only_after_consecutive_overflows():
    """hysteresis=3: two overflows keep the scale; the third and every further one back off."""
    pattern = [True, True, True, True, False, True, True, False]
    scales, _ = _run_pattern(LossScaler(init_scale=64.0, hysteresis=3), pattern)
    assert scales == [64.0, 64.0, 32.0, 16.0, 16.0, 16.0, 16.0, 16.0]


def test_max_scale_caps_growth():
    scales, _ = _run_pattern(
        LossScaler(init_scale=16.0, growth_interval=1, max_scale=48.0), [False] * 4
    )
    assert scales == [32.0, 48.0, 48.0, 48.0]


def test_min_scale_floor_then_collapse_error():
    scaler = LossScaler(init_scale=6.0, min_scale=2.0)
    params = _params()
    opt = torch.optim.SGD(params, lr=0.1)
    _iteration(scaler, opt, params, overflow=True)
    assert scaler.get_scale() == 3.0
    _iteration(scaler, opt, params, overflow=True)
    assert scaler.get_scale() == 2.0  # clamped to the floor, not 1.5
    with pytest.raises(LossScaleCollapseError) as info:
        _iteration(scaler, opt, params, overflow=True)
    assert isinstance(info.value, RuntimeError)
    text = str(info.value)
    assert "dtype=torch.bfloat16" in text
    assert 'amp_fx.convert(model, policy={"module:<name>": "fp32"})' in text
    assert "min_scale=2.0" in text


def test_no_floor_means_no_collapse_error():
    scales, _ = _run_pattern(LossScaler(init_scale=4.0), [True] * 40)
    assert scales[-1] == 4.0 * 0.5**40


def test_static_scale_stays_fixed_and_still_skips():
    scaler = LossScaler(init_scale=128.0, dynamic=False, growth_interval=1)
    params = _params()
    before = [p.detach().clone() for p in params]
    scales, _ = _run_pattern(scaler, [True, False, False, True], params)
    assert scales == [128.0] * 4
    assert scaler.skipped_steps == 2
    # Two real steps of SGD(lr=0.1) with unscaled grads of 1.0.
    for p, b in zip(params, before):
        assert torch.allclose(p, b - 0.2)


def test_bf16_turns_scaling_off_unless_explicitly_asked():
    off = LossScaler(dtype=torch.bfloat16)
    loss = torch.tensor(3.0)
    assert off.get_scale() == 1.0 and not off.is_enabled()
    assert off.scale(loss) is loss
    assert not LossScaler(dtype=torch.bfloat16, dynamic=False).is_enabled()
    asked = LossScaler(dtype=torch.bfloat16, init_scale=2.0**16)
    assert asked.is_enabled() and asked.get_scale() == 2.0**16
    assert LossScaler(dtype=torch.bfloat16, dynamic=True).get_scale() == 2.0**16
    fp16 = LossScaler(dtype=torch.float16)
    assert fp16.is_enabled() and fp16.scale(loss).item() == 3.0 * 2**16
    # Off means no growth either.
    scales, _ = _run_pattern(LossScaler(dtype=torch.bfloat16, growth_interval=1), [False] * 3)
    assert scales == [1.0, 1.0, 1.0]


MODES = {
    "dynamic": dict(),
    "static": dict(init_scale=128.0, dynamic=False),
    "bf16": dict(dtype=torch.bfloat16),
    "disabled": dict(enabled=False),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_nonfinite_step_is_skipped_in_every_mode(mode):
    scaler = LossScaler(**MODES[mode])
    params = _params()
    opt = torch.optim.SGD(params, lr=0.1)
    before = [p.detach().clone() for p in params]
    assert _iteration(scaler, opt, params, overflow=True) is False
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert scaler.skipped_steps == 1
    assert _iteration(scaler, opt, params) is True
    assert all(torch.allclose(p, b - 0.1) for p, b in zip(params, before))
    assert scaler.skipped_steps == 1


@pytest.mark.parametrize("mode", ["bf16", "disabled"])
def test_skip_nonfinite_false_steps_anyway_when_not_scaling(mode):
    scaler = LossScaler(**MODES[mode], skip_nonfinite=False)
    params = _params()
    opt = torch.optim.SGD(params, lr=0.1)
    assert _iteration(scaler, opt, params, overflow=True) is True
    assert not torch.isfinite(params[0]).all()
    assert scaler.skipped_steps == 0


def test_skip_nonfinite_false_still_skips_while_scaling():
    """GradScaler's behaviour: a scaling scaler always skips overflowing steps."""
    scaler = LossScaler(init_scale=4.0, skip_nonfinite=False)
    params = _params()
    opt = torch.optim.SGD(params, lr=0.1)
    assert _iteration(scaler, opt, params, overflow=True) is False
    assert torch.isfinite(params[0]).all() and scaler.get_scale() == 2.0


def test_disabled_without_checks_just_steps():
    scaler = LossScaler(enabled=False, skip_nonfinite=False)
    opt = torch.optim.SGD(_params(), lr=0.1)
    calls = []
    opt.step = lambda *a, **k: calls.append((a, k))
    loss = [torch.tensor(1.0), (torch.tensor(2.0),)]
    assert scaler.scale(loss) is loss
    assert scaler.step(opt, 7, flag=True) is True
    scaler.update()
    assert calls == [((7,), {"flag": True})] and scaler.get_scale() == 1.0


def test_step_scheduler_advances_only_on_real_steps():
    scaler = LossScaler(init_scale=8.0)
    params = _params()
    opt = torch.optim.SGD(params, lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    taken = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()"
        for overflow in [True, False, True, False, False]:
            scaler.scale(torch.ones(()))
            for p in params:
                p.grad = torch.full_like(p, scaler.get_scale())
            if overflow:
                params[1].grad[0] = float("nan")
            stepped = scaler.step(opt)
            taken.append(scaler.step_scheduler(sched))
            assert taken[-1] == stepped
            scaler.update()
    assert taken == [False, True, False, True, True]
    assert sched.get_last_lr() == [0.125]
    assert scaler.skipped_steps == 2
    with pytest.raises(RuntimeError, match="never called for this scheduler's optimizer"):
        scaler.step_scheduler(
            torch.optim.lr_scheduler.StepLR(torch.optim.SGD(_params(), lr=1.0), 1)
        )


def _scaled_grads(scaler, params):
    scaler.scale(torch.ones(()))
    for p in params:
        p.grad = torch.full_like(p, scaler.get_scale())


def test_error_unscale_twice_and_after_step():
    scaler, params = LossScaler(), _params()
    opt = torch.optim.SGD(params, lr=0.1)
    _scaled_grads(scaler, params)
    scaler.unscale_(opt)
    assert torch.equal(params[0].grad, torch.ones(3))
    with pytest.raises(RuntimeError, match="already been called.*at most once per iteration"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="after step\\(\\).*scaler.update\\(\\)"):
        scaler.unscale_(opt)


def test_error_step_twice_without_update():
    scaler, params = LossScaler(), _params()
    opt = torch.optim.SGD(params, lr=0.1)
    _scaled_grads(scaler, params)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="already been called.*Call scaler.update\\(\\)"):
        scaler.step(opt)
    scaler.update()
    _scaled_grads(scaler, params)
    assert scaler.step(opt) is True  # update() cleared the per-optimizer state


def test_error_step_without_gradients_and_without_scale():
    scaler, params = LossScaler(), _params()
    opt = torch.optim.SGD(params, lr=0.1)
    scaler.scale(torch.ones(()))
    with pytest.raises(RuntimeError, match="No inf checks were recorded for this optimizer.*depends on"):
        scaler.step(opt)
    fresh = LossScaler()
    for p in params:
        p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match="scaler.scale\\(loss\\) was not called"):
        fresh.step(opt)
    with pytest.raises(RuntimeError, match="No inf checks were recorded prior to update"):
        fresh.update()
    with pytest.raises(RuntimeError, match="closures are not supported"):
        fresh.step(opt, closure=lambda: 0.0)


def test_sparse_gradients_are_refused():
    emb = nn.Embedding(5, 3, sparse=True)
    scaler = LossScaler()
    scaler.scale(emb(torch.tensor([1, 2])).sum()).backward()
    with pytest.raises(NotImplementedError, match="sparse"):
        scaler.step(torch.optim.SGD(emb.parameters(), lr=0.1))


def test_scale_nested_structures():
    scaler = LossScaler(init_scale=4.0)
    a, b, c = torch.tensor(1.0), torch.tensor(2.0), torch.tensor(3.0)
    out = scaler.scale([a, (b, {"c": c})])
    assert isinstance(out, list) and isinstance(out[1], tuple) and isinstance(out[1][1], dict)
    assert [out[0].item(), out[1][0].item(), out[1][1]["c"].item()] == [4.0, 8.0, 12.0]
    assert [t.item() for t in scaler.scale(t for t in (a, b))] == [4.0, 8.0]
    with pytest.raises(ValueError, match="Tensor"):
        scaler.scale([a, "loss"])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_unscale_low_precision_grads(dtype):
    """O3: grads in fp16/bf16 are unscaled in place (GradScaler refuses fp16 ones)."""
    scaler = LossScaler(init_scale=256.0)
    params = _params(dtype=dtype)
    opt = torch.optim.SGD(params, lr=0.1)
    _scaled_grads(scaler, params)
    scaler.unscale_(opt)
    assert all(p.grad.dtype == dtype and torch.equal(p.grad, torch.ones_like(p)) for p in params)


def test_update_new_scale():
    scaler, params = LossScaler(), _params()
    opt = torch.optim.SGD(params, lr=0.1)
    _iteration(scaler, opt, params)
    scaler.scale(torch.ones(()))
    scaler.update(new_scale=512.0)
    assert scaler.get_scale() == 512.0
    scaler.update(new_scale=torch.tensor(32.0))
    assert scaler.get_scale() == 32.0


def test_multiple_optimizers_skip_individually_and_back_off_once():
    p1, p2 = _params(2), _params(2)
    o1, o2 = torch.optim.SGD(p1, lr=0.1), torch.optim.SGD(p2, lr=0.1)
    b2 = [p.detach().clone() for p in p2]
    scaler, ref = LossScaler(init_scale=8.0), torch.amp.GradScaler("cpu", init_scale=8.0)
    results = {}
    for name, s in (("ours", scaler), ("ref", ref)):
        s.scale(torch.ones(()))
        for p in p1 + p2:
            p.grad = torch.full_like(p, 8.0)
        p1[0].grad[0] = INF
        results[name] = (s.step(o1), s.step(o2))
        s.update()
    assert results["ours"] == (False, True)
    assert scaler.get_scale() == ref.get_scale() == 4.0
    assert scaler.skipped_steps == 1
    assert all(torch.allclose(p, b - 0.2) for p, b in zip(p2, b2))  # stepped by both scalers


@pytest.mark.parametrize("explicit_unscale", [False, True])
def test_one_host_sync_per_step_for_twenty_parameters(explicit_unscale, count_host_syncs):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(10)])
    assert len(list(model.parameters())) == 20
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = LossScaler(growth_interval=2)
    for i in range(3):
        opt.zero_grad()
        loss = model(torch.randn(2, 4)).sum()
        with count_host_syncs() as counter:
            scaled = scaler.scale(loss)
        scaled.backward()
        if i == 1:
            model[3].weight.grad[0, 0] = INF
        with count_host_syncs() as counter:
            if explicit_unscale:
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            scaler.get_scale()
        assert counter.count == 1
    assert scaler.skipped_steps == 1


def test_overflow_log_is_a_summary(caplog):
    scaler = LossScaler(init_scale=2.0**10, backoff_factor=0.99, log_every=100)
    params = _params(1)
    opt = torch.optim.SGD(params, lr=0.1)
    with caplog.at_level(logging.INFO, logger="amp_fx.runtime"):
        scales = []
        for _ in range(250):
            _iteration(scaler, opt, params, overflow=True)
            scales.append(scaler.get_scale())
    records = [r for r in caplog.records if r.name == "amp_fx.runtime"]
    assert len(records) == 3  # at the 1st, 101st and 201st skip
    assert "(1 in total)" in records[0].getMessage()
    assert "100 optimizer step(s)" in records[1].getMessage()
    assert records[2].getMessage().endswith(f"(201 in total); loss scale is now {scales[200]}")
    assert scales[200] == pytest.approx(2.0**10 * 0.99**201, rel=1e-4)


def test_state_dict_round_trip():
    scaler = LossScaler(init_scale=64.0, growth_interval=3, hysteresis=2, level="O2")
    _run_pattern(scaler, [True, True, False, False, True])
    state = scaler.state_dict()
    assert state["scale"] == 32.0 and state["_hysteresis_tracker"] == 1
    assert state["_growth_tracker"] == 0 and state["skipped_steps"] == 3
    fresh = LossScaler(hysteresis=2, level="O2")
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    # Both continue identically: one more overflow completes the hysteresis.
    assert _run_pattern(fresh, [True, False])[0] == _run_pattern(scaler, [True, False])[0] == [
        16.0, 16.0,
    ]


def test_state_dict_interoperates_with_gradscaler():
    ref = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=2)
    _run_pattern(ref, [False, True, False])
    ours = LossScaler()
    ours.load_state_dict(ref.state_dict())
    assert ours.get_scale() == 4.0 and ours.get_growth_interval() == 2
    back = torch.amp.GradScaler("cpu")
    back.load_state_dict(ours.state_dict())
    assert back.get_scale() == 4.0
    with pytest.raises(LossScalerStateError, match="disabled GradScaler"):
        LossScaler().load_state_dict({})


def test_load_state_dict_refuses_mismatches():
    dynamic = LossScaler(level="O1").state_dict()
    with pytest.raises(LossScalerStateError, match="dynamic mismatch.*dynamic scaler.*static"):
        LossScaler(init_scale=8.0, dynamic=False, level="O1").load_state_dict(dynamic)
    with pytest.raises(LossScalerStateError, match="enabled mismatch.*scaling on.*has it off"):
        LossScaler(dtype=torch.bfloat16).load_state_dict(dynamic)
    with pytest.raises(LossScalerStateError, match="level 'O1'.*level 'O2'"):
        LossScaler(level="O2").load_state_dict(dynamic)
    LossScaler(level=None).load_state_dict(dynamic)  # an unlabelled scaler accepts any level
    off = LossScaler(dtype=torch.bfloat16)
    off.skipped_steps = 5
    restored = LossScaler(enabled=False)
    restored.load_state_dict(off.state_dict())
    assert restored.skipped_steps == 5 and restored.get_scale() == 1.0


def test_constructor_validation():
    with pytest.raises(ValueError, match="growth_factor"):
        LossScaler(growth_factor=1.0)
    with pytest.raises(ValueError, match="backoff_factor"):
        LossScaler(backoff_factor=1.5)
    with pytest.raises(ValueError, match="outside"):
        LossScaler(init_scale=2.0**30)
    with pytest.raises(ValueError, match="dtype"):
        LossScaler(dtype=torch.int8)


def test_is_unscaled_tells_whether_unscale_ran_since_the_last_update():
    """What a framework asks before unscaling for a clip it may or may not own (Lightning manual optimization)."""
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler(dtype=torch.float16, init_scale=2.0**4)
    scaler.scale(model(torch.randn(3, 4)).sum()).backward()
    assert not scaler.is_unscaled(opt)
    scaler.unscale_(opt)
    assert scaler.is_unscaled(opt)
    scaler.step(opt)
    scaler.update()
    assert not scaler.is_unscaled(opt)
