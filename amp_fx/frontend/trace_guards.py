"""Refuse, while tracing, what a symbolic trace or torch.export would silently freeze or drop.

Symbolic tracing runs ``forward`` once.  Two kinds of construct change
meaning in the traced graph without any error from fx:

- **Python state changed by forward** (``self.calls += 1``,
  ``self.last = h``): the assignment runs once, at conversion, and the
  converted module keeps that value forever.  :func:`refuse_state_changes`
  stops the assignment (so the model is not mutated either) and raises.
- **Context managers that change how ops run** (``torch.random.fork_rng``,
  ``torch.nn.attention.sdpa_kernel``, ``torch.backends.*.flags``,
  ``saved_tensors_hooks``, Python ``TorchFunctionMode`` / ``TorchDispatchMode``):
  the graph keeps the ops inside but not the context.
  :func:`watch_context_managers` refuses the ones PyTorch defines; a
  ``@contextlib.contextmanager`` of the model's own is only noted in the
  report (it runs once during the trace, like any Python in forward).

Grad-mode and autocast regions are not watched here: they are recorded and
kept (see the tracer's region hooks).  Not detectable this way: state kept in
containers (``self.cache.append(h)``, ``self.stats["n"] += 1``), writes
through ``object.__setattr__`` or ``__dict__``, class-based context managers
defined outside PyTorch, and ``with torch.device(...)``.

``torch.export`` (non-strict) also runs ``forward`` once, on fake tensors,
and keeps ATen ops: it freezes the same Python state, keeps no context
manager, and inlines ``torch.utils.checkpoint`` (the activation-memory saving
is lost).  :func:`watch_export` runs the same two watches while it traces
and refuses checkpoint calls, naming the line and the route that keeps them.
Custom ``torch.autograd.Function`` calls, which export would trace through
(dropping their backward), are kept whole instead
(:mod:`amp_fx.frontend.opaque_calls`, used by the export call itself).

The notes the watches leave for the report sit on the graph's output node
(``NOTES_KEY``) until :func:`take_trace_notes` takes them.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
from typing import Any, Iterator, Optional

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils.checkpoint as torch_checkpoint

from amp_fx.errors import UnsupportedConstructError
from amp_fx.frontend.source_lines import current_user_line, is_user_file
from amp_fx.ir import meta

__all__ = ["refuse_state_changes", "watch_context_managers", "watch_export", "watched_export", "take_trace_notes", "NOTES_KEY",
           "HARMLESS_CONTEXT_MANAGERS"]

NOTES_KEY = meta.TRACE_NOTES  # the output node's notes for the report
_ACTIVE = threading.local()
_ROUTES = (
    "Routes that keep it: torch.compile(model, backend='amp_fx') (Dynamo captures it and converts the graphs it "
    "makes), or leaf_modules=[the module whose forward does this] to keep that module whole (it then runs as "
    "written, in the dtype its inputs arrive in)."
)
# PyTorch's @contextmanager functions that change nothing a graph computes.
HARMLESS_CONTEXT_MANAGERS = frozenset({
    "torch.nn.utils.parametrize.cached",
    "torch.autograd.profiler.record_function",
    "torch.profiler.record_function",
})


def _from_user_code(depth: int = 2) -> bool:
    """True when the caller ``depth`` frames up is the model's code (not torch's, amp_fx's or the standard library's)."""
    return is_user_file(sys._getframe(depth).f_code.co_filename)


def _module_path(tracer: fx.Tracer, module: nn.Module) -> Optional[str]:
    root = getattr(tracer, "root", None)
    if root is None:
        return None
    names = tracer.__dict__.get("_amp_fx_module_names")
    if names is None:
        names = tracer.__dict__["_amp_fx_module_names"] = {id(m): n for n, m in root.named_modules()}
    return names.get(id(module))


def _model_files(tracer: Any) -> frozenset:
    """Source files of the model's module classes (a note names only context managers entered there)."""
    files = tracer.__dict__.get("_amp_fx_model_files")
    if files is None:
        root = getattr(tracer, "root", None)
        found = set()
        for module in root.modules() if root is not None else ():
            try:
                found.add(inspect.getsourcefile(type(module)))
            except TypeError:
                continue
        files = tracer.__dict__["_amp_fx_model_files"] = frozenset(f for f in found if f)
    return files


def _describe(value: Any) -> str:
    if isinstance(value, fx.Proxy):
        return "a traced tensor"
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@contextlib.contextmanager
def refuse_state_changes(tracer: fx.Tracer) -> Iterator[None]:
    """While tracing with ``tracer``, raise on an attribute assignment to one of the model's modules from its code."""
    original = nn.Module.__setattr__
    previous = getattr(_ACTIVE, "state_tracer", None)

    def guarded_setattr(module: nn.Module, name: str, value: Any) -> None:
        if getattr(_ACTIVE, "state_tracer", None) is tracer and _from_user_code():
            path = _module_path(tracer, module)
            current = module.__dict__.get(name, module._parameters.get(name, module._buffers.get(name, module._modules.get(name))))
            if path is not None and value is not current:
                where = current_user_line() or "unknown source line"
                owner = f"module {path!r}" if path else "the root module"
                raise UnsupportedConstructError(
                    f"{type(module).__name__}.forward changes Python state: {owner} sets attribute {name!r} "
                    f"({_describe(current)} -> {_describe(value)})\n  at {where}\n"
                    "Symbolic tracing runs forward once, so a converted module would keep the value from conversion "
                    "time forever. amp_fx refused instead (the model was not changed).\n"
                    f"{_ROUTES} A counter kept as a buffer and updated in place (self.calls.add_(1)) is kept by "
                    "every route.",
                    construct="module attribute assignment in forward", where=where,
                )
        original(module, name, value)

    _ACTIVE.state_tracer = tracer
    nn.Module.__setattr__ = guarded_setattr
    try:
        yield
    finally:
        nn.Module.__setattr__ = original
        _ACTIVE.state_tracer = previous


def _refuse_context(name: str, why: str) -> None:
    where = current_user_line(skip_stdlib=True) or "unknown source line"
    raise UnsupportedConstructError(
        f"the model enters the context manager {name} in forward\n  at {where}\n"
        f"{why} A symbolic trace keeps the ops inside a `with` block but not the context, so the converted "
        f"module would run them differently. amp_fx refused instead.\n{_ROUTES}",
        construct=name, where=where,
    )


_WHY = {
    "torch.random.fork_rng": "fork_rng restores the random state after its block.",
    "torch.nn.attention.sdpa_kernel": "sdpa_kernel chooses the attention kernel, and so its numerics.",
    "torch.autograd.graph.saved_tensors_hooks": "saved_tensors_hooks changes what autograd saves for backward.",
}


def _qualified(func: Any) -> str:
    return f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', getattr(func, '__name__', '?'))}"


@contextlib.contextmanager
def watch_context_managers(tracer: fx.Tracer) -> Iterator[None]:
    """While tracing with ``tracer``: refuse PyTorch's context managers that change how ops run; note the model's own."""
    from torch.autograd.graph import saved_tensors_hooks
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    generator_cm = contextlib._GeneratorContextManager
    original_enter = generator_cm.__enter__
    classes = (saved_tensors_hooks, TorchFunctionMode, TorchDispatchMode)
    class_enters = {cls: cls.__dict__["__enter__"] for cls in classes if "__enter__" in cls.__dict__}
    notes: list[str] = []
    previous = getattr(_ACTIVE, "context_tracer", None)

    def enter_generator(cm: Any) -> Any:
        if getattr(_ACTIVE, "context_tracer", None) is tracer and _from_user_code():
            name = _qualified(getattr(cm, "func", None))
            if name.startswith("torch.") and name not in HARMLESS_CONTEXT_MANAGERS:
                why = _WHY.get(name) or ("torch.backends flags choose kernels and their numerics."
                                         if name.startswith("torch.backends.") else "It is a PyTorch context manager amp_fx does not know.")
                _refuse_context(name, why)
            elif not name.startswith("torch.") and sys._getframe(1).f_code.co_filename in _model_files(tracer):
                where = current_user_line() or "unknown source line"
                notes.append(f"context manager {name} entered in forward at {where}: it ran once, during tracing; "
                             "only the tensor ops inside its block are in the graph")
        return original_enter(cm)

    def class_enter(cls: type) -> Any:
        enter = class_enters[cls]

        def guarded(cm: Any) -> Any:
            if getattr(_ACTIVE, "context_tracer", None) is tracer and _from_user_code():
                name = f"{cls.__module__}.{cls.__qualname__}"
                _refuse_context(f"{name} ({type(cm).__qualname__})", _WHY.get(name, "A Python mode changes how every op runs."))
            return enter(cm)

        return guarded

    _ACTIVE.context_tracer = tracer
    generator_cm.__enter__ = enter_generator
    for cls in class_enters:
        cls.__enter__ = class_enter(cls)
    try:
        yield
        graph = getattr(tracer, "graph", None)
        output = next((n for n in reversed(graph.nodes) if n.op == "output"), None) if graph is not None else None
        if notes and output is not None:
            output.meta.setdefault(NOTES_KEY, []).extend(notes)
        elif hasattr(tracer, "amp_fx_notes"):  # the torch.export watch keeps its notes itself
            tracer.amp_fx_notes.extend(notes)
    finally:
        generator_cm.__enter__ = original_enter
        for cls, enter in class_enters.items():
            cls.__enter__ = enter
        _ACTIVE.context_tracer = previous


# -- the torch.export route ---------------------------------------------------------------
_EXPORT_ROUTES = (
    "Routes that keep it: torch.compile(model, backend='amp_fx'); or make the model symbolically traceable "
    "(amp_fx.convert keeps checkpointed regions on that route)."
)


class _ExportScope:
    """Stands in for a tracer in the shared watches: the model being exported, and the notes they leave."""

    graph = None

    def __init__(self, model: nn.Module):
        self.root = model
        self.amp_fx_notes: list[str] = []


def _refuse_on_export(construct: str, what: str) -> None:
    where = current_user_line() or "unknown source line"
    raise UnsupportedConstructError(
        f"{what}\n  at {where}\nThis model is traced with torch.export (symbolic tracing failed), which {construct}. "
        f"amp_fx refused instead of changing what the model computes.\n{_EXPORT_ROUTES}",
        construct=construct, where=where,
    )


@contextlib.contextmanager
def _refuse_checkpoints() -> Iterator[None]:
    original_checkpoint = getattr(torch_checkpoint.checkpoint, "__wrapped__", torch_checkpoint.checkpoint)
    missing = object()
    previous = original_checkpoint.__dict__.get("__dynamo_disable", missing)

    def checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
        _refuse_on_export("inlines checkpointed regions, losing their activation-memory saving",
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


def take_trace_notes(gm: fx.GraphModule) -> list[str]:
    """Remove and return the notes the trace left on the output node for the report (what it fixed or let through).

    Taken by the last pass (``passes/outline_checkpoints.py``), which also
    outlines the checkpointed regions, after the report has been read.
    """
    output = next((n for n in reversed(gm.graph.nodes) if n.op == "output"), None)
    return list(output.meta.pop(NOTES_KEY, [])) if output is not None else []
