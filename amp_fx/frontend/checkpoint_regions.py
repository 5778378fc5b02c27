"""Keep ``torch.utils.checkpoint`` regions checkpointed through ``convert()``, with their casts inside.

Symbolic tracing runs ``checkpoint(fn, x)`` as ``fn(x)``: the region is
inlined and its memory saving is gone.  amp_fx keeps it in two steps:

1. While tracing, :func:`record_checkpoints` intercepts each checkpoint call
   on traced values, traces ``fn`` inline and tags every node it made with
   ``meta.CHECKPOINT`` (a region number; nested regions merge
   into the outermost) and the call's options.
2. After the whole pipeline has run on the inlined graph (one dtype analysis,
   the same casts as without checkpointing) and the report has been read,
   the last pass (``passes/outline_checkpoints.py``) runs :func:`keep_checkpoints`, which moves
   each region -- with the casts that only it reads, parameter casts
   included -- into a submodule that calls ``torch.utils.checkpoint.checkpoint``
   on it.  Backward recomputes the region, casts and all, and the result is
   bitwise the first forward's (the same code on the same inputs).

Parameters and buffers stay ``get_attr`` nodes of the outer graph and enter
the region as arguments, so ``state_dict()`` keys do not change.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import threading
from typing import Any, Iterator, Optional

import torch.fx as fx
import torch.nn as nn
import torch.utils.checkpoint as torch_checkpoint
from torch.utils._pytree import tree_leaves

from amp_fx.frontend.source_lines import current_user_line
from amp_fx.ir import meta

__all__ = ["record_checkpoints", "keep_checkpoints", "CheckpointedRegion", "REGION_KEY"]

REGION_KEY = meta.CHECKPOINT  # kept importable from here
_ACTIVE = threading.local()
_COUNTER = itertools.count()
# checkpoint()'s own keywords; any other keyword goes to the checkpointed function.
_OPTIONS = ("use_reentrant", "context_fn", "determinism_check", "debug", "preserve_rng_state")


class CheckpointedRegion(nn.Module):
    """Runs a region of a converted graph under ``torch.utils.checkpoint.checkpoint``.

    The region's GraphModule is kept out of ``_modules`` (its leaf modules are
    the converted module's own, reached through it), so the region adds no
    ``state_dict`` keys and no second path to a parameter.
    """

    def __init__(self, body: fx.GraphModule, options: dict[str, Any], source: Optional[str] = None):
        super().__init__()
        self.__dict__["body"] = body
        self.options = dict(options)
        self.source = source

    def forward(self, *args: Any) -> Any:
        return torch_checkpoint.checkpoint(self.__dict__["body"], *args, **self.options)

    def extra_repr(self) -> str:
        return f"options={self.options}, source={self.source!r}"


def _first_proxy(args: tuple, kwargs: dict) -> Optional[fx.Proxy]:
    return next((a for a in tree_leaves((args, kwargs)) if isinstance(a, fx.Proxy)), None)


def _trace_region(function: Any, args: tuple, kwargs: dict, tracer: fx.Tracer) -> Any:
    """Trace ``function(*args)`` inline and tag the nodes it makes as one checkpointed region."""
    options = {k: kwargs.pop(k) for k in _OPTIONS if k in kwargs}
    graph = tracer.graph
    marker = graph._root.prev
    region = next(_COUNTER)
    source = current_user_line()
    out = function(*args, **kwargs)
    node = marker.next
    while node is not graph._root:
        if node.op not in ("placeholder", "output"):
            # An enclosing region re-tags these later: nested regions merge into the outermost.
            meta.CHECKPOINT.set(node, region)
            meta.CHECKPOINT_OPTIONS.set(node, (options, source))
        node = node.next
    return out


@contextlib.contextmanager
def record_checkpoints(tracer: fx.Tracer) -> Iterator[None]:
    """While tracing with ``tracer``, turn ``torch.utils.checkpoint.checkpoint`` calls on its proxies into tagged regions.

    ``checkpoint`` is wrapped by ``torch._disable_dynamo``, whose wrapper
    calls the function stored in the original's ``__dynamo_disable``
    attribute; setting that attribute reaches every reference to
    ``checkpoint``, however the model imported it.
    """
    original = getattr(torch_checkpoint.checkpoint, "__wrapped__", None)
    if original is None:  # another torch layout: patch the module attribute only
        original = torch_checkpoint.checkpoint
    missing = object()
    previous = original.__dict__.get("__dynamo_disable", missing)
    previous_tracer = getattr(_ACTIVE, "tracer", None)

    def intercept(function: Any, *args: Any, **kwargs: Any) -> Any:
        proxy = _first_proxy(args, kwargs)
        if proxy is not None and proxy.tracer is getattr(_ACTIVE, "tracer", None):
            return _trace_region(function, args, dict(kwargs), proxy.tracer)
        call = previous if previous is not missing else original
        return call(function, *args, **kwargs)

    _ACTIVE.tracer = tracer
    original.__dynamo_disable = intercept
    patched_module_attr = original is torch_checkpoint.checkpoint
    if patched_module_attr:
        torch_checkpoint.checkpoint = intercept
    try:
        yield
    finally:
        if patched_module_attr:
            torch_checkpoint.checkpoint = original
        if previous is missing:
            del original.__dynamo_disable
        else:
            original.__dynamo_disable = previous
        _ACTIVE.tracer = previous_tracer


def _is_pure_helper(node: fx.Node) -> bool:
    """Nodes amp_fx inserted (casts, promotes): pure, cheap, safe to recompute inside a region."""
    return bool(meta.INSERTED.get(node)) or meta.DECISION.get(node) == "cast"


def _grow(gm: fx.GraphModule, members: dict[fx.Node, int], region: int) -> None:
    """Add to ``region`` what it needs to be one convex, self-contained piece of graph.

    - any node both reachable from the region and reaching it (else the
      region could not be one call);
    - inserted casts whose every user is in the region (a parameter's cast
      read only inside: recomputed in backward instead of saved).
    """
    inside = {n for n, r in members.items() if r == region}
    down: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node in inside or node in down:
            for user in node.users:
                if user not in inside:
                    down.add(user)
    up: set[fx.Node] = set()
    for node in reversed(list(gm.graph.nodes)):
        if node in inside or node in up:
            for arg in node.all_input_nodes:
                if arg not in inside:
                    up.add(arg)
    for node in down & up:
        members[node] = region
        inside.add(node)
    changed = True
    while changed:
        changed = False
        for node in reversed(list(gm.graph.nodes)):
            if node in members or node.op in ("placeholder", "get_attr", "output") or not node.users:
                continue
            if _is_pure_helper(node) and all(members.get(u) == region for u in node.users):
                members[node] = region
                changed = True


def _outline(gm: fx.GraphModule, nodes: list[fx.Node], name: str) -> fx.Node:
    """Move ``nodes`` (graph order) into a :class:`CheckpointedRegion` submodule called ``name``; return its call node."""
    inside = set(nodes)
    body = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[fx.Node] = []

    def remap(value: fx.Node) -> fx.Node:
        if value in env:
            return env[value]
        placeholder = body.placeholder(value.name)
        placeholder.meta = dict(value.meta)
        env[value] = placeholder
        inputs.append(value)
        return placeholder

    for node in nodes:
        env[node] = body.node_copy(node, remap)
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    body.output(tuple(env[n] for n in outputs) if len(outputs) != 1 else env[outputs[0]])
    body.lint()
    options, source = next((meta.CHECKPOINT_OPTIONS.get(n) for n in nodes if meta.CHECKPOINT_OPTIONS.on(n)), ({}, None))
    region = CheckpointedRegion(fx.GraphModule(gm, body, "CheckpointedBody"), options, source)
    gm.add_submodule(name, region)
    with gm.graph.inserting_after(nodes[-1]):
        call = gm.graph.call_module(name, tuple(inputs))
    call.meta.update({meta.OP: "checkpoint", meta.DECISION: "follow", meta.RULE: "model",
                      meta.REASON: f"checkpointed region ({len(nodes)} nodes, casts included)"})
    with gm.graph.inserting_after(call):
        for index, node in enumerate(outputs):
            value = call
            if len(outputs) != 1:
                value = gm.graph.call_function(operator.getitem, (call, index))
                value.meta = dict(node.meta)
            node.replace_all_uses_with(value)
    for node in reversed(nodes):
        gm.graph.erase_node(node)
    return call


def _restore_order(graph: fx.Graph) -> None:
    """Move, in place, each node that now precedes one of its inputs to just after the point its inputs exist.

    A region's call sits where its last node was; an outside node that read
    an earlier region value may come before it.  The original order is kept
    otherwise (and the graph object, with its codegen, is the same).
    """
    seen: set[fx.Node] = set()
    pending: list[fx.Node] = []
    for node in list(graph.nodes):
        if any(i not in seen for i in node.all_input_nodes):
            pending.append(node)
            continue
        seen.add(node)
        cursor = node
        released = True
        while released:
            released = False
            for waiting in list(pending):
                if all(i in seen for i in waiting.all_input_nodes):
                    cursor.append(waiting)
                    cursor = waiting
                    seen.add(waiting)
                    pending.remove(waiting)
                    released = True


def keep_checkpoints(gm: fx.GraphModule, notes: Optional[list[str]] = None) -> fx.GraphModule:
    """Outline every tagged checkpoint region of ``gm`` (in place) into a checkpointed submodule; add a note on each to ``notes``.

    Run by ``passes/outline_checkpoints.py`` inside the pass runner, which
    lints and recompiles the graph after it.
    """
    members: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        region = meta.CHECKPOINT.get(node)
        if region is not None and node.op not in ("placeholder", "get_attr", "output"):
            members[node] = region
    regions = sorted(set(members.values()))
    if not regions:
        return gm
    for region in regions:
        _grow(gm, members, region)
    for index, region in enumerate(regions):
        nodes = [n for n in gm.graph.nodes if members.get(n) == region]
        call = _outline(gm, nodes, f"amp_fx_checkpoint_{index}")
        _restore_order(gm.graph)
        if notes is not None:
            where = call.graph.owning_module.get_submodule(str(call.target)).source or "unknown source line"
            notes.append(
                f"checkpointed region kept ({len(nodes)} nodes, casts included; recomputed in backward) from {where}"
            )
    return gm
