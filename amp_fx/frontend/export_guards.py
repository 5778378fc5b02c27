"""Refuse, while ``torch.export`` traces a model for ``convert()``, what that route would change silently.

``torch.export`` (non-strict) runs ``forward`` once on fake tensors and keeps
ATen ops.  It inlines ``torch.utils.checkpoint`` (the activation-memory
saving is lost), freezes a Python attribute that forward changes, and keeps
no context manager.  :func:`watch_export` raises
:class:`~amp_fx.errors.UnsupportedConstructError` for each, naming the line
and the route that keeps it; the same state-change and context-manager
watch as on the symbolic route is reused (see :mod:`amp_fx.frontend.trace_guards`).
Custom ``torch.autograd.Function`` calls, which export would trace through
(dropping their backward), are kept whole instead
(:mod:`amp_fx.frontend.export_functions`, used by the export call itself).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch.nn as nn
import torch.utils.checkpoint as torch_checkpoint

from amp_fx.errors import UnsupportedConstructError
from amp_fx.frontend.source_lines import current_user_line
from amp_fx.frontend.trace_guards import NOTES_KEY, refuse_state_changes, watch_context_managers

__all__ = ["watch_export", "watched_export"]

_ROUTE = (
    "Routes that keep it: torch.compile(model, backend='amp_fx'); or make the model symbolically traceable "
    "(amp_fx.convert keeps checkpointed regions on that route)."
)


class _ExportScope:
    """Stands in for a tracer in the shared watches: the model being exported, and the notes they leave."""

    graph = None

    def __init__(self, model: nn.Module):
        self.root = model
        self.amp_fx_notes: list[str] = []


def _refuse(construct: str, what: str) -> None:
    where = current_user_line() or "unknown source line"
    raise UnsupportedConstructError(
        f"{what}\n  at {where}\nThis model is traced with torch.export (symbolic tracing failed), which {construct}. "
        f"amp_fx refused instead of changing what the model computes.\n{_ROUTE}",
        construct=construct, where=where,
    )


@contextlib.contextmanager
def _refuse_checkpoints() -> Iterator[None]:
    original_checkpoint = getattr(torch_checkpoint.checkpoint, "__wrapped__", torch_checkpoint.checkpoint)
    missing = object()
    previous = original_checkpoint.__dict__.get("__dynamo_disable", missing)

    def checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
        _refuse("inlines checkpointed regions, losing their activation-memory saving",
                "the model calls torch.utils.checkpoint.checkpoint")

    original_checkpoint.__dynamo_disable = checkpoint
    try:
        yield
    finally:
        if previous is missing:
            del original_checkpoint.__dynamo_disable
        else:
            original_checkpoint.__dynamo_disable = previous


@contextlib.contextmanager
def watch_export(model: nn.Module) -> Iterator[list[str]]:
    """While ``torch.export`` traces ``model``: refuse what it would drop; yield the list of notes it leaves."""
    scope = _ExportScope(model)
    with _refuse_checkpoints(), refuse_state_changes(scope), watch_context_managers(scope):
        yield scope.amp_fx_notes


def watched_export(model: nn.Module, export: Any) -> Any:
    """Run ``export()`` (which traces ``model`` with torch.export) under :func:`watch_export`; its notes go to the report."""
    with watch_export(model) as notes:
        gm = export()
    output = next((n for n in reversed(gm.graph.nodes) if n.op == "output"), None)
    if notes and output is not None:
        output.meta.setdefault(NOTES_KEY, []).extend(notes)
    return gm
