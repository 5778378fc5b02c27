"""The export route's regions: inline torch.export's region ops, and keep or note what export drops.

torch.export (non-strict) records a model's ``torch.no_grad()`` and
``torch.autocast`` blocks as ``wrap_with_set_grad_enabled`` /
``wrap_with_autocast`` higher-order ops around a body submodule.
:func:`inline_region_hops` puts each body back in the graph between the
markers of :mod:`amp_fx.frontend.regions`, so the passes paint and report its nodes
exactly as on the symbolic route.  :func:`exporting` wraps the export call
itself (see its docstring).
"""

from __future__ import annotations

import contextlib
import operator
import os
import sys
import threading
from typing import Any, Iterator

import torch
import torch.fx as fx

from amp_fx.frontend.source_lines import innermost_user_frame
from amp_fx.frontend.regions import _grad, autocast_enter, autocast_exit, grad_enter, grad_exit

__all__ = ["inline_region_hops", "exporting", "NOTES_ATTR"]


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
