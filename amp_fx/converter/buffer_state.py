"""O2/O3: the model and its converted module keep one buffer state.

At O2/O3 ``convert()`` copies the model (the converted module owns
low-precision parameters; the model's fp32 ones become the masters), but its
buffers are the model's own tensors wherever the converted module keeps their
dtype, so running statistics, counters and any buffer the forward updates in
place are updated on the model too:

- **Shared** (the same tensor in both): integer and bool buffers (counters,
  ``num_batches_tracked``), float64 ones, norm statistics under
  ``keep_batchnorm_fp32``, buffers read only in ``autocast(enabled=False)``
  regions, buffers already in the low dtype, and floating buffers that the
  forward writes in place outside a norm (an EMA, a float step counter):
  ``cast_params`` keeps those in their own dtype, because accumulated state
  loses more than one rounding in bf16/fp16 (an EMA's small updates round
  away), and autocast keeps them fp32 too; the ops reading them get casts
  like any fp32 value.
- **Own low copy, with the model's tensor as its source**: the other
  floating buffers (constants such as a rotary ``inv_freq``, and norm
  statistics at O3 or ``keep_batchnorm_fp32=False``, which must match the
  norm's low weight: batch norm refuses bf16 weights with fp32 statistics).
  The model's tensor is never re-typed. ``state_dict()`` gives the source
  while the copy still equals it rounded (the exact fp32 value), otherwise
  the copy widened; ``load_state_dict()`` loads into both; and after every
  forward in training mode a copy that no longer equals its source rounded
  (batch norm updated its statistics) is copied into the model's tensor, by
  a forward hook on the converted module.  By value, not by version
  counter: batch norm's kernels update their statistics without bumping
  it.  Eval-mode forwards check nothing (its time: docs/performance.md,
  "Costs of the run-time checks").  Copying after each forward was
  chosen over syncing lazily because a user reads the model's tensors
  directly (``model.bn.running_mean``), and nothing else would run first.

Not covered: a ``gm.forward(...)`` call that bypasses module hooks, a low copy
an opaque leaf module changes in eval mode, a write
into the model's tensor itself while the converted module trains (the next
training forward overwrites it with the module's state), and copies of the
converted module (``copy.deepcopy``, pickle), which hold their own state and
give it back through ``state_dict()``.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

import torch
import torch.nn as nn

from amp_fx.converter.weight_computations import refuse_legacy_weight_norm
from amp_fx.frontend.train_flags import FROZEN_ATTR

__all__ = ["copy_sharing_buffers", "attach_buffer_sources", "write_back_buffers", "source_value", "load_buffer_sources",
           "SOURCES_ATTR"]

SOURCES_ATTR = "amp_fx_buffer_sources"  # buffer name -> the model's tensor of that name
_COPIES_ATTR = "_amp_fx_buffer_copies"  # the module's own low copies, one entry per tensor (not carried by copies)
_EXPORTED = "traced with torch.export"  # FROZEN_ATTR's word for a graph whose train/eval mode is fixed


def copy_sharing_buffers(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose buffers are the model's own tensors (its modules and parameters are new)."""
    refuse_legacy_weight_norm(model)  # its weight is a hook-computed tensor: a copy cannot keep its meaning
    memo: dict[int, Any] = {id(buffer): buffer for buffer in model.buffers()}
    for module in model.modules():
        for value in module.__dict__.values():
            # A value an earlier forward left on the module (``self.last_norm = h.norm()``) is shared, not copied:
            # deepcopy refuses a tensor autograd recorded, and the copy's next forward replaces it anyway.
            if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                memo[id(value)] = value
    return copy.deepcopy(model, memo)


def _plain(tensor: Any) -> bool:
    return type(tensor) in (torch.Tensor, nn.Parameter)


def attach_buffer_sources(module: nn.Module, model: nn.Module) -> None:
    """Record, for each buffer of ``module`` that ``model`` has, the model's tensor; write back copies after forward."""
    originals = dict(model.named_buffers(remove_duplicate=False))
    sources = {name: originals[name] for name, _ in module.named_buffers(remove_duplicate=False) if name in originals}
    module.__dict__[SOURCES_ATTR] = sources
    copies: list[tuple[nn.Module, str, torch.Tensor]] = []  # (owning module, buffer's name there, the model's tensor)
    seen: set[int] = set()
    for name, tensor in module.named_buffers(remove_duplicate=False):
        source = sources.get(name)
        if source is None or tensor is source or id(tensor) in seen or not (_plain(tensor) and _plain(source)):
            continue
        seen.add(id(tensor))  # a buffer under two names is written back once
        path, _, leaf = name.rpartition(".")
        copies.append((module.get_submodule(path) if path else module, leaf, source))
    module.__dict__[_COPIES_ATTR] = copies
    if copies:
        module.register_forward_hook(write_back_buffers)


def write_back_buffers(module: nn.Module, args: Any, output: Any) -> None:
    """Forward hook: copy each own low buffer that a training forward changed into the model's tensor."""
    copies = module.__dict__.get(_COPIES_ATTR)
    if not copies:
        return
    traced = (module.__dict__.get(FROZEN_ATTR) or {}).get("")
    exported = traced[0] if traced is not None and traced[1] == _EXPORTED else None  # the mode the graph runs in
    with torch.no_grad():
        for owner, leaf, source in copies:
            if not (owner.training if exported is None else exported):
                continue  # eval mode updates no statistics: nothing to compare
            low = owner._buffers.get(leaf)
            if low is not None and low is not source and not torch.equal(source.to(device=low.device, dtype=low.dtype), low):
                source.copy_(low)


def source_value(module: nn.Module, name: str, low: torch.Tensor, dtype: torch.dtype) -> Any:
    """The model's tensor for buffer ``name`` when ``low`` is still it rounded (its exact value); else None."""
    source = (module.__dict__.get(SOURCES_ATTR) or {}).get(name)
    if source is None or not (_plain(source) and _plain(low)) or source.dtype != dtype or source.shape != low.shape:
        return None
    return source.detach() if torch.equal(source.detach().to(device=low.device, dtype=low.dtype), low) else None


def load_buffer_sources(module: nn.Module, state_dict: Mapping[str, Any]) -> None:
    """After ``module.load_state_dict``: give the model's tensors behind the module's low copies the loaded values.

    Shared buffers were loaded in place already; a low copy got the value
    rounded, the model's tensor gets it exactly (so ``state_dict()`` gives
    it back unchanged).
    """
    sources = module.__dict__.get(SOURCES_ATTR) or {}
    with torch.no_grad():
        for name, source in sources.items():
            value = state_dict.get(name)
            try:
                current = module.get_buffer(name)
            except AttributeError:
                continue
            if current is not source and _plain(value) and _plain(source) and value.shape == source.shape:
                source.copy_(value)
