"""Views of a conversion: the code diff, a networkx graph, a picture, and a summary.

``diff`` and ``to_networkx`` live here; ``draw`` (Graphviz or a built-in
SVG/HTML layout) is in :mod:`amp_fx.inspection.draw` and ``summary`` (FLOPs, casts,
bytes) in :mod:`amp_fx.inspection.summary`; all four are exported as ``amp_fx.*``.
"""

from __future__ import annotations

import difflib
import re
from typing import Any, Optional, Sequence, Union

import torch
import torch.fx as fx
import torch.nn as nn

from amp_fx.ir.cast_nodes import cast_target, is_inserted_cast
from amp_fx.inspection.draw import draw
from amp_fx.ir.cast_costs import cast_bytes
from amp_fx.ir import meta
from amp_fx.ir.meta import float_dtype
from amp_fx.inspection.summary import Summary, summary
from amp_fx.errors import AmpTypeError

__all__ = ["diff", "to_networkx", "draw", "summary", "Summary", "CAST_MARK", "inserted_lines"]

# Appended to every line of the converted code that amp_fx inserted.
CAST_MARK = "# <- amp_fx"
# fx frees dead values with ``;  a = b = None`` tails: noise in a diff.
_FREE_TAIL = re.compile(r";\s+(?:\w+ = )+None\s*$")
_ASSIGN = re.compile(r"^\s*(\w+)(?:\s*,\s*\w+)*\s*=")


def _dtype_name(dtype: Optional[torch.dtype]) -> str:
    return "?" if dtype is None else str(dtype).replace("torch.", "")


def _code_lines(gm: fx.GraphModule) -> list[str]:
    lines = []
    for line in gm.code.strip("\n").splitlines():
        line = _FREE_TAIL.sub("", line.rstrip())
        if line.strip():
            lines.append(line)
    return lines


def _describe_inserted(node: fx.Node) -> str:
    if is_inserted_cast(node):
        source, src_dtype, dst = meta.CAST_OF.get(node, (None, None, cast_target(node)))
        kind = "weight cast" if meta.WEIGHT_CAST.get(node) else "cast"
        size = cast_bytes(node)
        cost = f", {size} B" if size is not None else ""
        return f"{CAST_MARK} {kind}: {source} {_dtype_name(src_dtype)} -> {_dtype_name(dst)}{cost}"
    return f"{CAST_MARK} inserted: {meta.REASON.get(node, 'by amp_fx')}"


def inserted_lines(gm: fx.GraphModule) -> list[str]:
    """The converted code, one statement a line, with every line amp_fx inserted marked."""
    inserted = {n.name: n for n in gm.graph.nodes if meta.INSERTED.get(n)}
    out = []
    for line in _code_lines(gm):
        match = _ASSIGN.match(line)
        node = inserted.get(match.group(1)) if match else None
        out.append(f"{line}  {_describe_inserted(node)}" if node is not None else line)
    return out


def _before_module(model_or_gm: Union[nn.Module, fx.GraphModule], example_inputs: Optional[Sequence[Any]]) -> fx.GraphModule:
    if isinstance(model_or_gm, fx.GraphModule):
        return model_or_gm
    if not isinstance(model_or_gm, nn.Module):
        raise AmpTypeError(f"diff expects the original nn.Module or its GraphModule, got {type(model_or_gm).__name__}")
    from amp_fx.frontend.tracing import trace_model

    gm, _ = trace_model(model_or_gm, example_inputs=tuple(example_inputs) if example_inputs is not None else None)
    return gm


def diff(
    model_or_gm: Union[nn.Module, fx.GraphModule],
    converted: fx.GraphModule,
    *,
    example_inputs: Optional[Sequence[Any]] = None,
    context: int = 3,
) -> str:
    """Unified diff of the generated code before and after conversion, inserted casts marked.

    ``model_or_gm`` is the original model (traced here as ``convert`` traced
    it; pass ``example_inputs`` when it needed them) or a GraphModule of it.
    Every line of ``converted`` that amp_fx inserted ends with
    ``# <- amp_fx cast: x float32 -> bfloat16, 192 B``; the dead-value
    ``; x = None`` tails fx writes are dropped from both sides.
    """
    before = _code_lines(_before_module(model_or_gm, example_inputs))
    after = inserted_lines(converted)
    name = type(model_or_gm).__name__
    return "\n".join(difflib.unified_diff(before, after, fromfile=f"{name} (traced)", tofile=f"{name} (amp_fx)",
                                          n=context, lineterm=""))


def _shape(node: fx.Node) -> Optional[tuple]:
    shape = meta.shape(node)
    return tuple(int(s) for s in shape) if shape is not None else None


def to_networkx(converted: fx.GraphModule) -> Any:
    """A ``networkx.DiGraph`` of the converted graph, one vertex per node (keyed by node name).

    Vertex attributes: ``op`` (canonical op, ``"to"`` for casts), ``fx_op``
    (placeholder / get_attr / call_* / output), ``target``, ``module``,
    ``decision``, ``reason``, ``dtype`` (name of the floating dtype the value
    has after conversion, or None), ``shape`` (tuple or None), ``source``,
    ``inserted``, ``order`` (position in the graph).  Edge attributes:
    ``cast_bytes`` -- the bytes a cast reads and writes, on the edge into an
    inserted cast (0 on every other edge; None where shapes are unknown) --
    and ``dtype`` of the value that flows.
    """
    import networkx as nx

    graph = nx.DiGraph(name=type(converted).__name__)
    for order, node in enumerate(converted.graph.nodes):
        op = "to" if is_inserted_cast(node) else meta.OP.get(node)
        graph.add_node(
            node.name, op=op or (node.op if node.op in ("placeholder", "output") else None), fx_op=node.op,
            target=str(node.target), module=meta.MODULE_PATH.get(node, ""), decision=meta.DECISION.get(node, "none"),
            reason=meta.REASON.get(node, ""), dtype=None if float_dtype(node) is None else _dtype_name(float_dtype(node)),
            shape=_shape(node), source=meta.SOURCE.get(node), inserted=bool(meta.INSERTED.get(node)), order=order,
        )
    for node in converted.graph.nodes:
        for source in node.all_input_nodes:
            size = cast_bytes(node) if is_inserted_cast(node) else 0
            dtype = float_dtype(source)
            graph.add_edge(source.name, node.name, cast_bytes=size, dtype=None if dtype is None else _dtype_name(dtype))
    return graph
