"""fp32 gradient accumulation for O2: each low gradient is added into its fp32 master's gradient as backward makes it.

Without it, k micro-batches accumulate in the low parameters' own ``.grad``
(bf16/fp16): autograd adds each micro-batch's gradient there, rounding k times
in the low dtype, and :class:`~amp_fx.runtime.MasterWeightOptimizer` copies the
rounded sum into the masters once.  With it (``MasterWeightOptimizer(...,
fp32_grad_accumulation=True)``), a post-accumulate-grad hook on every low
parameter adds the gradient it just received into the master's fp32 ``.grad``
(one correctly rounded fp32 add: the first one is a cast) and frees the low
one.  The masters then hold the fp32 sum of the low gradients, which rounds
once per micro-batch in fp32 instead of in bf16 (DeepSpeed's
``grad_accum_dtype=fp32``).

Memory: 4 bytes per low parameter for the master gradient, held from the first
backward of an optimizer step until the step frees it; the low gradient (2
bytes) lives only inside each backward.  Today's path holds the 2-byte low
gradients between backward and step and allocates the 4-byte master gradients
at the step, so the peak of a step moves from the optimizer step (2 + 4 bytes)
into backward (4 bytes), where activations are alive too.

A hook is registered once per low parameter and serves whichever wrapper last
claimed it (a newer :class:`MasterWeightOptimizer` over the same module takes
it over; one built without the option, or a dead one, leaves the low gradient
where autograd put it).
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from amp_fx.errors import AmpNotImplementedError

__all__ = ["claim", "release", "add_into_master", "drain"]


class _Claim:
    """A low parameter's hook and the (master, owner) it currently adds into."""

    __slots__ = ("handle", "master", "owner")

    def __init__(self) -> None:
        self.handle: Any = None
        self.master: Optional[torch.Tensor] = None
        self.owner: Optional[weakref.ref] = None


# low parameter -> its claim (weak keys: a dropped module takes its entries with it).
_CLAIMS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def add_into_master(master: torch.Tensor, grad: torch.Tensor) -> None:
    """Add the low gradient ``grad`` into ``master.grad`` in fp32 (a cast when it has none yet)."""
    if grad.is_sparse:
        raise AmpNotImplementedError(
            "MasterWeightOptimizer(fp32_grad_accumulation=True) does not support sparse gradients; use dense ones "
            "(nn.Embedding(sparse=False)) or leave fp32_grad_accumulation off")
    with torch.no_grad():
        if master.grad is None:
            # (laid out as the master, as autograd would lay out its gradient; widening is exact)
            master.grad = torch.empty_like(master, memory_format=torch.preserve_format).copy_(grad)
        else:
            # fp32 += bf16: the low value widens exactly, then one fp32 rounding (alpha is 1: an FMA by 1 is exact)
            master.grad.add_(grad)


def _hook(low: torch.Tensor) -> None:
    claim_ = _CLAIMS.get(low)
    if claim_ is None or claim_.owner is None or claim_.owner() is None or low.grad is None:
        return
    add_into_master(claim_.master, low.grad)
    low.grad = None


def claim(low: torch.Tensor, master: torch.Tensor, owner: Any) -> None:
    """Make ``low``'s gradients go into ``master.grad`` (in fp32) while ``owner`` lives; registers the hook once."""
    entry = _CLAIMS.get(low)
    if entry is None:
        entry = _CLAIMS[low] = _Claim()
        entry.handle = low.register_post_accumulate_grad_hook(_hook)
    entry.master, entry.owner = master, weakref.ref(owner)


def release(lows: Iterable[torch.Tensor]) -> None:
    """Leave ``lows``' gradients where autograd puts them again (their hooks stay, inactive)."""
    for low in lows:
        entry = _CLAIMS.get(low)
        if entry is not None:
            entry.master = entry.owner = None


def drain(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Add any low gradient still held (set by hand, or from a backward before the claim) into its master; free it."""
    for low, master in pairs:
        grad = low.grad
        if grad is not None:
            add_into_master(master, grad)
            low.grad = None
