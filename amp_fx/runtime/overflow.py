"""Fused inf/NaN detection and unscaling of an optimizer's gradients.

Gradients are checked and unscaled by one call of torch's fused kernel
(``torch._amp_foreach_non_finite_check_and_unscale_``, GradScaler's; in torch
2.13 it takes fp16, bf16, fp32 and fp64 on CPU as on CUDA) per (device, dtype)
group; a backend without it gets a foreach fallback. Everything stays on the
device: the verdict is a 0-dim float32 tensor per device (non-zero means
"found inf/NaN"), so checking a model of any size costs no host
synchronisation. The caller decides when to read it (once per step).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable

import torch

from .dtensors import local_tensor
from amp_fx.errors import PACKAGE, AmpNotImplementedError, AmpTypeError

__all__ = ["check_and_unscale_", "check_and_unscale_into_", "grads_of", "combined_found_inf"]


def grads_of(param_groups: Iterable[dict]) -> list[torch.Tensor]:
    """Return the gradients held by the params of ``param_groups`` (None skipped)."""
    grads = []
    for group in param_groups:
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                continue
            if grad.is_sparse:
                # Sparse grads would need coalescing before a trustworthy inf check
                # (duplicate indices can overflow only once summed); nobody in the
                # mixed-precision path produces them, so refuse rather than guess.
                raise AmpNotImplementedError(
                    f"{PACKAGE}.runtime.LossScaler does not support sparse gradients "
                    f"(parameter of shape {tuple(param.shape)}); use dense gradients "
                    "(e.g. nn.Embedding(sparse=False)) or torch.amp.GradScaler."
                )
            if not grad.is_floating_point():
                raise AmpTypeError(
                    f"gradient of dtype {grad.dtype} cannot be checked for inf/NaN"
                )
            grads.append(grad)
    return grads


def check_and_unscale_(
    grads: list[torch.Tensor], inv_scale: float
) -> dict[torch.device, torch.Tensor]:
    """Multiply ``grads`` in place by ``inv_scale`` and flag inf/NaN, per device.

    Returns ``{device: found_inf}`` with ``found_inf`` a 0-dim float32 tensor
    that is > 0 when any gradient on that device held inf or NaN. Devices with
    no gradients are absent. ``inv_scale == 1.0`` is a pure check (x * 1 == x).
    """
    by_device: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = (
        defaultdict(lambda: defaultdict(list))
    )
    for grad in grads:
        if type(grad) is not torch.Tensor:  # (the common plain tensor skips the DTensor test)
            grad = local_tensor(grad)  # a DTensor shard: check and unscale the local values in place
        by_device[grad.device][grad.dtype].append(grad)

    found: dict[torch.device, torch.Tensor] = {}
    with torch.no_grad():
        for device, per_dtype in by_device.items():
            found_inf = torch.zeros((), dtype=torch.float32, device=device)
            # The fused kernel wants inv_scale as a float32 tensor on the grads' device;
            # building it from a host float is a fill, not a sync.
            inv = torch.full((), inv_scale, dtype=torch.float32, device=device)
            for same_dtype in per_dtype.values():
                _check_and_unscale_one_dtype(same_dtype, found_inf, inv)
            found[device] = found_inf
    return found


def check_and_unscale_into_(grads: list[torch.Tensor], found_inf: torch.Tensor, inv: torch.Tensor) -> None:
    """:func:`check_and_unscale_` for same-device, same-dtype ``grads`` into a verdict the caller holds.

    ``found_inf`` (0-dim float32) is added to when inf/NaN is found; ``inv`` is the
    reciprocal scale as a 0-dim float32 tensor on the same device. Lets a caller
    check each gradient right after writing it, while it is still in cache
    (:meth:`amp_fx.runtime.master_copies.CopyGroup.copy_grads_to_masters`).
    """
    _check_and_unscale_one_dtype(grads, found_inf, inv)


def _check_and_unscale_one_dtype(
    grads: list[torch.Tensor], found_inf: torch.Tensor, inv: torch.Tensor
) -> None:
    try:
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv)
    except (NotImplementedError, RuntimeError) as err:
        # Devices without the fused kernel (some backends lack it): the same
        # result from generic ops, still without reading anything on the host.
        if "not implemented" not in str(err).lower() and not isinstance(
            err, NotImplementedError
        ):
            raise
        _flag_non_finite(grads, found_inf)
        torch._foreach_mul_(grads, inv)  # in fp32 and rounded once, as the fused kernel


def _flag_non_finite(grads: list[torch.Tensor], found_inf: torch.Tensor) -> None:
    """Add 1 to ``found_inf`` if any of ``grads`` holds inf/NaN: foreach passes, no host read."""
    # x * 0 is 0 for finite x and NaN for inf or NaN, and max propagates NaN; unlike
    # a norm, nothing here can overflow on large finite values.
    grads = [g for g in grads if g.numel()]  # max() of an empty tensor is an error
    if grads:
        peaks = torch.stack(torch._foreach_max(torch._foreach_mul(grads, 0.0)))
        found_inf.add_(peaks.isnan().any().to(found_inf.dtype))


def combined_found_inf(per_device: dict[torch.device, torch.Tensor]) -> torch.Tensor | None:
    """Sum per-device verdicts onto one device (no sync); None when there are none."""
    tensors = list(per_device.values())
    if not tensors:
        return None
    total = tensors[0].clone()
    for other in tensors[1:]:
        total += other.to(total.device, non_blocking=True)
    return total
