"""Run an O2/O3 module on low copies of the tensors ``torch.func.functional_call`` swaps in at other dtypes.

At O2 and O3 the graph computes with the module's low-precision parameters
and buffers.  ``functional_call(gm, params, args)`` puts the caller's
tensors in their places for one call; the common case is per-sample
gradients with respect to the fp32 masters
(``vmap(grad(loss))(masters, ...)``), and the graph would then meet an fp32
weight where it reads a bf16 one ("mat1 and mat2 must have the same dtype").

So before each call the converted module looks at the slots of its low
tensors: where a tensor of another floating dtype sits (functional_call put it
there), the call runs on that tensor's low copy, cast in the call, and the
caller's tensor is put back afterwards.  The cast is differentiable: the
gradient reaches the caller's fp32 tensor as the low gradient upcast (what
O2's master gradients are).  A tensor of the low dtype is used as it is.

Cost per call: one dict read and dtype check per low tensor (its time:
docs/performance.md, "Costs of the run-time checks"); nothing at O0/O1, which
keep the model's dtypes.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["swap_in_low_copies", "restore_swapped"]

# converted module -> ((slot dict, name), ...): where its low parameters and buffers live.
_SLOTS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _low_slots(module: nn.Module) -> tuple:
    """The (``_parameters`` or ``_buffers`` dict, name) of every tensor the conversion re-typed to the low dtype.

    Read from the state-dict keys the conversion recorded (``amp_fx_source_dtypes``
    holds exactly the re-typed ones), not from the tensors there now: the first
    call may already be inside a ``functional_call``.
    """
    slots = _SLOTS.get(module)
    if slots is None:
        found: dict[tuple[int, str], tuple] = {}
        for key in module.__dict__.get("amp_fx_source_dtypes") or {}:
            path, _, attr = key.rpartition(".")
            try:
                owner = module.get_submodule(path)
            except AttributeError:
                continue
            kind = owner._parameters if attr in owner._parameters else owner._buffers if attr in owner._buffers else None
            if kind is not None:
                found[(id(kind), attr)] = (kind, attr)
        slots = _SLOTS[module] = tuple(found.values())
    return slots


def swap_in_low_copies(module: nn.Module) -> Optional[list]:
    """Put low copies in the slots where a tensor of another dtype was swapped in; return what to restore, or None."""
    config = module.__dict__.get("amp_config")
    if config is None or not module.__dict__.get("amp_fx_source_dtypes"):
        return None  # O0/O1: the model's own dtypes, nothing re-typed
    low = config.low_dtype
    swapped = None
    for owner, attr in _low_slots(module):
        current = owner.get(attr)
        if current is None or current.dtype == low or current.dtype == torch.float64 or not current.is_floating_point():
            continue  # float64 is never cast (as autocast and the conversion never cast it)
        if swapped is None:
            swapped = []
        swapped.append((owner, attr, current))
        owner[attr] = current.to(low)  # differentiable: the caller's tensor gets the low gradient, upcast
    return swapped


def restore_swapped(swapped: list) -> None:
    """Put back the caller's tensors that :func:`swap_in_low_copies` replaced by their low copies."""
    for owner, attr, tensor in swapped:
        owner[attr] = tensor
