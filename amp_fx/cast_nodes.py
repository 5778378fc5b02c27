"""Recognise cast nodes in a graph: the ones amp_fx inserted and the ones the model wrote."""

from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from amp_fx.casts import amp_cast

__all__ = ["is_inserted_cast", "is_model_cast", "cast_source", "cast_target"]

_NAMED_CASTS = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16, "double": torch.float64}


def is_inserted_cast(node: fx.Node) -> bool:
    """True for a ``.to(dtype)`` or ``amp_cast`` node that amp_fx inserted."""
    return bool(node.meta.get("amp_fx.inserted")) and cast_target(node) is not None


def is_model_cast(node: fx.Node) -> bool:
    """True for a cast the model itself wrote to a floating dtype (``x.float()``, ``x.to(torch.half)``)."""
    return not node.meta.get("amp_fx.inserted") and cast_target(node) is not None


def cast_source(node: fx.Node) -> Optional[fx.Node]:
    """The value a cast node reads."""
    source = node.args[0] if node.args else None
    return source if isinstance(source, fx.Node) else None


def cast_target(node: fx.Node) -> Optional[torch.dtype]:
    """The floating dtype a cast node produces, or None when ``node`` is not a simple float cast."""
    if node.op == "call_function" and node.target is amp_cast:
        return node.args[1]
    if node.op != "call_method":
        return None
    if node.target in _NAMED_CASTS and len(node.args) == 1 and not node.kwargs:
        return _NAMED_CASTS[node.target]
    if node.target == "to" and len(node.args) == 2 and not node.kwargs:
        dtype = node.args[1]
        if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
            return dtype
    return None
