"""Rewrite: parameter casts become :func:`amp_fx.graph_ops.cast_cache.cached_cast`, reused across forwards in inference.

``insert_casts`` casts each fp32 parameter once per forward (``w.to(bf16)``).
Under ``torch.no_grad()`` / ``inference_mode`` (or for a frozen parameter)
that cast gives the same tensor until the parameter changes, so this pass
swaps it for :func:`~amp_fx.graph_ops.cast_cache.cached_cast`, which serves the cast
made by an earlier forward while the parameter's version counter, storage
and shape say it is unchanged, and is an ordinary autograd cast otherwise
(training).  Repeated inference then pays no weight casts at all.

A cast is left as it is where a cached tensor could be changed or handed out:
one whose value (or a view of it) reaches the graph's output or an in-place
op.  Graphs from ``torch.compile`` (``route == "dynamo"``) are left alone:
their parameters are graph inputs and inductor fuses the casts into its
kernels.  ``cache_casts=False`` turns the pass off.
"""

from __future__ import annotations

import torch.fx as fx

from amp_fx.ir import meta, tables
from amp_fx.graph_ops.cast_cache import cached_cast
from amp_fx.ir.cast_nodes import cast_source, cast_target, is_inserted_cast
from amp_fx.ir.pass_manager import PassContext, PassResult, amp_pass

__all__ = ["cache_weight_casts"]


def _escapes(node: fx.Node) -> bool:
    """True when ``node``'s value, or a view of it, reaches the output or an in-place op."""
    todo, seen = [node], set()
    while todo:
        value = todo.pop()
        for user in value.users:
            if user.op == "output" or user.meta.get(meta.INPLACE):
                return True
            if user.meta.get(meta.OP) in tables.DATA_MOVEMENT and user.args and user.args[0] is value and user not in seen:
                seen.add(user)
                todo.append(user)
    return False


@amp_pass(kind="rewrite", requires=("meta",))
def cache_weight_casts(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Turn parameter casts into cached casts (see the module docstring)."""
    if not getattr(ctx.config, "cache_casts", True) or ctx.route == "dynamo":
        return PassResult(gm, False, {"cached": 0, "skipped": "cache_casts=False" if ctx.route != "dynamo" else "compiled graph"})
    graph = gm.graph
    cached = kept = 0
    for node in list(graph.nodes):
        if not is_inserted_cast(node) or node.target is cached_cast:
            continue
        source = cast_source(node)
        if source is None or source.op != "get_attr" or not node.meta.get(meta.WEIGHT_CAST):
            continue
        if _escapes(node):
            kept += 1
            continue
        with graph.inserting_before(node):
            swapped = graph.call_function(cached_cast, (source, cast_target(node)))
        swapped.meta.update(node.meta)
        node.replace_all_uses_with(swapped)
        graph.erase_node(node)
        cached += 1
    stats = {"cached": cached, "kept": kept}
    if cached:
        stats["report_lines"] = [f"{cached} weight cast(s) reused across forwards where autograd does not record them "
                                 f"(no_grad, inference_mode, frozen parameters); invalidated by each parameter's version"]
    return PassResult(gm, cached > 0, stats)
