"""Rewrite: insert the casts that the precision paint asks for, one per (value, dtype).

Reads ``amp_fx.decision`` (written by ``assign_precision``) and the dtype
analysis (:mod:`amp_fx.ir.analysis`: the pass requires ``"dtypes"``, so the
pass runner stores it first if it does not hold), and models no dtype of its own.  For every node, the analysis says which
dtype its floating inputs must arrive in (:func:`~amp_fx.ir.analysis.input_target`);
a consumer that needs another dtype than its input has gets a cast.  Every
consumer of the same value and dtype shares that one cast, so a parameter
used by several ops is cast once per forward.

Where the value is known to be a floating tensor the cast is a plain
``x.to(dtype)``; where it is not known (a graph input without example
inputs) it is :func:`amp_fx.graph_ops.casts.amp_cast`, which leaves integer, bool and
complex tensors untouched.  Leaf modules that must run in another dtype get
their parameters' casts through :func:`amp_fx.graph_ops.casts.call_with_params`.
The dtype checks that torch.export records (``_assert_tensor_metadata``) are
kept true to the rewritten program.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx
from torch.fx.node import map_arg

from amp_fx.ir import meta, op_properties
from amp_fx.ir.analysis import ValueInfo, input_target, may_be_float_tensor, promoting_inputs
from amp_fx.ir.cast_nodes import CastBuilder, cast_source
from amp_fx.graph_ops.casts import amp_promote, call_with_params
from amp_fx.errors import UnsupportedConstructError
from amp_fx.ir.pass_manager import PassContext, PassResult, amp_pass

__all__ = ["insert_casts"]


def _info(node: fx.Node) -> Optional[ValueInfo]:
    return meta.value_of(node)


def _castable(node: object) -> bool:
    return isinstance(node, fx.Node) and may_be_float_tensor(_info(node))


def _leaf_params(gm: fx.GraphModule, node: fx.Node) -> dict[str, torch.Tensor]:
    if node.op != "call_module":
        return {}
    module = gm.get_submodule(str(node.target))
    return {name: p for name, p in module.named_parameters() if p.is_floating_point()}


def _run_leaf_with_cast_params(gm: fx.GraphModule, node: fx.Node, dtype: torch.dtype, builder: CastBuilder) -> int:
    """Rewrite a parametrised leaf module call so its parameters are cast for this call."""
    params = _leaf_params(gm, node)
    wrong = {name: p for name, p in params.items() if p.dtype != dtype}
    if not wrong:
        return 0
    graph = gm.graph
    mapping = {}
    for name in wrong:
        with graph.inserting_before(node):
            attr = graph.get_attr(f"{node.target}.{name}")
        ValueInfo.of(wrong[name].detach()).write(attr)
        attr.meta.update({meta.PARAM: f"{node.target}.{name}", meta.MODULE_PATH: str(node.target),
                          meta.DECISION: "none", meta.REASON: "parameter", meta.ORIG_DTYPE: wrong[name].dtype})
        meta.value_of(attr).fake = None
        mapping[name] = builder.cast(attr, dtype)
    with graph.inserting_before(node):
        module_ref = graph.get_attr(str(node.target))
        ValueInfo.non_tensor().write(module_ref)
        module_ref.meta.update({meta.DECISION: "none", meta.REASON: "module"})
    node.op = "call_function"
    node.target = call_with_params
    node.args = (module_ref, mapping) + tuple(node.args)
    return len(mapping)


def _out_of_place(node: fx.Node, builder: CastBuilder, dtype: torch.dtype) -> fx.Node:
    """Turn ``x.op_()`` into ``x.copy_(op(cast(x)))``: computed in ``dtype``, stored back in x."""
    graph = node.graph
    target = node.target
    if node.op == "call_method":
        node.target = str(target)[:-1]
    elif isinstance(target, torch._ops.OpOverload):
        packet = getattr(torch.ops.aten, target._opname[:-1])
        node.target = getattr(packet, target._overloadname)
    else:
        node.target = getattr(torch, target.__name__[:-1])
    destination = node.args[0]
    with graph.inserting_after(node):
        copy = graph.call_method("copy_", (destination, node))
    node.replace_all_uses_with(copy, delete_user_cb=lambda user: user is not copy)
    copy.meta.update(node.meta)  # the analysis's answer for the in-place op: the destination's dtype
    copy.meta.update({meta.OP: "copy", meta.DECISION: "follow", meta.REASON: "writes the fp32 result back in place", meta.INSERTED: True})
    node.meta[meta.INPLACE] = False
    meta.note_value(node, float_dtype=dtype)  # the out-of-place op computes in ``dtype``
    return copy


def _keep_checks_true(node: fx.Node) -> bool:
    """Keep a dtype check torch.export recorded true to the rewrite; False when the check was dropped."""
    if node.meta.get(meta.OP) != "_assert_tensor_metadata" or not node.args:
        return True
    checked = node.kwargs.get("dtype")
    source = _info(node.args[0])
    if not isinstance(checked, torch.dtype) or not checked.is_floating_point or source is None:
        return True
    if source.is_float is True and source.float_dtype is not None:
        if source.float_dtype != checked:
            node.kwargs = {**node.kwargs, "dtype": source.float_dtype}
        return True
    node.graph.erase_node(node)  # the dtype is decided at run time now: nothing to check it against
    return False


def _viewed_input(node: fx.Node) -> Optional[fx.Node]:
    """The graph input ``node`` is a view of, if it surely is one.

    Not :func:`~amp_fx.ir.analysis.alias_root`: that walks through copies too (``clone``,
    ``index_select``, casts), which over-approximates safely for cast sharing, but here it would
    refuse writes that never reach the input.
    """
    while node.op != "placeholder":
        viewing = op_properties.of(node.meta.get(meta.OP)).view
        if node.op not in ("call_function", "call_method") or not viewing or not node.args:
            return None
        if node.meta.get(meta.OP) == "getitem" and node.all_input_nodes[1:]:
            return None  # x[ids]: advanced indexing copies
        source = node.args[0]
        if not isinstance(source, fx.Node):
            return None
        node = source
    return node


def _written_inputs(graph: fx.Graph) -> set[fx.Node]:
    """Graph inputs that an in-place op writes into, directly or through views."""
    found = set()
    for node in graph.nodes:
        if node.meta.get(meta.INPLACE) and node.args and isinstance(node.args[0], fx.Node):
            target = _viewed_input(node.args[0])
            if target is not None:
                found.add(target)
    return found


def _refuse_input_write(node: fx.Node, ctx: PassContext) -> None:
    """An in-place write into a graph input cannot reach the caller's tensor once the input is cast at entry."""
    writer = next((n for n in node.graph.nodes if n.meta.get(meta.INPLACE) and n.args and isinstance(n.args[0], fx.Node)
                   and _viewed_input(n.args[0]) is node), None)
    where = (writer.meta.get(meta.SOURCE) if writer is not None else None) or "unknown source line"
    raise UnsupportedConstructError(
        f"forward writes in place into its input {node.name!r} ({writer.name if writer is not None else '?'} at {where}). "
        f"At {ctx.config.level} floating inputs are cast to {str(ctx.low).replace('torch.', '')} at entry, so the write "
        "would change the cast copy, not the caller's tensor. Convert at O1 (inputs are not cast at entry), or write "
        "the result out of place and return it.",
        construct="in-place write into a graph input", where=where)


@amp_pass(kind="rewrite", requires=("meta", "paint", "dtypes"))
def insert_casts(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Insert casts so that every node sees the dtype its decision asks for."""
    graph = gm.graph
    values = {n: meta.value_of(n) for n in graph.nodes if meta.value_of(n) is not None}
    builder = CastBuilder(graph)  # casts from an earlier run are reused, so a second run inserts nothing
    low = ctx.low
    promote_helpers = leaf_param_casts = checks_rewritten = 0
    entry_casts: list[fx.Node] = []
    written = _written_inputs(graph)
    for node in list(graph.nodes):
        if node.meta.get(meta.INSERTED):
            continue
        decision = node.meta.get(meta.DECISION, "follow")
        if node.op in ("placeholder", "get_attr"):
            # An input read only by casts (fold_casts reads through entry casts) needs no entry cast.
            if decision == "entry" and _castable(node) and any(not user.meta.get(meta.INSERTED) for user in node.users):
                if node in written:
                    _refuse_input_write(node, ctx)
                cast = builder.cast(node, low)
                # Every later reader sees the entry cast, never the raw input.
                node.replace_all_uses_with(cast, delete_user_cb=lambda user: user is not cast)
                entry_casts.append(cast)
            continue
        if node.op == "output":
            if decision == "exit":
                target = ctx.config.cast_model_outputs
                node.args = map_arg(node.args, lambda n: builder.cast(n, target) if _castable(n) else n)
            continue
        if not _keep_checks_true(node):
            checks_rewritten += 1
            continue
        target_dtype = input_target(node, decision, low, values)
        if decision == "promote" and target_dtype is None:
            inputs = list(dict.fromkeys(promoting_inputs(node, values)))
            if len(inputs) > 1 and not _promoted_already(inputs):
                _insert_runtime_promote(node, inputs)
                promote_helpers += 1
        writer = node if node.meta.get(meta.INPLACE) and node.args and isinstance(node.args[0], fx.Node) else None
        if target_dtype is not None:
            if writer is not None and decision == "fp32" and meta.float_dtype(node.args[0]) != target_dtype:
                writer = _out_of_place(node, builder, target_dtype)
                node = writer.args[1]
            node.args, node.kwargs = map_arg(
                (node.args, node.kwargs), lambda n: builder.cast(n, target_dtype) if _castable(n) else n)
            leaf_param_casts += _run_leaf_with_cast_params(gm, node, target_dtype, builder)
        if writer is not None:
            builder.note_write(writer)
    created = builder.created
    _sink_to_first_reader(created, entry_casts)
    weight_casts = sum(1 for c in created if c.meta.get(meta.WEIGHT_CAST))
    stats = {"casts_inserted": len(created), "weight_casts": weight_casts, "runtime_promotes": promote_helpers,
             "leaf_param_casts": leaf_param_casts, "entry_casts": len(entry_casts), "float64_kept": builder.kept_float64,
             "export_checks_rewritten": checks_rewritten}
    if builder.kept_float64:
        stats["report_lines"] = [f"float64 values left in float64, never cast (as under autocast): {', '.join(builder.kept_float64)}"]
    return PassResult(gm, bool(created) or promote_helpers > 0 or checks_rewritten > 0, stats)


def _sink_to_first_reader(casts: list[fx.Node], keep: list[fx.Node]) -> None:
    """Move each new cast of a graph input or parameter to just before its first reader.

    Such casts are first placed after the last placeholder, which in a Dynamo
    or torch.export graph (parameters are placeholders there) is the top of
    the graph.  Autograd runs a cast's backward (the low gradient cast back
    to fp32) in reverse forward order, so a cast at the top casts its
    gradient last: every parameter's low-precision gradient then stays alive
    until the end of backward.  Just before its reader, as autocast casts,
    each gradient is cast and freed as soon as it is made (the compiled
    step's peak memory with and without the move: docs/performance.md, "O1
    casts"; ``benchmarks/bench_o1_casts.py --only sink``).  Safe: a cast is
    made for its first reader, after any in-place write to its source, and
    its readers all come before the next write (which gets a new cast).
    Entry casts (``keep``) stay where they are: every reader sees them.
    """
    kept = set(keep)
    for cast in casts:
        source = cast_source(cast)
        if cast in kept or source is None or source.op not in ("placeholder", "get_attr") or not cast.users:
            continue
        min(cast.users).prepend(cast)


def _promoted_already(inputs: list[fx.Node]) -> bool:
    """True when ``inputs`` are the items of one :func:`amp_promote` (a second run adds none)."""
    sources = {n.args[0] if n.op == "call_function" and n.target is operator.getitem else None for n in inputs}
    source = next(iter(sources))
    return len(sources) == 1 and isinstance(source, fx.Node) and source.target is amp_promote


def _insert_runtime_promote(node: fx.Node, inputs: list[fx.Node]) -> None:
    """Promote inputs of unknown dtype at run time with :func:`amp_promote`."""
    graph = node.graph
    with graph.inserting_before(node):
        promoted = graph.call_function(amp_promote, tuple(inputs))
        ValueInfo.non_tensor().write(promoted)
        promoted.meta.update({meta.OP: "amp_cast", meta.DECISION: "cast", meta.REASON: "runtime promote (input dtypes unknown)",
                              meta.INSERTED: True})
        replacements = {}
        for index, value in enumerate(inputs):
            item = graph.call_function(operator.getitem, (promoted, index))
            known = _info(value) or ValueInfo()
            ValueInfo(known.is_tensor, known.is_float, None, None, known.shape).write(item)
            item.meta.update({meta.OP: "getitem", meta.DECISION: "follow", meta.REASON: "runtime promote", meta.INSERTED: True})
            replacements[value] = item
    node.args, node.kwargs = map_arg((node.args, node.kwargs), lambda n: replacements.get(n, n))
