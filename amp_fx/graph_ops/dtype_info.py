"""``torch.finfo`` of a dtype a graph reads at run time (``torch.finfo(scores.dtype).min``), as one graph node.

A traced ``torch.finfo(x.dtype)`` would be evaluated once, with the dtype the
trace saw; recorded as a call of :func:`finfo_of` on the graph's own
``x.dtype`` it is evaluated every call, with the dtype ``x`` has then: bf16's
minimum where the rewrite made ``x`` bf16, as under ``torch.autocast``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Proxy
from torch.fx.graph import _register_custom_builtin

__all__ = ["finfo_of"]


def finfo_of(dtype: Any = None) -> Any:
    """``torch.finfo(dtype)``; recorded as one node when ``dtype`` is a traced value."""
    if isinstance(dtype, Proxy):
        return dtype.tracer.create_proxy("call_function", finfo_of, (dtype,), {})
    return torch.finfo() if dtype is None else torch.finfo(dtype)


finfo_of._amp_fx_op = "getattr"  # op_keys reads this: it reads a property of a dtype, no tensor arithmetic

_register_custom_builtin("finfo_of", "from amp_fx.graph_ops.dtype_info import finfo_of", finfo_of)
