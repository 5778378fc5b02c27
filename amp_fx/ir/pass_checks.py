"""What the pass runner checks about a pass: the graph properties a pass requires and ensures, and what it reported.

:mod:`amp_fx.ir.pass_manager` declares and runs passes; this module holds the
checks it makes, so the runner reads as the steps it takes:

- :data:`PROPERTIES`: the named properties of a graph that a pass may
  require, ensure or invalidate, and how each is checked on the graph.
- :class:`GraphState`: what a pass may not change without saying so, taken
  before it runs and compared after: always the node count (O(1)); with
  ``verify`` every node's op, target, name and arguments, each parameter's
  and buffer's dtype and shape, and the paint (O(nodes), for tests and
  debugging: the pipeline runs it on every pass when ``$AMP_FX_VERIFY_PASSES``
  is set).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch.fx as fx

from amp_fx.ir import meta

__all__ = ["Property", "PROPERTIES", "first_lacking", "GraphState", "paint_of"]


@dataclass(frozen=True)
class Property:
    """One property of a graph: what it says, the key every node carries when it holds, and who establishes it.

    ``key`` None: the property cannot be read off the graph (stale answers
    look like current ones), so only the runner's bookkeeping says it holds.
    """

    name: str
    says: str
    key: Optional[meta.Key]
    established_by: str


PROPERTIES: dict[str, Property] = {p.name: p for p in (
    Property("meta", "every node says what it is (its canonical op)", meta.OP, "propagate_meta"),
    Property("paint", "every node carries a precision decision", meta.DECISION, "assign_precision"),
    Property("dtypes", "every node amp_fx did not write carries the dtype analysis's answer for the current graph "
             "and paint", None, "the runner, which runs the dtype analysis when a pass requires it"),
)}


def first_lacking(prop: str, graph: fx.Graph) -> Optional[fx.Node]:
    """The first node of ``graph`` that lacks ``prop``'s key, or None when every node carries it."""
    key = PROPERTIES[prop].key
    return next((node for node in graph.nodes if key not in node.meta), None)


def paint_of(graph: fx.Graph) -> list[tuple]:
    """What the dtype analysis reads of the paint, per node: the decision, a fused mark, a node's own low dtype."""
    return [(node, node.meta.get(meta.DECISION), bool(node.meta.get(meta.FUSED)), node.meta.get(meta.LOW_DTYPE))
            for node in graph.nodes]


def _structure(gm: fx.GraphModule) -> tuple[list[tuple], list[tuple]]:
    """Every node as its code reads it, and every parameter's and buffer's dtype and shape."""
    nodes = [(node, node.op, node.target, node.name, node.args, node.kwargs) for node in gm.graph.nodes]
    tensors = [(name, t.dtype, tuple(t.shape)) for named in (gm.named_parameters(remove_duplicate=False),
                                                             gm.named_buffers(remove_duplicate=False))
               for name, t in named]
    return nodes, tensors


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # a tensor among the arguments: equal only when it is the very object
        return a is b


class GraphState:
    """What a pass may not change without saying so, taken before it runs (see the module docstring)."""

    def __init__(self, gm: fx.GraphModule, verify: bool):
        self.count = len(gm.graph.nodes)
        self.verify = verify
        self.structure = _structure(gm) if verify else None
        self.paint = paint_of(gm.graph) if verify else None

    def graph_change(self, gm: fx.GraphModule) -> Optional[str]:
        """How ``gm`` differs from the graph this state was taken of (None: no difference found)."""
        count = len(gm.graph.nodes)
        if count != self.count:
            return f"the graph has {count} nodes, {self.count} before"
        if not self.verify:
            return None
        nodes, tensors = _structure(gm)
        for old, new in zip(self.structure[0], nodes):
            if old[0] is not new[0] or not all(_same(a, b) for a, b in zip(old[1:], new[1:])):
                was = f" (was {old[3]!r})" if old[3] != new[3] else ""
                return f"node {new[3]!r}{was} changed: its op, target, name, arguments or place in the graph"
        if not _same(self.structure[1], tensors):
            changed = next((new[0] for old, new in zip(self.structure[1], tensors) if old != new), "a tensor")
            return f"parameter or buffer {changed!r} changed dtype or shape"
        return None

    def paint_change(self, gm: fx.GraphModule) -> Optional[str]:
        """The first node whose paint (as the dtype analysis reads it) changed, or None (only with ``verify``)."""
        if not self.verify:
            return None
        for old, new in zip(self.paint, paint_of(gm.graph)):
            if old != new:
                return f"node {new[0].name!r} was repainted ({old[1:]} -> {new[1:]})"
        return None
