"""Module parameters and their fp32 masters in (device, dtype) groups: one foreach copy per group each way.

A :class:`~amp_fx.runtime.MasterWeightOptimizer` step moves every low-precision
gradient into its master's fp32 gradient and every updated master back into
its low-precision parameter. Grouping the (parameter, master) pairs once by
device and dtypes makes each direction one ``torch._foreach_copy_`` per group
(on CUDA one multi-tensor kernel launch per group instead of one per
parameter, which mixed dtypes in one list would fall back to) and keeps the
per-step Python work to reading each parameter's ``.grad``. Each group keeps
one fp32 gradient buffer per master and reuses it whenever the master's
gradient was set to None since the last step, unless anybody else still
holds it (a stash of gradients, a view, a user's variable: it is then left to
them and a new one kept). Why: on CPU a tensor above glibc's mmap threshold
(32 MiB at most) is fresh memory at every allocation, and its page faults
cost more than the copy (measured: docs/performance.md, "The lean O2 update";
``benchmarks/bench_o2_step.py --width 4096``).
"""

from __future__ import annotations

import sys
from collections import defaultdict
from typing import Iterable

import torch

from .dtensors import is_dtensor, local_tensor
from .overflow import check_and_unscale_into_
from amp_fx.errors import AmpNotImplementedError

__all__ = ["CopyGroup", "group_pairs"]

_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _references(buffers: list, i: int) -> tuple[int, int]:
    """(Python references, storage users) of ``buffers[i]``, counted without binding it to a name here."""
    if _storage_use_count is None:
        return sys.getrefcount(buffers[i]), -1
    return sys.getrefcount(buffers[i]), _storage_use_count(buffers[i].untyped_storage()._cdata)


# What _references() reports for a tensor that only its list holds (measured, not assumed: the
# interpreter's reference counting differs between versions). Anything else means somebody still
# holds the buffer (a stash of gradients, a view, a user's variable), and it must not be overwritten.
_SOLE = _references([torch.empty(1)], 0)


class CopyGroup:
    """(module parameter, master) pairs that share the parameter's device and both dtypes."""

    __slots__ = ("params", "masters", "sharded", "keep_buffers", "buffers", "_local_params", "_local_masters")

    def __init__(self, params: list[torch.Tensor], masters: list[torch.Tensor], keep_buffers: bool = True) -> None:
        self.params = params
        self.masters = masters
        # One fp32 gradient buffer per master, reused from step to step when the
        # masters' gradients were set to None in between (4 bytes per parameter, held).
        self.keep_buffers = keep_buffers
        self.buffers: list[torch.Tensor | None] = [None] * len(masters)
        # DTensor shards (FSDP2) are copied local shard to local shard; their local
        # tensors are looked up at every copy rather than cached.
        self.sharded = any(is_dtensor(t) for t in (*params, *masters))
        self._local_params = params
        self._local_masters = masters

    def _locals(self, tensors: list[torch.Tensor], cached: list[torch.Tensor]) -> list[torch.Tensor]:
        return [local_tensor(t) for t in tensors] if self.sharded else cached

    def copy_grads_to_masters(self, check: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Set each master's gradient to its parameter's (fp32 copy); None where the parameter has none.

        ``check`` ``(found_inf, inv)`` (0-dim float32 tensors on the group's
        device): also check each copied gradient for inf/NaN and multiply it by
        ``inv``, right after its copy, while it is still in cache (GradScaler's
        kernel, one call per gradient; the same bits as one call over all).

        A master whose parameter has no gradient gets none either, so the
        optimizer skips it (no weight decay, no momentum step), as torch skips
        a parameter without a gradient. A master without a gradient gets its
        kept buffer back (``keep_buffers``): no allocation, and no page faults
        on fresh memory, per step.
        """
        dst, src = self._attach()
        if not dst:
            return
        if self.sharded:
            dst, src = [local_tensor(d) for d in dst], [local_tensor(g) for g in src]
        if check is None:
            torch._foreach_copy_(dst, src)
            return
        found_inf, inv = check
        for d, g in zip(dst, src):
            d.copy_(g)
            check_and_unscale_into_([d], found_inf, inv)

    def _attach(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Give each master whose parameter has a gradient an fp32 gradient to copy into (others None); (into, from)."""
        dst, src = [], []
        for i, (param, master) in enumerate(zip(self.params, self.masters)):
            grad = param.grad
            if grad is None:
                master.grad = None
                continue
            if grad.is_sparse:
                raise AmpNotImplementedError(
                    "MasterWeightOptimizer does not support sparse gradients; use dense ones "
                    "(e.g. nn.Embedding(sparse=False))"
                )
            target = master.grad
            if target is None:
                target = master.grad = self._buffer(i, master)
            dst.append(target)
            src.append(grad)
        return dst, src

    def grad_sources(self, sources: dict[int, torch.Tensor]) -> None:
        """Map ``id(master)`` to its parameter's gradient in ``sources`` and clear the master's: the chunked step
        (:mod:`amp_fx.runtime.chunked_step`) reads the low gradients through a scratch buffer, not the masters'."""
        for param, master in zip(self.params, self.masters):
            master.grad = None
            grad = param.grad
            if grad is None:
                continue
            if grad.is_sparse:
                raise AmpNotImplementedError(
                    "MasterWeightOptimizer does not support sparse gradients; use dense ones "
                    "(e.g. nn.Embedding(sparse=False))"
                )
            sources[id(master)] = grad

    def _buffer(self, i: int, master: torch.Tensor) -> torch.Tensor:
        """The kept fp32 gradient buffer of master ``i``; a new one on first use, or when the master changed or
        anyone but this group still holds the old one (Apex's ``scale_loss`` stashes the masters' gradients)."""
        if self._reusable(i, master):
            return self.buffers[i]
        # (laid out as the master, as autograd would lay out its gradient)
        fresh = torch.empty_like(master, memory_format=torch.preserve_format)
        if self.keep_buffers and not self.sharded:  # (DTensor shards: allocated per step)
            self.buffers[i] = fresh
        return fresh

    def _reusable(self, i: int, master: torch.Tensor) -> bool:
        kept = self.buffers[i]
        if kept is None or kept.shape != master.shape or kept.dtype != master.dtype or kept.device != master.device:
            return False
        del kept  # (a name bound here would count as one more holder below)
        return _SOLE[1] >= 0 and _references(self.buffers, i) == _SOLE

    def buffer_bytes(self) -> int:
        """Bytes held by kept gradient buffers that are not a master's ``.grad`` right now."""
        return sum(b.numel() * b.element_size() for b, m in zip(self.buffers, self.masters)
                   if b is not None and m.grad is not b)

    def copy_masters_to_params(self) -> None:
        """Round every master into its parameter (all of them: an unchanged master rewrites the same value)."""
        torch._foreach_copy_(self._locals(self.params, self._local_params),
                             self._locals(self.masters, self._local_masters))

    def clear_param_grads(self, set_to_none: bool) -> None:
        """Reset the parameters' gradients (the masters' are the wrapped optimizer's to reset)."""
        if set_to_none:
            for param in self.params:
                param.grad = None
            return
        grads = [p.grad for p in self.params if p.grad is not None]
        for grad in grads:
            if grad.grad_fn is not None:
                grad.detach_()
        if grads:
            torch._foreach_zero_(grads)


def group_pairs(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], keep_buffers: bool = True) -> list[CopyGroup]:
    """Group (module parameter, master) pairs by the parameter's device, its dtype and the master's dtype."""
    by_key: dict[tuple, tuple[list, list]] = defaultdict(lambda: ([], []))
    for param, master in pairs:
        params, masters = by_key[(local_tensor(param).device, param.dtype, master.dtype)]
        params.append(param)
        masters.append(master)
    return [CopyGroup(params, masters, keep_buffers) for params, masters in by_key.values()]
