"""torch.compile'd modules train through the runtime, and common mistakes are refused or warned about (issue 13, cases 7-8)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_fx
from amp_fx.runtime import LossScaleCollapseError, LossScaler, MasterWeightOptimizer
from semantics_harness import make_batches, make_model, sgd


def _train(gm, opt, scaler, steps=3):
    for x, y in make_batches(steps):
        opt.zero_grad()
        scaler.scale(F.cross_entropy(gm(x), y)).backward()
        scaler.step(opt)
        scaler.update()


def _masters(opt):
    return [m.detach().clone() for m in opt.master_parameters()]


# ------------------------------------------------------------------ case 7
def test_master_weight_optimizer_takes_a_compiled_o2_module():
    """The README's torch.compile(convert(model, "O2")) trains, bit for bit as the uncompiled module (with the
    compiled update off: on, which is the default over a compiled module, it agrees within a few ulp per step,
    tests/runtime/test_compiled_update.py)."""
    plain_model, compiled_model = make_model(), make_model()
    plain = amp_fx.convert(plain_model, "O2", dtype=torch.bfloat16)
    compiled = torch.compile(amp_fx.convert(compiled_model, "O2", dtype=torch.bfloat16), backend="eager")
    opt_plain = MasterWeightOptimizer(sgd(plain_model.parameters()), plain)
    opt_compiled = MasterWeightOptimizer(sgd(compiled_model.parameters()), compiled, compiled_update=False)
    _train(plain, opt_plain, LossScaler(dtype="bf16"))
    _train(compiled, opt_compiled, LossScaler(dtype="bf16"))
    assert all(torch.equal(a, b) for a, b in zip(_masters(opt_plain), _masters(opt_compiled)))
    assert not torch.equal(_masters(opt_plain)[0], make_model().state_dict()["0.weight"])


def test_initialize_takes_a_compiled_model_and_returns_it_compiled():
    model, reference = make_model(), make_model()
    # compiled_update=False: a compiled model turns the compiled update on (a few ulp from the chunked route, tested in
    # tests/apex/test_initialize_options.py); off, both sides step the same kernels, bit for bit.
    gm, opt = amp_fx.initialize(torch.compile(model, backend="eager"), sgd(model.parameters()), opt_level="O2",
                                dtype=torch.float16, verbosity=0, compiled_update=False)
    ref_gm, ref_opt = amp_fx.initialize(reference, sgd(reference.parameters()), opt_level="O2",
                                        dtype=torch.float16, verbosity=0)
    assert type(gm).__name__ == "OptimizedModule" and gm._orig_mod.amp_config.level == "O2"
    for module, optimizer in ((gm, opt), (ref_gm, ref_opt)):
        for x, y in make_batches(3):
            optimizer.zero_grad()
            with amp_fx.scale_loss(F.cross_entropy(module(x), y), optimizer) as scaled:
                scaled.backward()
            optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


def test_loss_scaler_diagnoses_a_collapse_reproduced_with_a_compiled_module():
    class BigBackward(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(16, 16), nn.Linear(16, 4)
            with torch.no_grad():
                self.fc2.weight.mul_(2000.0)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))

    gm = amp_fx.convert(BigBackward(), "O1", dtype=torch.float16)
    compiled, x = torch.compile(gm, backend="eager"), torch.randn(4, 16) * 30
    scaler = LossScaler(init_scale=2048.0, min_scale=1024.0, dtype="fp16", on_collapse="diagnose",
                        reproduce=lambda: (compiled, (x,)))
    opt = torch.optim.SGD(compiled.parameters(), lr=0.0)
    with pytest.raises(LossScaleCollapseError) as info:
        for _ in range(10):
            opt.zero_grad()
            scaler.scale(compiled(x).pow(2).sum()).backward()
            scaler.step(opt)
            scaler.update()
    assert info.value.diagnosis is not None and "fc2" in str(info.value)


# ------------------------------------------------------------------ case 8
def test_master_weight_optimizer_refuses_modules_that_need_no_masters():
    model = make_model()
    with pytest.raises(ValueError, match="converted at O1.*plain optimizer"):
        MasterWeightOptimizer(sgd(model.parameters()), amp_fx.convert(model, "O1"))
    with pytest.raises(ValueError, match="no float16/bfloat16 parameters.*amp_fx.convert\\(model, 'O2'\\)"):
        MasterWeightOptimizer(sgd(model.parameters()), model)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_an_optimizer_over_the_original_parameters_of_an_o2_module_is_named(dtype):
    """At O2 the module trains copies: stepping the originals with a plain optimizer would train nothing."""
    model = make_model()
    gm = amp_fx.convert(model, "O2", dtype=dtype)
    opt, scaler = sgd(model.parameters()), LossScaler(dtype=dtype)
    x, y = make_batches(1)[0]
    if dtype == torch.float16:  # scaling: GradScaler raises here too; ours names the fix
        scaler.scale(F.cross_entropy(gm(x), y)).backward()
        with pytest.raises(RuntimeError, match="MasterWeightOptimizer\\(optimizer, converted\\)"):
            scaler.step(opt)
        return
    # bf16 (no scaling): the step guard refuses the step (the gradients went to gm's copies, the masters have none)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(amp_fx.AmpRuntimeError, match="amp_fx.MasterWeightOptimizer\\(opt, gm\\)"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the scaler's own warning about the same misuse may come first
        _train(gm, opt, scaler, steps=1)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


@pytest.mark.parametrize("name,dtype", [("fp16", torch.float16), ("half", torch.float16), ("float16", torch.float16),
                                        ("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16),
                                        ("fp32", torch.float32)])
def test_loss_scaler_takes_the_dtype_names_convert_takes(name, dtype):
    by_name, by_dtype = LossScaler(dtype=name), LossScaler(dtype=dtype)
    assert by_name._dtype == dtype and by_name.is_enabled() == by_dtype.is_enabled()
    assert by_name.get_scale() == by_dtype.get_scale()


def test_loss_scaler_refuses_other_dtypes_naming_the_accepted_ones():
    with pytest.raises(ValueError, match="'fp16'.*'bf16'"):
        LossScaler(dtype="int8")
    with pytest.raises(ValueError, match="torch.float16"):
        LossScaler(dtype=torch.float64)


def test_o1_outputs_are_fp32_unless_asked_low():
    """O1, like O2/O3, returns fp32 floating outputs (the loss then runs in fp32, as under autocast)."""
    x = torch.randn(2, 6)
    assert amp_fx.convert(make_model(), "O1", dtype=torch.bfloat16)(x).dtype == torch.float32
    assert amp_fx.convert(make_model(), "O1", dtype=torch.bfloat16, cast_model_outputs=False)(x).dtype == torch.bfloat16
    assert amp_fx.convert(make_model(), "O1", dtype=torch.float16,
                          cast_model_outputs=torch.float16)(x).dtype == torch.float16
