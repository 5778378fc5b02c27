"""Say so when the amp_fx backend converted nothing because Dynamo skipped or broke a compiled model's frames.

Dynamo hands a backend only the graphs it captures.  A frame it skips (a
graph break inside a loop, as ``nonzero()`` in a token-routing MoE causes)
runs eagerly in fp32, and no amp_fx code runs during or after such a call.
Dynamo's compile callbacks (:mod:`torch._dynamo.callback`) do run around
every frame compile, so this module registers one pair and, for each compile
whose backend is an amp_fx one:

1. at the start, finds the compiled model (``torch.compile``'s wrapper of the
   backend, read from Dynamo's ``_compile`` frame) and counts the graph
   breaks Dynamo has recorded so far;
2. meanwhile the backend reports each graph it converted and whether it holds
   a low-precision op (:func:`graph_converted`);
3. at the end, records why Dynamo skipped the frame (the exception it unwinds
   with) or broke its graph (``torch._dynamo.utils.graph_break_reasons``) in
   the model's :class:`~amp_fx.dynamo.report.CompiledReport`, which becomes
   :func:`amp_fx.last_report`; and once no resume function is left to
   compile, if none of the model's graphs holds a low-precision op but Dynamo
   gave reasons, warns once (:class:`NothingConvertedWarning`).

A model whose graphs Dynamo captured whole but that has no GEMM (a pure
elementwise function) gives no reason, so no warning.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import os
import re
import sys
import warnings
import weakref
from types import CodeType
from typing import Any, Callable, Optional

from amp_fx.errors import PACKAGE, AmpWarning
import torch
import torch.nn as nn

from amp_fx.dynamo import between_graphs, recompiles
from amp_fx.dynamo.report import FIXES, DynamoBreak, publish

__all__ = ["NothingConvertedWarning", "Watches", "ensure_watching", "set_resolver", "graph_converted",
           "summarise_reason"]

logger = logging.getLogger(__name__)  # amp_fx.dynamo.watch

_CHAINED = "*** While handling this graph break, another graph break occurred: ***"
_STEP_UNSUPPORTED = "step_unsupported"
_STEP_UNSUPPORTED_SAID = ("step_unsupported: Dynamo met a step it cannot trace, compiled the graph up to it and runs "
                          "the rest of the frame eagerly, with no resume function")
_NOISE = ("earlier graph break", "report an issue to PyTorch")
_RESUME = re.compile(r"^torch_dynamo_resume_in_(.+)_at_(\d+)$")
# Frames of torch, amp_fx and contextlib are not the user's: the warning points past them, at the call of the model.
_INTERNAL = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.path.dirname(__file__)) + os.sep,
             contextlib.__file__)


class NothingConvertedWarning(AmpWarning):
    """A model compiled with the amp_fx backend ran in fp32: Dynamo skipped its frames or broke them before any GEMM."""


@dataclasses.dataclass
class _Watch:
    """What one compiled model's Dynamo compiles produced so far."""

    key: Any  # a weak reference to torch.compile's wrapper of the backend (one per compiled model)
    graphs: int = 0
    low_graphs: int = 0
    open_resumes: int = 0  # graph breaks whose resume function Dynamo has not compiled yet
    pending: list[DynamoBreak] = dataclasses.field(default_factory=list)
    warned: bool = False
    limit_hit: set = dataclasses.field(default_factory=set)  # frames Dynamo stopped recompiling (warned once each)


class Watches:
    """The watch state of every model compiled with one backend object; ``reset()`` of the backend drops it."""

    def __init__(self) -> None:
        self._items: list[_Watch] = []

    def get(self, key: Any) -> _Watch:
        """The state of the model ``key`` stands for (created on first use)."""
        self._items = [w for w in self._items if w.key() is not None]
        for watch in self._items:
            if watch.key() is key:
                return watch
        watch = _Watch(weakref.ref(key))
        self._items.append(watch)
        return watch

    def __getstate__(self) -> dict:
        # This process's compiles, held by weak references (which do not pickle): a backend saved with its
        # compiled model (torch.save) is loaded watching nothing, as after reset().
        return {"_items": []}


@dataclasses.dataclass
class _Compile:
    """One Dynamo frame compile in flight whose backend is an amp_fx one."""

    backend: Any
    watch: _Watch
    code: Optional[CodeType]
    frame_locals: dict
    breaks_before: int
    raises: bool = False  # fullgraph=True or export: Dynamo raises instead of running the frame eagerly
    graphs: int = 0
    low_graphs: int = 0


_ACTIVE: dict[str, _Compile] = {}
# backend.py's answer to "which compiled model and AmpBackend does this compiler_fn belong to?"
_RESOLVER: list[Optional[Callable[[Any], Optional[tuple[Any, Any]]]]] = [None]


def set_resolver(resolver: Callable[[Any], Optional[tuple[Any, Any]]]) -> None:
    """Set how a compile's ``compiler_fn`` maps to ``(compiled-model key, AmpBackend)``, or None if not amp_fx."""
    _RESOLVER[0] = resolver


def ensure_watching() -> None:
    """Register the compile callbacks unless they are registered (``torch._dynamo.reset()`` drops them).

    Does nothing before ``torch._dynamo`` is imported: no frame compiles before
    that, and importing it costs seconds that ``import amp_fx`` should not pay.
    """
    if "torch._dynamo" not in sys.modules:
        return
    try:
        from torch._dynamo.callback import callback_handler
    except ImportError:  # a torch without compile callbacks: the report still lists what the backend saw
        return
    if _on_start not in callback_handler.start_callbacks:
        callback_handler.register_start_callback(_on_start)
    if _on_end not in callback_handler.end_callbacks:
        callback_handler.register_end_callback(_on_end)
    recompiles.install(_locate)  # the recompile limit is checked before the callbacks run: Dynamo's log line says it


def graph_converted(compile_id: str, low: bool) -> None:
    """Called by the backend for each graph it converted during Dynamo compile ``compile_id``."""
    record = _ACTIVE.get(compile_id)
    if record is not None:
        record.graphs += 1
        record.low_graphs += bool(low)


# -- the callbacks ------------------------------------------------------------
# A callback that raised would break the user's compile: they log instead.
def _on_start(args: Any) -> None:
    try:
        _start(str(args.compile_id))
    except Exception as error:
        logger.debug("amp_fx could not watch Dynamo compile %s: %s", getattr(args, "compile_id", "?"), error)


def _on_end(args: Any) -> None:
    record = _ACTIVE.pop(str(args.compile_id), None)
    if record is None:
        return
    try:
        _end(record, sys.exc_info()[1], str(args.compile_id))
    except Exception as error:
        logger.debug("amp_fx could not read Dynamo compile %s: %s", args.compile_id, error)


def _compile_frame() -> Optional[dict]:
    """The locals of Dynamo's ``_compile`` call on the stack: ``compiler_fn``, ``code`` and the frame's ``locals``.

    The compile callbacks are told only a compile id; the backend Dynamo
    compiles with is an argument of ``torch._dynamo.convert_frame._compile``.
    """
    from torch._dynamo import convert_frame

    target = getattr(inspect.unwrap(convert_frame._compile), "__code__", None)
    frame = sys._getframe(1)
    for _ in range(64):
        if frame is None or target is None:
            return None
        if frame.f_code is target:
            return frame.f_locals
        frame = frame.f_back
    return None


def _locate() -> Optional[tuple[set, bool]]:
    """For the frame Dynamo is compiling now, if its backend is an amp_fx one: (its model's frames at the limit, raises)."""
    found = _compile_frame()
    resolver = _RESOLVER[0]
    resolved = resolver(found.get("compiler_fn")) if found is not None and resolver is not None else None
    if resolved is None:
        return None
    key, backend = resolved
    return backend.watches.get(key).limit_hit, bool(found.get("one_graph") or found.get("export"))


def _start(compile_id: str) -> None:
    found = _compile_frame()
    resolver = _RESOLVER[0]
    resolved = resolver(found.get("compiler_fn")) if found is not None and resolver is not None else None
    if resolved is None:
        return
    key, backend = resolved
    between_graphs.attach(backend)  # before Dynamo saves the mode stack for tracing: see between_graphs
    from torch._dynamo.utils import graph_break_reasons

    code = found.get("code")
    watch = backend.watches.get(key)
    if isinstance(code, CodeType) and _RESUME.match(code.co_name):
        watch.open_resumes = max(0, watch.open_resumes - 1)
    frame_locals = found.get("locals")
    _ACTIVE[compile_id] = _Compile(backend, watch, code if isinstance(code, CodeType) else None,
                                   dict(frame_locals) if isinstance(frame_locals, dict) else {},
                                   len(graph_break_reasons), bool(found.get("one_graph") or found.get("export")))


def _end(record: _Compile, error: Optional[BaseException], compile_id: str) -> None:
    events = _events(record, error, compile_id)
    watch = record.watch
    watch.graphs += record.graphs
    watch.low_graphs += record.low_graphs
    # A compile that ends in a graph break leaves one resume function for the rest of the frame; one that raised, none;
    # an unsupported step none either: Dynamo runs the rest of that frame eagerly (step_graph_break skips its resume code).
    watch.open_resumes += int(error is None and any(event.kind == "graph break" and event.reason != _STEP_UNSUPPORTED_SAID
                                                    for event in events))
    if events:
        record.backend.report.breaks.extend(events)
        publish(record.backend.report)
    if watch.low_graphs or watch.warned:
        return
    watch.pending.extend(events)
    if not watch.pending or watch.open_resumes:
        return  # a resume function may still hold the GEMMs
    if error is not None and _may_compile_nested(record):
        return  # the verdict waits for the functions the skipped frame calls (see _may_compile_nested)
    watch.warned = True
    warnings.warn(_message(record.backend, watch), NothingConvertedWarning, stacklevel=_user_stacklevel())


# -- what Dynamo said -----------------------------------------------------------
def _events(record: _Compile, error: Optional[BaseException], compile_id: str) -> list[DynamoBreak]:
    import torch._dynamo.config as dynamo_config
    from torch._dynamo.exc import SkipFrame, UncapturedHigherOrderOpError, Unsupported, UserError
    from torch._dynamo.utils import graph_break_reasons

    frame, where = _frame_name(record.code)
    events = []
    for reason in graph_break_reasons[record.breaks_before:]:
        text, hints = summarise_reason(str(getattr(reason, "reason", reason)))
        if text == _STEP_UNSUPPORTED:  # Dynamo's bare tag: say what it means
            text = _STEP_UNSUPPORTED_SAID
        events.append(DynamoBreak("graph break", frame, where, text, _location(getattr(reason, "user_stack", None)),
                                  hints, compile_id))
    if error is None or isinstance(error, SkipFrame) or record.raises:
        # SkipFrame: nothing to compile ("No ops traced"), not a break; fullgraph/export: the user gets the error.
        return events
    # Dynamo's ConvertFrame runs the frame eagerly after these "soft" failures, and after any error when
    # suppress_errors is set; every other error reaches the user, so nothing is silent.
    if isinstance(error, (Unsupported, UserError)) and not isinstance(error, UncapturedHigherOrderOpError):
        kind = "frame skipped"
    elif dynamo_config.suppress_errors:
        kind = "compile failed"
    else:
        return events
    if kind == "compile failed":  # not one of Dynamo's graph-break messages: its lines, joined
        text, hints = " ".join(line.strip() for line in f"{type(error).__name__}: {error}".splitlines() if line.strip()), ()
    else:
        text, hints = summarise_reason(str(error))
    events.append(DynamoBreak(kind, frame, where, text, _location(getattr(error, "real_stack", None)), hints,
                              compile_id))
    return events


def summarise_reason(text: str) -> tuple[str, tuple[str, ...]]:
    """Dynamo's graph-break message shortened to ``"title: explanation"`` per break, and its hints.

    Dynamo's messages chain the breaks it met while handling one another;
    the developer context and links are dropped, and a hint that only says an
    earlier break may be the cause is not repeated.
    """
    reasons, hints = [], []
    for part in text.split(_CHAINED):
        lines = [line.strip() for line in part.strip().splitlines() if line.strip()]
        if not lines:
            continue
        explanation = next((line[len("Explanation:"):].strip() for line in lines if line.startswith("Explanation:")), "")
        reasons.append(f"{lines[0]}: {explanation.rstrip('.')}" if explanation else lines[0])
        for line in lines:
            hint = line[len("Hint:"):].strip() if line.startswith("Hint:") else None
            # Hints that say an earlier break may be the cause, or to file a PyTorch issue, say nothing new here.
            if hint and not any(noise in hint for noise in _NOISE) and hint not in hints:
                hints.append(hint)
    return ("; then ".join(reasons) or text.strip() or "no reason given"), tuple(hints)


def _short(path: str) -> str:
    try:
        relative = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return path
    return path if relative.startswith("..") else relative


def _frame_name(code: Optional[CodeType]) -> tuple[str, str]:
    """``forward`` and ``model.py:12``; a resume function is named after the function it continues."""
    if code is None:
        return "a frame", "?"
    name = code.co_name
    resumed = _RESUME.match(name)
    if resumed:
        name = f"{resumed.group(1)} (after line {resumed.group(2)})"
    return name, f"{_short(code.co_filename)}:{code.co_firstlineno}"


def _location(stack: Any) -> Optional[str]:
    try:
        frames = list(stack)
        # amp_fx's eager mode is on the stack Dynamo traces (it inlines the mode): the user's line is below it.
        last = next((f for f in reversed(frames) if not str(getattr(f, "filename", "")).startswith(_INTERNAL[1])),
                    frames[-1])
    except (TypeError, IndexError):
        return None
    filename, lineno = getattr(last, "filename", None), getattr(last, "lineno", None)
    return f"{_short(filename)}:{lineno}" if filename else None


def _may_compile_nested(record: _Compile) -> bool:
    """Whether code the skipped frame calls may still be compiled, and converted, as frames of its own.

    Dynamo runs a skipped frame eagerly but still compiles the Python
    functions it calls, except torch's own: a submodule whose ``forward`` is
    written outside torch (an expert MLP class) is converted on its own, so
    the verdict waits for those compiles.  ``nn.Linear`` experts in a
    ``ModuleList`` are torch's: nothing more will compile.
    """
    for name, value in record.frame_locals.items():
        if not isinstance(value, nn.Module):
            continue
        for module in value.modules():
            forward = getattr(type(module), "forward", None)
            if (name == "self" and module is value) or getattr(forward, "__code__", None) is record.code:
                continue  # the skipped frame itself (a decorated forward has another __code__)
            if not (getattr(forward, "__module__", None) or "").startswith("torch."):
                return True
    return False


def _message(backend: Any, watch: _Watch) -> str:
    captured = ("Dynamo captured no graph" if not watch.graphs else
                f"none of the {watch.graphs} graph(s) Dynamo captured holds a matrix multiply or convolution")
    ran = ("so it ran eagerly, uncompiled: its ops got amp_fx's eager decisions (the op tables; autocast inside "
           "composite calls), amp_fx.coverage(model, *inputs) measures what ran low" if backend.report.eager_decided
           else "so it ran in fp32")
    lines = [f"amp_fx converted nothing in a model compiled with the backend {backend.__name__}, {ran}: {captured}."]
    lines.extend(f"  {event}" for event in watch.pending)
    hints: list[str] = []
    for event in watch.pending:
        hints.extend(hint for hint in event.hints if hint not in hints)
    lines.extend(f"Dynamo's hint: {hint}" for hint in hints)
    lines.append(f"Or: {FIXES}.")
    if watch.graphs:
        lines.append("If this code has no matrix multiply or convolution, there was nothing to convert: "
                     "warnings.filterwarnings('ignore', category=amp_fx.NothingConvertedWarning) silences this.")
    lines.append(f"{PACKAGE}.last_report() says the same.")
    return "\n".join(lines)


def _user_stacklevel() -> int:
    """The ``stacklevel`` that points the warning at the user's call of the compiled model."""
    frame, level = sys._getframe(1), 1  # stacklevel 1 is the function that calls warnings.warn
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    return level
