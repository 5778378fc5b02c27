"""``torch.finfo(x.dtype)`` on the symbolic route: read at run time from the graph's ``x.dtype``, not refused.

fx hands ``x.dtype`` to the model as a Proxy, and ``torch.finfo(proxy)``
raises (torch.finfo takes only a dtype), so the trace failed and the user was
sent to ``example_inputs=``.  For the duration of one trace ``torch.finfo``
records :func:`amp_fx.graph_ops.dtype_info.finfo_of` on the proxy instead
(``finfo.min`` is then a ``getattr`` node): the converted graph asks the
dtype ``x`` has when it runs, which after the rewrite is the low dtype where
``x`` runs low -- what the model computes under ``torch.autocast``, and what
``passes/retarget_dtype_constants`` makes of the number the export route
records.  A ``torch.finfo`` of a plain dtype is evaluated as before.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import torch
import torch.fx as fx

from amp_fx.graph_ops.dtype_info import finfo_of

__all__ = ["record_dtype_reads"]


@contextlib.contextmanager
def record_dtype_reads(tracer: fx.Tracer) -> Iterator[None]:
    """While ``tracer`` traces, ``torch.finfo(proxy)`` records a run-time read instead of raising."""
    original = torch.finfo

    @functools.wraps(original, updated=())
    def finfo(*args: Any, **kwargs: Any) -> Any:
        traced = [a for a in (*args, *kwargs.values()) if isinstance(a, fx.Proxy)]
        if traced and traced[0].tracer is tracer:
            return finfo_of(*args, **kwargs)
        return original(*args, **kwargs)

    torch.finfo = finfo
    try:
        yield
    finally:
        torch.finfo = original
