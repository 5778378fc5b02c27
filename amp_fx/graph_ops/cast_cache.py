"""Weight casts cached across forwards wherever autograd does not record them (inference), keyed to each parameter's version.

At O1 a converted module casts every fp32 parameter to the low dtype in every
forward.  In training that cast must be an autograd op (the low gradient flows
back into the fp32 parameter), but under ``torch.no_grad()`` /
``torch.inference_mode()``, or for a parameter that does not require grad,
nothing records it, and the same parameter gives the same cast until it
changes.  :func:`cached_cast` keeps that cast and serves it again.

When a cached cast is served (all must hold, else it is an ordinary cast):

- autograd would not record the cast: grad mode is off, or the parameter does
  not require grad;
- it is a plain tensor or ``nn.Parameter`` (no fake or functional tensor, not
  under ``torch.compile``/``torch.export``, which trace it as a plain cast);
- the entry was made from this very parameter object at its current
  ``_version`` (every in-place change -- an optimizer step, ``load_state_dict``,
  ``with torch.no_grad(): w.add_(1)`` -- bumps it), with the same storage,
  shape and strides (``param.data = other`` changes those without a bump);
- an entry made under ``inference_mode`` (an inference tensor) is served only
  under ``inference_mode``.

Bounded memory: one entry per (parameter, dtype), dropped with the parameter
(weak keys), replaced when stale, and dropped as soon as the parameter is
cast on the autograd path again (training frees the copies inference made).
:func:`clear_cast_cache` drops every entry, or a module's.

The one hazard: a write through ``p.data`` (``p.data.mul_(0.5)``, an EMA or
clamp written as ``w.data.copy_(...)``) is not seen, and the old cast is
served: ``p.data`` is a new alias with its own version counter, so the write
bumps nothing on ``p``, and the storage, shape and strides stay the same.
Nothing cheaper than reading the whole weight can tell (measured on one CPU
thread, 1024x1024 fp32: a cached read 1.3 us, the bf16 cast it saves 117 us,
a ``sum`` of the weight 50 us and not even sound, ``torch.equal`` against a
kept copy 1354 us), so it is not detected. After such a write call
``gm.clear_cast_cache()`` (that module's parameters) or
``amp_fx.clear_cast_cache()`` (all); or write under ``torch.no_grad()``
without ``.data`` (``p.mul_(0.5)``), which bumps the version and is seen.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.fx import Proxy
from torch.fx.graph import _register_custom_builtin

__all__ = ["cached_cast", "clear_cast_cache", "cast_cache_size"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)


@dataclass
class _Entry:
    version: int
    storage: int
    shape: tuple
    stride: tuple
    inference: bool
    value: torch.Tensor


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


def cached_cast(param: Any, dtype: torch.dtype) -> Any:
    """``param.to(dtype)``, served from the cache where autograd would not record the cast (module docstring)."""
    if isinstance(param, Proxy):  # fx re-traces a converted module: stay one node
        return param.tracer.create_proxy("call_function", cached_cast, (param, dtype), {})
    if not isinstance(param, torch.Tensor) or param.dtype == dtype or not param.is_floating_point():
        return param.to(dtype) if isinstance(param, torch.Tensor) and param.is_floating_point() else param
    key = id(param)
    if (type(param) not in _PLAIN or torch.compiler.is_compiling()
            or (torch.is_grad_enabled() and param.requires_grad)):
        if key in _CACHE and _CACHE[key][0]() is param:
            del _CACHE[key]  # back on the autograd path (training): free what inference cached
        return param.to(dtype)
    slot = _CACHE.get(key)
    if slot is not None and slot[0]() is param:
        entry = slot[1].get(dtype)
        if entry is not None and _fresh(entry, param):
            return entry.value
    else:
        ref = weakref.ref(param, lambda r, key=key: _forget(key, r))
        slot = _CACHE[key] = (ref, {})
    with torch.no_grad():
        value = param.to(dtype)
    slot[1][dtype] = _Entry(param._version, param.data_ptr(), param.shape, param.stride(), value.is_inference(), value)
    return value


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


# Generated code names the helper with an import line (GraphModule.to_folder, pickling).
_register_custom_builtin(cached_cast.__name__, f"from amp_fx.graph_ops.cast_cache import {cached_cast.__name__}", cached_cast)
