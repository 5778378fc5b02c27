"""Rewrite: parameter casts become :func:`amp_fx.graph_ops.cast_cache.cached_cast`, reused across forwards.

``insert_casts`` casts each fp32 parameter once per forward (``w.to(bf16)``).
Until the parameter changes that cast gives the same tensor, so this pass
swaps it for :func:`~amp_fx.graph_ops.cast_cache.cached_cast`, which serves the cast
made by an earlier forward while the parameter's version counter, storage
and shape say it is unchanged (and no optimizer stepped it since).
``cache_casts=True`` serves it only where autograd does not record the cast
(``torch.no_grad()`` / ``inference_mode``, a frozen parameter) and casts as an
ordinary autograd op in training: repeated inference pays no weight casts.
``cache_casts="training"`` (the node's ``training=True``) serves it in
training too, one autograd node per use over the cached copy: under
gradient accumulation each weight is cast once per optimizer step.

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
    scope = getattr(ctx.config, "cache_casts", True)
    if not scope or ctx.route == "dynamo":
        return PassResult(gm, False, {"cached": 0, "skipped": "cache_casts=False" if ctx.route != "dynamo" else "compiled graph"})
    kwargs = {"training": True} if scope == "training" else {}
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
            swapped = graph.call_function(cached_cast, (source, cast_target(node)), dict(kwargs))
        swapped.meta.update(node.meta)
        node.replace_all_uses_with(swapped)
        graph.erase_node(node)
        cached += 1
    stats = {"cached": cached, "kept": kept, "scope": "training" if kwargs else "inference"}
    if cached:
        if kwargs:
            line = (f"{cached} weight cast(s) made once per parameter version and reused across forwards, training "
                    f"included (cache_casts='training'): under gradient accumulation one cast per optimizer step")
        else:
            line = (f"{cached} weight cast(s) reused across forwards where autograd does not record them "
                    f"(no_grad, inference_mode, frozen parameters); invalidated by each parameter's version")
        stats["report_lines"] = [line]
    return PassResult(gm, cached > 0, stats)
