"""Constants a model derives from a dtype: which values are ``torch.finfo(D)``'s extremes, and which dtypes narrow ``D``.

Tracing evaluates ``torch.finfo(t.dtype).min`` once, so the graph holds the
number, not where it came from.  These rules let ``passes/retarget_dtype_constants``
recognise such a number (only the exact extremes count: an approximation of
one is the model's own number) and let ``passes/cast_params`` leave a traced
constant holding one for that pass to decide, instead of rounding fp32's
minimum to bf16's ``-inf``.
"""

from __future__ import annotations

import math
import re
from typing import Any, Optional

import torch

__all__ = ["MEMBERS", "LOW_DTYPES", "finfo_member", "origins", "narrows", "is_trace_constant", "holds_dtype_extreme"]

MEMBERS = ("min", "max", "eps", "tiny")  # tiny is finfo's smallest_normal
LOW_DTYPES = (torch.bfloat16, torch.float16)
_FLOATS = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
# Constants a trace makes (fx's _tensor_constant0, torch.export's lifted_tensor_0, retarget_dtype_constants'
# own copies of them): values of the program, not state a checkpoint loads.
_TRACE_CONSTANT = re.compile(r"(.*\.)?(_tensor_constant|lifted_tensor_)\d+(_retargeted(_\d+)?)?")


def finfo_member(value: Any, dtype: torch.dtype) -> Optional[str]:
    """Which of ``finfo(dtype).min/max/eps/tiny`` ``value`` is exactly, or None."""
    if type(value) is not float or not math.isfinite(value) or dtype not in _FLOATS:
        return None
    info = torch.finfo(dtype)
    return next((m for m in MEMBERS if getattr(info, m) == value), None)


def origins(value: Any, traced: Optional[torch.dtype]) -> list[tuple[torch.dtype, str]]:
    """(D, member) pairs ``value`` may be ``finfo(D).member`` of: D the traced dtype when known, else any floating one."""
    candidates = _FLOATS if traced is None else (traced,)
    found = [(dtype, finfo_member(value, dtype)) for dtype in candidates]
    return [(dtype, member) for dtype, member in found if member is not None]


def narrows(source: torch.dtype, low: Optional[torch.dtype]) -> bool:
    """``low`` is a low dtype that cannot hold all of ``source``'s values (a smaller range or a coarser step).

    fp32 -> bf16/fp16 narrows; so do fp16 -> bf16 (a coarser step) and bf16 -> fp16
    (a smaller range).  Nothing widening does: bf16 -> fp32 holds every bf16 value.
    """
    if low not in LOW_DTYPES or low == source or source not in _FLOATS:
        return False
    a, b = torch.finfo(source), torch.finfo(low)
    return b.max < a.max or b.eps > a.eps


def is_trace_constant(target: str) -> bool:
    """``target`` names a tensor constant the trace made (not a parameter or buffer of the model)."""
    return _TRACE_CONSTANT.fullmatch(target) is not None


def holds_dtype_extreme(target: str, tensor: torch.Tensor, low: torch.dtype) -> bool:
    """A one-element trace constant holding an extreme of its dtype that ``low`` holds otherwise (or not at all)."""
    if not is_trace_constant(target) or not tensor.is_floating_point() or tensor.numel() != 1:
        return False
    member = finfo_member(tensor.item(), tensor.dtype)
    return member is not None and narrows(tensor.dtype, low) and getattr(torch.finfo(low), member) != tensor.item()
