"""Aliasing in a graph: which value a node may share memory with, and which values an in-place op writes.

Read off the op registry (:mod:`amp_fx.ir.op_properties`: views, data
movement and casts may alias their first input) and the in-place flag that
``propagate_meta`` writes.  Cast sharing (``insert_casts``' builder,
``dedupe_casts``, ``fold_casts``), ``cast_params`` and the min-cut ask these.
"""

from __future__ import annotations

import torch.fx as fx

from amp_fx.ir import meta, op_properties

__all__ = ["alias_root", "mutated_roots", "mutated_values"]


def _may_alias(node: fx.Node) -> bool:
    """The node's result may share memory with its first input: a view, data movement, or a cast
    (a cast to the dtype a tensor already has returns the tensor itself)."""
    return op_properties.of(node.meta.get(meta.OP)).may_alias


def alias_root(node: fx.Node) -> fx.Node:
    """The value ``node`` may share memory with, walking back through views, casts and in-place ops.

    Over-approximating (``index_select`` copies) only costs a cast; missing an
    alias would read stale values.
    """
    while node.op in ("call_function", "call_method") and node.args and isinstance(node.args[0], fx.Node):
        if not (_may_alias(node) or node.meta.get(meta.INPLACE)):
            break
        node = node.args[0]
    return node


def mutated_roots(graph: fx.Graph) -> set[fx.Node]:
    """Alias roots of the values some in-place op writes into: their casts must not be shared across the write."""
    return {alias_root(n.args[0]) for n in graph.nodes
            if n.meta.get(meta.INPLACE) and n.args and isinstance(n.args[0], fx.Node)}


def mutated_values(graph: fx.Graph) -> set[fx.Node]:
    """Every value an in-place op writes, with everything that may alias it (views up and down)."""
    found = {n.args[0] for n in graph.nodes if n.meta.get(meta.INPLACE) and n.args and isinstance(n.args[0], fx.Node)}
    todo = list(found)
    while todo:
        node = todo.pop()
        linked = [u for u in node.users if _may_alias(u) and u.args and u.args[0] is node]
        if _may_alias(node) and node.args and isinstance(node.args[0], fx.Node):
            linked.append(node.args[0])
        for other in linked:
            if other not in found:
                found.add(other)
                todo.append(other)
    return found
