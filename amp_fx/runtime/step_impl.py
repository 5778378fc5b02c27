"""Choose torch's fastest step implementation for fp32 masters on CPU where the user left it unset.

Where ``foreach`` and ``fused`` are both left unset, torch steps CUDA tensors
with its foreach implementation but CPU tensors one at a time. For the fp32
masters of a :class:`~amp_fx.runtime.MasterWeightOptimizer` on CPU this picks
``fused`` for Adam, AdamW and SGD: what measured fastest there (SGD: one pass
over memory, not foreach's three; figures in docs/performance.md, "The lean O2
update", ``benchmarks/bench_o2_step.py``), and what lets
:mod:`amp_fx.runtime.chunked_step` step chunk by chunk.

torch's fused SGD kernel runs the foreach step's fp32 operations in one pass;
on CPU it rounds ``buf * momentum + grad`` once (a fused multiply-add) on the
elements its vector loop leaves to a scalar tail, where foreach rounds twice,
so the two may differ by one rounding per step there (bounded in
``tests/runtime/test_lean_update.py``). The fused kernel needs every parameter of a group
that has a gradient to have a momentum buffer, or none to have one
(``torch.optim.sgd._fused_sgd`` passes the buffer list to the kernel as is),
so a parameter that gets its first gradient after the others would make the
step fail: :func:`fused_sgd_guard` steps such a group with foreach for that
one step, after which every buffer exists.

An explicit ``foreach=`` or ``fused=`` (either value) is the user's choice and
is kept: ``foreach=False`` restores torch's one-at-a-time step.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

__all__ = ["prefer_fast_step", "fused_sgd_guard"]

_CPU_CHOICE: dict[type, str] = {
    torch.optim.Adam: "fused",
    torch.optim.AdamW: "fused",
    torch.optim.SGD: "fused",
}
_PLAIN = (torch.Tensor, nn.Parameter)


def prefer_fast_step(optimizer: torch.optim.Optimizer) -> None:
    """Set ``fused`` or ``foreach`` on ``optimizer``'s groups that left both unset and hold only CPU fp32 tensors."""
    choice = _CPU_CHOICE.get(type(optimizer))  # exact class: a subclass may step differently
    if choice is None or torch.get_default_dtype() != torch.float32:
        # (a float64 default dtype gives the loop's "step" counters float64, the fused kernel's float32)
        return
    for group in optimizer.param_groups:
        if group.get("foreach") is not None or group.get("fused") is not None:
            continue
        if group.get("differentiable") or group.get("capturable"):
            continue
        if all(type(p) in _PLAIN and p.device.type == "cpu" and p.dtype == torch.float32
               for p in group["params"]):
            group[choice] = True


def _mixed_buffers(optimizer: torch.optim.Optimizer, group: dict) -> bool:
    """True when some parameters with a gradient have a momentum buffer and others have none."""
    have = set()
    for p in group["params"]:
        if p.grad is not None:
            have.add(optimizer.state.get(p, {}).get("momentum_buffer") is not None)
            if len(have) == 2:
                return True
    return False


@contextlib.contextmanager
def fused_sgd_guard(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Around ``optimizer.step()``: a fused SGD group whose momentum buffers are partly missing steps foreach once."""
    switched = []
    if isinstance(optimizer, torch.optim.SGD):
        for group in optimizer.param_groups:
            if group.get("fused") and group.get("momentum", 0) != 0 and _mixed_buffers(optimizer, group):
                switched.append((group, group.get("foreach")))
                group["fused"], group["foreach"] = False, True
    try:
        yield
    finally:
        for group, foreach in switched:
            group["fused"], group["foreach"] = True, foreach
