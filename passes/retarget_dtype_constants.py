"""Rewrite: constants a model derived from a dtype follow the dtype they are used in.

Attention code writes ``scores.masked_fill(mask, torch.finfo(scores.dtype).min)``.
Every tracer evaluates ``torch.finfo`` while it traces, so the graph holds
fp32's minimum, -3.4e38, as a plain number.  Once ``scores`` runs in bf16
that number is no longer the model's: ``masked_fill`` refuses it ("value
cannot be converted to type c10::BFloat16 without overflow"), ``where`` and
``add`` round it to -inf, and a fully masked softmax row becomes NaN.  Under
``torch.autocast`` the model sees bf16 and asks for bf16's minimum.  This
pass gives the converted program that constant.

The algorithm (on the final paint and its dtype analysis, before
``insert_casts``):

1. **Find the constants.**  A Python float argument of a call (the symbolic
   route's ``masked_fill``/``where``/``full``/``clamp``/``add``, torch.export's
   ``masked_fill.Scalar``, ``where.ScalarOther``, ``full.default``,
   ``scalar_tensor``, Dynamo's torch-level calls), and a one-element floating
   tensor constant (``_tensor_constant*``, read through ``lift_fresh_copy``),
   whose value is exactly ``finfo(D).min``, ``max``, ``eps`` or ``tiny`` of
   the dtype ``D`` its op computed in at trace time (torch's recorded example
   values say ``D``; where none was recorded -- the symbolic route -- any
   floating ``D`` whose member it is).  ``torch.iinfo`` values need nothing:
   integer tensors are never cast.  ``-inf``/``inf`` mean the same in every
   dtype.
2. **Find where it is rounded.**  The op the constant is an argument of
   rounds it to the dtype it now computes in (its cast inputs, its result).
   If that keeps ``D`` (an fp32 ``full`` building an additive mask), the
   value travels on through ops that only move data (views, ``triu``,
   ``expand``, ``lift_fresh_copy``) to the ops that read it; each of those
   rounds it to the dtype it reads it in (the cast ``insert_casts`` will
   write, or the dtype it computes in: a 0-dim tensor in a bf16 ``where``).
3. **Retarget narrowing only.**  Where it is rounded to a low dtype ``L``
   (bfloat16, float16) that cannot hold ``D``'s values (a smaller range or
   a coarser step), the constant becomes ``finfo(L)``'s same member: what
   the model computes under autocast (or, at O2/O3, in ``L`` throughout).
   A widening (a bf16 model's constant read in fp32) changes nothing: the
   value is still the model's, exact in the wider dtype, and fp32's extreme
   in its place could overflow arithmetic the model kept in range.  An
   additive mask built in fp32 and added to bf16 scores promotes to fp32
   (under autocast too) and keeps fp32's minimum.  A min/max a Dynamo graph
   returns is read by the graph after the break, in a dtype unknown here: it
   becomes the low member, exact in ``D`` too (``_escaping``).
4. **Readers that disagree** (some read the value low, some in ``D``) get a
   copy of the constant's op (and the data movement on the way) holding the
   low member; the others keep the original.  An in-place op cannot be
   copied: it is refused, naming the fix.
5. **Nothing is guessed.**  Where the deciding dtype is known only at run
   time (no example inputs, and an input that might promote), the constant
   is kept, and a warning and the report say so and how to have it
   retargeted (``example_inputs=``).

Every retargeted constant is a line of the report
(``finfo(float32).min -> finfo(bfloat16).min at masked_fill (file:line ...)``).
A one-element tensor constant (``torch.tensor(finfo.min)``) gets a new
non-persistent buffer holding the low member; ``cast_params`` leaves such a
constant fp32 at O2/O3 (:func:`amp_fx.ir.dtype_constants.holds_dtype_extreme`)
so that it reaches this pass as the model's value, not as ``-inf``.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
import torch.fx as fx

from amp_fx.errors import AmpWarning, UnsupportedConstructError
from amp_fx.ir import meta, op_properties
from amp_fx.ir.analysis import input_target, node_inputs, promoting_inputs
from amp_fx.ir.dtype_constants import finfo_member, is_trace_constant, narrows, origins
from amp_fx.ir.dtype_rules import widest
from amp_fx.ir.pass_manager import PassContext, PassResult, amp_pass

__all__ = ["retarget_dtype_constants", "finfo_member", "DtypeConstantWarning"]

_CALLS = ("call_function", "call_method", "call_module")
UNKNOWN = "unknown"  # the dtype a constant is read in is known only at run time


class DtypeConstantWarning(AmpWarning):
    """A dtype-derived constant was kept: the dtype it is read in is known only at run time."""


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _traced_dtype(node: fx.Node) -> Optional[torch.dtype]:
    """The floating dtype ``node`` computed in at trace time, from torch's recorded example values (None: not recorded)."""
    value = meta.example_value(node)
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.dtype
    inputs = [meta.example_value(n) for n in node_inputs(node)]
    floats = [v.dtype for v in inputs if isinstance(v, torch.Tensor) and v.is_floating_point()]
    return widest(floats) if floats else None


class _Reading:
    """The dtypes the current paint and analysis make each node compute in (read-only)."""

    def __init__(self, gm: fx.GraphModule, ctx: PassContext):
        self.low = ctx.low
        self.values = {n: meta.value_of(n) for n in gm.graph.nodes if meta.value_of(n) is not None}
        # O2/O3 graph inputs as their readers see them (after the entry cast).
        self.read_as = dict(getattr(ctx.analysis, "read_as", None) or {})

    def _arriving(self, node: fx.Node) -> dict:
        return {n: self.read_as.get(n, self.values[n]) for n in node_inputs(node) if n in self.values}

    def rounds_to(self, node: fx.Node, source: torch.dtype, via: Optional[fx.Node] = None) -> Any:
        """The low dtype narrower than ``source`` that ``node`` rounds a constant to (read through ``via``).

        None: none does (the cast it gets, its result and its inputs hold ``source``'s
        values); :data:`UNKNOWN`: the deciding dtype is known only at run time (no
        example inputs).  In order: the cast its decision asks for (``insert_casts``
        writes it), the dtype of its result, and, for a non-floating result
        (``x < c``), the dtype its floating inputs promote to.
        """
        info = self.values.get(node)
        if info is None:
            return UNKNOWN
        values = self._arriving(node)
        via_info = values.get(via) if via is not None else None
        if via is None or (via_info is not None and via_info.float_dtype != torch.float64):
            cast = input_target(node, node.meta.get(meta.DECISION, "follow"), self.low, values)
            if cast is not None and narrows(source, cast):
                return cast
        if info.is_float is False and not info.container:
            floats = [values[n].float_dtype for n in promoting_inputs(node, values)]
            result = widest(floats) if floats else source
        else:
            result = info.float_dtype
        if result is None:
            return UNKNOWN
        return result if narrows(source, result) else None

    def carries(self, user: fx.Node, value: fx.Node) -> bool:
        """``user`` only moves ``value``'s elements on (a view, ``triu``, ``expand``), uncast."""
        props = op_properties.of(meta.OP.get(user))
        if user.op not in _CALLS or meta.INSERTED.get(user) or not props.data_movement:
            return False
        if (meta.INPLACE.get(user) and not props.view) or not user.args or user.args[0] is not value:
            return False  # (an in-place view, export's detach_ of a lifted constant, changes no element)
        return input_target(user, user.meta.get(meta.DECISION, "follow"), self.low, self.values) is None


def _readers(start: fx.Node, reading: _Reading) -> tuple[list[fx.Node], list[tuple[fx.Node, fx.Node]]]:
    """The data-movement nodes ``start``'s value travels through, and its readers as (reader, the value it reads)."""
    carriers, readers = [start], []
    # (value, read only after this node): an in-place op's written tensor is read on through its own node.
    frontier: list[tuple[fx.Node, Optional[fx.Node]]] = [(start, None)]
    if meta.INPLACE.get(start) and start.args and isinstance(start.args[0], fx.Node):
        frontier.append((start.args[0], start))
    while frontier:
        value, after = frontier.pop()
        for user in value.users:
            if after is not None and not after < user:
                continue
            if reading.carries(user, value):
                carriers.append(user)
                frontier.append((user, None))
            else:
                readers.append((user, value))
    return carriers, readers


class _Retargeter:
    """Finds each dtype-derived constant and rewrites it (module docstring)."""

    def __init__(self, gm: fx.GraphModule, ctx: PassContext):
        self.gm, self.graph = gm, gm.graph
        self.reading = _Reading(gm, ctx)
        self.route = ctx.route
        self.lines: list[str] = []  # retargeted
        self.kept: list[str] = []  # left as they are: their dtype is known only at run time
        self.copies = 0

    # -- the constants ---------------------------------------------------------
    def run(self) -> None:
        for node in list(self.graph.nodes):
            if meta.INSERTED.get(node):
                continue
            if node.op in _CALLS:
                for key, value in self._scalars(node):
                    self._scalar(node, key, value)
            elif node.op == "get_attr":
                self._tensor_constant(node)

    @staticmethod
    def _scalars(node: fx.Node) -> list[tuple[Any, float]]:
        """(position or keyword, value) of the float arguments of ``node``."""
        found = [(i, a) for i, a in enumerate(node.args) if type(a) is float]
        return found + [(k, v) for k, v in node.kwargs.items() if type(v) is float]

    def _scalar(self, node: fx.Node, key: Any, value: float) -> None:
        for source, member in origins(value, _traced_dtype(node)):
            if self._decide(node, source, member, lambda n, low: self._set_arg(n, key, getattr(torch.finfo(low), member))):
                return

    def _tensor_constant(self, node: fx.Node) -> None:
        # Only constants the trace made (fx's _tensor_constant0, torch.export's lifted_tensor_0): a model's
        # own buffer is its state, which a checkpoint may load, and keeps its value.
        if not is_trace_constant(str(node.target)):
            return
        tensor = getattr(self.gm, str(node.target), None)
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point() or tensor.numel() != 1:
            return
        for source, member in origins(tensor.item(), tensor.dtype):
            if self._decide(node, source, member, lambda n, low: self._set_constant(n, getattr(torch.finfo(low), member))):
                return

    # -- where it is rounded -----------------------------------------------------
    def _decide(self, node: fx.Node, source: torch.dtype, member: str, write) -> bool:
        """Retarget ``node``'s constant where it is rounded to a narrower low dtype; True when it was finfo(source)'s."""
        low = self.reading.rounds_to(node, source) if node.op in _CALLS else None
        if low is UNKNOWN:
            self._unknown(node, source, member)
            return True
        if low is not None:
            write(node, low)
            self._note(node, source, member, low)
            return True
        carriers, readers = _readers(node, self.reading)
        groups: dict[Any, list[tuple[fx.Node, fx.Node]]] = {}
        for reader, value in readers:
            if reader.op == "output":
                rounded = self._escaping(source, member)
            else:
                rounded = self.reading.rounds_to(reader, source, via=value)
            groups.setdefault(rounded, []).append((reader, value))
        unknown = groups.pop(UNKNOWN, None)
        if unknown:
            self._unknown(node, source, member, [reader for reader, _ in unknown])
        lows = [d for d in groups if d is not None]
        if not lows:
            return bool(unknown)
        if len(groups) == 1 and not unknown:
            write(node, lows[0])
            self._note(node, source, member, lows[0])
            return True
        if meta.INPLACE.get(node):
            where = meta.SOURCE.get(node) or node.name
            raise UnsupportedConstructError(
                f"the in-place {node.name} at {where} writes finfo({_name(source)}).{member}, which some readers take in "
                f"{', '.join(_name(d) for d in lows)} and others in another dtype: amp_fx would have to give the "
                "constant two values. Write the op out of place (x = x.masked_fill(...)), or pin its readers with "
                "policy={'op:...': 'fp32'}.", construct="dtype-derived constant written in place", where=where)
        for low in lows:
            copy = self._copy_for(node, carriers, groups[low])
            write(copy, low)
            self._note(copy, source, member, low, f"for its {_name(low)} readers (a copy of {node.name})")
        return True

    def _escaping(self, source: torch.dtype, member: str) -> Optional[torch.dtype]:
        """The dtype a constant the graph returns is rounded to: the low one for a Dynamo graph's min/max, else none.

        A Dynamo graph's output goes on to the graph after a break (a mask made in one graph, added to the
        scores in the next), whose dtype is unknown here.  Read low there, finfo(D).min becomes -inf, and a
        padded row's softmax NaN (Longformer, issue 42); the low member is exact in D too and as extreme for a
        mask, so it is right either way.  eps and tiny mean other numbers in D: they are kept.
        """
        if self.route == "dynamo" and member in ("min", "max") and narrows(source, self.reading.low):
            return self.reading.low
        return None

    def _copy_for(self, start: fx.Node, carriers: list[fx.Node], readers: list[tuple[fx.Node, fx.Node]]) -> fx.Node:
        """Copy ``start`` and the carriers on the way to ``readers``; point those readers at the copies."""
        needed: set[fx.Node] = set()
        for _, value in readers:
            node = value
            while node not in needed:
                needed.add(node)
                if node is start:
                    break
                node = node.args[0]  # a carrier moves its first argument on
        mapping: dict[fx.Node, fx.Node] = {}
        for node in sorted(needed & set(carriers)):
            with self.graph.inserting_after(node):
                mapping[node] = self.graph.node_copy(node, lambda n: mapping.get(n, n))
        for reader, value in readers:
            reader.replace_input_with(value, mapping[value])
        self.copies += len(mapping)
        return mapping[start]

    # -- the rewrite ---------------------------------------------------------------
    @staticmethod
    def _set_arg(node: fx.Node, key: Any, value: float) -> None:
        if isinstance(key, int):
            node.args = node.args[:key] + (value,) + node.args[key + 1:]
        else:
            node.kwargs = {**node.kwargs, key: value}

    def _set_constant(self, node: fx.Node, value: float) -> None:
        old = getattr(self.gm, str(node.target))
        name, index = f"{node.target}_retargeted", 0
        while hasattr(self.gm, name):
            index += 1
            name = f"{node.target}_retargeted_{index}"
        # In the constant's own dtype (the low member is exact in it); a buffer, as fx keeps its constants, but
        # not part of the state_dict (convert() keeps the model's keys).
        self.gm.register_buffer(name, torch.full_like(old, value), persistent=False)
        node.target = name

    def _unknown(self, node: fx.Node, source: torch.dtype, member: str, readers: Optional[list[fx.Node]] = None) -> None:
        where = meta.SOURCE.get(node) or "no source line"
        by = f" by {', '.join(r.name for r in readers)}" if readers else ""
        self.kept.append(f"finfo({_name(source)}).{member} at {node.name} ({where}) kept: the dtype it is read in{by} is "
                          "known only at run time (no example inputs); convert with example_inputs=(...) to give it "
                          "that dtype's value")

    def _note(self, node: fx.Node, source: torch.dtype, member: str, low: torch.dtype, extra: str = "") -> None:
        where = meta.SOURCE.get(node) or "no source line"
        self.lines.append(f"finfo({_name(source)}).{member} -> finfo({_name(low)}).{member} at {node.name} "
                          f"({where}){' ' + extra if extra else ''}")


@amp_pass(kind="rewrite", requires=("meta", "paint", "dtypes"), ensures=("dtypes",))
def retarget_dtype_constants(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Give each dtype-derived constant (finfo min/max/eps/tiny) the value of the low dtype it is rounded to."""
    retargeter = _Retargeter(gm, ctx)
    retargeter.run()
    stats: dict[str, Any] = {"retargeted": len(retargeter.lines), "copies": retargeter.copies, "kept": len(retargeter.kept)}
    if retargeter.lines or retargeter.kept:
        stats["report_lines"] = retargeter.lines + retargeter.kept
    if retargeter.kept:
        # Said at conversion too: a masked_fill holding fp32's minimum fails at run time if it is read low.
        warnings.warn("amp_fx: " + "; ".join(retargeter.kept), DtypeConstantWarning, stacklevel=2)
    # New copies need the analysis's answer: the runner analyses again ("dtypes" is ensured) when the code changed.
    return PassResult(gm, bool(retargeter.lines), stats)
