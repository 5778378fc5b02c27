"""What amp_fx watches while it traces a model symbolically: one context manager that installs every hook.

Symbolic tracing runs ``forward`` once with proxies and keeps the tensor ops
it sees.  Constructs with a meaning of their own are either kept (custom
autograd Functions stay one node, checkpoint calls stay checkpointed) or
refused with an error naming the construct, its line and the route that
works (Python state changed during forward, context managers amp_fx does
not know).  See :mod:`amp_fx.frontend.opaque_calls`, :mod:`amp_fx.frontend.checkpoint_regions`
and :mod:`amp_fx.frontend.trace_guards`.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch.fx as fx

from amp_fx.frontend.checkpoint_regions import record_checkpoints
from amp_fx.frontend.dtype_reads import record_dtype_reads
from amp_fx.frontend.opaque_calls import record_function_calls
from amp_fx.frontend.trace_guards import NOTES_KEY, refuse_state_changes, watch_context_managers

__all__ = ["front_end_hooks", "take_trace_notes"]


@contextlib.contextmanager
def front_end_hooks(tracer: fx.Tracer) -> Iterator[None]:
    """Install, for the duration of one trace with ``tracer``, every hook of the symbolic front end."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(record_function_calls(tracer))
        stack.enter_context(record_checkpoints(tracer))
        stack.enter_context(refuse_state_changes(tracer))
        stack.enter_context(watch_context_managers(tracer))
        stack.enter_context(record_dtype_reads(tracer))
        yield


def take_trace_notes(gm: fx.GraphModule) -> list[str]:
    """Remove and return the notes the trace left on the output node for the report (what it fixed or let through).

    Taken by the last pass (``passes/outline_checkpoints.py``), which also
    outlines the checkpointed regions, after the report has been read.
    """
    output = next((n for n in reversed(gm.graph.nodes) if n.op == "output"), None)
    return list(output.meta.pop(NOTES_KEY, [])) if output is not None else []
