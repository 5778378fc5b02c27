"""Grad-mode and autocast regions: one representation for every route (symbolic, torch.export, Dynamo).

A region is a pair of *marker* nodes in the graph, the way Dynamo records
them: an enter node whose result the exit node reads.  Between them the
model's code ran under ``torch.no_grad()`` / ``enable_grad()`` /
``set_grad_enabled(b)`` / ``inference_mode()`` or ``torch.autocast(...)``.

- The symbolic route (:func:`recording`) emits the markers while fx traces:
  the context managers' ``__enter__``/``__exit__`` are patched for the trace,
  so ``with`` blocks and decorators on methods are both seen.
- The export route (:func:`inline_region_hops`) inlines torch.export's
  ``wrap_with_set_grad_enabled`` / ``wrap_with_autocast`` bodies between
  markers, so the passes paint and report their nodes exactly as on the
  symbolic route; :func:`exporting` wraps the export call itself, keeping an
  ``inference_mode()`` region as ``no_grad()`` and noting what export drops.
- Dynamo writes ``_enter_autocast``/``_exit_autocast`` and
  ``torch._C._set_grad_enabled(b)`` nodes itself; :func:`region_stacks` reads
  them too.

The markers are ordinary call nodes that *run*: grad mode is set at the enter
and restored (to whatever it was at run time) at the exit, so backward sees
what eager would.  ``honour_autocast_regions`` then applies autocast's rules to
each region's nodes (:func:`autocast_rule`) and erases the autocast markers
(the casts are explicit); at O0 nothing is rewritten and the markers run
autocast itself, as the model would.
"""

from __future__ import annotations

import contextlib
import operator
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.fx as fx
from torch.fx.graph import _register_custom_builtin
from torch.fx.proxy import Proxy

from amp_fx.frontend.source_lines import innermost_user_frame
from amp_fx.ir import meta

__all__ = [
    "grad_enter", "grad_exit", "inference_enter", "inference_exit", "autocast_enter", "autocast_exit",
    "Region", "marker_role", "region_stacks", "recording", "autocast_rule",
    "region_dtype", "separate_grad_reads", "inline_region_hops", "exporting", "LOW_DTYPE_KEY", "GRAD_READ_KEY",
    "NOTES_ATTR",
]

# a node's own low dtype (an autocast(dtype=) region), read by the dtype analysis
LOW_DTYPE_KEY = meta.LOW_DTYPE

# (thread id, tracer) while AmpTracer records on that thread; None otherwise.
_RECORDING: Optional[tuple[int, Any]] = None


_BUSY = threading.local()  # inside a patched context manager's own method: record nothing more


def _tracer() -> Any:
    """The AmpTracer recording on this thread, if any (markers then record themselves)."""
    recording = _RECORDING
    if recording is not None and recording[0] == threading.get_ident() and not getattr(_BUSY, "depth", 0):
        return recording[1]
    return None


def _run(original: Any, *args: Any) -> Any:
    """Run a context manager's own method; what it calls (no_grad calls set_grad_enabled) is not a region."""
    _BUSY.depth = getattr(_BUSY, "depth", 0) + 1
    try:
        return original(*args)
    finally:
        _BUSY.depth -= 1


def _record(fn: Any, args: tuple) -> Any:
    """Record ``fn(*args)`` in the graph being traced, or return None when nothing is tracing."""
    tracer = _tracer()
    if tracer is None:
        proxy = next((a for a in args if isinstance(a, Proxy)), None)
        tracer = proxy.tracer if proxy is not None else None
    return None if tracer is None else tracer.create_proxy("call_function", fn, args, {})


# --------------------------------------------------------------------------
# The markers: what runs in the converted module
# --------------------------------------------------------------------------
def grad_enter(mode: bool) -> Any:
    """Set grad mode to ``mode``; return the mode it replaced (for :func:`grad_exit`)."""
    traced = _record(grad_enter, (mode,))
    if traced is not None:
        return traced
    previous = torch.is_grad_enabled()
    torch._C._set_grad_enabled(mode)
    return previous


def grad_exit(previous: Any) -> None:
    """Restore the grad mode :func:`grad_enter` replaced."""
    if _record(grad_exit, (previous,)) is None:
        torch._C._set_grad_enabled(previous)


def inference_enter(mode: bool) -> Any:
    """Enter ``torch.inference_mode(mode)``; return the guard :func:`inference_exit` closes."""
    traced = _record(inference_enter, (mode,))
    if traced is not None:
        return traced
    guard = torch._C._InferenceMode(mode)
    guard.__enter__()
    return guard


def inference_exit(guard: Any) -> None:
    """Leave the inference mode :func:`inference_enter` entered."""
    if _record(inference_exit, (guard,)) is None:
        guard.__exit__(None, None, None)


def autocast_enter(device_type: str, dtype: Optional[torch.dtype], enabled: bool, cache_enabled: Optional[bool]) -> Any:
    """Enter ``torch.autocast(device_type, dtype, enabled, cache_enabled)`` (only left in O0 graphs)."""
    traced = _record(autocast_enter, (device_type, dtype, enabled, cache_enabled))
    if traced is not None:
        return traced
    return torch.amp.autocast_mode._enter_autocast(device_type, dtype, enabled, cache_enabled)


def autocast_exit(mode: Any) -> None:
    """Leave the autocast region :func:`autocast_enter` entered."""
    if _record(autocast_exit, (mode,)) is None:
        torch.amp.autocast_mode._exit_autocast(mode)


_MARKERS = (grad_enter, grad_exit, inference_enter, inference_exit, autocast_enter, autocast_exit)
for _marker in _MARKERS:
    # Dead-code elimination must keep them (they change global state), and
    # generated code names them with an import line (GraphModule.to_folder).
    torch.fx.node._side_effectful_functions.add(_marker)
    _register_custom_builtin(_marker.__name__, f"from amp_fx.frontend.regions import {_marker.__name__}", _marker)

_DYNAMO_ENTER = getattr(torch.amp.autocast_mode, "_enter_autocast", None)
_DYNAMO_EXIT = getattr(torch.amp.autocast_mode, "_exit_autocast", None)


def marker_role(node: fx.Node) -> Optional[tuple[str, str]]:
    """(role, kind) of a region marker: role enter / exit / set, kind autocast / grad; None otherwise."""
    if node.op != "call_function":
        return None
    target = node.target
    if target is autocast_enter or (target is _DYNAMO_ENTER and target is not None):
        return "enter", "autocast"
    if target is autocast_exit or (target is _DYNAMO_EXIT and target is not None):
        return "exit", "autocast"
    if target is grad_enter or target is inference_enter:
        return "enter", "grad"
    if target is grad_exit or target is inference_exit:
        return "exit", "grad"
    if target is torch._C._set_grad_enabled:
        return "set", "grad"
    return None


# --------------------------------------------------------------------------
# Reading regions off a graph
# --------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class Region:
    """One open region: its enter node and what it asks for."""

    kind: str  # "autocast" or "grad"
    enter: fx.Node
    device: Optional[str] = None  # autocast
    dtype: Optional[torch.dtype] = None  # autocast; None: the device's autocast default
    enabled: bool = True  # autocast
    grad: Optional[bool] = None  # grad mode inside (grad regions)
    inference: bool = False  # torch.inference_mode

    def describe(self) -> str:
        """The region as the model wrote it, for report reasons."""
        if self.kind == "autocast":
            if not self.enabled:
                return f"torch.autocast({self.device!r}, enabled=False)"
            dtype = f", dtype={str(self.dtype).replace('torch.', '')}" if self.dtype is not None else ""
            return f"torch.autocast({self.device!r}{dtype})"
        if self.inference:
            return "torch.inference_mode()" if self.grad is False else "torch.inference_mode(False)"
        return "torch.no_grad()" if self.grad is False else "torch.enable_grad()"


def _args(node: fx.Node, names: tuple[str, ...]) -> dict[str, Any]:
    values: dict[str, Any] = dict(zip(names, node.args))
    values.update(node.kwargs)
    return values


def _region(node: fx.Node, kind: str) -> Region:
    if kind == "autocast":
        values = _args(node, ("device_type", "dtype", "enabled", "cache_enabled"))
        enabled = values.get("enabled", True)
        return Region("autocast", node, device=str(values.get("device_type")), dtype=values.get("dtype"),
                      enabled=True if enabled is None else bool(enabled))
    mode = bool(node.args[0]) if node.args else True
    if node.target is inference_enter:
        return Region("grad", node, grad=not mode, inference=True)
    return Region("grad", node, grad=mode)


def region_stacks(graph: fx.Graph, initial_grad: Optional[bool] = None) -> dict[fx.Node, tuple[Region, ...]]:
    """For every node that is not a marker: the regions open around it, outermost first.

    Dynamo's ``_set_grad_enabled(b)`` nodes are not nested: each one ends the
    previous one, and opens a region unless ``b`` is the mode the graph was
    captured in (``initial_grad``, default: the current mode).
    """
    initial = torch.is_grad_enabled() if initial_grad is None else initial_grad
    stack: list[Region] = []
    out: dict[fx.Node, tuple[Region, ...]] = {}
    for node in graph.nodes:
        role = marker_role(node)
        if role is None:
            out[node] = tuple(stack)
            continue
        what, kind = role
        if what == "enter":
            stack.append(_region(node, kind))
        elif what == "exit":
            entered = node.args[0] if node.args else None
            if any(r.enter is entered for r in stack):
                while stack and stack[-1].enter is not entered:
                    stack.pop()
                stack.pop()
        else:
            stack = [r for r in stack if r.enter.target is not torch._C._set_grad_enabled]
            if bool(node.args[0]) != initial:
                stack.append(Region("grad", node, grad=bool(node.args[0])))
    return out


def region_dtype(region: Region) -> torch.dtype:
    """The low dtype an enabled autocast region runs its low ops in (its device's default when unnamed)."""
    if region.dtype is not None:
        return region.dtype
    return torch.get_autocast_dtype(region.device or "cpu")


def autocast_rule(region: Region, decision: str, low: torch.dtype) -> tuple[Optional[str], Optional[torch.dtype], str]:
    """(new decision or None to keep it, node's own low dtype or None, reason) inside ``region``.

    autocast's own rules, innermost region first: ``enabled=False`` runs the
    region in fp32, as the model wrote it for fp32 weights; an enabled region
    lets the tables decide, and runs its low ops in the region's dtype.
    """
    where = f"inside the model's {region.describe()} region"
    if not region.enabled:
        return "fp32", None, f"{where}: fp32"
    dtype = region_dtype(region)
    if decision == "low" and dtype != low:
        return None, dtype, f"{where}: runs in {str(dtype).replace('torch.', '')}"
    return None, None, where


# --------------------------------------------------------------------------
# The symbolic route: record the context managers while fx traces
# --------------------------------------------------------------------------
_grad = torch.autograd.grad_mode
_STACK_ATTR = "_amp_fx_region_markers"


def _push(manager: Any, marker: Any) -> None:
    manager.__dict__.setdefault(_STACK_ATTR, []).append(marker)


def _pop(manager: Any) -> Any:
    markers = manager.__dict__.get(_STACK_ATTR)
    return markers.pop() if markers else None


def _patched(cls: type, name: str, original: Any) -> Any:
    """``cls.name`` that also records a marker when this thread is tracing."""
    if name == "__init__":  # set_grad_enabled(b) switches the mode at construction
        def init(self: Any, mode: Any) -> None:
            tracing = _tracer() is not None
            _run(original, self, mode)
            if tracing:
                _push(self, grad_enter(bool(self.mode)))
        return init

    def enter(self: Any) -> Any:
        tracing = _tracer() is not None
        result = _run(original, self)
        if tracing:
            if isinstance(self, torch.amp.autocast_mode.autocast):
                _push(self, autocast_enter(self.device, self.fast_dtype, self._enabled, self._cache_enabled))
            elif isinstance(self, _grad.inference_mode):
                _push(self, inference_enter(bool(self.mode)))
            else:
                _push(self, grad_enter(isinstance(self, _grad.enable_grad)))
        return result

    def exit(self: Any, *exc: Any) -> Any:
        tracing = _tracer() is not None
        result = _run(original, self, *exc)
        marker = _pop(self) if tracing else None
        if marker is not None:
            if isinstance(self, torch.amp.autocast_mode.autocast):
                autocast_exit(marker)
            elif isinstance(self, _grad.inference_mode):
                inference_exit(marker)
            else:
                grad_exit(marker)
        return result

    return enter if name == "__enter__" else exit


_TARGETS = (
    (_grad.no_grad, ("__enter__", "__exit__")),
    (_grad.enable_grad, ("__enter__", "__exit__")),
    (_grad.set_grad_enabled, ("__init__", "__exit__")),
    (_grad.inference_mode, ("__enter__", "__exit__")),
    (torch.amp.autocast_mode.autocast, ("__enter__", "__exit__")),
)


@contextlib.contextmanager
def recording(tracer: Any) -> Iterator[None]:
    """While ``tracer`` traces on this thread, record grad-mode and autocast regions as marker nodes.

    Other threads calling the same context managers meanwhile run them
    unchanged (the patched methods check the thread).
    """
    global _RECORDING
    previous = _RECORDING
    _RECORDING = (threading.get_ident(), tracer)
    saved = []
    if previous is None:
        for cls, names in _TARGETS:
            for name in names:
                original = cls.__dict__[name]
                saved.append((cls, name, original))
                setattr(cls, name, _patched(cls, name, original))
    try:
        yield
    finally:
        for cls, name, original in saved:
            setattr(cls, name, original)
        _RECORDING = previous


# --------------------------------------------------------------------------
# One read per grad mode
# --------------------------------------------------------------------------
GRAD_READ_KEY = meta.GRAD_READ  # a read made by separate_grad_reads


def _grad_key(regions: tuple[Region, ...]) -> tuple[int, ...]:
    return tuple(id(r.enter) for r in regions if r.kind == "grad")


def separate_grad_reads(graph: fx.Graph) -> int:
    """Give a parameter or input read under another grad mode than where it is made its own read there.

    Casts are shared per (value, dtype) and placed near the value or its
    first reader; a weight read both inside ``torch.no_grad()`` and outside
    would otherwise share one cast made under one of the two modes, and the
    other reader would see the wrong ``requires_grad``.  The read is
    ``value.view_as(value)`` placed at the first reader in that mode, so its
    casts land there.  Returns the number of reads added.
    """
    if not any((marker_role(n) or ("", ""))[1] == "grad" for n in graph.nodes):
        return 0
    stacks = region_stacks(graph)
    added = 0
    for value in list(graph.nodes):
        if value.op not in ("placeholder", "get_attr") or meta.is_tensor(value) is not True:
            continue
        home = _grad_key(stacks.get(value, ()))
        groups: dict[tuple[int, ...], list[fx.Node]] = {}
        for user in value.users:
            if user in stacks and not meta.GRAD_READ.get(user):
                groups.setdefault(_grad_key(stacks[user]), []).append(user)
        for key, users in groups.items():
            if key == home:
                continue
            first = min(users)
            with graph.inserting_before(first):
                read = graph.call_method("view_as", (value, value))
            meta.inherit(read, value, same_value=True)  # the very tensor: its dtype is the analysis's to tell
            read.meta.update({
                meta.OP: "view_as", meta.INPLACE: False, meta.DECISION: "follow", meta.RULE: "grad-mode",
                meta.REASON: f"its own read of {value.name} in this grad mode (a cast is never shared across grad modes)",
                meta.GRAD_READ: True,
            })
            for user in users:
                user.replace_input_with(value, read)
            added += 1
    return added


# --------------------------------------------------------------------------
# The export route: inline torch.export's region higher-order ops
# --------------------------------------------------------------------------
def _hop(name: str) -> Any:
    return getattr(torch.ops.higher_order, name, None)


def _attr(gm: fx.GraphModule, target: str) -> Any:
    value: Any = gm
    for atom in target.split("."):
        value = getattr(value, atom)
    return value


def _inline_one(gm: fx.GraphModule, node: fx.Node, enter_fn: Any, enter_args: tuple, exit_fn: Any, body_arg: int) -> None:
    graph = gm.graph
    body_node = node.args[body_arg]
    body: fx.GraphModule = _attr(gm, str(body_node.target))
    operands = node.args[body_arg + 1:]
    values: dict[fx.Node, Any] = {}
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    for placeholder, operand in zip(placeholders, operands):
        values[placeholder] = operand
    with graph.inserting_before(node):
        enter = graph.call_function(enter_fn, enter_args)
        enter.meta.update({k: v for k, v in node.meta.items() if k in ("stack_trace", "nn_module_stack")})
        for inner in body.graph.nodes:
            if inner.op in ("placeholder", "output"):
                continue
            if inner.op in ("get_attr", "call_module"):
                # a nested region's body, or a constant: move it onto the outer module under a fresh name
                name = _fresh_name(gm, str(inner.target).replace(".", "_"))
                setattr(gm, name, _attr(body, str(inner.target)))
                copied = graph.node_copy(inner, lambda n: values[n])
                copied.target = name
            else:
                copied = graph.node_copy(inner, lambda n: values[n])
            values[inner] = copied
        output = next(n for n in body.graph.nodes if n.op == "output")
        results = fx.node.map_arg(output.args[0], lambda n: values[n])
        exit_node = graph.call_function(exit_fn, (enter,))
    for user in list(node.users):
        if user.op == "call_function" and user.target is operator.getitem:
            user.replace_all_uses_with(results[user.args[1]])
            graph.erase_node(user)
    if node.users:  # the tuple used whole: build it
        with graph.inserting_after(exit_node):
            whole = graph.call_function(tuple, (list(results),))
        node.replace_all_uses_with(whole)
    graph.erase_node(node)
    if not body_node.users:
        graph.erase_node(body_node)


def _fresh_name(gm: fx.GraphModule, base: str) -> str:
    name, index = base, 0
    while hasattr(gm, name):
        index += 1
        name = f"{base}_{index}"
    return name


def inline_region_hops(gm: fx.GraphModule) -> int:
    """Inline every ``wrap_with_set_grad_enabled`` / ``wrap_with_autocast`` body between markers; return how many."""
    grad_hop, autocast_hop = _hop("wrap_with_set_grad_enabled"), _hop("wrap_with_autocast")
    inlined = 0
    while True:
        hops = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (grad_hop, autocast_hop) and n.target is not None]
        if not hops:
            break
        for node in hops:
            if node.target is grad_hop:
                _inline_one(gm, node, grad_enter, (bool(node.args[0]),), grad_exit, 1)
            else:
                _inline_one(gm, node, autocast_enter, tuple(node.args[:4]), autocast_exit, 4)
            inlined += 1
    if inlined:
        gm.graph.lint()
        gm.recompile()
    return inlined


# --------------------------------------------------------------------------
# The export route: what torch.export would drop
# --------------------------------------------------------------------------
NOTES_ATTR = "amp_fx_region_notes"
_TORCH_DIR = os.path.dirname(torch.__file__)  # graph attribute: report lines about regions a route could not keep


def _user_line() -> str:
    frame = innermost_user_frame(skip_stdlib=True)  # contextlib's frames sit between the model's line and these hooks
    return "unknown source line" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


@contextlib.contextmanager
def exporting() -> Iterator[list[str]]:
    """While torch.export traces on this thread, keep what it would drop, and note what it cannot keep.

    - ``torch.inference_mode()`` runs as ``torch.no_grad()``, which torch.export
      records (as ``wrap_with_set_grad_enabled``); export keeps no inference-mode
      region.  Gradients are the same; tensors made there are not inference tensors.
    - ``enable_grad()`` / ``set_grad_enabled(True)`` entered while grad is
      already on (export traces with grad on) leaves no trace in the graph:
      called under ``torch.no_grad()``, the converted module computes that
      region without grad.  Each one is noted with its source line.
    """
    notes: list[str] = []
    me = threading.get_ident()
    saved = [(cls, name, cls.__dict__[name]) for cls, name in (
        (_grad.inference_mode, "__enter__"), (_grad.inference_mode, "__exit__"),
        (_grad.enable_grad, "__enter__"), (_grad.set_grad_enabled, "__init__"))]
    originals = {(cls, name): fn for cls, name, fn in saved}

    def ours() -> bool:
        """This thread, called from the model (or a decorator on it), not from torch's own code."""
        caller = sys._getframe(2).f_code.co_filename
        return threading.get_ident() == me and (not caller.startswith(_TORCH_DIR) or caller.endswith("_contextlib.py"))

    def inference_enter_(self: Any) -> Any:
        if not ours():
            return originals[(_grad.inference_mode, "__enter__")](self)
        self._amp_fx_no_grad = torch.no_grad() if self.mode else contextlib.nullcontext()
        self._amp_fx_no_grad.__enter__()
        notes.append(f"{_user_line()}: torch.inference_mode() kept as torch.no_grad() (torch.export keeps no inference mode)")
        return None

    def inference_exit_(self: Any, *exc: Any) -> Any:
        if threading.get_ident() != me or not hasattr(self, "_amp_fx_no_grad"):
            return originals[(_grad.inference_mode, "__exit__")](self, *exc)
        return self._amp_fx_no_grad.__exit__(*exc)

    def lost(kind: str) -> None:
        if ours() and torch.is_grad_enabled():
            notes.append(f"{_user_line()}: {kind} is not kept by torch.export (grad is on while it traces): called under "
                         "torch.no_grad(), the converted module computes that region without grad; the symbolic route "
                         "and torch.compile(backend='amp_fx') keep it")

    def enable_enter(self: Any) -> Any:
        lost("torch.enable_grad()")
        return originals[(_grad.enable_grad, "__enter__")](self)

    def set_init(self: Any, mode: Any) -> None:
        if mode:
            lost("torch.set_grad_enabled(True)")
        originals[(_grad.set_grad_enabled, "__init__")](self, mode)

    replacements = {"__enter__": {_grad.inference_mode: inference_enter_, _grad.enable_grad: enable_enter},
                    "__exit__": {_grad.inference_mode: inference_exit_}, "__init__": {_grad.set_grad_enabled: set_init}}
    for cls, name, _ in saved:
        setattr(cls, name, replacements[name][cls])
    try:
        yield notes
    finally:
        for cls, name, fn in saved:
            setattr(cls, name, fn)
