"""What a paint costs in cast traffic: value sizes, and the casts ``insert_casts`` will write with their bytes.

Read off the dtype analysis (:mod:`amp_fx.ir.analysis`), so the min-cut
placement compares paints without rewriting a copy of the graph, and the
report and views count the bytes of the casts that were written.
"""

from __future__ import annotations

from typing import Mapping, Optional

import math

import torch
import torch.fx as fx
from torch.fx.node import map_arg

from amp_fx.ir import meta, op_properties
from amp_fx.ir.analysis import Analysis, input_target, node_inputs
from amp_fx.ir.meta import ValueInfo, may_be_float_tensor

__all__ = ["ELEMENT_SIZE", "FALLBACK_NUMEL", "static_numel", "numel_estimates", "cast_bytes", "planned_casts"]

ELEMENT_SIZE = {torch.float16: 2, torch.bfloat16: 2, torch.float32: 4, torch.float64: 8}
FALLBACK_NUMEL = 4096  # elements of a graph input whose shape is unknown (cost estimates only)


def _growth(node: fx.Node) -> int:
    """How many times larger than its input a repeat-like op's result is, from literal arguments (1 if unknown)."""
    op = node.meta.get(meta.OP)
    if not op_properties.of(op).grows:  # the op registry's repeat, tile, repeat_interleave, expand
        return 1
    sizes = [a for a in node.args[1:] if isinstance(a, int)]
    if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)):
        sizes = [a for a in node.args[1] if isinstance(a, int)]
    if op == "expand":
        return 2 if sizes else 1  # the input's shape is unknown: only "larger"
    return max(1, math.prod(sizes)) if sizes else 1


def static_numel(shape: Optional[tuple]) -> Optional[int]:
    """Elements of ``shape``; a symbolic size counts as its example value (never specialised: no guard is added)."""
    if shape is None:
        return None
    total = 1
    for size in shape:
        if not isinstance(size, int):
            hint = getattr(getattr(size, "node", None), "hint", None)
            if not isinstance(hint, int):
                return None
            size = hint
        total *= size
    return total


def numel_estimates(graph: fx.Graph) -> dict[fx.Node, int]:
    """Elements per value: from shapes where known; otherwise a graph input counts ``FALLBACK_NUMEL``
    and an op's result as much as its largest input (times a repeat's literal factor)."""
    numel: dict[fx.Node, int] = {}
    for node in graph.nodes:
        known = static_numel(meta.shape(node))
        inputs = [numel[n] for n in node_inputs(node) if n in numel]
        if known is not None:
            numel[node] = known
        elif inputs and node.op not in ("placeholder", "get_attr"):
            numel[node] = max(inputs) * _growth(node)
        else:
            numel[node] = FALLBACK_NUMEL
    return numel


def cast_bytes(node: fx.Node) -> Optional[int]:
    """Bytes an inserted cast node reads plus writes, from shape metadata (None without shapes)."""
    numel = static_numel(meta.shape(node))
    _, source_dtype, target = node.meta.get(meta.CAST_OF, (None, None, None))
    if numel is None or target is None:
        return None
    # An unknown source dtype is counted as fp32: the cast exists because it differs.
    return numel * (ELEMENT_SIZE.get(source_dtype, 4) + ELEMENT_SIZE.get(target, 2))


def _widening_model_cast(node: fx.Node, values: Mapping[fx.Node, ValueInfo]) -> Optional[fx.Node]:
    """The value a cast the model wrote widens (``x.float()`` on a low x), which a later cast reads through."""
    if node.meta.get(meta.DECISION) != "cast" or node.meta.get(meta.INSERTED) or not node.args:
        return None
    source = node.args[0]
    target = values[node].float_dtype
    if not isinstance(source, fx.Node) or target not in (torch.float32, torch.float64):
        return None
    info = values.get(source)
    return source if info is not None and info.is_float is True and info.float_dtype != torch.float64 else None


def planned_casts(gm: fx.GraphModule, analysis: Analysis, paint: Mapping[fx.Node, str], low: torch.dtype,
                  output_dtype: Optional[torch.dtype]) -> dict[tuple[fx.Node, torch.dtype], int]:
    """The casts ``insert_casts`` (then ``fold_casts``) writes under ``paint``, one per (value, dtype), with their bytes.

    Sizes come from :func:`numel_estimates`.  A cast that reads a widening
    cast the model wrote reads through it, as ``fold_casts`` does.
    """
    values = analysis.values
    numel = numel_estimates(gm.graph)
    casts: dict[tuple[fx.Node, torch.dtype], int] = {}

    def want(value: fx.Node, dtype: Optional[torch.dtype]) -> None:
        info = analysis.read_as.get(value, values.get(value))
        if dtype is None or not may_be_float_tensor(info) or info.float_dtype == torch.float64:
            return
        through = _widening_model_cast(value, values)
        if through is not None:
            value, info = through, values[through]
        if info.float_dtype == dtype:
            return
        source_size = ELEMENT_SIZE.get(info.float_dtype, 4)
        casts[(value, dtype)] = numel.get(value, FALLBACK_NUMEL) * (source_size + ELEMENT_SIZE.get(dtype, 2))

    for node in gm.graph.nodes:
        decision = paint.get(node) or node.meta.get(meta.DECISION, "follow")
        if node.op == "placeholder":
            if node in analysis.read_as and values[node].float_dtype != low:
                source_size = ELEMENT_SIZE.get(values[node].float_dtype, 4)
                casts[(node, low)] = numel.get(node, FALLBACK_NUMEL) * (source_size + ELEMENT_SIZE[low])
            continue
        if node.op == "output":
            if decision == "exit":
                map_arg(node.args, lambda n: want(n, output_dtype))
            continue
        if node.op == "get_attr" or node.meta.get(meta.INPLACE):
            continue
        target = input_target(node, decision, low, values)
        if target is None:
            continue
        for value in node_inputs(node):
            want(value, target)
        if node.op == "call_module":
            module = gm.get_submodule(str(node.target))
            for name, p in module.named_parameters():
                if p.is_floating_point() and p.dtype not in (target, torch.float64):
                    casts[(f"{node.target}.{name}", target)] = p.numel() * (ELEMENT_SIZE.get(p.dtype, 4) + ELEMENT_SIZE.get(target, 2))
    return casts
