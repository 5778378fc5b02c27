"""Small helpers over what a graph node computed: its floating tensors, their inf/NaN count, magnitude and dtype.

The overflow finder, calibration and the summary all read node values that
may be a tensor, a tuple, a list or a dict of them; these helpers see through
that nesting once, here.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.utils import _pytree as pytree

__all__ = ["LOW_DTYPES", "float_tensors", "nonfinite_count", "max_abs", "value_dtype", "plain_containers"]

LOW_DTYPES = (torch.float16, torch.bfloat16)


def float_tensors(value: Any) -> list[torch.Tensor]:
    """The floating tensors inside ``value`` (tensors, tuples, lists, dicts)."""
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def nonfinite_count(value: Any) -> int:
    """How many inf/NaN elements ``value`` holds."""
    return sum(int((~torch.isfinite(t)).sum()) for t in float_tensors(value))


def max_abs(value: Any) -> float:
    """Largest finite magnitude inside ``value`` (0.0 when there is none)."""
    best = 0.0
    for t in float_tensors(value):
        finite = t.detach()[torch.isfinite(t.detach())]
        if finite.numel():
            best = max(best, float(finite.abs().max()))
    return best


def value_dtype(value: Any) -> Optional[torch.dtype]:
    """The dtype of the first floating tensor in ``value``."""
    tensors = float_tensors(value)
    return tensors[0].dtype if tensors else None


def plain_containers(value: Any) -> Any:
    """fx's immutable dicts and lists as plain ones (``functional_call`` mutates its parameter dict)."""
    if isinstance(value, dict):
        return {k: plain_containers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_containers(v) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(plain_containers(v) for v in value)
    return value
