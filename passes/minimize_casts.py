"""Rewrite the precision paint so that the casts move the fewest bytes: a minimum s-t cut (networkx).

``assign_precision`` paints locally: a FOLLOW op runs in whatever arrives, so
a cast lands wherever a LOW op meets an fp32 value or the reverse.  That
greedy placement can move more bytes than needed: an fp32 value fanning out
through FOLLOW ops into LOW ops is cast once per branch; a small fp32 tensor
(a bias, rotary cos/sin, a row sum) drags a large low activation to fp32, or
is cast after it was broadcast.  This pass picks a side (low or fp32) for
every *free* node:

1. LOW-decided nodes are tied to the source, FP32-decided nodes to the sink;
   graph inputs, parameters and the model's own casts keep their dtype, and
   O2/O3's entry and exit casts stay.
2. Free: FOLLOW ops from a safe list (elementwise, views, pooling, dropout)
   and PROMOTE ops, all of whose inputs are fp32 or low.  Nodes pinned by the
   policy, in-place ops (and whatever aliases what they write), leaf modules,
   ops with ``dtype=`` and anything else are not, and the values they read
   keep their dtype: they compute what they computed before.
3. A cast weighs the bytes it reads plus writes (``amp_fx.shape``; without a
   shape a graph input counts ``FALLBACK_NUMEL`` elements and an op's result
   as much as its largest input).  Integer, bool and non-tensor values cost
   nothing.  A value is cast once per dtype however many readers it has: an
   auxiliary vertex per value and direction makes the cut pay it once.
4. PROMOTE ops keep their semantics (widest input), so they move only with
   their inputs.  A multi-input FOLLOW op promotes for free (``add(fp32,
   low)`` needs no cast), so it may be fp32 only where a designated input is;
   a single-input op on the other side of its input casts that input.
5. ``networkx.minimum_cut`` solves it; ties go to the greedy side.
6. A free node whose new dtype is not what following its inputs gives is
   repainted ``"low"``/``"fp32"`` (reason ``"placed low: min-cut"``);
   ``insert_casts`` writes the casts.  The placement is kept only if the casts
   that insert/dedupe/fold then write, measured on a copy of the graph, move
   fewer bytes than the greedy placement's.

Stats: ``cast_bytes_greedy`` and ``cast_bytes_min_cut`` per forward (measured
that way) and one report line.
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Optional

import networkx as nx
import torch
import torch.fx as fx
from torch.fx.node import map_arg

from amp_fx.cast_nodes import is_inserted_cast
from amp_fx.casts import amp_cast
from amp_fx.pass_manager import PassContext, PassResult
from amp_fx.passes.dedupe_casts import dedupe_casts
from amp_fx.passes.fold_casts import fold_casts
from amp_fx.passes.insert_casts import cast_bytes, insert_casts
from amp_fx.passes.propagate_meta import NON_TENSOR_METHODS, example_value

__all__ = ["minimize_casts", "CastProblem", "build_problem", "measure_cast_bytes", "FALLBACK_NUMEL"]

logger = logging.getLogger("amp_fx.passes.minimize_casts")

SOURCE, SINK = "<low>", "<fp32>"  # the two terminals: source side runs low
FALLBACK_NUMEL = 4096  # elements of a graph input whose shape is unknown
_PLACED_KEY = "amp_fx.placed_from"  # (decision, reason, rule) before this pass moved the node
_ELEMENT_SIZE = {torch.float16: 2, torch.bfloat16: 2, torch.float32: 4, torch.float64: 8}

# FOLLOW ops that compute a float tensor from float tensors: running them in
# either precision is legal, and casting their input instead of their output
# gives the same values up to rounding.
_FREE_FOLLOW = frozenset({
    # elementwise arithmetic and activations
    "add", "sub", "mul", "div", "neg", "abs", "relu", "relu6", "gelu", "silu", "sigmoid", "tanh",
    "leaky_relu", "elu", "selu", "celu", "hardswish", "hardsigmoid", "hardtanh", "mish", "clamp",
    "clamp_min", "clamp_max", "where", "maximum", "minimum", "sqrt", "square", "sin", "cos",
    "masked_fill", "lerp", "rsub", "threshold", "erf", "sign",
    # views and copies (expand_as/view_as are not here: their second input gives only a shape)
    "view", "reshape", "flatten", "unflatten", "permute", "transpose", "t", "contiguous", "expand",
    "repeat", "squeeze", "unsqueeze", "narrow", "select", "slice", "index_select", "gather", "roll",
    "flip", "clone", "detach", "identity", "pad", "constant_pad_nd", "tril", "triu", "alias",
    "unsafe_view", "_unsafe_view", "getitem",
    # windows, dropout, small reductions autocast leaves alone
    "max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d",
    "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "dropout", "mean", "amax", "amin",
})
# Of those, the ones whose result dtype is the promotion of several tensor inputs.
_PROMOTING_FOLLOW = frozenset({"add", "sub", "mul", "div", "where", "maximum", "minimum", "lerp", "rsub"})
# Ops that return a tuple of tensors (their items are read with getitem).
_TUPLE_OPS = frozenset({"split", "chunk", "unbind", "split_with_sizes", "topk", "sort", "var_mean", "lstm", "gru",
                        "rnn_tanh", "rnn_relu", "native_dropout", "max_pool2d_with_indices", "multi_head_attention"})
# Ops whose result may share memory with their first input.
_ALIASING = frozenset({"view", "reshape", "flatten", "unflatten", "permute", "transpose", "t", "expand", "expand_as",
                       "squeeze", "unsqueeze", "narrow", "select", "slice", "getitem", "detach", "alias", "view_as",
                       "unsafe_view", "_unsafe_view", "split", "chunk", "unbind", "split_with_sizes", "contiguous",
                       "diagonal", "as_strided"})
_NON_TENSOR_OPS = frozenset({"getattr", "size", "dim", "numel"}) | NON_TENSOR_METHODS
_NAMED_CASTS = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16, "double": torch.float64}


# --------------------------------------------------------------------------
# What every value is, and which dtype it has under a paint
# --------------------------------------------------------------------------
def _inputs(node: fx.Node) -> list[fx.Node]:
    found: list[fx.Node] = []
    map_arg((node.args, node.kwargs), lambda n: found.append(n) if n not in found else None)
    return found


def _kinds(graph: fx.Graph) -> dict[fx.Node, str]:
    """"tensor" (may be a float tensor), "container" (a tuple of tensors) or "other" per node."""
    kinds: dict[fx.Node, str] = {}
    for node in graph.nodes:
        meta = node.meta
        op = meta.get("amp_fx.op")
        is_tensor, is_float = meta.get("amp_fx.is_tensor"), meta.get("amp_fx.is_float")
        if node.op == "output":
            kind = "other"
        elif is_tensor is True:
            kind = "tensor" if is_float is not False else "other"
        elif is_tensor is False:
            value = example_value(node)
            floats = isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) and v.is_floating_point() for v in value)
            kind = "container" if floats else "other"
        elif op in _NON_TENSOR_OPS:
            kind = "other"
        elif op == "getitem" and isinstance(node.args[0], fx.Node):
            kind = "tensor" if kinds[node.args[0]] != "other" else "other"
        else:
            kind = "container" if op in _TUPLE_OPS else "tensor"
        kinds[node] = kind
    return kinds


def _source_dtype(node: fx.Node) -> Optional[torch.dtype]:
    """A graph input's or parameter's dtype; an input of unknown dtype is assumed fp32 (for costs only)."""
    if node.meta.get("amp_fx.is_float") is False:
        return None
    dtype = node.meta.get("amp_fx.orig_dtype")
    if dtype is None:
        return torch.float32
    return dtype if dtype.is_floating_point else None


def _explicit_dtype(node: fx.Node) -> Optional[torch.dtype]:
    dtype = node.kwargs.get("dtype")
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def _model_cast(node: fx.Node, dtypes: dict) -> tuple[Optional[torch.dtype], bool]:
    """(target dtype or None, whether the target comes from another tensor) of a cast the model wrote."""
    op = node.meta.get("amp_fx.op")
    if op in _NAMED_CASTS:
        return _NAMED_CASTS[op], False
    if node.target is amp_cast:
        return node.args[1], False
    for arg in list(node.args[1:]) + list(node.kwargs.values()):
        if isinstance(arg, torch.dtype):
            return (arg if arg.is_floating_point else None), False
        if isinstance(arg, fx.Node):  # .to(other) / .type_as(other)
            return dtypes.get(arg), True
    return None, False


def _promoting(node: fx.Node, dtypes: dict) -> list[fx.Node]:
    """The float inputs that decide a FOLLOW/PROMOTE op's dtype (0-dim ones only when alone)."""
    inputs = [n for n in _inputs(node) if dtypes.get(n) is not None]
    dimensioned = [n for n in inputs if n.meta.get("amp_fx.shape") != ()]
    return dimensioned or inputs


def _dtype_of(node: fx.Node, decision: str, dtypes: dict, kinds: dict, low: torch.dtype) -> Optional[torch.dtype]:
    """The floating dtype ``node`` produces under ``decision`` (None: not floating), as insert_casts will make it."""
    if kinds[node] == "other" or node.op == "output":
        return None
    if node.op in ("placeholder", "get_attr"):
        return low if decision == "entry" else _source_dtype(node)
    if node.meta.get("amp_fx.op") == "getitem" and isinstance(node.args[0], fx.Node) and kinds[node.args[0]] == "container":
        return dtypes.get(node.args[0])
    if decision == "low":
        return _explicit_dtype(node) or low
    if decision == "fp32":
        return _explicit_dtype(node) or torch.float32
    if decision == "cast":
        target, _ = _model_cast(node, dtypes)
        if target is not None:
            return target
    explicit = _explicit_dtype(node)
    if explicit is not None:
        return explicit
    inputs = _promoting(node, dtypes)
    if not inputs:
        return torch.get_default_dtype() if node.meta.get("amp_fx.is_float") is True else None
    result = dtypes[inputs[0]]
    for other in inputs[1:]:
        result = torch.promote_types(result, dtypes[other])
    return result


def _dtypes(graph: fx.Graph, paint: dict, kinds: dict, low: torch.dtype) -> dict[fx.Node, Optional[torch.dtype]]:
    dtypes: dict[fx.Node, Optional[torch.dtype]] = {}
    for node in graph.nodes:
        dtypes[node] = _dtype_of(node, paint[node], dtypes, kinds, low)
    return dtypes


def _numel_estimates(graph: fx.Graph) -> dict[fx.Node, int]:
    """Elements per value, from shapes where known (see the module docstring for the fallback)."""
    numel: dict[fx.Node, int] = {}
    for node in graph.nodes:
        shape = node.meta.get("amp_fx.shape")
        inputs = [numel[n] for n in _inputs(node) if n in numel]
        if shape is not None and all(isinstance(size, int) for size in shape):  # a SymInt would add a guard
            numel[node] = math.prod(shape)
        else:
            numel[node] = max(inputs) if inputs and node.op not in ("placeholder", "get_attr") else FALLBACK_NUMEL
    return numel


def _mutated(graph: fx.Graph) -> set[fx.Node]:
    """Values that an in-place op writes, with everything that may alias them.

    Moving such a value or a reader of it would read or write a cast copy
    instead of the memory the in-place op changes, so none of them is free.
    """
    found = {n.args[0] for n in graph.nodes if n.meta.get("amp_fx.inplace") and n.args and isinstance(n.args[0], fx.Node)}
    todo = list(found)
    while todo:
        node = todo.pop()
        linked = [u for u in node.users if u.meta.get("amp_fx.op") in _ALIASING and u.args and u.args[0] is node]
        if node.meta.get("amp_fx.op") in _ALIASING and node.args and isinstance(node.args[0], fx.Node):
            linked.append(node.args[0])
        for other in linked:
            if other not in found:
                found.add(other)
                todo.append(other)
    return found


# --------------------------------------------------------------------------
# The cut problem
# --------------------------------------------------------------------------
@dataclass
class CastProblem:
    """The placement as a min-cut problem; side 0 = low (source), 1 = fp32 (sink).

    ``up[u]`` lists the readers that need ``u`` in fp32 when they sit on the
    fp32 side (``u`` pays one cast if it is low and any of them is fp32);
    ``down[u]`` the readers that need it low when they sit on the low side.
    ``implies`` holds pairs (a, b): a on the fp32 side forces b there too.
    Readers and pairs may name the terminals.
    """

    free: list[fx.Node]
    greedy: dict[Any, int]  # side of every fp32/low value under the greedy paint
    weight: dict[fx.Node, int]  # bytes one cast of the value moves
    up: dict[Any, list] = field(default_factory=dict)
    down: dict[Any, list] = field(default_factory=dict)
    implies: list[tuple] = field(default_factory=list)

    def side(self, x: Any, sides: dict) -> int:
        """The side of a value, reader or terminal under ``sides`` (free nodes) and the greedy paint (the rest)."""
        if x == SOURCE or x == SINK:
            return 0 if x == SOURCE else 1
        return sides[x] if x in sides else self.greedy[x]

    def cost(self, sides: dict) -> float:
        """Cast bytes the model charges for ``sides`` (inf when a constraint is broken)."""
        if any(self.side(a, sides) == 1 and self.side(b, sides) == 0 for a, b in self.implies):
            return float("inf")
        total = 0
        for u, readers in self.up.items():
            if self.side(u, sides) == 0 and any(self.side(v, sides) == 1 for v in readers):
                total += self.weight[u]
        for u, readers in self.down.items():
            if self.side(u, sides) == 1 and any(self.side(v, sides) == 0 for v in readers):
                total += self.weight[u]
        return total

    def solve(self) -> dict[fx.Node, int]:
        """The cheapest sides for the free nodes (networkx minimum_cut; ties go to the greedy side)."""
        free = set(self.free)
        # Costs are scaled so that the unit edges pulling each free node to its
        # greedy side only break ties: they add up to less than one byte.
        scale = len(self.free) + 1
        graph = nx.DiGraph()
        graph.add_nodes_from([SOURCE, SINK, *self.free])

        def vertex(x: Any) -> Any:
            if x in free or x in (SOURCE, SINK):
                return x
            return SOURCE if self.greedy[x] == 0 else SINK

        def finite(a: Any, b: Any, capacity: int) -> None:
            if a == b:
                return
            if not graph.has_edge(a, b):
                graph.add_edge(a, b, capacity=capacity)
            elif "capacity" in graph[a][b]:
                graph[a][b]["capacity"] += capacity

        def infinite(a: Any, b: Any) -> None:  # networkx reads a missing capacity as infinite
            if a != b:
                graph.add_edge(a, b)
                graph[a][b].pop("capacity", None)

        for u, readers in self.up.items():
            targets = {vertex(v) for v in readers} - {SOURCE}
            if vertex(u) != SINK and targets:
                finite(vertex(u), ("up", u), self.weight[u] * scale)
                for target in targets:
                    infinite(("up", u), target)
        for u, readers in self.down.items():
            targets = {vertex(v) for v in readers} - {SINK}
            if vertex(u) != SOURCE and targets:
                finite(("down", u), vertex(u), self.weight[u] * scale)
                for target in targets:
                    infinite(target, ("down", u))
        for a, b in self.implies:
            infinite(vertex(b), vertex(a))
        for node in self.free:
            finite(*((SOURCE, node) if self.greedy[node] == 0 else (node, SINK)), 1)
        _, (low_side, _) = nx.minimum_cut(graph, SOURCE, SINK)  # raises NetworkXUnbounded on contradictions
        return {node: 0 if node in low_side else 1 for node in self.free}


def _add(table: dict, key: Any, reader: Any) -> None:
    table.setdefault(key, []).append(reader)


def build_problem(gm: fx.GraphModule, ctx: PassContext, paint: dict, kinds: dict, dtypes: dict) -> tuple[CastProblem, dict]:
    """The cut problem for ``paint`` (node -> decision); also returns each free node's kind."""
    low = ctx.low
    sided = {n: (0 if d == low else 1) for n, d in dtypes.items() if kinds[n] == "tensor" and d in (low, torch.float32)}
    numel = _numel_estimates(gm.graph)
    weight = {n: numel[n] * (_ELEMENT_SIZE[low] + 4) for n in sided}
    problem = CastProblem(free=[], greedy=dict(sided), weight=weight)
    free_kind: dict[fx.Node, str] = {}
    mutated = _mutated(gm.graph)

    def pin(u: fx.Node) -> None:
        if u in sided:
            problem.implies.append((u, SOURCE) if sided[u] == 0 else (SINK, u))

    for node in gm.graph.nodes:
        decision = paint[node]
        inputs = [n for n in _inputs(node) if n in sided]
        if node.op == "output":
            target = ctx.config.cast_model_outputs if decision == "exit" else None
            for u in inputs:
                if target == low:
                    _add(problem.down, u, SOURCE)
                elif target == torch.float32:
                    _add(problem.up, u, SINK)
                else:
                    pin(u)
            continue
        if node.op in ("placeholder", "get_attr"):
            continue
        if decision in ("low", "fp32"):
            for u in inputs:
                _add(problem.down, u, SOURCE) if decision == "low" else _add(problem.up, u, SINK)
            continue
        kind = _free_kind(node, decision, kinds, dtypes, sided)
        if node in mutated or any(u in mutated for u in inputs):
            kind = None
        if kind is None:
            if decision == "cast" and not _model_cast(node, dtypes)[1] and _model_cast(node, dtypes)[0] is not None:
                continue  # the model's own cast reads whatever arrives
            if dtypes[node] is None and node.meta.get("amp_fx.inplace") is not True and decision == "follow":
                continue  # a comparison, argmax, ...: reads any float dtype, makes no float
            for u in _inputs(node):
                pin(u)  # whatever it is, it computes exactly what it computed before
            continue
        free_kind[node] = kind
        problem.free.append(node)
        promoting = [n for n in _promoting(node, dtypes) if n in sided]
        if kind == "single":
            _add(problem.up, promoting[0], node)
            _add(problem.down, promoting[0], node)
            continue
        designated = _designated(promoting, sided[node], sided, weight)
        problem.implies.append((node, designated))
        for u in promoting:
            if kind == "follow":
                _add(problem.down, u, node)  # running low casts fp32 inputs; fp32 promotes low ones for free
            else:
                _add(problem.up, u, node)  # PROMOTE casts its narrower inputs up
                problem.implies.append((u, node))
    return problem, free_kind


def _free_kind(node: fx.Node, decision: str, kinds: dict, dtypes: dict, sided: dict) -> Optional[str]:
    """"single", "follow" (several inputs) or "promote" when the node may move; None when it may not."""
    meta = node.meta
    if node not in sided or decision not in ("follow", "promote") or meta.get("amp_fx.rule") == "policy":
        return None
    if node.op not in ("call_function", "call_method") or meta.get("amp_fx.inplace") or _explicit_dtype(node):
        return None
    if any(kinds[n] == "container" or (dtypes.get(n) is not None and n not in sided) for n in _inputs(node)):
        return None  # reads a tuple, or an fp64 / other-low value: leave it alone
    promoting = [n for n in _promoting(node, dtypes) if n in sided]
    if not promoting or any(n.meta.get("amp_fx.shape") == () for n in promoting):
        return None
    if decision == "promote":
        return "promote"
    op = meta.get("amp_fx.op")
    if op not in _FREE_FOLLOW:
        return None
    if len(promoting) == 1:
        return "single"
    return "follow" if op in _PROMOTING_FOLLOW else None


def _designated(inputs: list[fx.Node], node_side: int, sided: dict, weight: dict) -> fx.Node:
    """The input a multi-input node may not out-rank; one on the node's greedy side, so greedy stays feasible."""
    candidates = [n for n in inputs if sided[n] == node_side] if node_side == 1 else inputs
    return max(candidates or inputs, key=lambda n: weight[n])


# --------------------------------------------------------------------------
# From sides back to a paint, measuring, and the pass
# --------------------------------------------------------------------------
def _realize(graph: fx.Graph, free_kind: dict, sides: dict, paint: dict, kinds: dict, low: torch.dtype) -> Optional[tuple[dict, dict]]:
    """The paint that gives every free node its side: it keeps following where its inputs already give that side."""
    new_paint = dict(paint)
    dtypes: dict[fx.Node, Optional[torch.dtype]] = {}
    for node in graph.nodes:
        if node in sides:
            want = low if sides[node] == 0 else torch.float32
            if _dtype_of(node, paint[node], dtypes, kinds, low) != want:
                if free_kind[node] == "promote":
                    return None  # the constraints rule this out; never break PROMOTE semantics
                new_paint[node] = "low" if sides[node] == 0 else "fp32"
        dtypes[node] = _dtype_of(node, new_paint[node], dtypes, kinds, low)
    return new_paint, dtypes


class _Host:
    """Just enough of a GraphModule for insert/dedupe/fold to run on a copy of the graph."""

    def __init__(self, graph: fx.Graph, owner: fx.GraphModule):
        self.graph = graph
        self._owner = owner

    def get_submodule(self, target: str) -> torch.nn.Module:
        return self._owner.get_submodule(target)


def measure_cast_bytes(gm: fx.GraphModule, ctx: PassContext, paint: Optional[dict] = None) -> tuple[int, bool]:
    """(bytes per forward, estimated?) of the casts insert/dedupe/fold would write under ``paint``.

    ``paint`` maps nodes to decisions (default: the graph's own paint).  The
    rewrites run on a copy; ``gm`` is not touched.  Casts of values without
    a shape are counted with the fallback estimate, and then ``estimated``
    is True.
    """
    graph = copy.deepcopy(gm.graph)
    copies = {node.name: node for node in graph.nodes}
    for node, decision in (paint or {}).items():
        copies[node.name].meta["amp_fx.decision"] = decision
    host = _Host(graph, gm)
    for rewrite in (insert_casts, dedupe_casts, fold_casts):
        rewrite(host, ctx)  # type: ignore[arg-type]
    numel = _numel_estimates(gm.graph)
    by_name = {node.name: count for node, count in numel.items()}
    total, estimated = 0, False
    for node in graph.nodes:
        if not is_inserted_cast(node):
            continue
        shape = node.meta.get("amp_fx.shape")
        size = cast_bytes(node) if shape is not None and all(isinstance(s, int) for s in shape) else None
        if size is None:
            source, source_dtype, target = node.meta.get("amp_fx.cast_of", (None, None, None))
            size = by_name.get(source, FALLBACK_NUMEL) * (_ELEMENT_SIZE.get(source_dtype, 4) + _ELEMENT_SIZE.get(target, 2))
            estimated = True
        total += size
    return total, estimated


def _paint_of(node: fx.Node) -> tuple[str, str, str]:
    meta = node.meta
    return meta.get("amp_fx.decision", "follow"), meta.get("amp_fx.reason", ""), meta.get("amp_fx.rule", "")


def _report_line(greedy: int, placed: int, moved: dict, free: int, estimated: bool, measured_worse: bool) -> str:
    approx = "~" if estimated else ""
    tail = " (sizes estimated: shapes unknown or symbolic)" if estimated else ""
    if not moved:
        why = "greedy placement kept, the min-cut one measures no fewer bytes" if measured_worse else "greedy placement is already minimal"
        return f"cast bytes per forward {approx}{greedy:,}: {why} ({free} free nodes){tail}"
    to_low = sum(1 for side in moved.values() if side == 0)
    saved = greedy - placed
    return (f"cast bytes per forward {approx}{greedy:,} greedy -> {approx}{placed:,} min-cut "
            f"({saved:,} saved, {100.0 * saved / greedy:.0f}%); {len(moved)} nodes moved: "
            f"{to_low} to low, {len(moved) - to_low} to fp32{tail}")


def minimize_casts(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Repaint free nodes so that the casts move the fewest bytes (see module docstring)."""
    graph = gm.graph
    if any(node.meta.get("amp_fx.inserted") for node in graph.nodes):
        return PassResult(gm, False, {"skipped": "the graph already has its casts (minimize_casts runs before insert_casts)"})
    low = ctx.low
    current = {node: _paint_of(node) for node in graph.nodes}
    # A second run starts from the greedy paint again, so it finds the same placement.
    original = {node: tuple(node.meta.get(_PLACED_KEY, current[node])) for node in graph.nodes}
    paint = {node: original[node][0] for node in graph.nodes}
    kinds = _kinds(graph)
    dtypes = _dtypes(graph, paint, kinds, low)
    problem, free_kind = build_problem(gm, ctx, paint, kinds, dtypes)
    greedy_bytes, estimated = measure_cast_bytes(gm, ctx, paint)
    placed_bytes, moved, target = greedy_bytes, {}, dict(original)
    measured_worse = False
    sides: dict = {}
    if problem.free:
        try:
            sides = problem.solve()
        except nx.NetworkXUnbounded:  # pins that contradict each other: keep the greedy paint
            logger.debug("contradictory constraints; greedy placement kept")
            sides = {}
        realized = _realize(graph, free_kind, sides, paint, kinds, low) if sides else None
        if realized is not None:
            new_paint, new_dtypes = realized
            changed = [n for n in graph.nodes if new_paint[n] != paint[n] or new_dtypes[n] != dtypes[n]]
            if changed and all(n in sides for n in changed):
                candidate_bytes, _ = measure_cast_bytes(gm, ctx, new_paint)
                if candidate_bytes < greedy_bytes:
                    placed_bytes = candidate_bytes
                    for node in changed:
                        side = "low" if sides[node] == 0 else "fp32"
                        explicit = new_paint[node] != paint[node]
                        reason = f"placed {side}: min-cut" + ("" if explicit else " (follows its inputs)")
                        target[node] = (new_paint[node], reason, "min-cut")
                        moved[node] = sides[node]
                        logger.debug("step 6: %s -> %s (%s)", node.name, new_paint[node], reason)
                else:
                    measured_worse = True
    modified = False
    for node in graph.nodes:
        if target[node] != current[node]:
            node.meta["amp_fx.decision"], node.meta["amp_fx.reason"], node.meta["amp_fx.rule"] = target[node]
            modified = True
        if node in moved:
            node.meta[_PLACED_KEY] = original[node]
        elif node.meta.pop(_PLACED_KEY, None) is not None:
            modified = True
    stats = {
        "free_nodes": len(problem.free),
        "moved": len(moved),
        "to_low": sum(1 for side in moved.values() if side == 0),
        "to_fp32": sum(1 for side in moved.values() if side == 1),
        "cast_bytes_greedy": greedy_bytes,
        "cast_bytes_min_cut": placed_bytes,
        "cast_bytes_saved": greedy_bytes - placed_bytes,
        "sizes_estimated": estimated,
        "model_bytes_greedy": problem.cost({}),
        "model_bytes_min_cut": problem.cost(sides) if sides else problem.cost({}),
        "report_lines": [_report_line(greedy_bytes, placed_bytes, moved, len(problem.free), estimated, measured_worse)],
    }
    return PassResult(gm, modified, stats)
