"""Cast nodes in a graph: recognise the ones amp_fx inserted and the ones the model wrote, and build new ones."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.fx as fx

from amp_fx.ir import meta, op_properties
from amp_fx.ir.analysis import alias_root, arrives_as
from amp_fx.graph_ops.cast_cache import cached_cast
from amp_fx.graph_ops.casts import amp_cast

__all__ = ["is_inserted_cast", "is_model_cast", "cast_source", "cast_target", "written_cast_dtype", "CastBuilder"]


def is_inserted_cast(node: fx.Node) -> bool:
    """True for a ``.to(dtype)``, ``amp_cast`` or ``cached_cast`` node that amp_fx inserted."""
    return bool(node.meta.get(meta.INSERTED)) and cast_target(node) is not None


def is_model_cast(node: fx.Node) -> bool:
    """True for a cast the model itself wrote to a floating dtype (``x.float()``, ``x.to(torch.half)``)."""
    return not node.meta.get(meta.INSERTED) and cast_target(node) is not None


def cast_source(node: fx.Node) -> Optional[fx.Node]:
    """The value a cast node reads."""
    source = node.args[0] if node.args else None
    return source if isinstance(source, fx.Node) else None


def cast_target(node: fx.Node) -> Optional[torch.dtype]:
    """The floating dtype a cast node produces, or None when ``node`` is not a simple float cast."""
    if node.op == "call_function" and node.target in (amp_cast, cached_cast):
        return node.args[1]
    if node.op != "call_method":
        return None
    named = op_properties.NAMED_CASTS.get(node.target)  # x.float(), x.half(), ...
    if named is not None and len(node.args) == 1 and not node.kwargs:
        return named
    if node.target == "to" and len(node.args) == 2 and not node.kwargs:
        dtype = node.args[1]
        if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
            return dtype
    return None


def written_cast_dtype(node: fx.Node) -> Optional[torch.dtype]:
    """The floating dtype a cast the model wrote produces, in any spelling: ``x.float()``, ``x.to(torch.float32)``,
    ``x.to(dtype=...)``, ``aten._to_copy(x, dtype=...)`` / ``aten.to.dtype`` (torch.export); None when not known."""
    simple = cast_target(node)
    if simple is not None:
        return simple
    if node.op not in ("call_function", "call_method"):
        return None
    for arg in list(node.args[1:]) + [node.kwargs.get("dtype")]:
        if isinstance(arg, torch.dtype):
            return arg if arg.is_floating_point else None
    return None


def _after_placeholders(node: fx.Node) -> fx.Node:
    """Insert point right after ``node``, but never among the placeholders."""
    if node.op != "placeholder":
        return node
    last = node
    for candidate in node.graph.nodes:
        if candidate.op == "placeholder":
            last = candidate
    return last


class CastBuilder:
    """Creates and remembers casts so that each (value, dtype) is cast once (per in-place write).

    Where the analysis knows the value is a floating tensor the cast is a plain
    ``x.to(dtype)``; where it does not, it is :func:`amp_fx.graph_ops.casts.amp_cast`,
    which leaves integer, bool and complex tensors untouched at run time.
    """

    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self.cache: dict[tuple[fx.Node, torch.dtype], fx.Node] = {
            (cast_source(n), cast_target(n)): n for n in graph.nodes if is_inserted_cast(n)}
        self.created: list[fx.Node] = []
        self.writes: dict[fx.Node, fx.Node] = {}  # alias root -> the last in-place op that wrote into it
        self.kept_float64: list[str] = []

    def cast(self, value: fx.Node, dtype: torch.dtype) -> fx.Node:
        """Return a node holding ``value`` cast to ``dtype`` (shared across consumers)."""
        current = meta.float_dtype(value)
        if current == dtype:
            return value
        if current == torch.float64:
            # As autocast: an op reading float64 is not eligible; the value keeps its precision.
            if value.name not in self.kept_float64:
                self.kept_float64.append(value.name)
            return value
        key = (value, dtype)
        if key in self.cache:
            return self.cache[key]
        anchor = _after_placeholders(value)
        writer = self.writes.get(alias_root(value))
        if writer is not None and anchor < writer:
            anchor = writer  # a cast made before an in-place write would hold stale values
        with self.graph.inserting_after(anchor):
            if meta.is_float(value) is True:
                cast = self.graph.call_method("to", (value, dtype))
            else:
                cast = self.graph.call_function(amp_cast, (value, dtype))
        self._annotate(cast, value, dtype)
        self.cache[key] = cast
        self.created.append(cast)
        return cast

    def note_write(self, writer: fx.Node) -> None:
        """``writer`` wrote in place into its first argument: readers after it get fresh casts."""
        root = alias_root(writer.args[0])
        self.writes[root] = writer
        for key in [key for key in self.cache if alias_root(key[0]) is root]:
            del self.cache[key]

    @staticmethod
    def _annotate(cast: fx.Node, value: fx.Node, dtype: torch.dtype) -> None:
        meta.inherit(cast, value, float_dtype=dtype)  # same tensor, same place in the model
        meta.OP.set(cast, "to")
        meta.DECISION.set(cast, "cast")
        # A Dynamo graph's weights are placeholders with machine names: name the weight (fc1.weight) instead.
        weight = meta.PARAM.get(value) if value.op == "placeholder" else None
        meta.REASON.set(cast, f"inserted: {weight or value.name} to {str(dtype).replace('torch.', '')}")
        meta.INSERTED.set(cast, True)
        meta.CAST_OF.set(cast, (value.name, meta.float_dtype(value) or meta.ORIG_DTYPE.get(value), dtype))
        meta.WEIGHT_CAST.set(cast, meta.PARAM.get(value) is not None)
        source = meta.value_of(value)
        if source is not None:  # the analysis's answer for the cast: the source's value in ``dtype``
            answer = arrives_as(source, dtype)
            meta.store_value(cast, answer if answer.float_dtype == dtype else dataclasses.replace(answer, float_dtype=dtype))
