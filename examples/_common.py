"""Shared pieces of the training examples: a tiny model, fixed data, and both ways to set up amp_fx.

Every recipe example trains the same :class:`Net` on the same batches three
ways: plain fp32 torch (the reference), amp_fx's GradScaler-style API
(``convert`` + ``LossScaler`` [+ ``MasterWeightOptimizer`` at O2]) and its
Apex-style API (``initialize`` + ``scale_loss``), then compares the weights.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Optional

import torch
from torch import nn

import amp_fx
from amp_fx.runtime import LossScaler, MasterWeightOptimizer

__all__ = [
    "Net", "make_net", "make_batches", "setup_gradscaler", "setup_apex", "weights", "poison_", "max_diff",
    "tolerance", "print_rows", "setup_run", "params_of", "clone", "maybe", "compare_table", "LEVELS", "DTYPES", "LR",
]

LEVELS = ("O0", "O1", "O2", "O3")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
LR = 0.1


class Net(nn.Module):
    """Linear -> LayerNorm -> tanh -> Linear: tiny (fp16 runs on a CPU), a norm for O2 to keep fp32, and smooth
    (no ReLU kink whose side can flip with rounding), so low-precision runs track fp32 within a few ulps."""

    def __init__(self, d_in: int = 16, hidden: int = 32, d_out: int = 4):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


def make_net(seed: int = 0, **kwargs: Any) -> Net:
    """A freshly initialised :class:`Net` (same weights for the same seed)."""
    torch.manual_seed(seed)
    return Net(**kwargs)


def make_batches(steps: int, batch: int = 16, d_in: int = 16, d_out: int = 4, seed: int = 1) -> list:
    """``steps`` (input, target) pairs from a fixed random linear teacher plus noise."""
    gen = torch.Generator().manual_seed(seed)
    teacher = torch.randn(d_in, d_out, generator=gen) / d_in**0.5
    out = []
    for _ in range(steps):
        x = torch.randn(batch, d_in, generator=gen)
        out.append((x, x @ teacher + 0.1 * torch.randn(batch, d_out, generator=gen)))
    return out


def setup_gradscaler(model: nn.Module, level: str, dtype: torch.dtype, lr: float = LR, optimizer_cls=torch.optim.SGD,
                     **scaler_kwargs: Any):
    """GradScaler-style set-up: (converted module, optimizer to step, LossScaler).

    O0/O1 modules share the model's fp32 parameters, so the optimizer is built
    over them; O2 wraps an optimizer over the model's fp32 parameters (the
    masters) in MasterWeightOptimizer; O3 steps the module's own low parameters.
    """
    gm = amp_fx.convert(model, level, dtype=dtype)
    if level == "O2":
        optimizer: Any = MasterWeightOptimizer(optimizer_cls(model.parameters(), lr=lr), gm)
    else:
        optimizer = optimizer_cls(gm.parameters(), lr=lr)
    scaler = LossScaler(dtype=torch.float32 if level == "O0" else dtype, **scaler_kwargs)
    return gm, optimizer, scaler


def setup_apex(model: nn.Module, level: str, dtype: torch.dtype, lr: float = LR, optimizer_cls=torch.optim.SGD,
               **properties: Any):
    """Apex-style set-up: ``amp_fx.initialize(model, optimizer, opt_level=level)``."""
    optimizer = optimizer_cls(model.parameters(), lr=lr)
    return amp_fx.initialize(model, optimizer, opt_level=level, dtype=dtype, verbosity=0, **properties)


def weights(model: nn.Module, gm: nn.Module) -> dict[str, torch.Tensor]:
    """The trained fp32 weights: the model's own parameters when the module shares them (O0/O1) or they
    are its masters (O2), else the module's low-precision parameters as fp32 (O3)."""
    own = dict(model.named_parameters())
    shared = all(p is own.get(n) for n, p in gm.named_parameters())
    source = own if shared or gm.amp_config.master_weights else dict(gm.named_parameters())
    return {n: p.detach().float().clone() for n, p in source.items()}


def poison_(module: nn.Module, kind: str = "inf", name: str = "fc1.weight") -> None:
    """Put one inf (or NaN) into the gradient of parameter ``name`` (a fault to be skipped)."""
    grad = module.get_parameter(name).grad
    grad.view(-1)[0] = float(kind)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference between two weight dicts with the same keys."""
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def tolerance(level: str, dtype: torch.dtype) -> float:
    """How far weights trained at ``level`` may drift from fp32 on these recipes (a few ulps of the dtype)."""
    if level == "O0":
        return 0.0
    eps = torch.finfo(dtype).eps
    # O1/O2 keep fp32 weights: only activations and gradients are rounded, which moves these smooth
    # models' weights by a fraction of an ulp (the gradient penalty, a second derivative computed in
    # low precision, comes closest). O3 also rounds every update to the low dtype: up to half an ulp
    # per step (the weights are below 1, so below eps / 2 each), over the 8 steps of a recipe.
    return 4 * eps if level == "O3" else eps / 4


def print_rows(title: str, rows: list[tuple]) -> None:
    """Print a small aligned table."""
    print(title)
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  " + "  ".join(str(c).ljust(w) for c, w in zip(row, widths)))


def clone(model: nn.Module) -> nn.Module:
    """A deep copy (each API run starts from the same weights)."""
    return copy.deepcopy(model)


def maybe(inject: Optional[dict], step: int) -> Optional[str]:
    """The fault to inject at ``step`` (``"inf"``/``"nan"``) or None."""
    return (inject or {}).get(step)


def params_of(optimizer: Any) -> list[torch.Tensor]:
    """The tensors an optimizer steps (the fp32 masters for a MasterWeightOptimizer): clip these."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def setup_run() -> None:
    """Set up a run of an example: one thread (these models are tiny; on a shared machine threads only
    wait for each other) and no skip reports on the console (the examples inject inf/NaN on purpose)."""
    torch.set_num_threads(1)
    logging.getLogger("amp_fx.runtime").setLevel(logging.ERROR)


def compare_table(title: str, reference: dict, trainers: dict, make_model, inject: Optional[dict],
                  levels=LEVELS, dtypes=DTYPES, tol=tolerance) -> list[tuple]:
    """Train with every (level, dtype, api), print how far each lands from ``reference``; return the rows.

    ``trainers`` maps an API name to ``train(model, level, dtype, inject) -> (weights, skipped)``.
    """
    rows = [("level", "dtype", "api", "max |w - w_fp32|", "tolerance", "skipped")]
    for level in levels:
        for name, dtype in dtypes.items():
            for api, train in trainers.items():
                got, skipped = train(make_model(), level, dtype, inject)
                rows.append((level, name, api, f"{max_diff(got, reference):.2e}", f"{tol(level, dtype):.1e}",
                             skipped))
    print_rows(title, rows)
    return rows
