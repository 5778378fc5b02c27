"""O2's step in bulk (issue 14): per (device, dtype) group one grad copy, the step, one copy back; one fused check.

1. After each step the masters, the optimizer state and the module's low weights equal those of a plain fp32
   torch optimizer (same options) stepped on the same gradients: bitwise (the math is the same).
2. Where the inner optimizer leaves foreach/fused unset, Adam/AdamW/SGD step fused on CPU; an explicit
   choice is kept, also through add_param_group and load_state_dict.
3. A skipped step (inf/NaN gradient) leaves parameters, masters and optimizer state untouched.
4. A parameter without a gradient is not touched: no weight decay, no momentum step, no state.
5. On the plain route each direction is one ``torch._foreach_copy_`` per dtype group, also after add_param_group;
   under a scaler the way in is one copy per gradient, each checked right after its copy (the chunked route's
   calls: tests/runtime/test_chunked_step.py).
6. The inf/NaN check is one fused kernel call per (device, dtype), finds inf and NaN in bf16 and fp16 gradients,
   unscales as GradScaler's kernel does, and is read once per step; without the kernel a foreach fallback agrees.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_fx

LOW_DTYPES = [torch.float16, torch.bfloat16]
OPTIMIZERS = {
    "sgd-momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    "adam": (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
}


def make_model(seed: int = 0) -> nn.Module:
    """Linear-GELU-LayerNorm twice and a head: low Linears and fp32 LayerNorms at O2 (two dtype groups)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16),
                         nn.Linear(16, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))


def make_batches(count: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(12, 8, generator=gen), torch.randint(0, 4, (12,), generator=gen)) for _ in range(count)]


def o2(name: str, dtype: torch.dtype, seed: int = 0, **opt_kw):
    """(fp32 model, its O2 conversion, MasterWeightOptimizer, LossScaler), built as in the README's Training section."""
    model = make_model(seed)
    gm = amp_fx.convert(model, "O2", dtype=dtype)
    cls, kw = OPTIMIZERS[name]
    mw = amp_fx.MasterWeightOptimizer(cls(model.parameters(), **kw, **opt_kw), gm)
    # fp16 scales by 2**8 (a power of two: unscaling is exact, so the reference sees the same grads).
    scaler = amp_fx.LossScaler(**({"init_scale": 2.0**8} if dtype == torch.float16 else {}), dtype=dtype)
    return model, gm, mw, scaler


def backward(gm: nn.Module, scaler, x: torch.Tensor, y: torch.Tensor) -> None:
    scaler.scale(F.cross_entropy(gm(x), y)).backward()


def reference_for(mw) -> torch.optim.Optimizer:
    """A plain fp32 torch optimizer over copies of the masters, with exactly the wrapped optimizer's group options."""
    inner = mw.optimizer
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": [nn.Parameter(m.detach().clone()) for m in g["params"]]} for g in inner.param_groups]
    return type(inner)(groups)


def snapshot(mw):
    """(module parameters, masters, optimizer state), copied; the lists in the optimizer's order."""
    return copy.deepcopy(([p.detach() for p in mw.module_parameters()], [m.detach() for m in mw.master_parameters()],
                          mw.state_dict()["optimizer"]["state"]))


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for i in a:
        assert a[i].keys() == b[i].keys()
        for key in a[i]:
            assert torch.equal(a[i][key], b[i][key]), (i, key)


# ------------------------------------------------------------------ 1
@pytest.mark.parametrize("impl", [{}, {"foreach": False}], ids=["default", "loop"])
@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_lean_step_equals_an_fp32_step_on_the_masters(name, dtype, impl):
    """Three steps: masters, state and module weights equal an fp32 optimizer fed the unscaled grads, bit for bit."""
    _, gm, mw, scaler = o2(name, dtype, **impl)
    start = [m.detach().clone() for m in mw.master_parameters()]
    ref = reference_for(mw)
    ref_params = [p for g in ref.param_groups for p in g["params"]]
    module_of = list(mw.module_parameters())
    for x, y in make_batches(3):
        mw.zero_grad()
        backward(gm, scaler, x, y)
        inv = 1.0 / scaler.get_scale()
        for p, src in zip(ref_params, module_of):
            p.grad = src.grad.float() * inv  # fp32, as the fused unscale computes it
        assert scaler.step(mw) is True
        scaler.update()
        ref.step()
        for master, want in zip(mw.master_parameters(), ref_params):
            assert torch.equal(master, want)
        for param, want in zip(module_of, ref_params):
            assert torch.equal(param, want.to(param.dtype))
    assert {p.dtype for p in module_of} == {dtype, torch.float32}  # low Linears, fp32 LayerNorms
    assert_same_state(mw.state_dict()["optimizer"]["state"], ref.state_dict()["state"])
    assert all(not torch.equal(m, s) for m, s in zip(mw.master_parameters(), start))  # every master moved


# ------------------------------------------------------------------ 2
@pytest.mark.parametrize("name,chosen", [("adam", "fused"), ("adamw", "fused"), ("sgd-momentum", "fused")])
def test_unset_implementation_is_chosen_and_an_explicit_one_kept(name, chosen):
    _, gm, mw, _ = o2(name, torch.bfloat16)
    assert mw.param_groups[0][chosen] is True
    other = "foreach" if chosen == "fused" else "fused"
    assert not mw.param_groups[0][other]
    for explicit in ({"foreach": False}, {"fused": False}, {"foreach": True}):
        _, _, mw2, _ = o2(name, torch.bfloat16, **explicit)
        (key, value), = explicit.items()
        assert mw2.param_groups[0][key] is value
        assert mw2.param_groups[0]["fused" if key == "foreach" else "foreach"] in (None, False)


def test_added_groups_and_loaded_plain_states_get_the_choice_too():
    """add_param_group with a second converted model, and a plain optimizer's state_dict, are chosen for as at build."""
    _, gm, mw, scaler = o2("adamw", torch.bfloat16)
    other = amp_fx.convert(make_model(1), "O2", dtype=torch.bfloat16)
    mw.add_param_group({"params": list(other.parameters()), "lr": 1e-3})
    assert mw.param_groups[1]["fused"] is True
    mw.add_param_group({"params": [nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))], "foreach": False})
    assert mw.param_groups[2]["foreach"] is False and mw.param_groups[2]["fused"] is None

    _, gm2, mw2, _ = o2("adamw", torch.bfloat16)
    plain = torch.optim.AdamW([m.detach().clone() for m in mw2.master_parameters()], lr=5e-3, weight_decay=0.1)
    assert plain.param_groups[0]["fused"] is None
    mw2.load_state_dict(plain.state_dict())  # no "masters": loads into the wrapped optimizer only
    assert mw2.param_groups[0]["fused"] is True and mw2.param_groups[0]["lr"] == 5e-3
    x, y = make_batches(1)[0]
    backward(gm2, scaler, x, y)
    assert scaler.step(mw2) is True


# ------------------------------------------------------------------ 3
@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_skipped_step_leaves_params_masters_and_state_untouched(name, dtype, bad):
    _, gm, mw, scaler = o2(name, dtype)
    batches = make_batches(3)
    for x, y in batches[:2]:
        mw.zero_grad()
        backward(gm, scaler, x, y)
        assert scaler.step(mw) is True
        scaler.update()
    params, masters, state = snapshot(mw)
    mw.zero_grad()
    backward(gm, scaler, *batches[2])
    next(gm.parameters()).grad.view(-1)[3] = bad
    assert scaler.step(mw) is False
    scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(params, mw.module_parameters()))
    assert all(torch.equal(a, b) for a, b in zip(masters, mw.master_parameters()))
    assert_same_state(state, mw.state_dict()["optimizer"]["state"])


# ------------------------------------------------------------------ 4
@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_parameter_without_grad_is_not_touched(name, dtype):
    """Weight decay would move a master with no gradient; torch skips it, and so does the lean step."""
    _, gm, mw, scaler = o2(name, dtype)
    first = dict(gm.named_parameters())["0.weight"]
    index = [p is first for p in mw.module_parameters()].index(True)
    batches = make_batches(2)
    # Two steps without a gradient for the first layer's weight: it gets no state at all.
    for step, (x, y) in enumerate(batches):
        params, masters, state = snapshot(mw)
        mw.zero_grad()
        backward(gm, scaler, x, y)
        first.grad = None
        assert scaler.step(mw) is True
        scaler.update()
        assert torch.equal(first, params[index]) and torch.equal(list(mw.master_parameters())[index], masters[index])
        now = mw.state_dict()["optimizer"]["state"]
        assert index not in now
        moved = [not torch.equal(a, b) for a, b in zip(params, mw.module_parameters())]
        assert sum(moved) == len(moved) - 1  # every other parameter stepped
        if step:
            assert all(k in now for k in state)


# ------------------------------------------------------------------ 5
class CountCalls:
    """Wrap a torch function; record the length of its first (list) argument at each call."""

    def __init__(self, monkeypatch, name: str):
        self.lengths: list[int] = []
        original = getattr(torch, name)

        def counted(tensors, *args, **kwargs):
            self.lengths.append(len(tensors))
            return original(tensors, *args, **kwargs)

        monkeypatch.setattr(torch, name, counted)


def test_one_copy_per_dtype_group_each_way(monkeypatch):
    """6 low (Linear) and 4 fp32 (LayerNorm) parameters with masters: 2 copies in, 2 out; add_param_group regroups.

    Under a LossScaler the way in is one copy per gradient, each checked right after its copy (issue 27: while
    it is in cache), and the way out one foreach copy per group; a plain ``mw.step()`` copies in per group too.
    This is the plain route (``foreach=True``: not the chunked step, which tests/runtime/test_chunked_step.py counts).
    """
    _, gm, mw, scaler = o2("adamw", torch.bfloat16, foreach=True)
    x, y = make_batches(1)[0]
    mw.zero_grad()
    backward(gm, scaler, x, y)
    copies = CountCalls(monkeypatch, "_foreach_copy_")
    checks = CountCalls(monkeypatch, "_amp_foreach_non_finite_check_and_unscale_")
    assert scaler.step(mw) is True
    assert mw.last_step_route == "optimizer.step (a param group is not fused=True (or is capturable/differentiable))"
    assert sorted(copies.lengths) == [4, 6]
    assert checks.lengths == [1] * 10

    other = amp_fx.convert(make_model(1), "O2", dtype=torch.bfloat16)
    mw.add_param_group({"params": list(other.parameters())})
    scaler.update()
    mw.zero_grad()
    scaler.scale(F.cross_entropy(gm(x) + other(x), y)).backward()
    copies.lengths.clear()
    checks.lengths.clear()
    assert scaler.step(mw) is True
    # The added model's parameters join the groups, with its own model's parameters as masters (its fp32
    # LayerNorm copies too, as for the first model).
    assert sorted(copies.lengths) == [8, 12]
    assert checks.lengths == [1] * 20

    scaler.update()
    mw.zero_grad()
    F.cross_entropy(gm(x) + other(x), y).backward()
    copies.lengths.clear()
    mw.step()  # no scaler: nothing to check, one foreach copy per group each way
    assert sorted(copies.lengths) == [8, 8, 12, 12]


# ------------------------------------------------------------------ 6
def o3(dtype: torch.dtype):
    """A converted O3 module (low gradients reach the scaler directly), plain SGD, a scaling LossScaler."""
    gm = amp_fx.convert(make_model(), "O3", dtype=dtype)
    return gm, torch.optim.SGD(gm.parameters(), lr=0.1), amp_fx.LossScaler(init_scale=1000.0, dtype=dtype)


@pytest.mark.parametrize("kernel", ["fused", "fallback"])
@pytest.mark.parametrize("bad", [None, float("inf"), float("-inf"), float("nan")], ids=["finite", "inf", "-inf", "nan"])
@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=["fp16", "bf16"])
def test_check_finds_inf_and_nan_in_low_grads_and_unscales(monkeypatch, count_host_syncs, dtype, bad, kernel):
    """One fused call per dtype group; 1/1000 (not a power of two) is applied in fp32 and rounded once."""
    gm, opt, scaler = o3(dtype)
    x, y = make_batches(1)[0]
    backward(gm, scaler, x, y)
    grads = [p.grad for p in gm.parameters()]
    assert {g.dtype for g in grads} == {dtype}
    if bad is not None:
        grads[-1].view(-1)[1] = bad
    want = [(g.float() * torch.tensor(1.0 / 1000.0)).to(dtype) for g in grads]
    calls = CountCalls(monkeypatch, "_amp_foreach_non_finite_check_and_unscale_")
    if kernel == "fallback":
        def missing(*args, **kwargs):
            raise NotImplementedError("no fused kernel on this backend")
        monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", missing)
    with count_host_syncs() as syncs:
        scaler.unscale_(opt)
        stepped = scaler.step(opt)
    assert syncs.count == 1
    assert stepped is (bad is None)
    if kernel == "fused":
        assert calls.lengths == [len(grads)]
    for got, expected in zip(grads, want):
        torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)  # bitwise, inf/NaN in place


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=["fp16", "bf16"])
def test_o2_step_reads_the_verdict_once_and_checks_each_master_grad_once(monkeypatch, count_host_syncs, dtype):
    _, gm, mw, scaler = o2("adamw", dtype)
    x, y = make_batches(1)[0]
    backward(gm, scaler, x, y)
    calls = CountCalls(monkeypatch, "_amp_foreach_non_finite_check_and_unscale_")
    with count_host_syncs() as syncs:
        assert scaler.step(mw) is True
        scaler.update()
    assert syncs.count == 1
    assert mw.last_step_route == "chunked"
    if dtype == torch.bfloat16:  # nothing to unscale: the gradients are checked as backward left them, once per dtype
        assert sorted(calls.lengths) == [4, 6]
    else:  # every fp32 master gradient checked (and unscaled) once, each right after its copy
        assert calls.lengths == [1] * len(list(mw.master_parameters()))


def test_closure_step_through_the_lean_path():
    """mw.step(closure) evaluates the closure, then syncs, steps fused and copies back."""
    _, gm, mw, _ = o2("adamw", torch.bfloat16)
    x, y = make_batches(1)[0]

    def closure():
        mw.zero_grad()
        loss = F.cross_entropy(gm(x), y)
        loss.backward()
        return loss

    losses = [mw.step(closure).item() for _ in range(4)]
    assert losses[-1] < losses[0]
    for name, p in gm.named_parameters():
        assert torch.equal(p, mw._masters[name].to(p.dtype))
