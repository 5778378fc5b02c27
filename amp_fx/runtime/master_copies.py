"""Module parameters and their fp32 masters in (device, dtype) groups: one foreach copy per group each way.

A :class:`~amp_fx.runtime.MasterWeightOptimizer` step moves every low-precision
gradient into its master's fp32 gradient and every updated master back into
its low-precision parameter. Grouping the (parameter, master) pairs once by
device and dtypes makes each direction one ``torch._foreach_copy_`` per group
(on CUDA one multi-tensor kernel launch per group instead of one per
parameter, which mixed dtypes in one list would fall back to) and keeps the
per-step Python work to reading each parameter's ``.grad``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable

import torch

from .dtensors import is_dtensor, local_tensor
from amp_fx.errors import AmpNotImplementedError

__all__ = ["CopyGroup", "group_pairs"]


class CopyGroup:
    """(module parameter, master) pairs that share the parameter's device and both dtypes."""

    __slots__ = ("params", "masters", "sharded", "_local_params", "_local_masters")

    def __init__(self, params: list[torch.Tensor], masters: list[torch.Tensor]) -> None:
        self.params = params
        self.masters = masters
        # DTensor shards (FSDP2) are copied local shard to local shard; their local
        # tensors are looked up at every copy rather than cached.
        self.sharded = any(is_dtensor(t) for t in (*params, *masters))
        self._local_params = params
        self._local_masters = masters

    def _locals(self, tensors: list[torch.Tensor], cached: list[torch.Tensor]) -> list[torch.Tensor]:
        return [local_tensor(t) for t in tensors] if self.sharded else cached

    def copy_grads_to_masters(self) -> None:
        """Set each master's gradient to its parameter's (fp32 copy); None where the parameter has none.

        A master whose parameter has no gradient gets none either, so the
        optimizer skips it (no weight decay, no momentum step), as torch skips
        a parameter without a gradient.
        """
        grads = [p.grad for p in self.params]
        masters = self.masters
        if any(g is None for g in grads):
            for master, grad in zip(masters, grads):
                if grad is None:
                    master.grad = None
            masters = [m for m, g in zip(masters, grads) if g is not None]
            grads = [g for g in grads if g is not None]
            if not grads:
                return
        if any(g.is_sparse for g in grads):
            raise AmpNotImplementedError(
                "MasterWeightOptimizer does not support sparse gradients; use dense ones "
                "(e.g. nn.Embedding(sparse=False))"
            )
        for master in masters:
            if master.grad is None:
                master.grad = torch.empty_like(master, memory_format=torch.preserve_format)
        dst = [m.grad for m in masters]
        if self.sharded:
            dst, grads = [local_tensor(d) for d in dst], [local_tensor(g) for g in grads]
        torch._foreach_copy_(dst, grads)

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


def group_pairs(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> list[CopyGroup]:
    """Group (module parameter, master) pairs by the parameter's device, its dtype and the master's dtype."""
    by_key: dict[tuple, tuple[list, list]] = defaultdict(lambda: ([], []))
    for param, master in pairs:
        params, masters = by_key[(local_tensor(param).device, param.dtype, master.dtype)]
        params.append(param)
        masters.append(master)
    return [CopyGroup(params, masters) for params, masters in by_key.values()]
