"""Training loops behave as torch.amp.GradScaler and Apex amp do (issue 13), case by case, step by step against fp32.

1. scale() returns an fp32 scaled loss for fp16/bf16 losses (LossScaler and scale_loss).
2. The loss is as precise as under autocast: O1 returns fp32 floating outputs by default.
3. Master gradients derive from the model's at every unscale/step: any zeroing style works.
4. Accumulating several scale_loss blocks respects ``.grad = None``.
5. add_param_group with a converted model's parameters (masters at O2, low tensors at O3), momentum kept.
6. Several losses and optimizers: an optimizer steps only if no loss scaled into it overflowed (Apex).
7. torch.compile'd modules are accepted by MasterWeightOptimizer, initialize and LossScaler.
8. Misuse is an error or a one-time warning that names the fix.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_fx
from amp_fx.runtime import LossScaler, MasterWeightOptimizer
from semantics_harness import (LEVEL_DTYPES, LEVEL_IDS, ZEROING, amp_iteration, assert_close_steps,
                               assert_close_weights, clone, fp32_iteration, make_batches, make_model,
                               record_grads, setup, sgd, weights, zero)

APIS = ("gradscaler", "apex")


# ------------------------------------------------------------------ case 1
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_scale_returns_what_gradscaler_returns(dtype):
    """A 0-dim low loss comes back fp32 with GradScaler's value; a loss with dims keeps its dtype, as there."""
    ours, theirs = LossScaler(init_scale=2.0**16, dtype=dtype), torch.amp.GradScaler("cpu", init_scale=2.0**16)
    for loss in (torch.tensor(6.3, dtype=dtype), torch.full((3,), 6.3, dtype=dtype)):
        got, want = ours.scale(loss), theirs.scale(loss)
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert ours.scale(torch.tensor(6.3, dtype=torch.float16)).item() == pytest.approx(6.3 * 2**16, rel=1e-3)


def _gradscaler_run(model, batches):
    """autocast(fp16) + torch.amp.GradScaler: the (stepped, scale) sequence amp_fx must reproduce."""
    opt, scaler, log = sgd(model.parameters()), torch.amp.GradScaler("cpu"), []
    for x, y in batches:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        log.append((scaler.get_scale() >= before, scaler.get_scale()))
    return log


def test_scale_loss_yields_an_fp32_loss():
    """As Apex's ``loss.float() * scale``: an fp16 loss comes out of scale_loss fp32 and finite."""
    model = make_model()
    gm, opt = amp_fx.initialize(model, sgd(model.parameters()), opt_level="O1", dtype=torch.float16,
                                cast_model_outputs=False, verbosity=0)
    x, y = make_batches(1)[0]
    loss = F.cross_entropy(gm(x), y)
    assert loss.dtype == torch.float16
    with amp_fx.scale_loss(loss, opt) as scaled:
        assert scaled.dtype == torch.float32 and scaled.item() == pytest.approx(loss.item() * 2**16, rel=1e-3)
        scaled.backward()


@pytest.mark.parametrize("api", APIS)
def test_o1_fp16_steps_and_scales_match_gradscaler(api):
    """The README's O1 recipe in fp16 takes the steps autocast + GradScaler takes, at the same scales
    (step 0 included: with an fp16 loss its own gradient, 2**16, would overflow and skip it)."""
    model, batches = make_model(), make_batches(4)
    want = _gradscaler_run(clone(model), batches)
    assert want[0] == (True, 2.0**16)
    if api == "apex":
        gm, opt = amp_fx.initialize(model, sgd(model.parameters()), opt_level="O1", dtype=torch.float16,
                                    verbosity=0)
        scaler = amp_fx.loss_scalers()[0]
    else:
        gm, scaler = amp_fx.convert(model, "O1", dtype=torch.float16), LossScaler()
        opt = sgd(gm.parameters())
    got = []
    for x, y in batches:
        opt.zero_grad()
        loss = F.cross_entropy(gm(x), y)
        assert loss.dtype == torch.float32
        if api == "apex":
            with amp_fx.scale_loss(loss, opt) as scaled:
                assert scaled.dtype == torch.float32 and torch.isfinite(scaled)
                scaled.backward()
            stepped = opt.step() is not False
        else:
            scaled = scaler.scale(loss)
            assert scaled.dtype == torch.float32 and torch.isfinite(scaled)
            scaled.backward()
            stepped = scaler.step(opt)
            scaler.update()
        got.append((stepped, scaler.get_scale()))
    assert got == want


# ------------------------------------------------------------------ case 2
class TinyLM(nn.Module):
    """Embedding and a vocabulary-sized head: the logits are where a low-precision loss loses digits."""

    def __init__(self, vocab: int = 4000, width: int = 32):
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, width), nn.Linear(width, vocab)

    def forward(self, ids):
        return self.head(torch.tanh(self.embed(ids)))


def test_o1_loss_is_as_precise_as_under_autocast():
    """Default O1 returns fp32 logits: loss and gradients equal autocast's; cast_model_outputs=False keeps bf16."""
    model = TinyLM()
    ids = torch.randint(0, 4000, (8, 32))
    target = torch.randint(0, 4000, (8 * 32,))

    def loss_and_grads(run):
        model.zero_grad()
        loss = run()
        loss.backward()
        return loss.detach().double(), [p.grad.clone() for p in model.parameters()]

    exact, _ = loss_and_grads(lambda: F.cross_entropy(model(ids).flatten(0, 1), target))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto, auto_grads = loss_and_grads(lambda: F.cross_entropy(model(ids).flatten(0, 1), target))
    gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16)
    assert gm(ids).dtype == torch.float32
    ours, our_grads = loss_and_grads(lambda: F.cross_entropy(gm(ids).flatten(0, 1), target))
    low_gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16, cast_model_outputs=False)
    assert low_gm(ids).dtype == torch.bfloat16
    low, _ = loss_and_grads(lambda: F.cross_entropy(low_gm(ids).flatten(0, 1), target))

    assert abs(ours - auto) <= 1e-6 * abs(auto)
    for got, want in zip(our_grads, auto_grads):
        assert torch.allclose(got, want, rtol=1e-3, atol=1e-7)
    # The loss computed in bf16 is far worse than autocast's: what the fp32 default avoids.
    assert abs(low - exact) > 5 * abs(auto - exact)


# ------------------------------------------------------------- cases 3 and 4
# (api, micro-batches per step, delay_unscale): delay_unscale is scale_loss's option only.
LOOPS = [("gradscaler", 1, False), ("gradscaler", 2, False), ("apex", 1, False), ("apex", 2, False), ("apex", 2, True)]


@pytest.mark.parametrize("style", ZEROING)
@pytest.mark.parametrize("level,dtype", LEVEL_DTYPES, ids=LEVEL_IDS)
@pytest.mark.parametrize("api,micro,delay", LOOPS, ids=[f"{a}-{m}{'-delayed' if d else ''}" for a, m, d in LOOPS])
def test_gradients_follow_the_model_whatever_zeroes_them(level, dtype, style, api, micro, delay):
    """Each step uses the gradients fp32 torch uses: one loss, two accumulated blocks, or a delayed-unscale pair."""
    model, batches = make_model(), make_batches(3 * micro)
    reference = clone(model)
    ref_opt = sgd(reference.parameters())
    want = record_grads(ref_opt)
    gm, opt, scaler = setup(api, model, level, dtype)
    got = record_grads(opt)
    for step in range(3):
        chunk = batches[step * micro:(step + 1) * micro]
        zero(style, [ref_opt], [reference])
        fp32_iteration(reference, ref_opt, chunk)
        zero(style, [opt], [gm])
        assert amp_iteration(api, gm, opt, scaler, chunk, delay)
    assert_close_steps(got, want, level, dtype)
    assert_close_weights(weights(model, gm, level), dict(reference.named_parameters()), level, dtype)


# ------------------------------------------------------------------ case 5
@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("style", ZEROING)
@pytest.mark.parametrize("level,dtype", LEVEL_DTYPES, ids=LEVEL_IDS)
def test_add_param_group_with_a_converted_models_parameters(level, dtype, style, api):
    """After one step, the second converted model's parameters join the optimizer; group 0 keeps its momentum."""
    m0, m1 = make_model(0), make_model(1)
    r0, r1 = clone(m0), clone(m1)
    ref_opt = sgd(r0.parameters())
    low = None if level == "O0" else dtype
    if api == "apex":
        (g0, g1), opt = amp_fx.initialize([m0, m1], sgd(m0.parameters()), opt_level=level, dtype=low, verbosity=0)
        scaler = None
    else:
        g0, g1 = amp_fx.convert(m0, level, dtype=low), amp_fx.convert(m1, level, dtype=low)
        opt = MasterWeightOptimizer(sgd(m0.parameters()), g0) if level == "O2" else sgd(g0.parameters())
        scaler = LossScaler(dtype=dtype)
    batches = make_batches(3)

    def two_models(a, b):
        return lambda x: a(x) + b(x)

    for step, (x, y) in enumerate(batches):
        if step == 1:
            ref_opt.add_param_group({"params": list(r1.parameters()), "lr": 1.0})
            opt.add_param_group({"params": list(g1.parameters()), "lr": 1.0})
            assert len(opt.state) == len(ref_opt.state) == 6  # group 0's momentum survives
        zero(style, [ref_opt], [r0, r1])
        fp32_iteration(two_models(r0, r1), ref_opt, [(x, y)])
        zero(style, [opt], [g0, g1])
        assert amp_iteration(api, two_models(g0, g1), opt, scaler, [(x, y)])
    for (gm, model, ref) in ((g0, m0, r0), (g1, m1, r1)):
        # At O2 the second model's own parameters are its masters too: they trained, and its state_dict is them.
        assert_close_weights(weights(model, gm, level), dict(ref.named_parameters()), level, dtype)
        if level == "O2":
            assert all(torch.equal(gm.state_dict()[k], v) for k, v in model.state_dict().items())
    moved = (dict(r1.named_parameters())["0.weight"] - dict(make_model(1).named_parameters())["0.weight"]).abs().max()
    assert moved > 0.1  # the added group really trained, further than the tolerance


# ------------------------------------------------------------------ case 6
@pytest.mark.parametrize("style", ZEROING)
@pytest.mark.parametrize("level,dtype", LEVEL_DTYPES, ids=LEVEL_IDS)
def test_an_overflowing_loss_skips_every_optimizer_it_was_scaled_into(level, dtype, style):
    """Apex's three models, two losses, two optimizers; an inf in model 2 during loss 1 at iteration 0: both skip."""
    models = [make_model(i) for i in range(3)]
    refs = [clone(m) for m in models]
    ref_opts = [sgd([*refs[0].parameters(), *refs[1].parameters()]), sgd(refs[2].parameters())]
    opts = [sgd([*models[0].parameters(), *models[1].parameters()]), sgd(models[2].parameters())]
    gms, opts = amp_fx.initialize(models, opts, opt_level=level, dtype=None if level == "O0" else dtype,
                                  num_losses=2, verbosity=0)
    start = [weights(m, g, level) for m, g in zip(models, gms)]
    for step, (x, y) in enumerate(make_batches(3)):
        zero(style, opts, gms)
        with amp_fx.scale_loss(F.cross_entropy(gms[0](x) + gms[1](x), y), opts[0], loss_id=0) as s:
            s.backward()
        with amp_fx.scale_loss(F.cross_entropy(gms[2](x) + gms[1](x), y), opts, loss_id=1) as s:
            s.backward()
            if step == 0:
                next(gms[2].parameters()).grad.view(-1)[0] = float("inf")
        stepped = [opt.step() is not False for opt in opts]
        assert stepped == [step > 0, step > 0]
        if step == 0:
            for before, m, g in zip(start, models, gms):
                assert all(torch.equal(before[n], w) for n, w in weights(m, g, level).items())
            continue
        zero(style, ref_opts, refs)
        F.cross_entropy(refs[0](x) + refs[1](x), y).backward()
        F.cross_entropy(refs[2](x) + refs[1](x), y).backward()
        for opt in ref_opts:
            opt.step()
    for m, g, ref in zip(models, gms, refs):
        assert_close_weights(weights(m, g, level), dict(ref.named_parameters()), level, dtype)
