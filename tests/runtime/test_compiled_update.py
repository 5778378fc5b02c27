"""O2's compiled update (issue 41): one compiled pass reads the low gradients and writes state, master and low copy.

Through the public API: ``convert(..., "O2")`` + ``MasterWeightOptimizer(compiled_update=...)`` + ``LossScaler``,
against the chunked route (``compiled_update=False``) on the same model and data.

The bound: each step is compared from IDENTICAL states (the chunked side loads the compiled side's state_dict
before every step), so differences never compound through the model. Per element, a step is a chain of at most
~8 fp32 operations (Adam: unscale, decay, lerp, square-and-add, sqrt, divide, add eps, multiply-add); the
compiled kernel may contract a multiply and an add into one FMA (one rounding fewer) or take 1 - beta from a
double where torch's kernel takes it in float, each worth at most 1 ulp of the largest operand it touches. So
masters and state agree within ``8 * eps32 * max|operand|`` per tensor (eps32 = 2**-23): ``BOUND``. A wrong
formula (dampening, bias correction, a lost decay) moves them by a fraction of the update, far above it. The low
parameters are compared EXACTLY with ``master.to(low dtype)``, round to nearest even, bit for bit.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo import register_backend

import amp_fx
from amp_fx.errors import AmpRuntimeError, AmpValueError
from amp_fx.runtime.compiled_update import CompiledUpdateWarning

EPS32 = 2.0 ** -23
BOUND_ULPS = 8

OPTIMIZERS = {
    "sgd-plain": (torch.optim.SGD, {"lr": 0.1, "maximize": True}),
    "sgd-momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01, "dampening": 0.25}),
    "sgd-nesterov": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    "adam-amsgrad": (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.01, "amsgrad": True}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "betas": (0.8, 0.99)}),
}

STATE_TENSORS = {"sgd-plain": 0, "sgd-momentum": 6, "sgd-nesterov": 6, "adam-amsgrad": 18, "adamw": 12}

GRAPHS: list[int] = []  # graphs handed to the counting backend (one entry per compile)


@register_backend(name="amp_fx_test_counting")
def counting_backend(gm, example_inputs):
    """aot_eager that counts the graphs it is given: a recompile shows as a second entry."""
    GRAPHS.append(len(gm.graph.nodes))
    from torch._dynamo.backends.debugging import aot_eager
    return aot_eager(gm, example_inputs)


@register_backend(name="amp_fx_test_failing")
def failing_backend(gm, example_inputs):
    raise RuntimeError("no C++ compiler here (simulated)")


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))


def batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(12, 8, generator=gen), torch.randint(0, 4, (12,), generator=gen)) for _ in range(count)]


def build(name: str, compiled, dtype: torch.dtype = torch.bfloat16, module_wrap=None, own_masters: bool = False):
    """``own_masters``: the optimizer over the module's parameters with no masters given, so the fp32 LayerNorm
    parameters are their own masters (their fp32 gradients are read by the compiled pass as they are)."""
    model = make_model()
    gm = amp_fx.convert(model, "O2", dtype=dtype)
    cls, options = OPTIMIZERS[name]
    given = gm if module_wrap is None else module_wrap(gm)
    params, masters = (gm.parameters(), {}) if own_masters else (model.parameters(), None)
    mw = amp_fx.MasterWeightOptimizer(cls(params, **options), given, masters=masters, compiled_update=compiled)
    scaler = amp_fx.LossScaler(**({"init_scale": 2.0 ** 10} if dtype == torch.float16 else {}), dtype=dtype)
    return gm, mw, scaler


def one_step(gm, mw, scaler, x, y, edit=None) -> bool:
    mw.zero_grad()
    scaler.scale(F.cross_entropy(gm(x), y)).backward()
    if edit is not None:
        edit(gm)
    taken = scaler.step(mw)
    scaler.update()
    return taken


def state_tensors(mw) -> list[torch.Tensor]:
    state = mw.state_dict()["optimizer"]["state"]
    return [state[i][k] for i in sorted(state) for k in sorted(state[i]) if k != "step"]


def assert_low_copies_exact(gm, mw) -> None:
    """Every low parameter is its master rounded to the low dtype, bit for bit."""
    pairs = list(zip(mw.module_parameters(), mw.master_parameters()))
    assert len([p for p, _ in pairs if p.dtype != torch.float32]) == 4  # the Linear layers' weights and biases
    for p, m in pairs:  # (the LayerNorm's fp32 parameters: an exact copy of theirs)
        assert torch.equal(p.detach(), m.detach().to(p.dtype))


def assert_close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b) > 0
    for u, v in zip(a, b):
        bound = BOUND_ULPS * EPS32 * max(u.abs().max().item(), v.abs().max().item(), 1e-30)
        assert (u - v).abs().max().item() <= bound, ((u - v).abs().max().item(), bound)


def compare_with_chunked(name: str, steps: int = 4, dtype=torch.bfloat16, edit=None, scheduler=None,
                         compiled="aot_eager", own_masters: bool = False) -> tuple:
    """Step the compiled side; before each step the chunked side loads its state: agree within the bound each step."""
    data = batches(steps)
    gm, mw, scaler = build(name, compiled, dtype, own_masters=own_masters)
    ref_gm, ref_mw, ref_scaler = build(name, False, dtype, own_masters=own_masters)
    sched = scheduler(mw) if scheduler else None
    routes = []
    for i, (x, y) in enumerate(data):
        ref_mw.load_state_dict(copy.deepcopy(mw.state_dict()))
        ref_scaler.load_state_dict(scaler.state_dict())
        before = [m.detach().clone() for m in mw.master_parameters()]
        taken = one_step(gm, mw, scaler, x, y, edit and (lambda g: edit(g, i)))
        assert one_step(ref_gm, ref_mw, ref_scaler, x, y, edit and (lambda g: edit(g, i))) is taken
        routes.append(mw.last_step_route if taken else "skipped")
        assert ref_mw.last_step_route == "chunked" or not taken
        assert_close([m.detach() for m in mw.master_parameters()], [m.detach() for m in ref_mw.master_parameters()])
        assert len(state_tensors(mw)) == STATE_TENSORS[name]  # 6 parameters x the optimizer's state tensors
        if STATE_TENSORS[name]:
            assert_close(state_tensors(mw), state_tensors(ref_mw))
        assert_low_copies_exact(gm, mw)
        if taken:  # the step moved the masters (no comparison of two untouched models)
            assert not torch.equal(before[0], next(mw.master_parameters()))
        if sched is not None:
            sched.step()
    return gm, mw, routes


FIRST = "chunked (not compiled: "


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_compiled_update_agrees_with_the_chunked_route(name):
    """SGD (maximize; momentum with dampening and decay; nesterov) and Adam (amsgrad, L2 decay), AdamW: the first
    step makes the state on the chunked route, the next ones run compiled; fp32 LayerNorm masters step too."""
    _, mw, routes = compare_with_chunked(name)
    assert routes[0].startswith(FIRST) == name.startswith(("sgd-m", "sgd-n", "adam"))
    assert routes[1:] == ["compiled"] * 3
    norm = [p for p in mw.module_parameters() if p.dtype == torch.float32]
    assert len(norm) == 2  # the LayerNorm's: fp32 gradients read beside the bf16 ones


def test_skipped_step_changes_nothing_and_fp16_unscale_is_folded_in():
    """fp16 with a scale of 2**10: the unscale is multiplied in by the compiled pass (the masters hold no gradient:
    none was copied) and agrees with the chunked route; a NaN step is skipped with nothing changed."""
    def poison(gm, i):
        if i == 2:
            gm.get_submodule("0").weight.grad.view(-1)[3] = float("nan")
    gm, mw, routes = compare_with_chunked("adamw", steps=4, dtype=torch.float16, edit=poison)
    assert routes[1:] == ["compiled", "skipped", "compiled"]
    assert all(m.grad is None for m in mw.master_parameters())
    # the skipped step: compare with a copy taken before it
    data = batches(1)
    snapshot = copy.deepcopy(mw.state_dict())
    assert not one_step(gm, mw, amp_fx.LossScaler(init_scale=2.0 ** 10, dtype=torch.float16), *data[0],
                        edit=lambda g: g.get_submodule("3").weight.grad.view(-1).__setitem__(0, float("inf")))
    after = mw.state_dict()
    for name, master in snapshot["masters"].items():
        assert torch.equal(master, after["masters"][name])
    assert len(state_tensors(mw)) == 12  # 6 parameters x (exp_avg, exp_avg_sq)


def test_fp32_parameters_that_are_their_own_masters_fp16():
    """The LayerNorm's fp32 parameters as their own masters: under fp16 their fp32 gradients were only checked
    (the unscale left to the step) and the compiled pass unscales them with the low ones, as the chunked route."""
    gm, mw, routes = compare_with_chunked("adam-amsgrad", steps=3, dtype=torch.float16, own_masters=True)
    assert routes[1:] == ["compiled"] * 2
    own = [p for p, m in zip(mw.module_parameters(), mw.master_parameters()) if p is m]
    assert len(own) == 2 and all(p.dtype == torch.float32 for p in own)


def test_lr_scheduler_takes_effect_without_recompiling():
    """lr changes every step (a scheduler): the graph is compiled once, and each step agrees with the chunked route
    run at the same lr (the scheduler's lr reaches the compiled pass)."""
    GRAPHS.clear()
    lrs = []

    def scheduler(mw):
        return torch.optim.lr_scheduler.LambdaLR(mw, lambda step: lrs.append(step) or 1.0 / (1 + step))
    _, mw, routes = compare_with_chunked("sgd-momentum", steps=5, scheduler=scheduler,
                                         compiled="amp_fx_test_counting")
    assert routes[1:] == ["compiled"] * 4 and mw.param_groups[0]["lr"] == pytest.approx(0.1 / 6)
    assert len(GRAPHS) == 1


def test_state_dict_resumes_bit_for_bit():
    """Two compiled steps, a checkpoint, a fresh model and wrapper loading it, two more: the same bits as
    four uninterrupted steps (same compiled kernel on both sides)."""
    data = batches(4)
    gm, mw, scaler = build("adamw", "aot_eager")
    for x, y in data:
        one_step(gm, mw, scaler, x, y)
    gm2, mw2, scaler2 = build("adamw", "aot_eager")
    for x, y in data[:2]:
        one_step(gm2, mw2, scaler2, x, y)
    saved = copy.deepcopy(mw2.state_dict())
    gm3, mw3, scaler3 = build("adamw", "aot_eager")
    mw3.load_state_dict(saved)
    for x, y in data[2:]:
        one_step(gm3, mw3, scaler3, x, y)
    assert mw3.last_step_route == "compiled"
    for a, b in zip([*gm.parameters(), *mw.master_parameters(), *state_tensors(mw)],
                    [*gm3.parameters(), *mw3.master_parameters(), *state_tensors(mw3)]):
        assert torch.equal(a, b)


def test_unscale_and_clip_before_the_step_reach_the_compiled_update():
    """fp16: ``scaler.unscale_`` then a clip of the module's low gradients (the masters' gradients are copied and
    unscaled there, and the clip is carried over to them): the compiled pass steps on those, as the chunked route
    does from the same state."""
    gm, mw, scaler = build("sgd-momentum", "aot_eager", torch.float16)
    ref_gm, ref_mw, ref_scaler = build("sgd-momentum", False, torch.float16)
    for x, y in batches(3):
        ref_mw.load_state_dict(copy.deepcopy(mw.state_dict()))
        ref_scaler.load_state_dict(scaler.state_dict())
        for g, opt, sc in ((gm, mw, scaler), (ref_gm, ref_mw, ref_scaler)):
            opt.zero_grad()
            sc.scale(F.cross_entropy(g(x), y)).backward()
            sc.unscale_(opt)
            assert torch.nn.utils.clip_grad_norm_(g.parameters(), 0.05) > 0.1  # (the clip engages)
            sc.step(opt)
            sc.update()
        assert_close([m.detach() for m in mw.master_parameters()], [m.detach() for m in ref_mw.master_parameters()])
        assert_close(state_tensors(mw), state_tensors(ref_mw))
        assert_low_copies_exact(gm, mw)
    assert mw.last_step_route == "compiled" and ref_mw.last_step_route == "chunked"


def test_parameter_without_a_gradient_is_not_stepped():
    """A parameter whose gradient is None at step 3 keeps its master, momentum and low copy (as torch skips it);
    the others step compiled, and everything agrees with the chunked route."""
    kept = {}

    def drop(gm, i):
        if i == 2:
            gm.get_submodule("3").bias.grad = None
            kept["bias"] = gm.get_submodule("3").bias.detach().clone()
    gm, mw, routes = compare_with_chunked("sgd-momentum", steps=3, edit=drop)
    assert routes[1:] == ["compiled", "compiled"]
    assert torch.equal(gm.get_submodule("3").bias.detach(), kept["bias"])


def test_add_param_group_after_compiling():
    """A group added after compiled steps: its first step makes its momentum on the chunked route, then every group
    steps compiled (a new graph for the new group), agreeing with the chunked route throughout."""
    data = batches(5)
    runs = []
    for compiled in ("aot_eager", False):
        model = make_model()
        gm = amp_fx.convert(model, "O2", dtype=torch.bfloat16)
        mw = amp_fx.MasterWeightOptimizer(torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9), gm,
                                          compiled_update=compiled)
        scaler = amp_fx.LossScaler(dtype=torch.bfloat16)
        later = [p for layer in ("2", "3") for p in gm.get_submodule(layer).parameters()]
        for p in later:
            p.requires_grad_(False)  # (trained from step 3 on)
        routes = []
        for i, (x, y) in enumerate(data):
            if i == 2:
                for p in later:
                    p.requires_grad_(True)
                mw.add_param_group({"params": later, "lr": 0.05})
            mw.zero_grad()
            scaler.scale(F.cross_entropy(gm(x), y)).backward()
            scaler.step(mw)
            scaler.update()
            routes.append(mw.last_step_route)
        runs.append((gm, mw, routes))
    (gm, mw, routes), (ref_gm, ref_mw, _) = runs
    assert routes[1] == "compiled" and routes[2].startswith(FIRST) and routes[3:] == ["compiled"] * 2
    assert len(mw.param_groups) == 2
    assert_low_copies_exact(gm, mw)
    # four steps on diverging bf16 trajectories: a looser bound (the low copies may round apart once)
    for u, v in zip(mw.master_parameters(), ref_mw.master_parameters()):
        assert (u - v).abs().max().item() <= 1e-2 * max(v.abs().max().item(), 1e-3)


def test_refusals_and_defaults():
    """True/str refuse what cannot be compiled, naming why and the fix; None is off over a module not compiled."""
    model = make_model()
    gm = amp_fx.convert(model, "O2", dtype=torch.bfloat16)
    with pytest.raises(AmpValueError, match=r"compiled_update=True.*fp32_grad_accumulation.*compiled_update=False"):
        amp_fx.MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), gm, compiled_update=True,
                                     fp32_grad_accumulation=True)
    with pytest.raises(AmpValueError, match=r"RMSprop is not exactly SGD, Adam or AdamW.*compiled_update=False"):
        amp_fx.MasterWeightOptimizer(torch.optim.RMSprop(model.parameters(), lr=0.1), gm, compiled_update="aot_eager")
    with pytest.raises(AmpValueError, match="compiled_update must be"):
        amp_fx.MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), gm, compiled_update=1)
    gm, mw, scaler = build("sgd-momentum", None)
    for x, y in batches(2):
        one_step(gm, mw, scaler, x, y)
    assert mw.last_step_route == "chunked"
    # a step hook of the user's added later: the step takes the plain route and says why it was not compiled
    gm, mw, scaler = build("sgd-momentum", "aot_eager")
    mw.register_step_pre_hook(lambda *args: None)
    one_step(gm, mw, scaler, *batches(1)[0])
    assert mw.last_step_route.endswith("(not compiled: a step hook is registered on the MasterWeightOptimizer)")


def test_compile_failure_warns_under_none_and_raises_when_asked():
    gm, mw, scaler = build("sgd-momentum", "amp_fx_test_failing")
    data = batches(3)
    one_step(gm, mw, scaler, *data[0])
    with pytest.raises(AmpRuntimeError, match=r"amp_fx_test_failing.*failed to compile.*compiled_update=False"):
        one_step(gm, mw, scaler, *data[1])
    # None over a compiled module: on; the compile failing (simulated: a backend that raises) warns once, then chunked
    gm, mw, scaler = build("sgd-momentum", None, module_wrap=lambda m: torch.compile(m, backend="aot_eager"))
    mw._compiled.backend = "amp_fx_test_failing"  # (stands in for inductor without a C++ compiler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in data:
            one_step(gm, mw, scaler, x, y)
    assert [w.category for w in caught if issubclass(w.category, CompiledUpdateWarning)] == [CompiledUpdateWarning]
    assert mw.last_step_route.startswith("chunked (not compiled: the compiled update failed to compile")
    assert_low_copies_exact(gm, mw)


def test_inductor_default_over_a_compiled_module():
    """The one inductor test: ``compiled_update=None`` over ``torch.compile(gm)`` compiles the update with inductor;
    its low copies are the masters rounded to nearest even exactly, and it agrees with the chunked route."""
    data = batches(3)
    gm, mw, scaler = build("adamw", None, module_wrap=lambda m: torch.compile(m, backend="aot_eager"))
    ref_gm, ref_mw, ref_scaler = build("adamw", False)
    for x, y in data:
        ref_mw.load_state_dict(copy.deepcopy(mw.state_dict()))
        one_step(gm, mw, scaler, x, y)
        one_step(ref_gm, ref_mw, ref_scaler, x, y)
        assert_close([m.detach() for m in mw.master_parameters()], [m.detach() for m in ref_mw.master_parameters()])
        assert_close(state_tensors(mw), state_tensors(ref_mw))
        assert_low_copies_exact(gm, mw)
    assert mw.last_step_route == "compiled" and mw._compiled.backend == "inductor"


def test_torch_compile_around_the_step_steps_as_uncompiled():
    """torch's compiled-optimizer recipe, ``torch.compile(lambda: mw.step())``: Dynamo runs the wrapper's step
    eagerly (tracing the chunked route's in-place fused kernels over the masters failed to functionalize), so the
    chunked route steps bit for bit as without the compile (same kernels), and with ``compiled_update`` on the
    update's own graph still compiles and runs inside it."""
    data = batches(3)
    runs = {}
    for around, compiled in ((False, False), (True, False), (True, "aot_eager")):
        model = make_model()
        gm = amp_fx.convert(model, "O2", dtype=torch.bfloat16)
        mw = amp_fx.MasterWeightOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), gm,
                                          compiled_update=compiled)
        step = torch.compile(lambda: mw.step(), backend="aot_eager") if around else mw.step
        routes = []
        for x, y in data:
            mw.zero_grad()
            F.cross_entropy(gm(x), y).backward()
            step()
            routes.append(mw.last_step_route)
        assert_low_copies_exact(gm, mw)
        runs[around, compiled] = (gm, mw, routes)
    (gm, mw, routes), (cgm, cmw, croutes) = runs[False, False], runs[True, False]
    assert routes == croutes == ["chunked"] * 3
    tensors = [*gm.parameters(), *mw.master_parameters(), *state_tensors(mw)]
    compiled_tensors = [*cgm.parameters(), *cmw.master_parameters(), *state_tensors(cmw)]
    assert len(tensors) == len(compiled_tensors) == 6 + 6 + 12
    for a, b in zip(tensors, compiled_tensors):
        assert torch.equal(a, b)
    assert runs[True, "aot_eager"][2][1:] == ["compiled"] * 2  # (its numerics: the tests above)


@pytest.mark.parametrize("value, match", [
    ("aot_eagr", r"compiled_update='aot_eagr' is not a torch.compile backend.*Did you mean 'aot_eager'"),
    ("True", r"compiled_update='True' is not a torch.compile backend.*compiled_update=True, not the string 'True'"),
])
def test_unknown_backend_is_refused_at_construction(value, match):
    """A misspelt backend (or a bool passed as a string) is refused when the wrapper is built, naming the close
    matches, not at the second step where the update first compiles."""
    model = make_model()
    gm = amp_fx.convert(model, "O2", dtype=torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(AmpValueError, match=match):
        amp_fx.MasterWeightOptimizer(opt, gm, compiled_update=value)
