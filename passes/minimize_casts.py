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
2. Free: FOLLOW ops from one table, ``_MOVABLE`` (elementwise, views, pooling, dropout)
   and PROMOTE ops, all of whose inputs are fp32 or low.  Nodes pinned by the
   policy, in-place ops (and whatever aliases what they write), leaf modules,
   ops with ``dtype=`` and anything else are not, and the values they read
   keep their dtype: they compute what they computed before.
3. A cast weighs the bytes it reads plus writes (sizes from the dtype
   analysis, :func:`amp_fx.ir.analysis.numel_estimates`, which estimates where
   shapes are unknown).  Integer, bool and non-tensor values cost
   nothing.  A value is cast once per dtype however many readers it has: an
   auxiliary vertex per value and direction makes the cut pay it once.
4. PROMOTE ops keep their semantics (widest input), so they move only with
   their inputs.  A multi-input FOLLOW op promotes for free (``add(fp32,
   low)`` needs no cast), so it may be fp32 only where a designated input is;
   a single-input op on the other side of its input casts that input.
5. Precision is never lowered: a node the greedy paint runs in fp32 may move
   low only if its op commutes with rounding forward and its backward sums
   nothing (views, ``relu``, a ``cat`` of distinct values; not ``expand``,
   ``repeat`` or a ``cat`` of copies) and every reader rounds its result low
   anyway.  A residual ``add`` of an fp32 stream stays fp32, as under autocast.
6. ``networkx.minimum_cut`` solves it; ties go to the greedy side.
7. A free node whose new dtype is not what following its inputs gives is
   repainted ``"low"``/``"fp32"`` (reason ``"placed low: min-cut"``);
   ``insert_casts`` writes the casts.  The placement is kept only if the casts
   it implies (:func:`amp_fx.ir.analysis.planned_casts`, read off the dtype
   analysis of each paint) move fewer bytes than the greedy placement's.

Graph inputs whose dtype is unknown (no example inputs) are costed as fp32:
their casts are guarded at run time, but placed by the same cut.

Stats: ``cast_bytes_greedy`` and ``cast_bytes_min_cut`` per forward (measured
that way) and one report line.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Optional

import torch
import torch.fx as fx
from torch.fx.node import map_arg

from amp_fx.ir import meta
from amp_fx.ir.analysis import Analysis, ValueInfo, analyse, explicit_dtype, mutated_values, promoting_inputs
from amp_fx.ir.cast_costs import ELEMENT_SIZE, numel_estimates, planned_casts, static_numel
from amp_fx.ir.pass_manager import PassContext, PassResult

__all__ = ["minimize_casts", "CastProblem", "build_problem", "measure_cast_bytes", "cost_view"]

logger = logging.getLogger("amp_fx.passes.minimize_casts")

SOURCE, SINK = "<low>", "<fp32>"  # the two terminals: source side runs low

# Placement rules (which ops may move, and how far), not dtype rules: the dtypes come from the analysis.
# One table: every op here computes a float tensor from float tensors and is legal in either precision,
# so a FOLLOW node of it is free to move; the tag says the one property that decides how far.
#   "exact":    narrowing its input gives exactly what narrowing its output gives (forward), AND its
#               backward only moves gradients, never sums them.  Only these may move from fp32 to low;
#               a use that repeats one value (``cat([x, x])``) still sums: see ``_exact_under_rounding``.
#   "promotes": reads several tensors and may run in the widest of them (``add(fp32, low)`` needs no
#               cast); computes (or broadcasts, whose backward sums), so it never moves fp32 to low.
#   "computes": rounds differently when run low (``gelu``, ``mean``; ``amax``: rounding makes ties,
#               which split the gradient): it may move to fp32, never from fp32 to low.
#   "sums":     forward exact, but the backward sums gradients (``expand``, ``repeat``, gathers,
#               overlapping max pooling, ``masked_fill`` broadcasting its input): summing them in the low
#               dtype is less precise than autocast, so it never moves fp32 to low.
# ``expand_as``/``view_as`` are not here: their second input gives only a shape.  ``cat``/``stack`` are
# PROMOTE ops in the tables (they move with their inputs); their tag says whether they may move low.
_MOVABLE: Mapping[str, str] = MappingProxyType({
    **dict.fromkeys(("add", "sub", "mul", "div", "where", "maximum", "minimum", "lerp", "rsub"), "promotes"),
    **dict.fromkeys((  # elementwise, exact under rounding
        "relu", "relu6", "neg", "abs", "sign", "clamp", "clamp_min", "clamp_max", "hardtanh", "threshold",
    ), "exact"),
    **dict.fromkeys((  # elementwise, computing
        "gelu", "silu", "sigmoid", "tanh", "leaky_relu", "elu", "selu", "celu", "hardswish", "hardsigmoid",
        "mish", "sqrt", "square", "sin", "cos", "erf",
    ), "computes"),
    **dict.fromkeys((  # views, copies, layout: values moved, never combined
        "view", "reshape", "flatten", "unflatten", "permute", "transpose", "t", "contiguous", "squeeze",
        "unsqueeze", "narrow", "select", "slice", "flip", "roll", "clone", "detach", "identity", "pad",
        "constant_pad_nd", "tril", "triu", "alias", "unsafe_view", "_unsafe_view", "getitem", "cat", "stack",
    ), "exact"),
    **dict.fromkeys(("expand", "repeat", "index_select", "gather", "masked_fill",
                     "max_pool1d", "max_pool2d", "max_pool3d"), "sums"),
    **dict.fromkeys((  # windows, dropout, small reductions autocast leaves alone
        "avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d",
        "adaptive_avg_pool3d", "dropout", "mean", "amax", "amin",
    ), "computes"),
})
_PROMOTING_FOLLOW = frozenset(op for op, tag in _MOVABLE.items() if tag == "promotes")
_EXACT_UNDER_ROUNDING = frozenset(op for op, tag in _MOVABLE.items() if tag == "exact")


# --------------------------------------------------------------------------
# The analysis as the cut sees it
# --------------------------------------------------------------------------
def cost_view(gm: fx.GraphModule, ctx: PassContext, paint: dict, repaint: Any = None) -> Analysis:
    """The dtype analysis of ``paint`` for costing: graph inputs of unknown dtype are taken as fp32.

    The stored analysis is reused when it is of the same paint and assumed nothing about inputs.
    """
    stored = ctx.analysis
    if repaint is None and stored is not None and stored.complete and _same_paint(stored, paint):
        return stored
    return analyse(gm, ctx, paint, store=False, assume_inputs=torch.float32, repaint=repaint)


def _same_paint(analysis: Analysis, paint: dict) -> bool:
    return all(analysis.decisions.get(node) == decision for node, decision in paint.items())


def _kinds(analysis: Analysis) -> dict[fx.Node, str]:
    """"tensor" (may be a float tensor), "container" (a tuple of tensors) or "other" per node."""
    kinds = {}
    for node, info in analysis.values.items():
        if node.op == "output":
            kinds[node] = "other"
        elif info.container:
            kinds[node] = "container"
        elif info.is_tensor is not False and info.is_float is not False:
            kinds[node] = "tensor"
        else:
            kinds[node] = "other"
    return kinds


def _dtypes(analysis: Analysis) -> dict[fx.Node, Optional[torch.dtype]]:
    """Each value's floating dtype as its readers see it (an O2 graph input after its entry cast)."""
    return {n: analysis.read_as.get(n, info).float_dtype for n, info in analysis.values.items()}


def _fixed_model_cast(node: fx.Node, decision: str, dtypes: dict) -> bool:
    """True for a cast the model wrote to a fixed floating dtype (not ``.to(other_tensor)``): it reads whatever arrives."""
    if decision != "cast" or dtypes.get(node) is None:
        return False
    return not any(isinstance(arg, fx.Node) for arg in list(node.args[1:]) + list(node.kwargs.values()))


def _inputs(node: fx.Node) -> list[fx.Node]:
    return list(dict.fromkeys(node.all_input_nodes))


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
        import networkx as nx  # loaded on first use: `import amp_fx` stays light

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


def build_problem(gm: fx.GraphModule, ctx: PassContext, paint: dict, analysis: Analysis) -> tuple[CastProblem, dict]:
    """The cut problem for ``paint`` (node -> decision) and its analysis; also returns each free node's kind."""
    low = ctx.low
    kinds, dtypes = _kinds(analysis), _dtypes(analysis)
    values = analysis.values
    sided = {n: (0 if d == low else 1) for n, d in dtypes.items() if kinds[n] == "tensor" and d in (low, torch.float32)}
    numel = numel_estimates(gm.graph)
    weight = {n: numel[n] * (ELEMENT_SIZE[low] + 4) for n in sided}
    problem = CastProblem(free=[], greedy=dict(sided), weight=weight)
    free_kind: dict[fx.Node, str] = {}
    mutated = mutated_values(gm.graph)

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
        kind = _free_kind(node, decision, kinds, dtypes, sided, values)
        if node in mutated or any(u in mutated for u in inputs):
            kind = None
        if kind is None:
            if _fixed_model_cast(node, decision, dtypes):
                continue  # the model's own cast reads whatever arrives
            if dtypes[node] is None and node.meta.get(meta.INPLACE) is not True and decision == "follow":
                continue  # a comparison, argmax, ...: reads any float dtype, makes no float
            for u in _inputs(node):
                pin(u)  # whatever it is, it computes exactly what it computed before
            continue
        free_kind[node] = kind
        problem.free.append(node)
        promoting = [n for n in promoting_inputs(node, values) if n in sided]
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
    _keep_fp32_precision(problem, paint, ctx, low)
    return problem, free_kind


def _exact_under_rounding(node: fx.Node) -> bool:
    """The op commutes with rounding forward and backward (tag ``"exact"`` in ``_MOVABLE``) at this use.

    ``x[idx]`` with a tensor index is a gather.  A node that reads one value
    twice (``cat([x] * 64)``) is not exact either: autograd sums the
    gradients of the copies into that value, in the low dtype were the node
    moved low (measured: x.grad 3.6x further from fp64 than autocast's for
    64 copies), so its backward sums like ``repeat``'s.
    """
    if node.meta.get(meta.OP) not in _EXACT_UNDER_ROUNDING:
        return False
    if node.meta.get(meta.OP) == "getitem":
        indices: list[fx.Node] = []
        map_arg(node.args[1:], indices.append)
        return not indices
    uses: list[fx.Node] = []
    map_arg((node.args, node.kwargs), uses.append)
    return len(uses) == len(set(uses))


def _keep_fp32_precision(problem: CastProblem, paint: dict, ctx: PassContext, low: torch.dtype) -> None:
    """Forbid every move to low that would round a value some reader computed with in fp32.

    Moving casts changes where rounding happens, never how much: a free node
    that the greedy paint runs in fp32 may run low only if its op commutes
    with rounding and every reader rounds its result to ``low`` anyway (a
    low op, a low output) or is itself free, and then may only follow that
    reader to the low side.  So the min-cut saves bytes without computing
    anything in lower precision than the tables (and autocast) do.
    """
    free = set(problem.free)
    output_low = ctx.config.cast_model_outputs == low

    def rounds_anyway(reader: fx.Node) -> bool:
        if reader.op == "output":
            return output_low
        return paint.get(reader) == "low" and reader.meta.get(meta.LOW_DTYPE) in (None, low)

    for node in problem.free:
        if problem.greedy[node] != 1:
            continue
        if not _exact_under_rounding(node) or not all(
                reader in free or rounds_anyway(reader) for reader in node.users):
            problem.implies.append((SINK, node))
            continue
        problem.implies.extend((reader, node) for reader in node.users if reader in free)


def _free_kind(node: fx.Node, decision: str, kinds: dict, dtypes: dict, sided: dict, values: dict) -> Optional[str]:
    """"single", "follow" (several inputs) or "promote" when the node may move; None when it may not."""
    m = node.meta
    if node not in sided or decision not in ("follow", "promote") or m.get(meta.RULE) == "policy":
        return None
    if node.op not in ("call_function", "call_method") or m.get(meta.INPLACE) or explicit_dtype(node):
        return None
    if any(kinds[n] == "container" or (dtypes.get(n) is not None and n not in sided) for n in _inputs(node)):
        return None  # reads a tuple, or an fp64 / other-low value: leave it alone
    promoting = [n for n in promoting_inputs(node, values) if n in sided]
    if not promoting or any(values[n].shape == () for n in promoting):
        return None
    if decision == "promote":
        return "promote"
    op = m.get(meta.OP)
    if op not in _MOVABLE:
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
def _realize(gm: fx.GraphModule, ctx: PassContext, free_kind: dict, sides: dict, paint: dict) -> Optional[tuple[dict, Analysis]]:
    """The paint that gives every free node its side: it keeps following where its inputs already give that side."""
    low = ctx.low
    new_paint = dict(paint)
    broken: list[fx.Node] = []

    def repaint(node: fx.Node, info: ValueInfo) -> Optional[str]:
        if node not in sides:
            return None
        want = low if sides[node] == 0 else torch.float32
        if info.float_dtype == want:
            return None
        if free_kind[node] == "promote":
            broken.append(node)  # the constraints rule this out; never break PROMOTE semantics
            return None
        return "low" if sides[node] == 0 else "fp32"

    analysis = cost_view(gm, ctx, new_paint, repaint)
    return None if broken else (new_paint, analysis)


def measure_cast_bytes(gm: fx.GraphModule, ctx: PassContext, paint: Optional[dict] = None,
                       analysis: Optional[Analysis] = None) -> tuple[int, bool]:
    """(bytes per forward, estimated?) of the casts ``insert_casts`` would write under ``paint``.

    ``paint`` maps nodes to decisions (default: the graph's own paint).  Read
    off the dtype analysis; the graph is not touched.  ``estimated`` is True
    when some cast's size had to be estimated (shapes unknown or symbolic).
    """
    paint = dict(paint or {})
    analysis = analysis or cost_view(gm, ctx, paint)
    casts = planned_casts(gm, analysis, paint, ctx.low, ctx.config.cast_model_outputs)
    estimated = any(not isinstance(value, fx.Node) or not _has_int_shape(value) for value, _ in casts)
    return sum(casts.values()), estimated


def _has_int_shape(node: fx.Node) -> bool:
    return static_numel(node.meta.get(meta.SHAPE)) is not None


def _paint_of(node: fx.Node) -> tuple[str, str, str]:
    return node.meta.get(meta.DECISION, "follow"), node.meta.get(meta.REASON, ""), node.meta.get(meta.RULE, "")


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
    import networkx as nx  # loaded on first use: `import amp_fx` stays light
    graph = gm.graph
    if any(node.meta.get(meta.INSERTED) for node in graph.nodes):
        return PassResult(gm, False, {"skipped": "the graph already has its casts (minimize_casts runs before insert_casts)"})
    if any(meta.VALUE not in node.meta for node in graph.nodes):
        analyse(gm, ctx)  # shapes for the costs
    current = {node: _paint_of(node) for node in graph.nodes}
    # A second run starts from the greedy paint again, so it finds the same placement.
    original = {node: tuple(node.meta.get(meta.PLACED_FROM, current[node])) for node in graph.nodes}
    paint = {node: original[node][0] for node in graph.nodes}
    greedy = cost_view(gm, ctx, dict(paint))
    dtypes = _dtypes(greedy)
    problem, free_kind = build_problem(gm, ctx, paint, greedy)
    greedy_bytes, estimated = measure_cast_bytes(gm, ctx, paint, greedy)
    placed_bytes, moved, target = greedy_bytes, {}, dict(original)
    measured_worse = False
    sides: dict = {}
    new_analysis: Optional[Analysis] = None
    if problem.free:
        try:
            sides = problem.solve()
        except nx.NetworkXUnbounded:  # pins that contradict each other: keep the greedy paint
            logger.debug("contradictory constraints; greedy placement kept")
            sides = {}
        realized = _realize(gm, ctx, free_kind, sides, paint) if sides else None
        if realized is not None:
            new_paint, new_analysis = realized
            new_dtypes = _dtypes(new_analysis)
            changed = [n for n in graph.nodes if new_paint[n] != paint[n] or new_dtypes[n] != dtypes[n]]
            if changed and all(n in sides for n in changed):
                candidate_bytes, _ = measure_cast_bytes(gm, ctx, new_paint, new_analysis)
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
            node.meta[meta.DECISION], node.meta[meta.REASON], node.meta[meta.RULE] = target[node]
            modified = True
        if node in moved:
            node.meta[meta.PLACED_FROM] = original[node]
        elif node.meta.pop(meta.PLACED_FROM, None) is not None:
            modified = True
    if modified:  # the answer insert_casts reads is the one for the final paint
        final = {node: node.meta[meta.DECISION] for node in graph.nodes}
        kept = [a for a in (new_analysis, greedy) if a is not None and a.complete and _same_paint(a, final)]
        if kept:
            kept[0].write()
            ctx.analysis = kept[0]
        else:
            analyse(gm, ctx)
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
