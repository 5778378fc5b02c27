"""Weight casts cached across forwards, keyed to each parameter's version: in inference, and in training on request.

At O1 a converted module casts every fp32 parameter to the low dtype in every
forward.  Until the parameter changes, that cast gives the same tensor, so
:func:`cached_cast` keeps it and serves it again.  Two scopes
(``convert(cache_casts=...)``):

- ``True``: served only where autograd does not record the cast -- under
  ``torch.no_grad()`` / ``torch.inference_mode()``, or for a parameter that
  does not require grad.  A forward that records it (training) casts as an
  ordinary autograd op and drops what inference cached.
- ``"training"``: served in training too, so under gradient accumulation each
  weight is cast once per optimizer step, not once per micro-batch.  The first
  forward's cast is an ordinary autograd cast, ``w.to(dtype)``, and the cache
  keeps its output.  Its ``ToCopyBackward`` node saves no tensor, so autograd
  can run it again in every later backward without ``retain_graph``: each
  micro-batch's backward reaches the fp32 weight through it, casting that
  micro-batch's gradient up once, as the uncached form's own node would.  One
  node must not serve two uses whose backward runs in one pass (two forwards,
  then ``(l1 + l2).backward()``): autograd would add their low gradients in
  the low dtype before the one cast, where the uncached form adds them in
  fp32.  So the node is lent to one use at a time: a hook on it marks it free
  again when it has run, and a use while it is lent gets its own node
  (:class:`_ServedCast`, the same cast of the gradient in a Python backward)
  over the same copy.  Gradients equal the uncached form's bit for bit.

When a cached cast is served (all must hold, else it is an ordinary cast):

- the scope allows it (above);
- it is a plain tensor or ``nn.Parameter`` (no fake or functional tensor, not
  under ``torch.compile``/``torch.export``, which trace it as a plain cast, nor
  under a ``torch.func`` transform);
- the entry was made from this very parameter object at its current
  ``_version`` (every in-place change -- an optimizer step, ``load_state_dict``,
  ``with torch.no_grad(): w.add_(1)`` -- bumps it), with the same storage,
  shape and strides (``param.data = other`` changes those without a bump);
- no ``torch.optim`` optimizer stepped the parameter since: torch's fused
  CPU/CUDA kernels (``AdamW(fused=True)``, ``SGD(fused=True)``) update in place
  without bumping ``_version``, so a global optimizer step post-hook drops the
  entries of every parameter an optimizer just stepped (which also frees the
  copies at the step);
- an entry made under ``inference_mode`` (an inference tensor) is served only
  under ``inference_mode``.

Bounded memory: one entry per (parameter, dtype), 2 bytes per element for
bf16/fp16, dropped with the parameter (weak keys), replaced when stale,
dropped at each optimizer step over it, and (scope ``True``) dropped as soon
as the parameter is cast on the autograd path again.  In the training scope a
copy lives from the first forward to the step, where the uncached form frees
it after each backward passes it: backward's peak rises by up to the copies'
size.  :func:`cast_cache_size` and :func:`cast_cache_bytes` count them;
:func:`clear_cast_cache` drops every entry, or a module's.

The one hazard: a write through ``p.data`` (``p.data.mul_(0.5)``, an EMA or
clamp written as ``w.data.copy_(...)``, a hand-written update
``p.data -= lr * p.grad`` outside ``torch.optim``) is not seen, and the old
cast is served: ``p.data`` is a new alias with its own version counter, so the
write bumps nothing on ``p``, and the storage, shape and strides stay the same.
Nothing cheaper than reading the whole weight can tell, and a sound check (a
comparison with a kept copy) costs more than the cast it would save
(docs/performance.md, "O1 casts"; ``benchmarks/bench_o1_casts.py --only
cache``), so it is not detected. After such a write call
``gm.clear_cast_cache()`` (that module's parameters) or
``amp_fx.clear_cast_cache()`` (all); or write under ``torch.no_grad()``
without ``.data`` (``p.mul_(0.5)``), which bumps the version and is seen.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch.fx import Proxy
from torch.fx.graph import _register_custom_builtin
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["cached_cast", "clear_cast_cache", "cast_cache_size", "cast_cache_bytes"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)


@dataclass
class _Entry:
    version: int
    storage: int
    shape: tuple
    stride: tuple
    inference: bool
    value: torch.Tensor
    # Training scope: the value is an autograd cast's output; [True] while its node is lent to a use whose backward
    # has not run yet (the node's hook clears it).  A list, not the entry: the hook must not keep the value alive.
    lent: Optional[list] = None


# id(parameter) -> (weak reference to it, {dtype: entry}).  Keyed by id for a fast lookup; the
# weak reference both proves identity (an id may be reused after death) and removes the slot
# when the parameter dies, so an entry lives no longer than its parameter.
_CACHE: dict[int, tuple[weakref.ref, dict[torch.dtype, _Entry]]] = {}


def _forget(key: int, ref: weakref.ref) -> None:
    slot = _CACHE.get(key)
    if slot is not None and slot[0] is ref:
        del _CACHE[key]


def _fresh(entry: _Entry, param: torch.Tensor) -> bool:
    return (entry.version == param._version and entry.storage == param.data_ptr() and entry.shape == param.shape
            and entry.stride == param.stride() and (not entry.inference or torch.is_inference_mode_enabled()))


class _ServedCast(torch.autograd.Function):
    """A use of a cached low copy whose cast node is lent out: forward hands out an alias, backward casts the gradient up.

    A node of its own, so this use's gradient is cast up and added into the
    parameter's ``.grad`` in fp32 (AccumulateGrad sums, as for uncached casts).
    The alias is a new tensor per use: what a downstream op saves for backward
    then keeps this node as its ``grad_fn``, so double backward is exact too.
    """

    @staticmethod
    def forward(ctx: Any, param: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
        ctx.dtype = param.dtype
        return low.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], None]:
        # ToCopyBackward's own kernel for w.to(dtype): grad.to(w's dtype)
        return (grad.to(ctx.dtype) if grad is not None else None), None


def _lookup(param: torch.Tensor, dtype: torch.dtype) -> tuple[dict, Optional[_Entry]]:
    """``param``'s slot (created when missing) and its fresh entry for ``dtype``, if any."""
    key = id(param)
    slot = _CACHE.get(key)
    if slot is None or slot[0]() is not param:
        ref = weakref.ref(param, lambda r, key=key: _forget(key, r))
        slot = _CACHE[key] = (ref, {})
        _watch_optimizer_steps()
    entry = slot[1].get(dtype)
    return slot[1], (entry if entry is not None and _fresh(entry, param) else None)


def _store(entries: dict, param: torch.Tensor, dtype: torch.dtype, value: torch.Tensor, lent: Optional[list]) -> None:
    entries[dtype] = _Entry(param._version, param.data_ptr(), param.shape, param.stride(), value.is_inference(), value,
                            lent)


def _served(param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The cached cast where autograd does not record it, made (without autograd) when missing or stale."""
    entries, entry = _lookup(param, dtype)
    if entry is not None:
        return entry.value  # (a training entry's too: under no_grad its graph is not extended)
    with torch.no_grad():
        value = param.to(dtype)
    _store(entries, param, dtype, value, None)
    return value


def _free_again(lent: list) -> Callable[..., None]:
    def hook(grad_inputs: Any, grad_outputs: Any) -> None:
        lent[0] = False
    return hook


def _served_with_grad(param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The cached cast for a use autograd records (module docstring: one node, lent to one use at a time)."""
    entries, entry = _lookup(param, dtype)
    if entry is not None and entry.lent is not None:
        if entry.lent[0]:
            return _ServedCast.apply(param, entry.value)
        entry.lent[0] = True
        return entry.value
    value = param.to(dtype)  # this step's one cast, an autograd op; its node serves the next forwards
    lent = [True]
    value.grad_fn.register_hook(_free_again(lent))
    _store(entries, param, dtype, value, lent)
    return value


def cached_cast(param: Any, dtype: torch.dtype, training: bool = False) -> Any:
    """``param.to(dtype)``, served from the cache where the scope allows (module docstring).

    ``training=False`` (``cache_casts=True``): only where autograd would not
    record the cast.  ``training=True`` (``cache_casts="training"``): also
    where it would.
    """
    if isinstance(param, Proxy):  # fx re-traces a converted module: stay one node
        return param.tracer.create_proxy("call_function", cached_cast, (param, dtype),
                                         {"training": True} if training else {})
    if not isinstance(param, torch.Tensor) or param.dtype == dtype or not param.is_floating_point():
        return param.to(dtype) if isinstance(param, torch.Tensor) and param.is_floating_point() else param
    if type(param) not in _PLAIN or torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return param.to(dtype)
    if torch.is_grad_enabled() and param.requires_grad:
        if training:
            return _served_with_grad(param, dtype)
        key = id(param)
        if key in _CACHE and _CACHE[key][0]() is param:
            del _CACHE[key]  # back on the autograd path (training): free what inference cached
        return param.to(dtype)
    return _served(param, dtype)


cached_cast._amp_fx_cast = True  # op_keys reads this: the node is a cast, not an op


def clear_cast_cache(module: Optional[torch.nn.Module] = None) -> None:
    """Drop every cached weight cast, or only those of ``module``'s parameters and buffers.

    The way to invalidate after a write the cache cannot see (through
    ``p.data``, module docstring); ``AmpGraphModule.clear_cast_cache()`` calls
    it with the converted module.
    """
    if module is None:
        _CACHE.clear()
        return
    for tensor in (*module.parameters(), *module.buffers()):
        slot = _CACHE.get(id(tensor))
        if slot is not None and slot[0]() is tensor:
            del _CACHE[id(tensor)]


def cast_cache_size() -> int:
    """How many (parameter, dtype) casts are cached now."""
    return sum(len(entries) for _, entries in _CACHE.values())


def cast_cache_bytes() -> int:
    """How many bytes the cached casts hold now (their own storage: 2 per element for bf16/fp16)."""
    return sum(e.value.untyped_storage().nbytes() for _, entries in _CACHE.values() for e in entries.values())


# The global optimizer step post-hook, registered with the first entry (torch.optim calls it after every step).
_STEP_HOOK: Optional[Any] = None


def _watch_optimizer_steps() -> None:
    global _STEP_HOOK
    if _STEP_HOOK is None:
        _STEP_HOOK = register_optimizer_step_post_hook(_after_step)


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Drop the entries of every parameter ``optimizer`` just stepped: fused kernels bump no version, and the step
    is where a training cache's copies are freed."""
    if not _CACHE:
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            slot = _CACHE.get(id(param))
            if slot is not None and slot[0]() is param:
                del _CACHE[id(param)]


# Generated code names the helper with an import line (GraphModule.to_folder, pickling).
_register_custom_builtin(cached_cast.__name__, f"from amp_fx.graph_ops.cast_cache import {cached_cast.__name__}", cached_cast)
