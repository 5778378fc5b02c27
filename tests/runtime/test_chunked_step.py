"""O2's chunked step (issue 41): gradient copy, fused update and low copy per cache-sized chunk.

1. The chunked route (bf16: the low gradients read through a scratch buffer) leaves masters, low parameters and optimizer state bit for bit as the plain route
   (``optimizer.step()`` over all masters), for SGD (momentum, nesterov, none), Adam (amsgrad) and AdamW, across
   several chunks, a skipped inf/NaN step, gradient accumulation, a closure and fp16 loss scaling.
2. A checkpoint taken between steps resumes to the same bits as an uninterrupted run.
3. With bf16 (nothing to unscale) the scaler checks the low gradients once per dtype and the copies run per chunk.
4. Where it does not apply (a user's step hook, an unfused group, a momentum buffer missing for some
   parameters) the plain route runs and ``last_step_route`` says why; an LR scheduler sees the step.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_fx
from amp_fx.runtime import chunked_step

OPTIMIZERS = {
    "sgd-momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    "sgd-nesterov": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "dampening": 0.0}),
    "sgd-plain": (torch.optim.SGD, {"lr": 0.1, "maximize": True}),
    "adam-amsgrad": (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.01, "amsgrad": True}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
}
PLAIN = "optimizer.step (an optimizer step hook is registered)"


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Chunks of 1 KiB of masters (256-element slices of larger ones): the test model (1.7k parameters) steps in 6."""
    monkeypatch.setattr(chunked_step, "CHUNK_BYTES", 1024)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 32), nn.GELU(),
                         nn.LayerNorm(32), nn.Linear(32, 4))


def batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(12, 8, generator=gen), torch.randint(0, 4, (12,), generator=gen)) for _ in range(count)]


def build(name: str, chunked: bool, dtype: torch.dtype = torch.bfloat16):
    """(O2 module, MasterWeightOptimizer, LossScaler); ``chunked=False`` forces the plain route with a no-op hook."""
    model = make_model()
    gm = amp_fx.convert(model, "O2", dtype=dtype)
    cls, options = OPTIMIZERS[name]
    mw = amp_fx.MasterWeightOptimizer(cls(model.parameters(), **options), gm)
    if not chunked:
        mw.optimizer.register_step_pre_hook(lambda *args: None)
    scaler = amp_fx.LossScaler(**({"init_scale": 2.0**8} if dtype == torch.float16 else {}), dtype=dtype)
    return gm, mw, scaler


def train(gm, mw, scaler, data, inf_at: int | None = None, accumulate: int = 1) -> list[str]:
    routes = []
    for i, (x, y) in enumerate(data):
        mw.zero_grad()
        for _ in range(accumulate):
            scaler.scale(F.cross_entropy(gm(x), y)).backward()
        if i == inf_at:
            next(gm.parameters()).grad.view(-1)[5] = float("nan")
        taken = scaler.step(mw)
        scaler.update()
        assert taken is (i != inf_at)
        routes.append(mw.last_step_route if taken else "skipped")
    return routes


def values(gm, mw) -> list[torch.Tensor]:
    """Low parameters, masters and every optimizer state tensor, in a fixed order."""
    state = mw.state_dict()["optimizer"]["state"]
    out = [p.detach() for p in gm.parameters()] + [m.detach() for m in mw.master_parameters()]
    return out + [state[i][k] for i in sorted(state) for k in sorted(state[i])]


def assert_bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b) > 0
    for i, (u, v) in enumerate(zip(a, b)):
        assert u.dtype == v.dtype and torch.equal(u, v), i


# ------------------------------------------------------------------ 1
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_chunked_route_equals_the_plain_route_bitwise(name):
    """Four steps, the second skipped (NaN): the two routes agree bit for bit, and each route is the one asked."""
    data = batches(4)
    runs = []
    for chunked in (True, False):
        gm, mw, scaler = build(name, chunked)
        routes = train(gm, mw, scaler, data, inf_at=1)
        runs.append(values(gm, mw))
        assert routes == ["chunked" if chunked else PLAIN, "skipped"] + ["chunked" if chunked else PLAIN] * 2
        assert scaler.skipped_steps == 1
    assert_bitwise(*runs)
    # the masters moved (the comparison is not of two untouched models)
    assert not torch.equal(runs[0][len(list(make_model().parameters()))], make_model()[0].weight)


@pytest.mark.parametrize("name", ["sgd-momentum", "adamw"])
def test_accumulation_closure_and_fp16_scaling_agree_too(name):
    """Two micro-batches per step; then a direct ``mw.step(closure)``; fp16 with a loss scale of 2**8."""
    data = batches(3)
    for dtype in (torch.bfloat16, torch.float16):
        runs = []
        for chunked in (True, False):
            gm, mw, scaler = build(name, chunked, dtype)
            train(gm, mw, scaler, data[:2], accumulate=2)
            x, y = data[2]

            def closure():
                mw.zero_grad()
                loss = F.cross_entropy(gm(x), y)
                loss.backward()
                return loss
            mw.step(closure)
            assert mw.last_step_route == ("chunked" if chunked else PLAIN)
            runs.append(values(gm, mw))
        assert_bitwise(*runs)


# ------------------------------------------------------------------ 2
@pytest.mark.parametrize("name", ["sgd-momentum", "adam-amsgrad"])
def test_resume_from_a_checkpoint_is_bitwise_the_uninterrupted_run(name):
    data = batches(4)
    gm, mw, scaler = build(name, True)
    train(gm, mw, scaler, data)
    uninterrupted = values(gm, mw)

    gm, mw, scaler = build(name, True)
    train(gm, mw, scaler, data[:2])
    saved = copy.deepcopy({"model": gm.state_dict(), "optimizer": mw.state_dict(), "scaler": scaler.state_dict()})
    gm, mw, scaler = build(name, True)
    gm.load_state_dict(saved["model"])
    mw.load_state_dict(saved["optimizer"])
    scaler.load_state_dict(saved["scaler"])
    assert train(gm, mw, scaler, data[2:]) == ["chunked"] * 2
    assert_bitwise(values(gm, mw), uninterrupted)


# ------------------------------------------------------------------ 3
def test_bf16_checks_the_low_gradients_once_and_copies_per_chunk(monkeypatch):
    gm, mw, scaler = build("adamw", True)
    x, y = batches(1)[0]
    scaler.scale(F.cross_entropy(gm(x), y)).backward()
    calls: dict[str, list[list[torch.dtype]]] = {"_amp_foreach_non_finite_check_and_unscale_": [], "_foreach_copy_": []}
    for fn in calls:
        original = getattr(torch, fn)

        def counted(tensors, *args, _name=fn, _original=original, **kwargs):
            calls[_name].append([t.dtype for t in tensors])
            return _original(tensors, *args, **kwargs)
        monkeypatch.setattr(torch, fn, counted)
    assert scaler.step(mw) is True
    # one check per dtype, of the gradients as backward left them: the Linears' 6 bf16 ones, the LayerNorms' 4 fp32
    checks = calls["_amp_foreach_non_finite_check_and_unscale_"]
    assert sorted(checks, key=len) == [[torch.float32] * 4, [torch.bfloat16] * 6]
    # 1 KiB chunks, slices of 256 elements: [0.weight (256)], [0.bias, 2.weight, 2.bias, 3.weight's 1st slice],
    # 3.weight's 2nd, 3rd and 4th slices alone, [3.bias, 5.weight, 5.bias, 6.weight (128), 6.bias]: 6 chunks,
    # each one copy of its gradients in and one of its masters out (13 pieces each way)
    copies = calls["_foreach_copy_"]
    assert len(copies) == 12 and sum(len(c) for c in copies) == 26
    assert [len(c) for c in copies[::2]] == [1, 4, 1, 1, 1, 5]
    assert all(m.grad is None for m in mw.master_parameters())  # the gradients went through the scratch buffer


def test_pieces_slice_contiguous_masters_at_vector_boundaries_and_keep_others_whole():
    master, source, low = torch.zeros(1000), torch.ones(1000, dtype=torch.bfloat16), torch.zeros(1000)
    pieces = list(chunked_step._pieces(master, source, [torch.zeros(1000)], None, low))
    assert [p.master.numel() for p in pieces] == [256, 256, 256, 232]  # CHUNK_BYTES 1 KiB: 256 fp32 per slice
    assert all(p.grad is None and p.master.data_ptr() == master.data_ptr() + 4 * 256 * i for i, p in enumerate(pieces))
    wide = torch.zeros(40, 30).t()  # not contiguous: one piece, with a gradient of its own layout
    piece, = chunked_step._pieces(wide, torch.ones(30, 40, dtype=torch.bfloat16).t(), [], None, None)
    assert piece.master is wide and piece.grad.stride() == wide.stride()
    chunks = list(chunked_step._chunks(pieces + [piece]))
    assert [len(c) for c in chunks] == [1, 1, 1, 2]  # >= 1 KiB of masters each but the last


# ------------------------------------------------------------------ 4
def test_where_it_does_not_apply_the_plain_route_runs_and_says_why():
    data = batches(2)
    gm, mw, scaler = build("sgd-momentum", True)
    seen = []
    mw.optimizer.register_step_post_hook(lambda opt, args, kwargs: seen.append(opt))
    train(gm, mw, scaler, data[:1])
    assert mw.last_step_route == PLAIN and seen == [mw.optimizer]  # the user's hook ran, once

    gm, mw, scaler = build("sgd-momentum", True)
    mw.param_groups[0]["fused"], mw.param_groups[0]["foreach"] = False, True
    train(gm, mw, scaler, data[:1])
    assert mw.last_step_route.startswith("optimizer.step (a param group is not fused=True")

    gm, mw, scaler = build("sgd-momentum", True)
    first = next(gm.parameters())
    x, y = data[0]
    scaler.scale(F.cross_entropy(gm(x), y)).backward()
    first.grad = None  # the first step makes momentum buffers for all but this one
    assert scaler.step(mw)
    scaler.update()
    mw.zero_grad()
    assert train(gm, mw, scaler, data[1:]) == ["optimizer.step (SGD momentum buffers exist for some parameters "
                                               "only (stepped with foreach once))"]
    assert train(gm, mw, scaler, data[1:]) == ["chunked"]  # every buffer exists now


def test_an_lr_scheduler_sees_the_chunked_step():
    gm, mw, scaler = build("adamw", True)
    schedule = torch.optim.lr_scheduler.StepLR(mw, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when the scheduler steps before any optimizer step it saw
        assert train(gm, mw, scaler, batches(1)) == ["chunked"]
        schedule.step()
    assert mw.param_groups[0]["lr"] == 5e-3
