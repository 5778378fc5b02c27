"""Tiny training loops shared by test_gradscaler_semantics: fp32 torch, amp_fx GradScaler-style, amp_fx Apex-style.

Every loop records, at each optimizer step, the gradients the update really
uses (through a step pre-hook on the torch optimizer that does the update: for
a MasterWeightOptimizer that is the one stepping the fp32 masters), so a test
compares gradients step by step against fp32 torch, not only the final weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import amp_fx
from amp_fx.runtime import LossScaler, MasterWeightOptimizer

# (level, dtype) pairs: O0 ignores the dtype, so it runs once.
LEVEL_DTYPES = [("O0", torch.float32), ("O1", torch.float16), ("O1", torch.bfloat16), ("O2", torch.float16),
                ("O2", torch.bfloat16), ("O3", torch.float16), ("O3", torch.bfloat16)]
LEVEL_IDS = [f"{level}-{str(dtype)[6:]}" for level, dtype in LEVEL_DTYPES]
ZEROING = ("optimizer.zero_grad", "model.zero_grad", "grad=None")
LR, MOMENTUM = 0.2, 0.9


def make_model(seed: int = 0) -> nn.Module:
    """Linear-LayerNorm-ReLU-Linear: the LayerNorm stays fp32 at O2, so both kinds of master are met."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 4))


def make_batches(count: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 6, generator=gen), torch.randint(0, 4, (16,), generator=gen)) for _ in range(count)]


def clone(model: nn.Module) -> nn.Module:
    copy = make_model()
    copy.load_state_dict(model.state_dict())
    return copy


def sgd(params) -> torch.optim.SGD:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def zero(style: str, optimizers, modules) -> None:
    """Zero the gradients the way ``style`` names (all three are common in real code)."""
    if style == "optimizer.zero_grad":
        for opt in optimizers:
            opt.zero_grad()
    elif style == "model.zero_grad":
        for module in modules:
            module.zero_grad()
    else:
        for module in modules:
            for param in module.parameters():
                param.grad = None


def record_grads(optimizer) -> list[list[torch.Tensor]]:
    """Return a list that gets, at every real step, the fp32 gradients the update uses."""
    log: list[list[torch.Tensor]] = []
    inner = getattr(optimizer, "optimizer", optimizer)

    def hook(opt, args, kwargs):
        log.append([p.grad.detach().float().clone() for g in opt.param_groups for p in g["params"]
                    if p.grad is not None])

    inner.register_step_pre_hook(hook)
    return log


def setup(api: str, model: nn.Module, level: str, dtype: torch.dtype):
    """(module to run, optimizer to step, LossScaler or None) as a user of ``api`` writes them."""
    low = None if level == "O0" else dtype
    if api == "apex":
        gm, opt = amp_fx.initialize(model, sgd(model.parameters()), opt_level=level, dtype=low, verbosity=0)
        return gm, opt, None
    gm = amp_fx.convert(model, level, dtype=low)
    opt = MasterWeightOptimizer(sgd(model.parameters()), gm) if level == "O2" else sgd(gm.parameters())
    return gm, opt, LossScaler(dtype=dtype)


def loss_of(out: torch.Tensor, y: torch.Tensor, parts: int) -> torch.Tensor:
    return F.cross_entropy(out, y) / parts


def amp_iteration(api, gm, opt, scaler, micro, delay: bool = False) -> bool:
    """One optimizer step over the micro-batches ``micro``; returns whether it stepped."""
    if api == "apex":
        for i, (x, y) in enumerate(micro):
            last = i == len(micro) - 1
            with amp_fx.scale_loss(loss_of(gm(x), y, len(micro)), opt, delay_unscale=delay and not last) as s:
                s.backward()
        return opt.step() is not False
    for x, y in micro:
        scaler.scale(loss_of(gm(x), y, len(micro))).backward()
    stepped = scaler.step(opt)
    scaler.update()
    return stepped


def fp32_iteration(model, opt, micro) -> None:
    for x, y in micro:
        loss_of(model(x), y, len(micro)).backward()
    opt.step()


def weights(model: nn.Module, gm: nn.Module, level: str) -> dict[str, torch.Tensor]:
    """The weights a run ends with, fp32: the masters (the original model's tensors) at O2, else the module's."""
    source = model if level == "O2" else gm
    return {n: p.detach().float().clone() for n, p in source.named_parameters()}


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm().clamp_min(1e-12)).item()


def grad_tolerance(level: str, dtype: torch.dtype) -> float:
    """Relative gradient error allowed against fp32 (an accumulated or stale gradient is off by ~100%)."""
    if level == "O0":
        return 0.0
    return 0.02 if dtype == torch.float16 else 0.08


def weight_tolerance(level: str, dtype: torch.dtype) -> float:
    if level == "O0":
        return 0.0
    return 0.01 if dtype == torch.float16 else 0.06


def assert_close_steps(got: list, want: list, level: str, dtype: torch.dtype) -> None:
    """Same number of steps, and each step's gradients within the level's tolerance of fp32's."""
    assert len(got) == len(want), f"{len(got)} steps taken, fp32 took {len(want)}"
    tol = grad_tolerance(level, dtype)
    for step, (g_step, w_step) in enumerate(zip(got, want)):
        assert len(g_step) == len(w_step)
        for g, w in zip(g_step, w_step):
            err = rel_error(g, w)
            assert err <= tol, f"step {step}: gradient off by {err:.3g} (relative), tolerance {tol}"


def assert_close_weights(got: dict, want: dict, level: str, dtype: torch.dtype) -> None:
    tol = weight_tolerance(level, dtype)
    for name, w in want.items():
        err = (got[name] - w).abs().max().item()
        assert err <= tol, f"{name}: {err:.3g} from fp32, tolerance {tol}"
