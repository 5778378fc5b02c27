"""DTensor shards (FSDP2) as the training step sees them: this rank's shard, new shards, verdicts summed over ranks.

The optimizers and the loss scaler call these on every step; they need no
conversion code (:func:`~amp_fx.runtime.distributed.convert_for_sharding`
is what makes a model shardable).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

from amp_fx.errors import AmpRuntimeError

__all__ = [
    "is_dtensor", "local_tensor", "shard_like", "refuse_replaced_params", "reduce_found_inf", "reduce_over_ranks",
    "process_groups_of",
]


def is_dtensor(tensor: Any) -> bool:
    """Return whether ``tensor`` is a ``torch.distributed.tensor.DTensor`` (FSDP2's sharded parameters)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without distributed support
        return False
    return isinstance(tensor, DTensor)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view: in-place ops on it change the DTensor), or the tensor itself."""
    return tensor._local_tensor if is_dtensor(tensor) else tensor


def shard_like(full: torch.Tensor, like: torch.Tensor) -> nn.Parameter:
    """Return this rank's shard of the full tensor ``full``, as a DTensor Parameter placed like ``like``.

    Every rank holds the same ``full`` (the original model's fp32 parameter), so
    each slices its own shard locally: no communication, and the full copy can
    be dropped afterwards.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    assert isinstance(like, DTensor)
    shard = distribute_tensor(full.detach(), like.device_mesh, like.placements, src_data_rank=None)
    return nn.Parameter(shard.to(torch.float32), requires_grad=like.requires_grad)


def refuse_replaced_params(module: nn.Module, params: dict[str, torch.Tensor]) -> None:
    """Refuse a module whose parameters fully_shard replaced by DTensor shards after ``params`` were taken.

    ``params`` is ``{name: parameter}`` as a MasterWeightOptimizer recorded it;
    the masters would no longer reach the module (FSDP2 registers new
    Parameter objects), and training would silently stop.
    """
    for name, param in params.items():
        if is_dtensor(param):
            continue
        try:
            current = module.get_parameter(name)
        except AttributeError:
            continue
        if current is not param and is_dtensor(current):
            raise AmpRuntimeError(
                f"the module's parameter {name!r} was replaced by a DTensor shard after "
                "MasterWeightOptimizer was built (fully_shard after amp_fx.initialize or after "
                "MasterWeightOptimizer), so the masters would never reach the module. Shard first, "
                "then build the optimizer: gm = amp_fx.runtime.convert_for_sharding(model, 'O2', "
                "blocks=..., keep_batchnorm_fp32=False); fully_shard each block, then gm; then "
                "MasterWeightOptimizer(torch.optim.X(model.parameters()), gm). See docs/sharded.md."
            )


def reduce_found_inf(found: torch.Tensor, groups: Iterable[Any]) -> torch.Tensor:
    """Sum a 0-dim inf/NaN verdict over every rank of ``groups`` (in place; every rank must call it).

    One rank's overflow then skips the step on all of them, and their loss
    scales stay identical (what torch's ShardedGradScaler does for FSDP).
    """
    for group in groups:
        dist.all_reduce(found, op=dist.ReduceOp.SUM, group=group)
    return found


def reduce_over_ranks(found: dict, grads: list[torch.Tensor]) -> dict:
    """Sum per-device inf/NaN verdicts over the ranks the DTensor ``grads`` are sharded over (else as is)."""
    groups = process_groups_of(grads)
    if not groups:
        return found
    return {device: reduce_found_inf(flag, groups) for device, flag in found.items()}


def process_groups_of(tensors: Iterable[torch.Tensor]) -> list[Any]:
    """The distinct process groups over which the DTensors among ``tensors`` are sharded."""
    groups: dict[int, Any] = {}
    for tensor in tensors:
        if is_dtensor(tensor):
            mesh = tensor.device_mesh
            for dim in range(mesh.ndim):
                group = mesh.get_group(dim)
                groups.setdefault(id(group), group)
    return list(groups.values())
