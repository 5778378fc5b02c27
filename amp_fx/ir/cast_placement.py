"""The cast placement as a minimum s-t cut: which nodes may move between low and fp32, and what each side costs.

``passes/minimize_casts.py`` builds this problem from a paint and its dtype
analysis (:func:`build_problem`), solves it (:meth:`CastProblem.solve`, with
networkx, imported on first use) and turns the sides back into a paint.  The
numbered rules the problem encodes are in that pass's docstring.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx

from amp_fx.ir import meta, op_properties
from amp_fx.ir.analysis import Analysis, explicit_dtype, mutated_values, promoting_inputs
from amp_fx.ir.cast_costs import ELEMENT_SIZE, numel_estimates
from amp_fx.ir.pass_manager import PassContext

__all__ = ["CastProblem", "build_problem", "dtypes_as_read", "SOURCE", "SINK"]

SOURCE, SINK = "<low>", "<fp32>"  # the two terminals: source side runs low

# Which ops may move, and how far, is the op registry's answer (amp_fx/ir/op_properties.py):
#   either_precision:   computes a float tensor from float tensors, legal in either precision, so a
#                       FOLLOW node of it is free to move (to fp32 at least).
#   native_promotion:   reads several tensors and may run in the widest of them (``add(fp32, low)``
#                       needs no cast); it computes (or broadcasts, whose backward sums), so it never
#                       moves fp32 to low.
#   exact under rounding (forward and backward, at this use): the only ops that may move from fp32 to
#                       low (``relu``, views, a ``cat`` of distinct values; not ``gelu``, ``expand``,
#                       ``clamp``, whose backward masks at a bound rounding can cross, or ``cat([x, x])``).


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


def dtypes_as_read(analysis: Analysis) -> dict[fx.Node, Optional[torch.dtype]]:
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
    kinds, dtypes = _kinds(analysis), dtypes_as_read(analysis)
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
        if not op_properties.exact_under_rounding_at(node) or not all(
                reader in free or rounds_anyway(reader) for reader in node.users):
            problem.implies.append((SINK, node))
            continue
        problem.implies.extend((reader, node) for reader in node.users if reader in free)


def _free_kind(node: fx.Node, decision: str, kinds: dict, dtypes: dict, sided: dict, values: dict) -> Optional[str]:
    """"single", "follow" (several inputs) or "promote" when the node may move; None when it may not."""
    m = node.meta
    if node not in sided or decision not in ("follow", "promote") or m.get(meta.RULE) == "policy":
        return None
    if decision == "promote" and op_properties.of(m.get(meta.OP)).table == "unknown":
        return None  # an undecided custom op made to promote (assign_precision): it computes what it did
    if node.op not in ("call_function", "call_method") or m.get(meta.INPLACE) or explicit_dtype(node):
        return None
    if any(kinds[n] == "container" or (dtypes.get(n) is not None and n not in sided) for n in _inputs(node)):
        return None  # reads a tuple, or an fp64 / other-low value: leave it alone
    promoting = [n for n in promoting_inputs(node, values) if n in sided]
    if not promoting or any(values[n].shape == () for n in promoting):
        return None
    if decision == "promote":
        return "promote"
    props = op_properties.of(m.get(meta.OP))
    if not props.either_precision:
        return None
    if len(promoting) == 1:
        return "single"
    return "follow" if props.native_promotion else None


def _designated(inputs: list[fx.Node], node_side: int, sided: dict, weight: dict) -> fx.Node:
    """The input a multi-input node may not out-rank; one on the node's greedy side, so greedy stays feasible."""
    candidates = [n for n in inputs if sided[n] == node_side] if node_side == 1 else inputs
    return max(candidates or inputs, key=lambda n: weight[n])
