"""Bytes per parameter a training setup holds, measured from its tensors: weights, grads, masters, state.

:func:`measure_training_memory` walks what a module and its optimizer really
hold (the module's parameters and their ``.grad``, fp32 masters and their
grads, compensation buffers, every tensor in the optimizer's state) and sums
the bytes of each distinct storage once, in the first role it is met in. No
formula is involved, so a setup that keeps a hidden copy shows it.

It understands any ``torch.optim.Optimizer``, :class:`MasterWeightOptimizer`
(through its public ``master_parameters()``, and ``grad_buffer_bytes()``: the
fp32 gradient buffers ``keep_grad_buffers=True`` keeps between steps, counted
as gradients even while no ``.grad`` points at them) and
:class:`LowPrecisionOptimizer` (through ``compensation_buffers()``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import nn

__all__ = ["MemoryReport", "measure_training_memory", "ROLES"]

ROLES = ("weights", "gradients", "masters", "compensation", "optimizer_state")


@dataclass
class MemoryReport:
    """Bytes held per role, the parameter count, and the dtype of each optimizer state entry."""

    params: int
    bytes: dict[str, int]
    state_dtypes: dict[str, str] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    @property
    def bytes_per_param(self) -> dict[str, float]:
        """``{role: bytes / parameter}`` for every role, plus ``"total"``."""
        n = max(self.params, 1)
        out = {role: self.bytes[role] / n for role in ROLES}
        out["total"] = self.total_bytes / n
        return out

    def row(self) -> list[str]:
        """The per-parameter figures as table cells, in :data:`ROLES` order then the total."""
        per = self.bytes_per_param
        return [f"{per[r]:.2f}" for r in (*ROLES, "total")]

    def __str__(self) -> str:
        per = self.bytes_per_param
        parts = ", ".join(f"{r} {per[r]:.2f}" for r in ROLES)
        states = ", ".join(f"{k}: {v}" for k, v in self.state_dtypes.items()) or "none"
        return (f"{self.params:,} parameters, {per['total']:.2f} bytes/param ({parts}); "
                f"optimizer state dtypes: {states}")


def _storage_key(t: torch.Tensor) -> tuple[Any, int]:
    storage = t.untyped_storage()
    return (t.device, storage.data_ptr()), storage.nbytes()


def _state_tensors(state: Any) -> Iterable[tuple[str, torch.Tensor]]:
    for per_param in state.values():
        if isinstance(per_param, dict):
            for key, value in per_param.items():
                if isinstance(value, torch.Tensor):
                    yield str(key), value


def measure_training_memory(module: nn.Module, optimizer: Any = None) -> MemoryReport:
    """Measure the bytes ``module`` and ``optimizer`` hold now (call it after a step, before ``zero_grad``).

    Roles: ``weights`` (the module's parameters), ``gradients`` (their
    ``.grad`` and the masters', and kept gradient buffers), ``masters`` (fp32 copies a
    ``MasterWeightOptimizer`` steps), ``compensation`` (Kahan buffers) and
    ``optimizer_state``. ``params`` counts the module's parameter elements.
    """
    seen: set = set()
    held = dict.fromkeys(ROLES, 0)

    def add(role: str, tensor: torch.Tensor | None) -> None:
        if tensor is None:
            return
        key, nbytes = _storage_key(tensor)
        if key not in seen:
            seen.add(key)
            held[role] += nbytes

    params = list(dict.fromkeys(module.parameters()))  # a shared parameter once
    for p in params:
        add("weights", p)
    masters = list(optimizer.master_parameters()) if callable(getattr(optimizer, "master_parameters", None)) else []
    for m in masters:
        add("masters", m)
    buffers = optimizer.compensation_buffers() if callable(getattr(optimizer, "compensation_buffers", None)) else {}
    for c in buffers.values():
        add("compensation", c)
    for p in (*params, *masters):
        add("gradients", p.grad)
    kept = getattr(optimizer, "grad_buffer_bytes", None)
    if callable(kept):  # buffers no .grad points at now (those that one does were counted just above)
        held["gradients"] += int(kept())
    dtypes: dict[str, set[str]] = {}
    if optimizer is not None:
        for key, value in _state_tensors(optimizer.state):
            add("optimizer_state", value)
            dtypes.setdefault(key, set()).add(str(value.dtype).replace("torch.", ""))
    return MemoryReport(params=sum(p.numel() for p in params), bytes=held,
                        state_dtypes={k: "/".join(sorted(v)) for k, v in dtypes.items()})
