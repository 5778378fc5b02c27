"""Rewrite: fold cast chains, drop casts to a value's own dtype, merge duplicate casts.

After this pass no inserted cast reads another cast, no inserted cast
targets the dtype its input already has, and each (value, dtype) has one
inserted cast.  A low->fp32 round trip of a value that is already fp32
resolves to the value itself.  Casts the model wrote are read through only
when they widen (``x.float()``), since a narrowing cast the user wrote
(``x.half()``) is a rounding they asked for.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from amp_fx.ir.cast_nodes import cast_source, cast_target, is_inserted_cast, is_model_cast
from amp_fx.ir.pass_manager import PassContext, PassResult, amp_pass
from amp_fx.ir.analysis import alias_root, mutated_roots
from amp_fx.ir import meta
from amp_fx.ir.meta import float_dtype

__all__ = ["fold_casts"]


def _replace(node: fx.Node, value: fx.Node) -> None:
    node.replace_all_uses_with(value)
    node.graph.erase_node(node)


def _widens(dtype: torch.dtype) -> bool:
    return dtype in (torch.float32, torch.float64)


def _narrower_float(node: fx.Node) -> bool:
    """True when ``node`` is known to be a float tensor that a widening cast may be read through to.

    An integer or bool value (``mask.float()``) must keep the model's cast, and
    so must float64, which amp_fx never casts.
    """
    return meta.is_float(node) is True and float_dtype(node) != torch.float64


@amp_pass(kind="rewrite", requires=("meta",))
def fold_casts(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Fold chains, drop no-op casts and merge duplicates among the inserted casts."""
    folded = dropped = merged = 0
    seen: dict[tuple[fx.Node, torch.dtype], fx.Node] = {}
    # Casts of a value some in-place op writes into are placed around the write: leave them be.
    mutated = mutated_roots(gm.graph)
    for node in list(gm.graph.nodes):
        if not is_inserted_cast(node):
            continue
        target = cast_target(node)
        source = cast_source(node)
        if source is None or alias_root(source) in mutated:
            continue
        # cast(cast(x)): read x directly, or x itself when it already has the target dtype.
        while cast_source(source) is not None and (
                is_inserted_cast(source)
                or (is_model_cast(source) and _widens(cast_target(source)) and _narrower_float(cast_source(source)))):
            inner = source
            source = cast_source(inner)
            node.args = (source,) + tuple(node.args[1:])
            folded += 1
            # A cast kept in ``seen`` may still take over later duplicates of itself.
            if not inner.users and seen.get((cast_source(inner), cast_target(inner))) is not inner:
                gm.graph.erase_node(inner)
        if float_dtype(source) == target and meta.is_float(source) is True:
            _replace(node, source)
            dropped += 1
            continue
        key = (source, target)
        if key in seen:
            _replace(node, seen[key])
            merged += 1
            continue
        seen[key] = node
        if float_dtype(node) != target:
            meta.note_value(node, float_dtype=target)
    for node in list(gm.graph.nodes):
        if is_inserted_cast(node) and not node.users:
            gm.graph.erase_node(node)
            dropped += 1
    return PassResult(gm, bool(folded or dropped or merged), {"folded": folded, "dropped": dropped, "merged": merged})
