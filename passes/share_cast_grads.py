"""Rewrite: a low cast read by several ops gets one read per reader, so its gradient is summed in fp32.

``insert_casts`` casts a value once per dtype and every reader shares that
cast (one cast per (value, dtype)).  In backward, autograd then sums the
readers' gradients at the shared cast, in the cast's low dtype, and upcasts
the sum once; autocast casts once per reader, so there each reader's
gradient is upcast alone and the sum is in fp32.  With ``k`` readers (``h =
layer_norm(x)`` read by the q, k and v projections, or by many heads) the
low sum loses ``log2(k)`` bits or so more than autocast's.

This pass keeps the one forward cast and gives each reader its own
:func:`~amp_fx.graph_ops.casts.shared_cast_read` of it: in forward a view of
the cast (no data is cast or copied), in backward the reader's gradient sent
to the cast's source in the source's dtype, where autograd sums them.  It
reads only inserted casts to a lower precision of a non-parameter value:
a weight's cast is shared the same way by autocast (its cast cache), O2's
entry casts stand for the input itself (as Apex's), and a cast of a value
written in place is placed around the write.  It runs after
``fp8_gemms`` and ``pad_gemm``, which look through a GEMM operand's cast.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from amp_fx.graph_ops.casts import shared_cast_read
from amp_fx.ir import meta
from amp_fx.ir.analysis import alias_root, mutated_roots
from amp_fx.ir.cast_nodes import cast_source, cast_target, is_inserted_cast
from amp_fx.ir.pass_manager import PassContext, PassResult, amp_pass

__all__ = ["share_cast_grads"]

_LOW = (torch.float16, torch.bfloat16)


def _is_read(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is shared_cast_read


def _shared(cast: fx.Node, mutated: set) -> bool:
    """True for a low cast of an activation that several ops read, none of them writing into it."""
    source = cast_source(cast)
    if source is None or cast_target(cast) not in _LOW or len(cast.users) < 2:
        return False
    if meta.PARAM.get(source) is not None or meta.WEIGHT_CAST.get(cast) or meta.is_float(source) is False:
        return False
    if meta.DECISION.get(source) == "entry":
        return False  # O2/O3 cast the input once at entry, as Apex did; every reader sees that cast
    if meta.float_dtype(source) in _LOW or alias_root(source) in mutated:
        return False  # already low (no rounding to route around), or a value some op writes into
    return not any(meta.INPLACE.get(user) for user in cast.users)


def _read_for(cast: fx.Node, user: fx.Node) -> fx.Node:
    """A read of ``cast`` just before ``user``, standing for the cast's value."""
    graph = cast.graph
    source = cast_source(cast)
    with graph.inserting_before(user):
        read = graph.call_function(shared_cast_read, (cast, source))
    meta.inherit(read, cast, float_dtype=cast_target(cast), same_value=True)
    answer = meta.value_of(cast)
    if answer is not None:
        meta.store_value(read, answer)  # the very tensor the cast made
    meta.OP.set(read, "alias")
    meta.DECISION.set(read, "follow")
    meta.REASON.set(read, f"inserted: {user.name}'s read of {cast.name}; its gradient is summed in "
                          f"{str(meta.float_dtype(source) or 'the source dtype').replace('torch.', '')} at {source.name}")
    meta.INSERTED.set(read, True)
    if meta.CHECKPOINT.get(user) is not None:  # it belongs to its reader's (and the cast's) checkpointed region
        meta.CHECKPOINT.set(read, meta.CHECKPOINT.get(user))
    return read


@amp_pass(kind="rewrite", requires=("meta",))
def share_cast_grads(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Give each reader of a shared low cast its own read, whose gradient is summed in fp32 (module docstring)."""
    graph = gm.graph
    mutated = mutated_roots(graph)
    casts = reads = 0
    for cast in list(graph.nodes):
        if not is_inserted_cast(cast) or not _shared(cast, mutated):
            continue
        # A reader in another checkpointed region than the cast would make that region keep the fp32 source
        # for its recompute, not only the low cast: it shares the cast as before.
        region = meta.CHECKPOINT.get(cast)
        readers = [user for user in cast.users
                   if not _is_read(user) and user.op != "output" and meta.CHECKPOINT.get(user) == region]
        if not readers:
            continue  # a second run: every reader has its read
        casts += 1
        for user in readers:
            read = _read_for(cast, user)
            user.replace_input_with(cast, read)
            reads += 1
    stats = {"casts": casts, "reads": reads}
    if casts:
        stats["report_lines"] = [f"{casts} shared low casts read by {reads} ops: gradients summed in fp32, as autocast"]
    return PassResult(gm, casts > 0, stats)
