"""initialize(fp32_grad_accumulation=True) and the loss scale amp_config reports (issue 36, item 8).

Before: initialize refused fp32_grad_accumulation (an unknown property), and ``gm.amp_config.to_dict()`` said
``loss_scale: "dynamic"`` for a bf16 model whose scaler does not scale at all.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_fx
from amp_fx.apex.amp import loss_scalers

K = 4  # micro-batches per step


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 16), nn.LayerNorm(16), nn.Linear(16, 4))


def _micro_batches(step):
    gen = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen)) for _ in range(K)]


def _loss(gm, x, y):
    return F.mse_loss(gm(x).float(), y) / K


def _train_initialized(steps, **options):
    model = _model()
    gm, opt = amp_fx.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), "O2",
                                dtype=torch.bfloat16, verbosity=0, **options)
    for step in range(steps):
        for i, (x, y) in enumerate(_micro_batches(step)):
            with amp_fx.scale_loss(_loss(gm, x, y), opt, delay_unscale=i < K - 1) as scaled:
                scaled.backward()
            if options.get("fp32_grad_accumulation"):
                assert all(p.grad is None for p in gm.parameters())  # each low gradient freed into its master
        opt.step()
        opt.zero_grad()
    return model, gm, opt


def _train_by_hand(steps, accumulate):
    """The same loop with MasterWeightOptimizer(fp32_grad_accumulation=...) built by hand (no scaler: bf16)."""
    model = _model()
    gm = amp_fx.convert(model, "O2", dtype=torch.bfloat16)
    opt = amp_fx.MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), gm,
                                       fp32_grad_accumulation=accumulate)
    for step in range(steps):
        for x, y in _micro_batches(step):
            _loss(gm, x, y).backward()
        opt.step()
        opt.zero_grad()
    return model


def test_initialize_accumulates_gradients_in_fp32_as_the_hand_built_wrapper():
    """Three steps of 4 micro-batches through scale_loss: the fp32 masters equal the hand-built fp32-accumulating
    wrapper's bit for bit (the same adds and the same steps), and differ from bf16 accumulation's."""
    model, _, opt = _train_initialized(3, fp32_grad_accumulation=True)
    assert isinstance(opt, amp_fx.MasterWeightOptimizer) and opt._fp32_accum
    fp32_sum, bf16_sum = _train_by_hand(3, accumulate=True), _train_by_hand(3, accumulate=False)
    for (name, p), q, r in zip(model.named_parameters(), fp32_sum.parameters(), bf16_sum.parameters()):
        assert p.dtype == torch.float32 and torch.equal(p, q), name
    assert any(not torch.equal(p, r) for p, r in zip(model.parameters(), bf16_sum.parameters()))


def test_without_the_option_initialize_keeps_accumulating_in_the_low_grads():
    model, _, opt = _train_initialized(1)
    assert not opt._fp32_accum
    for (name, p), q in zip(model.named_parameters(), _train_by_hand(1, accumulate=False).parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("level, extra, match", [
    ("O1", {}, "fp32 already"),
    ("O3", {}, "has none"),
    ("O2", {"master_weights": False}, "master_weights=False"),
])
def test_fp32_grad_accumulation_without_masters_is_refused(level, extra, match):
    model = _model()
    with pytest.raises(amp_fx.AmpValueError, match=match):
        amp_fx.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), level, dtype=torch.bfloat16,
                          verbosity=0, fp32_grad_accumulation=True, **extra)
    with pytest.raises(amp_fx.AmpValueError, match="True or False"):
        amp_fx.initialize(_model(), None, "O2", verbosity=0, fp32_grad_accumulation="yes")


@pytest.mark.parametrize("kwargs", [
    dict(opt_level="O2", dtype=torch.bfloat16),  # bf16: the scaler is off
    dict(opt_level="O1", dtype=torch.bfloat16),
    dict(opt_level="O2", dtype=torch.bfloat16, loss_scale="dynamic"),  # asked for: it scales
    dict(opt_level="O2", dtype=torch.float16),
    dict(opt_level="O2", dtype=torch.float16, loss_scale=128.0),
    dict(opt_level="O3", dtype=torch.float16),
    dict(opt_level="O0"),
])
def test_amp_config_reports_the_loss_scale_the_scaler_uses(kwargs):
    model = _model()
    gm, _ = amp_fx.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), verbosity=0, **kwargs)
    (scaler,) = loss_scalers()
    reported = gm.amp_config.to_dict()["loss_scale"]
    if not scaler.is_enabled():
        assert reported == 1.0, (kwargs, reported)
    elif scaler._dynamic:
        assert reported == "dynamic", (kwargs, reported)
    else:
        assert reported == scaler.get_scale(), (kwargs, reported)


def _train_compiled_update(model, opt, gm, steps=3):
    """Bare bf16 steps (no scaler) of ``opt``; the route each step took."""
    routes = []
    for step in range(steps):
        x, y = _micro_batches(step)[0]
        opt.zero_grad()
        _loss(gm, x, y).backward()
        opt.step()
        routes.append(opt.last_step_route)
    return routes


def test_initialize_takes_compiled_update_as_the_hand_built_wrapper():
    """initialize(..., compiled_update="aot_eager") (issue 41: refused as an unknown property before) steps as
    MasterWeightOptimizer(compiled_update="aot_eager") built by hand: the same routes, and bit for bit the same
    masters (the same eager kernels run on both sides)."""
    model = _model()
    gm, opt = amp_fx.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "O2", dtype=torch.bfloat16,
                                verbosity=0, compiled_update="aot_eager")
    routes = _train_compiled_update(model, opt, gm)
    by_hand = _model()
    hand_gm = amp_fx.convert(by_hand, "O2", dtype=torch.bfloat16)
    hand_opt = amp_fx.MasterWeightOptimizer(torch.optim.AdamW(by_hand.parameters(), lr=1e-2), hand_gm,
                                            compiled_update="aot_eager")
    assert routes == _train_compiled_update(by_hand, hand_opt, hand_gm)
    assert routes[0].startswith("chunked (not compiled: ") and routes[1:] == ["compiled"] * 2
    params = list(model.parameters())
    assert len(params) == 8
    for p, q in zip(params, by_hand.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("compiled_update, route", [
    (None, "chunked (not compiled: SGD's first step makes the momentum buffers"),  # on: it only waits for state
    (False, "chunked"),
])
def test_initialize_over_a_compiled_model_turns_the_compiled_update_on(compiled_update, route):
    """initialize(torch.compile(model), ...) at O2: compiled_update left None is on, as MasterWeightOptimizer over a
    compiled module (before: off, the wrapper saw the converted module inside); False keeps it off. One SGD step
    (nothing compiles: the first step makes the momentum the compiled update reads) shows which."""
    model = _model()
    options = {} if compiled_update is None else {"compiled_update": compiled_update}
    cm, opt = amp_fx.initialize(torch.compile(model, backend="aot_eager"),
                                torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), "O2",
                                dtype=torch.bfloat16, verbosity=0, **options)
    assert isinstance(cm, torch._dynamo.eval_frame.OptimizedModule)
    routes = _train_compiled_update(model, opt, cm, steps=1)
    assert routes[0] == route if compiled_update is False else routes[0].startswith(route)


@pytest.mark.parametrize("level, options, match", [
    ("O2", {"compiled_update": "aot_eagr"}, r"not a torch.compile backend.*Did you mean 'aot_eager'"),
    ("O2", {"compiled_update": 1}, "compiled_update must be True, False, None or a torch.compile backend name"),
    ("O3", {"compiled_update": True}, "has none"),
    ("O2", {"compiled_update": "aot_eager", "master_weights": False}, "master_weights=False"),
    ("O1", {"compiled_update": True}, "has none"),
])
def test_initialize_refuses_a_compiled_update_it_cannot_use(level, options, match):
    """The wrapper's own check (a bad value or backend name), and asking for it where no masters are stepped."""
    model = _model()
    with pytest.raises(amp_fx.AmpValueError, match=match):
        amp_fx.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), level, dtype=torch.bfloat16,
                          verbosity=0, **options)
