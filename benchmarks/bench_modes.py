"""The training set-ups ``benchmarks/benchmark.py`` compares: one :class:`Trainer` per mode.

Every mode trains its own deep copy of the same model with the same
optimizer (SGD with momentum, ``foreach=True``; ``sgd="fused"`` makes it
``fused=True`` on every side, torch's fastest SGD on CPU: one pass over
memory, where foreach makes three).  A step is
``zero_grad``, forward (the model returns its loss), backward and the
optimizer step, with a loss scaler where the mode uses one:

- ``torch.autocast`` modes use ``torch.amp.GradScaler`` for float16 and no
  scaler for bfloat16 (what the PyTorch AMP recipe does);
- amp_fx modes use :class:`amp_fx.LossScaler` as amp_fx documents it
  (for bfloat16 it does not scale but still skips a step with inf/NaN
  gradients, a check the autocast recipe does not make), and O2 steps fp32
  masters through :class:`amp_fx.MasterWeightOptimizer`.
"""

from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

import amp_fx
from amp_fx.runtime import LossScaler, MasterWeightOptimizer

__all__ = ["Trainer", "MODES", "SGD_KINDS", "EAGER_BASELINE", "COMPILED_BASELINE", "build_trainer", "state_tensors"]

EAGER_BASELINE = "torch.autocast"
COMPILED_BASELINE = "compile+autocast"
# name -> (group, the baseline its ratio is taken against)
MODES: dict[str, tuple[str, str]] = {
    "fp32": ("eager", EAGER_BASELINE),
    "torch.autocast": ("eager", EAGER_BASELINE),
    "amp_fx O1": ("eager", EAGER_BASELINE),
    "amp_fx O2": ("eager", EAGER_BASELINE),
    "amp_fx O3": ("eager", EAGER_BASELINE),
    "compile fp32": ("compiled", COMPILED_BASELINE),
    "compile+autocast": ("compiled", COMPILED_BASELINE),
    'compile(backend="amp_fx")': ("compiled", COMPILED_BASELINE),
    "compile(convert O2)": ("compiled", COMPILED_BASELINE),
}
LR = 1e-4


@dataclass
class Trainer:
    """One mode's module, optimizer, scaler and batch; ``step()`` is one training step."""

    name: str
    module: Callable
    optimizer: Any
    scaler: Any
    inputs: tuple
    autocast: Optional[tuple[str, torch.dtype]]
    setup_s: float = float("nan")  # seconds amp_fx.convert took (NaN: the mode does not convert)
    state: tuple = ()  # the module's parameters and buffers (see state_tensors)
    last_loss: float = float("nan")

    def zero(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def work(self) -> torch.Tensor:
        """Forward, backward and optimizer step (gradients must be zeroed before)."""
        region = torch.autocast(self.autocast[0], dtype=self.autocast[1]) if self.autocast else contextlib.nullcontext()
        with region:
            loss = self.module(*self.inputs)
        if self.scaler is None:
            loss.backward()
            self.optimizer.step()
        else:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        return loss

    def step(self) -> None:
        self.zero()
        self.work()

    def warm_up(self, steps: int) -> float:
        """Run ``steps`` steps (compiles the compiled modes); return the first step's seconds."""
        start = time.perf_counter()
        for i in range(steps):
            self.zero()
            loss = self.work()
            if i == 0:
                first = time.perf_counter() - start
        self.last_loss = float(loss.detach())
        return first

    def skipped(self) -> int:
        """Steps the scaler skipped (inf/NaN gradients): those would flatter a mode's time."""
        return int(getattr(self.scaler, "skipped_steps", 0) or 0)


SGD_KINDS = ("foreach", "fused")


def _sgd(params: Any, kind: str = "foreach") -> torch.optim.Optimizer:
    if kind not in SGD_KINDS:
        raise ValueError(f"sgd must be one of {SGD_KINDS}, got {kind!r}")
    return torch.optim.SGD(params, lr=LR, momentum=0.9, **{kind: True})


def _amp_fx_scaler(level: str, dtype: torch.dtype) -> LossScaler:
    # O3 is Apex's "pure low precision": static loss scale 1.0 (fp16); bf16 never scales.
    if level == "O3" and dtype == torch.float16:
        return LossScaler(init_scale=1.0, dynamic=False, dtype=dtype)
    return LossScaler(dtype=dtype)


def _autocast_scaler(device: str, dtype: torch.dtype) -> Any:
    return torch.amp.GradScaler(device) if dtype == torch.float16 else None


def build_trainer(mode: str, base: nn.Module, inputs: tuple, device: str, dtype: torch.dtype, inner: str,
                  sgd: str = "foreach") -> Trainer:
    """Set up ``mode`` on a deep copy of ``base`` (timing the conversion, not the compilation); ``sgd``: foreach or fused."""
    if sgd not in SGD_KINDS:  # (before any set-up)
        raise ValueError(f"sgd must be one of {SGD_KINDS}, got {sgd!r}")
    model = copy.deepcopy(base)
    autocast = (device, dtype)
    timed: list[float] = []

    def convert(level: str) -> nn.Module:
        start = time.perf_counter()
        converted = amp_fx.convert(model, level, dtype=dtype)
        timed.append(time.perf_counter() - start)
        return converted

    if mode == "fp32":
        module, opt, scaler, autocast = model, _sgd(model.parameters(), sgd), None, None
    elif mode == "torch.autocast":
        module, opt, scaler = model, _sgd(model.parameters(), sgd), _autocast_scaler(device, dtype)
    elif mode.startswith("amp_fx O"):
        level = mode[-2:]
        module = convert(level)
        opt = MasterWeightOptimizer(_sgd(model.parameters(), sgd), module) if level == "O2" else _sgd(module.parameters(), sgd)
        scaler, autocast = _amp_fx_scaler(level, dtype), None
    elif mode == "compile fp32":
        module, opt, scaler, autocast = torch.compile(model, backend=inner), _sgd(model.parameters(), sgd), None, None
    elif mode == "compile+autocast":
        module, opt, scaler = torch.compile(model, backend=inner), _sgd(model.parameters(), sgd), _autocast_scaler(device, dtype)
    elif mode == 'compile(backend="amp_fx")':
        module = torch.compile(model, backend="amp_fx", options={"level": "O1", "dtype": dtype, "inner": inner})
        opt, scaler, autocast = _sgd(model.parameters(), sgd), _amp_fx_scaler("O1", dtype), None
    elif mode == "compile(convert O2)":
        converted = convert("O2")
        module = torch.compile(converted, backend=inner)
        # Given the compiled module, as a user of torch.compile would: the wrapper then compiles its update too.
        opt = MasterWeightOptimizer(_sgd(model.parameters(), sgd), module)
        scaler, autocast = _amp_fx_scaler("O2", dtype), None
    else:
        raise ValueError(f"unknown mode {mode!r}; choose from {list(MODES)}")
    setup_s = sum(timed) if timed else float("nan")
    # The training state: what the module computes with (at O2/O3 its own low copies; the
    # fp32 model it was converted from is not needed, except as O2's masters, which the
    # optimizer holds and state_tensors() adds).
    owner = module if isinstance(module, nn.Module) else model
    state = (*owner.parameters(), *owner.buffers())
    return Trainer(mode, module, opt, scaler, inputs, autocast, setup_s, state)


def state_tensors(trainer: Trainer) -> list[torch.Tensor]:
    """Parameters, buffers, masters and optimizer state of ``trainer`` as they are now."""
    opt = trainer.optimizer
    extra = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    extra += [p for g in opt.param_groups for p in g["params"]]
    return [*trainer.state, *extra]
