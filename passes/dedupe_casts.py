"""Rewrite: share one cast per parameter by hoisting casts above views.

``insert_casts`` already shares one cast per (value, dtype).  A weight used
through a view (``w.t()``, ``w.view(...)``, ``w[0]``) is a different value,
so it would get a second cast.  This pass rewrites ``cast(view(w))`` into
``view(cast(w))`` when ``w`` is a parameter or is cast to that dtype anyway,
so each parameter is cast at most once per forward and the views read the
cast copy.  Chains of views (``w.t().contiguous()``) are hoisted one step at a
time until the cast reads the parameter.
"""

from __future__ import annotations

import torch.fx as fx
from torch.fx.node import map_arg

from amp_fx.ir import meta, op_properties
from amp_fx.ir.analysis import alias_root, mutated_roots
from amp_fx.ir.cast_nodes import CastBuilder, cast_source, cast_target, is_inserted_cast
from amp_fx.ir.pass_manager import PassContext, PassResult, amp_pass

__all__ = ["dedupe_casts"]


def _single_tensor_view(node: fx.Node) -> fx.Node | None:
    """The tensor a view-like node reads, when it reads exactly one tensor."""
    # Views with one tensor input: casting before or after them gives the same values, and the same
    # gradients (op_properties: cast_hoistable).  Not ``expand``: its backward would sum in the low dtype.
    if not op_properties.of(meta.OP.get(node)).cast_hoistable or not node.args:
        return None
    source = node.args[0]
    others: list[fx.Node] = []
    map_arg((node.args[1:], node.kwargs), others.append)
    if not isinstance(source, fx.Node) or others:
        return None
    return source


def _rooted_at_param(node: fx.Node) -> bool:
    """True when ``node`` is a parameter or a chain of views of one."""
    while meta.PARAM.get(node) is None:
        source = _single_tensor_view(node)
        if source is None:
            return False
        node = source
    return True


@amp_pass(kind="rewrite", requires=("meta",))
def dedupe_casts(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Hoist casts of views of parameters above the view (see module docstring)."""
    graph = gm.graph
    builder = CastBuilder(graph)
    hoisted = 0
    # A cast hoisted above a view would read its source before an in-place write.
    mutated = mutated_roots(graph)
    changed = True
    while changed:
        changed = False
        for cast in list(graph.nodes):
            if cast.graph is not graph or not is_inserted_cast(cast):
                continue
            view = cast_source(cast)
            source = _single_tensor_view(view) if view is not None else None
            target = cast_target(cast)
            if source is None or meta.is_float(source) is not True or alias_root(source) in mutated:
                continue
            if not _rooted_at_param(source) and (source, target) not in builder.cache:
                continue
            source_cast = builder.cast(source, target)
            if cast < source_cast:  # insert_casts sank it to its first reader: the view is read earlier
                cast.prepend(source_cast)
            with graph.inserting_before(cast):
                new_view = graph.node_copy(view, lambda n: source_cast if n is source else n)
            new_view.meta = dict(view.meta)
            meta.note_value(new_view, float_dtype=target)
            meta.REASON.set(new_view, f"{meta.REASON.get(view, '')}; reads the shared cast of {source.name}")
            cast.replace_all_uses_with(new_view)
            graph.erase_node(cast)
            if not view.users:
                graph.erase_node(view)
            hoisted += 1
            changed = True
    return PassResult(gm, hoisted > 0, {"hoisted": hoisted, "casts_created": len(builder.created)})
