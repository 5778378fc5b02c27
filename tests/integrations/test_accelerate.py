"""Accelerate: amp_fx.integrations.accelerate.prepare against Accelerator(mixed_precision="bf16"), and save/load_state."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

accelerate = pytest.importorskip("accelerate")

import amp_fx  # noqa: E402
from amp_fx.integrations.accelerate import prepare  # noqa: E402

# bf16 keeps 8 significant bits (u = 2^-9): amp_fx and autocast round the same GEMMs but not always at
# the same points, so losses may differ by a few u after 10 AdamW steps: 4u = 2^-7. fp16: 4u = 2^-10.
RTOL = {"bf16": 2.0**-7, "fp16": 2.0**-10}
STEPS = 10


def _accelerator(mixed_precision="no"):
    # Accelerate keeps one process-wide state; each run here builds its own Accelerator from scratch.
    accelerate.state.AcceleratorState._reset_state(True)
    accelerate.state.GradientState._reset_state()
    return accelerate.Accelerator(cpu=True, mixed_precision=mixed_precision)


def _setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 4))
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(STEPS * 8, 16, generator=g), torch.randint(0, 4, (STEPS * 8,), generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=False)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), loader


def _train(model, opt, loader, accelerator, scaler=None, steps=STEPS, skip=0):
    losses = []
    for i, (x, y) in enumerate(loader):
        if i < skip:
            continue
        if i >= steps:
            break
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        if scaler is None:
            accelerator.backward(loss)
            opt.step()
        else:
            accelerator.backward(scaler.scale(loss))
            scaler.unscale_(opt)
            accelerator.clip_grad_norm_(opt.master_parameters() if hasattr(opt, "master_parameters") else model.parameters(), 1.0)
            assert scaler.step(opt)
            scaler.update()
        losses.append(loss.item())
    return losses


def _reference(mixed_precision):
    accelerator = _accelerator(mixed_precision)
    model, opt, loader = _setup()
    model, opt, loader = accelerator.prepare(model, opt, loader)
    losses = []
    for x, y in loader:
        opt.zero_grad()
        with accelerator.autocast():
            loss = F.cross_entropy(model(x), y)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses


def _amp_fx(level, dtype, **scaler_options):
    accelerator = _accelerator()
    model, opt, loader = _setup()
    scaler = amp_fx.LossScaler(dtype=dtype, level=level, **scaler_options) if scaler_options else None
    model, opt, scaler, loader = prepare(accelerator, model, opt, loader, level=level, dtype=dtype, scaler=scaler)
    return accelerator, model, opt, scaler, loader


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_losses_match_mixed_precision_bf16(level):
    """10 steps (with clipping at 1.0) match Accelerator(mixed_precision="bf16") within bf16 tolerance."""
    reference = _reference("bf16")
    accelerator, model, opt, scaler, loader = _amp_fx(level, "bf16")
    assert isinstance(model, amp_fx.AmpGraphModule)
    assert isinstance(opt.optimizer, amp_fx.MasterWeightOptimizer) == (level == "O2")
    losses = _train(model, opt, loader, accelerator, scaler)
    assert len(losses) == len(reference) == STEPS
    for step, (ours, theirs) in enumerate(zip(losses, reference)):
        assert abs(ours - theirs) <= RTOL["bf16"] * abs(theirs), (step, ours, theirs)
    assert len(set(losses)) == STEPS  # every step saw its own batch and weights


@pytest.mark.parametrize("level,dtype", [("O1", "bf16"), ("O2", "bf16"), ("O2", "fp16")])
def test_save_state_load_state_resume_exactly(level, dtype, tmp_path):
    """save_state after 5 steps, load_state into a fresh setup: steps 6-10, weights and scale equal an uninterrupted run."""
    scaler_options = dict(init_scale=2.0**8, growth_interval=2) if dtype == "fp16" else {}
    accelerator, model, opt, scaler, loader = _amp_fx(level, dtype, **scaler_options)
    whole = _train(model, opt, loader, accelerator, scaler)
    final = {k: v.clone() for k, v in model.state_dict().items()}
    final_scale = scaler.state_dict()

    accelerator, model, opt, scaler, loader = _amp_fx(level, dtype, **scaler_options)
    assert _train(model, opt, loader, accelerator, scaler, steps=5) == whole[:5]
    accelerator.save_state(tmp_path / "state")

    accelerator, model, opt, scaler, loader = _amp_fx(level, dtype, **scaler_options)
    accelerator.load_state(tmp_path / "state")
    assert _train(model, opt, loader, accelerator, scaler, skip=5) == whole[5:]
    for name, value in model.state_dict().items():
        assert value.dtype == torch.float32 and torch.equal(value, final[name]), name
    assert scaler.state_dict() == final_scale
    if dtype == "fp16":
        assert final_scale["scale"] > 2.0**8  # it grew, so the loaded scale (not the initial one) is what matched


def test_refuses_accelerator_with_autocast():
    accelerator = _accelerator("bf16")
    model, opt, _ = _setup()
    with pytest.raises(amp_fx.AmpValueError, match="mixed_precision='no'"):
        prepare(accelerator, model, opt, level="O1")


@pytest.mark.parametrize("level,dtype", [("O1", "fp16"), ("O2", "bf16"), ("O2", "fp16")])
def test_accelerate_accumulate_idiom_equals_stepping_only_on_the_sync_micro_batch(level, dtype):
    """Accelerate's own accumulation loop steps inside ``with accelerator.accumulate(model)`` on every micro-batch
    and lets the optimizer skip the non-sync ones. The scaler prepare() returns must skip them too: a plain one
    unscaled the low gradients in place there (fp16: scaled + unscaled sums) and, at O2, copied a partial sum into
    the masters (measured before: weights off by 0.04-0.07 after 4 steps). Same kernels on both sides: bit-exact."""
    def run(guard):
        accelerate.state.AcceleratorState._reset_state(True)
        accelerate.state.GradientState._reset_state()
        accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
        model, _, loader = _setup()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = amp_fx.LossScaler(dtype=dtype, level=level, init_scale=2.0**10) if dtype == "fp16" else None
        gm, opt, scaler, loader = prepare(accelerator, model, opt, loader, level=level, dtype=dtype, scaler=scaler)
        taken = []
        for x, y in loader:
            with accelerator.accumulate(gm):
                accelerator.backward(scaler.scale(F.cross_entropy(gm(x), y)))
                if guard and not accelerator.sync_gradients:
                    continue
                taken.append(scaler.step(opt))
                scaler.update()
                opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()], taken, scaler.state_dict()

    idiom, taken, state = run(guard=False)
    guarded, guarded_taken, guarded_state = run(guard=True)
    assert taken == [False, True] * (STEPS // 2) and guarded_taken == [True] * (STEPS // 2)
    assert state == guarded_state  # the scale advanced once per optimizer step, not per micro-batch
    for ours, theirs in zip(idiom, guarded):
        assert torch.equal(ours, theirs)
    assert not all(torch.equal(p, q) for p, q in zip(idiom, _setup()[0].parameters()))  # it trained


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_o2_clipping_model_parameters_clips_the_masters(dtype):
    """The usual Accelerate line, accelerator.clip_grad_norm_(model.parameters(), ...), at O2: before, it clipped
    the low copies, whose gradients the step does not use (a run clipped at 0.01 equalled the unclipped one; fp16
    read still-scaled gradients, a norm of inf). It now clips the masters, unscaling first: bit-exact to clipping
    opt.master_parameters() after scaler.unscale_."""
    def run(clip):
        accelerator, model, opt, scaler, loader = _amp_fx("O2", dtype, **({"init_scale": 2.0**10} if dtype == "fp16" else {}))
        norms = []
        for x, y in loader:
            opt.zero_grad()
            accelerator.backward(scaler.scale(F.cross_entropy(model(x), y)))
            if clip == "model":
                norms.append(accelerator.clip_grad_norm_(model.parameters(), 0.01).item())
            elif clip == "masters":
                scaler.unscale_(opt)
                norms.append(accelerator.clip_grad_norm_(opt.master_parameters(), 0.01).item())
            scaler.step(opt)
            scaler.update()
        return [p.detach().clone() for p in opt.master_parameters()], norms

    through_model, norms = run("model")
    through_masters, master_norms = run("masters")
    unclipped, _ = run(None)
    assert norms == master_norms and all(0 < n < float("inf") for n in norms)
    assert all(torch.equal(a, b) for a, b in zip(through_model, through_masters))
    assert not all(torch.equal(a, b) for a, b in zip(through_model, unclipped))


SPELLINGS = ["master_params", "master_parameters", "original_model"]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("spelling", SPELLINGS)
def test_o2_clipping_the_masters_without_unscale_clips(spelling, dtype):
    """accelerator.clip_grad_norm_/clip_grad_value_ given the masters by any name (amp_fx.master_params(opt),
    opt.master_parameters(), the original model's parameters: the masters at O2) and no scaler.unscale_ first:
    before, the masters had no gradient yet, so the norm clip returned 0 and clipped nothing and the value clip
    died inside torch. It unscales and copies first: bit-exact to unscale_ then clip."""
    def run(clip, unscale_first):
        accelerator = _accelerator()
        original, opt, loader = _setup()
        model, opt, scaler, _ = prepare(accelerator, original, opt, loader, level="O2", dtype=dtype)
        params = {"master_params": lambda: amp_fx.master_params(opt), "master_parameters": opt.master_parameters,
                  "original_model": original.parameters}[spelling]
        x, y = next(iter(loader))
        accelerator.backward(scaler.scale(F.cross_entropy(model(x), y)))
        if unscale_first:
            scaler.unscale_(opt)
        ret = (accelerator.clip_grad_norm_(params(), 1e-3) if clip == "norm"
               else accelerator.clip_grad_value_(params(), 1e-5))
        assert scaler.step(opt)
        return [p.detach().clone() for p in opt.master_parameters()], ret

    for clip in ("norm", "value"):
        clipped, ret = run(clip, unscale_first=False)
        reference, ref_ret = run(clip, unscale_first=True)
        assert len(clipped) == 6
        assert all(torch.equal(a, b) for a, b in zip(clipped, reference))
        if clip == "norm":
            assert float(ret) == float(ref_ret) > 1e-3  # the true norm, and the clip engaged


@pytest.mark.parametrize("dynamo_backend, route", [
    ("aot_eager", "chunked (not compiled: SGD's first step makes the momentum buffers"),  # on: it waits for state
    ("no", "chunked"),
])
def test_o2_dynamo_backend_turns_the_compiled_update_on(dynamo_backend, route):
    """Accelerator(dynamo_backend=...) compiles the prepared model: at O2 the masters' update is then compiled too,
    as MasterWeightOptimizer over a compiled module (issue 41: it stayed off). One SGD step shows it is on without
    compiling anything (the first step makes the momentum the compiled update reads)."""
    accelerate.state.AcceleratorState._reset_state(True)
    accelerate.state.GradientState._reset_state()
    accelerator = accelerate.Accelerator(cpu=True, dynamo_backend=dynamo_backend)
    model, _, loader = _setup()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt, scaler, loader = prepare(accelerator, model, opt, loader, level="O2", dtype="bf16")
    assert isinstance(model, torch._dynamo.eval_frame.OptimizedModule) == (dynamo_backend != "no")
    _train(model, opt, loader, accelerator, scaler, steps=1)
    wrapper = opt.optimizer
    assert isinstance(wrapper, amp_fx.MasterWeightOptimizer)
    assert wrapper.last_step_route == route if dynamo_backend == "no" else wrapper.last_step_route.startswith(route)
