"""Tests for the Apex-style API: amp_fx.initialize, amp_fx.scale_loss, amp_fx.state_dict / load_state_dict."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_fx
from probes import captured_because
from amp_fx.apex.amp import AlreadyInitializedError, loss_scalers, master_params
from amp_fx.runtime import LossScalerStateError, MasterWeightOptimizer


class Net(nn.Module):
    """Linear -> LayerNorm -> Linear: the norm stays fp32 at O2 (keep_batchnorm_fp32), goes low at O3."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


def make(seed=0, lr=0.1, opt=torch.optim.SGD):
    torch.manual_seed(seed)
    model = Net()
    return model, opt(model.parameters(), lr=lr)


def data(seed=1, n=6):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=gen), torch.randn(n, 4, generator=gen)


def loss_of(module, x, y):
    return F.mse_loss(module(x).float(), y)



# ------------------------------------------------------------- structure
def test_returns_what_it_was_given_in_the_same_structure():
    (m1, o1), (m2, o2) = make(0), make(1)
    gm = amp_fx.initialize(m1, opt_level="O1", verbosity=0)  # no optimizers: the model alone
    assert isinstance(gm, amp_fx.AmpGraphModule)
    models, opts = amp_fx.initialize([m2, make(2)[0]], [o2], opt_level="O1", verbosity=0)
    assert isinstance(models, list) and len(models) == 2 and isinstance(opts, list) and opts[0] is o2
    (m3, o3), (m4, o4) = make(3), make(4)
    models, opts = amp_fx.initialize((m3, m4), (o3, o4), opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    assert isinstance(models, tuple) and isinstance(opts, tuple)
    assert all(isinstance(o, MasterWeightOptimizer) for o in opts)


@pytest.mark.parametrize("level", ["O0", "O1"])
def test_o0_o1_leave_the_optimizer_alone(level):
    """The converted module shares the model's fp32 parameters, which the optimizer already steps."""
    model, opt = make()
    groups_before = [list(g["params"]) for g in opt.param_groups]
    gm, out = amp_fx.initialize(model, opt, opt_level=level, verbosity=0)
    assert out is opt and [list(g["params"]) for g in opt.param_groups] == groups_before
    assert all(p is dict(model.named_parameters())[n] for n, p in gm.named_parameters())


def test_o2_wraps_the_optimizer_and_the_model_params_are_the_masters():
    model, opt = make()
    originals = dict(model.named_parameters())
    gm, mw = amp_fx.initialize(model, opt, opt_level="O2", dtype=torch.float16, verbosity=0)
    assert isinstance(mw, MasterWeightOptimizer) and mw.optimizer is opt and mw.module is gm
    assert gm.fc1.weight.dtype == torch.float16 and gm.norm.weight.dtype == torch.float32
    # No third copy: the optimizer keeps stepping the model's own fp32 parameters.
    assert [id(p) for p in master_params(mw)] == [id(p) for p in originals.values()]
    assert all(p.dtype == torch.float32 for p in master_params(mw))
    x, y = data()
    with amp_fx.scale_loss(loss_of(gm, x, y), mw) as scaled:
        scaled.backward()
    mw.step()
    for name, p in gm.named_parameters():
        assert torch.equal(p, originals[name].detach().to(p.dtype)), name  # module = cast(masters)


def test_o3_points_the_optimizer_at_the_low_params_keeping_groups():
    model, _ = make()
    opt = torch.optim.SGD([{"params": list(model.fc1.parameters()), "lr": 0.5},
                           {"params": list(model.norm.parameters()) + list(model.fc2.parameters())}], lr=0.1)
    gm, out = amp_fx.initialize(model, opt, opt_level="O3", dtype=torch.bfloat16, verbosity=0)
    assert out is opt and [g["lr"] for g in opt.param_groups] == [0.5, 0.1]
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(gm.fc1.weight), id(gm.fc1.bias)]
    assert all(p.dtype == torch.bfloat16 for g in opt.param_groups for p in g["params"])
    before = model.fc1.weight.detach().clone()
    x, y = data()
    with amp_fx.scale_loss(loss_of(gm, x, y), opt) as scaled:
        scaled.backward()
    opt.step()
    assert torch.equal(model.fc1.weight, before)  # O3 trains the module's own copies
    assert not torch.equal(gm.fc1.weight, before.to(torch.bfloat16))


def test_one_optimizer_over_two_models_at_o2():
    (m1, _), (m2, _) = make(0), make(1)
    opt = torch.optim.SGD(list(m1.parameters()) + list(m2.parameters()), lr=0.1)
    ref = [copy.deepcopy(m1), copy.deepcopy(m2)]
    ref_opt = torch.optim.SGD(list(ref[0].parameters()) + list(ref[1].parameters()), lr=0.1)
    (g1, g2), mw = amp_fx.initialize([m1, m2], opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    x, y = data()
    with amp_fx.scale_loss(loss_of(g1, x, y) + loss_of(g2, x, y), mw) as scaled:
        scaled.backward()
    mw.step()
    (loss_of(ref[0], x, y) + loss_of(ref[1], x, y)).backward()
    ref_opt.step()
    for a, b in zip(list(m1.parameters()) + list(m2.parameters()), list(ref[0].parameters()) + list(ref[1].parameters())):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=0)
    assert torch.equal(g2.fc2.weight, m2.fc2.weight.detach().to(torch.bfloat16))


def test_example_inputs_reach_convert_for_models_fx_cannot_trace():
    class ShapeBranch(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 4)

        def forward(self, x):
            return self.fc(x) if x.shape[0] > 1 else self.fc(x) * 2  # fx cannot trace this; export can

    torch.manual_seed(0)
    plain, branchy = Net(), ShapeBranch()
    opt = torch.optim.SGD(list(plain.parameters()) + list(branchy.parameters()), lr=0.1)
    captured_because(ShapeBranch(), "x.shape[0] > 1")  # without example inputs: captured from the call
    (g_plain, g_branchy), _ = amp_fx.initialize([plain, branchy], opt, opt_level="O1", verbosity=0,
                                                example_inputs=[None, (torch.randn(3, 8),)])
    assert g_branchy.amp_report.route == "torch.export"
    x = torch.randn(3, 8)
    assert g_branchy(x).dtype == torch.float32  # O1 returns fp32 outputs; the linear inside runs low:
    assert "low" in {r.decision for r in g_branchy.amp_report.nodes}
    torch.testing.assert_close(g_branchy(x).float(), branchy(x), atol=3e-2, rtol=3e-2)


# ------------------------------------------------------------ properties
def test_properties_map_onto_the_conversion():
    model, opt = make()
    gm, mw = amp_fx.initialize(model, opt, opt_level="O2", cast_model_type=torch.float16,
                               keep_batchnorm_fp32="False", cast_model_outputs=torch.float16, verbosity=0)
    assert gm.fc1.weight.dtype == torch.float16 and gm.norm.weight.dtype == torch.float16
    assert gm(torch.randn(2, 8)).dtype == torch.float16
    assert isinstance(mw, MasterWeightOptimizer)
    model, opt = make()
    gm, out = amp_fx.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, master_weights=False, verbosity=0)
    assert out is opt and all(p.dtype == torch.bfloat16 for p in opt.param_groups[0]["params"] if p.dim() == 2)
    assert gm.amp_config.master_weights is False


@pytest.mark.parametrize("kwargs,scale,scaling,dynamic", [
    (dict(opt_level="O1", dtype=torch.float16), 2.0**16, True, True),
    (dict(opt_level="O1", dtype=torch.float16, max_loss_scale=2.0**10), 2.0**10, True, True),
    (dict(opt_level="O2", dtype=torch.float16, loss_scale=128.0), 128.0, True, False),
    (dict(opt_level="O2", dtype=torch.float16, loss_scale="64"), 64.0, True, False),
    (dict(opt_level="O3", dtype=torch.float16), 1.0, False, None),  # Apex O3: static 1.0
    (dict(opt_level="O2", dtype=torch.bfloat16), 1.0, False, None),  # bf16: off by itself
    (dict(opt_level="O2", dtype=torch.bfloat16, loss_scale="dynamic"), 2.0**16, True, True),  # asked for
    (dict(opt_level="O0"), 1.0, False, None),
])
def test_loss_scale_properties(kwargs, scale, scaling, dynamic):
    model, opt = make()
    gm, opt = amp_fx.initialize(model, opt, verbosity=0, **kwargs)
    (scaler,) = loss_scalers()
    assert scaler.get_scale() == scale and scaler.is_enabled() is scaling
    x, y = data()
    with amp_fx.scale_loss(loss_of(gm, x, y) * float("inf"), opt) as scaled:  # every gradient non-finite
        scaled.backward()
    assert opt.step() is False  # skipped at every level, scaling or not
    expected = scale / 2 if dynamic else scale
    assert scaler.get_scale() == expected and scaler.skipped_steps == 1


def test_min_loss_scale_bounds_the_backoff():
    model, opt = make()
    gm, opt = amp_fx.initialize(model, opt, opt_level="O1", dtype=torch.float16, min_loss_scale=2.0**15,
                                verbosity=0)
    x, y = data()
    with amp_fx.scale_loss(loss_of(gm, x, y) * float("inf"), opt) as scaled:
        scaled.backward()
    opt.step()
    assert loss_scalers()[0].get_scale() == 2.0**15
    with pytest.raises(amp_fx.runtime.LossScaleCollapseError, match="bfloat16"):
        with amp_fx.scale_loss(loss_of(gm, x, y) * float("inf"), opt) as scaled:
            scaled.backward()


def test_num_losses_gives_each_loss_its_own_scaler():
    model, opt = make()
    gm, opt = amp_fx.initialize(model, opt, opt_level="O1", dtype=torch.float16, num_losses=3, verbosity=0)
    scalers = loss_scalers()
    assert len(scalers) == 3 and len({id(s) for s in scalers}) == 3
    x, y = data()
    with amp_fx.scale_loss(loss_of(gm, x, y) * float("inf"), opt, loss_id=2) as scaled:
        scaled.backward()
    assert [s.get_scale() for s in scalers] == [2.0**16, 2.0**16, 2.0**15]
    with pytest.raises(IndexError, match="num_losses=4"):
        with amp_fx.scale_loss(loss_of(gm, x, y), opt, loss_id=3):
            pass


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(opt_level="O4"), ValueError, "O0"),
    (dict(opt_level="O1", loss_scales=2.0), TypeError, "loss_scales"),
    (dict(opt_level="O2", cast_model_type=torch.float32), ValueError, "O1"),
    (dict(opt_level="O1", cast_model_type=torch.float16), ValueError, "dtype="),
    (dict(opt_level="O2", cast_model_type=torch.float16, dtype=torch.bfloat16), ValueError, "disagree"),
    (dict(opt_level="O1", keep_batchnorm_fp32=False), ValueError, "O2 or O3"),
    (dict(opt_level="O1", loss_scale="big"), ValueError, "dynamic"),
    (dict(opt_level="O1", min_loss_scale=8.0, max_loss_scale=4.0), ValueError, "min_loss_scale"),
])
def test_bad_properties_are_refused_with_the_fix(kwargs, error, match):
    model, opt = make()
    with pytest.raises(error, match=match):
        amp_fx.initialize(model, opt, verbosity=0, **kwargs)
    assert amp_fx.initialize(model, opt, opt_level="O1", verbosity=0)  # nothing was marked as initialized


def test_verbosity_logs_the_chosen_properties(caplog):
    with caplog.at_level(logging.INFO, logger="amp_fx.apex.amp"):
        amp_fx.initialize(make()[0], opt_level="O2", dtype=torch.bfloat16)
        amp_fx.initialize(make()[0], opt_level="O1", verbosity=0)
    messages = [r.getMessage() for r in caplog.records if r.name == "amp_fx.apex.amp"]
    assert len(messages) == 1 and "opt_level=O2" in messages[0] and "master_weights=True" in messages[0]


# ------------------------------------------------------------- scale_loss
def test_block_yields_the_scaled_loss_and_leaves_unscaled_master_grads():
    model, opt = make()
    ref = copy.deepcopy(model)
    gm, mw = amp_fx.initialize(model, opt, opt_level="O2", dtype=torch.float16, verbosity=0)
    x, y = data()
    loss = loss_of(gm, x, y)
    with amp_fx.scale_loss(loss, mw) as scaled:
        assert scaled.item() == loss.item() * 2.0**16
        scaled.backward()
        assert gm.fc1.weight.grad.abs().max() > 100  # still scaled inside the block
    loss_of(ref, x, y).backward()
    for (name, master), r in zip(model.named_parameters(), ref.parameters()):
        assert master.grad.dtype == torch.float32
        torch.testing.assert_close(master.grad, r.grad, atol=2e-3, rtol=2e-2, msg=name)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_overflow_skips_only_the_next_step(level):
    model, opt = make(opt=torch.optim.Adam, lr=1e-2)
    gm, opt = amp_fx.initialize(model, opt, opt_level=level, dtype=torch.float16, verbosity=0)
    x, y = data()
    with amp_fx.scale_loss(loss_of(gm, x, y), opt) as scaled:  # one clean step: Adam has state
        scaled.backward()
    opt.step()
    opt.zero_grad()
    tensors = lambda: [("module." + n, p) for n, p in gm.named_parameters()] + list(model.named_parameters())
    weights = {n: p.detach().clone() for n, p in tensors()}
    state = copy.deepcopy(opt.state_dict())
    with amp_fx.scale_loss(loss_of(gm, x, y), opt) as scaled:
        scaled.backward()
        gm.fc2.weight.grad[0, 0] = float("nan")
    assert opt.step() is False
    for n, p in tensors():  # module params and (O2) masters untouched
        assert torch.equal(p, weights[n]), n
    after = opt.state_dict()
    inner = (lambda s: s["optimizer"]) if level == "O2" else (lambda s: s)
    for key, value in inner(state)["state"].items():
        assert all(torch.equal(value[k], inner(after)["state"][key][k]) for k in value)
    assert loss_scalers()[0].get_scale() == 2.0**15
    opt.zero_grad()
    with amp_fx.scale_loss(loss_of(gm, x, y), opt) as scaled:
        scaled.backward()
    assert opt.step() is not False
    assert not torch.equal(gm.fc2.weight, weights["module.fc2.weight"])


def test_skip_puts_an_lr_schedulers_step_wrapper_back():
    model, opt = make()
    gm, opt = amp_fx.initialize(model, opt, opt_level="O1", dtype=torch.float16, verbosity=0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    wrapped_step = opt.__dict__.get("step")
    x, y = data()
    with amp_fx.scale_loss(loss_of(gm, x, y) * float("inf"), opt) as scaled:
        scaled.backward()
    assert opt.step() is False
    assert opt.__dict__.get("step") is wrapped_step
    opt.zero_grad()
    with amp_fx.scale_loss(loss_of(gm, x, y), opt) as scaled:
        scaled.backward()
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.05


def test_two_losses_on_one_optimizer_are_each_unscaled_by_their_own_scale():
    """Gradients of the first loss are set aside while the second back-propagates, then added back
    after the second is unscaled by *its* scale: the sum equals fp32's, whatever the two scales."""
    model, opt = make()
    ref = copy.deepcopy(model)
    gm, mw = amp_fx.initialize(model, opt, opt_level="O2", dtype=torch.float16, num_losses=2, verbosity=0)
    loss_scalers()[1].update(new_scale=2.0**9)
    (x, y), (x2, y2) = data(1), data(2)
    with amp_fx.scale_loss(loss_of(gm, x, y), mw, loss_id=0) as scaled:
        scaled.backward()
    with amp_fx.scale_loss(loss_of(gm, x2, y2), mw, loss_id=1) as scaled:
        scaled.backward()
    (loss_of(ref, x, y) + loss_of(ref, x2, y2)).backward()
    for master, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(master.grad, r.grad, atol=2e-3, rtol=2e-2)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_optimizers_a_loss_does_not_reach_keep_their_gradients(level):
    """Each block names both optimizers, but each loss reaches one model only."""
    (m0, o0), (m1, o1) = make(0), make(1)
    refs = [copy.deepcopy(m0), copy.deepcopy(m1)]
    initial = [copy.deepcopy(m0), copy.deepcopy(m1)]
    ref_opts = [torch.optim.SGD(r.parameters(), lr=0.1) for r in refs]
    (g0, g1), opts = amp_fx.initialize([m0, m1], [o0, o1], opt_level=level, dtype=torch.float16, num_losses=2,
                                       verbosity=0)
    x, y = data()
    for loss_id, gm in enumerate((g0, g1)):
        with amp_fx.scale_loss(loss_of(gm, x, y), opts, loss_id=loss_id) as scaled:
            scaled.backward()
    for opt in opts:
        assert opt.step() is not False
    for ref, opt in zip(refs, ref_opts):
        loss_of(ref, x, y).backward()
        opt.step()
    for model, ref, start in zip((m0, m1), refs, initial):
        for a, b, c in zip(model.parameters(), ref.parameters(), start.parameters()):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
            assert (a - c).abs().max() > 2e-3  # every parameter was stepped with its gradient


def test_an_error_inside_the_block_gives_back_the_earlier_gradients():
    model, opt = make()
    gm, mw = amp_fx.initialize(model, opt, opt_level="O2", dtype=torch.float16, verbosity=0)
    x, y = data()
    with amp_fx.scale_loss(loss_of(gm, x, y), mw) as scaled:
        scaled.backward()
    grads = [p.grad.clone() for p in master_params(mw)]
    with pytest.raises(ZeroDivisionError):
        with amp_fx.scale_loss(loss_of(gm, x, y), mw):
            1 / 0
    assert all(torch.equal(p.grad, g) for p, g in zip(master_params(mw), grads))
    before = [p.detach().clone() for p in master_params(mw)]
    mw.step()  # steps with the restored gradients
    assert all(torch.equal(p, b.add(g, alpha=-0.1)) for p, b, g in zip(master_params(mw), before, grads))


def test_scale_loss_refuses_what_initialize_did_not_return():
    model, opt = make()
    gm, _ = amp_fx.initialize(model, opt, opt_level="O1", verbosity=0)
    other = torch.optim.SGD(gm.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="did not return"):
        with amp_fx.scale_loss(loss_of(gm, *data()), other):
            pass


def test_block_without_gradients_is_an_error():
    (m1, o1), (m2, o2) = make(0), make(1)
    (g1, g2), (o1, o2) = amp_fx.initialize([m1, m2], [o1, o2], opt_level="O1", verbosity=0)
    with pytest.raises(RuntimeError, match="no gradient"):
        with amp_fx.scale_loss(loss_of(g1, *data()), o2) as scaled:
            scaled.backward()


# ---------------------------------------------------------------- errors
def test_initialize_twice_is_an_error():
    model, opt = make()
    gm, out = amp_fx.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    for args in ((model, torch.optim.SGD(model.parameters(), lr=0.1)), (gm,), (make()[0], out), (make()[0], opt)):
        with pytest.raises(AlreadyInitializedError, match="once"):
            amp_fx.initialize(*args, opt_level="O2", verbosity=0)


def test_models_wrapped_in_data_parallel_or_ddp_are_refused():
    import torch.distributed as dist

    model, opt = make()
    with pytest.raises(AlreadyInitializedError, match="DataParallel"):
        amp_fx.initialize(nn.DataParallel(model), opt, opt_level="O1", verbosity=0)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(model)
        with pytest.raises(AlreadyInitializedError, match="wrap what it returns"):
            amp_fx.initialize(ddp, opt, opt_level="O1", verbosity=0)
    finally:
        dist.destroy_process_group()


def test_optimizer_that_does_not_own_the_model_params_is_refused():
    model, _ = make()
    foreign = torch.optim.SGD(Net().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="does not own"):
        amp_fx.initialize(model, foreign, opt_level="O2", verbosity=0)
    gm, _ = amp_fx.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    assert gm is not None  # the refused call converted and marked nothing


# ----------------------------------------------------------- checkpoints
def test_scaler_states_round_trip_and_mismatches_are_refused():
    model, opt = make()
    gm, opt = amp_fx.initialize(model, opt, opt_level="O2", dtype=torch.float16, num_losses=2, verbosity=0)
    x, y = data()
    with amp_fx.scale_loss(loss_of(gm, x, y) * float("inf"), opt, loss_id=1) as scaled:
        scaled.backward()
    state = amp_fx.state_dict()
    assert list(state) == ["loss_scaler0", "loss_scaler1"]
    assert state["loss_scaler1"]["scale"] == 2.0**15 and state["loss_scaler1"]["skipped_steps"] == 1

    model2, opt2 = make()
    amp_fx.initialize(model2, opt2, opt_level="O2", dtype=torch.float16, num_losses=2, verbosity=0)
    amp_fx.load_state_dict(state)
    assert [s.get_scale() for s in loss_scalers()] == [2.0**16, 2.0**15]
    assert loss_scalers()[1].skipped_steps == 1

    amp_fx.initialize(make()[0], opt_level="O2", dtype=torch.float16, verbosity=0)
    with pytest.raises(ValueError, match="num_losses=2"):
        amp_fx.load_state_dict(state)
    amp_fx.initialize(make()[0], opt_level="O1", dtype=torch.float16, num_losses=2, verbosity=0)
    with pytest.raises(LossScalerStateError, match="level"):
        amp_fx.load_state_dict(state)


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_converted_state_dict_holds_fp32_and_loads_fp32(level):
    """Checkpoints move between the fp32 model and its O2/O3 forms."""
    model, opt = make()
    fp32_state = copy.deepcopy(model.state_dict())
    gm, opt = amp_fx.initialize(model, opt, opt_level=level, dtype=torch.bfloat16, verbosity=0)
    state = gm.state_dict()
    assert list(state) == list(fp32_state) and all(v.dtype == torch.float32 for v in state.values())
    assert gm.fc1.weight.dtype == torch.bfloat16  # the module itself stays low
    for k in state:  # O2: the fp32 masters themselves; O3 (no masters): the low weights widened
        want = fp32_state[k] if level == "O2" else fp32_state[k].to(gm.get_parameter(k).dtype).float()
        assert torch.equal(state[k], want)

    other = Net()  # an fp32 model loads the converted module's checkpoint ...
    other.load_state_dict(state)
    with torch.no_grad():  # ... and the converted module loads an fp32 one, cast on the way in
        for p in other.parameters():
            p.add_(1.0)
    gm.load_state_dict(other.state_dict())
    assert gm.fc1.weight.dtype == torch.bfloat16
    assert torch.equal(gm.fc1.weight, other.fc1.weight.detach().to(torch.bfloat16))
