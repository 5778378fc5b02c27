"""Repaint: move the precision paint so that the casts move the fewest bytes, by a minimum s-t cut (networkx).

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
2. Free: FOLLOW ops that run in either precision (the op registry's
   ``either_precision``: elementwise, views, pooling, dropout) and PROMOTE
   ops, all of whose inputs are fp32 or low.  Nodes pinned by the policy,
   in-place ops (and whatever aliases what they write), leaf modules, ops
   with ``dtype=`` and anything else are not, and the values they read keep
   their dtype: they compute what they computed before.
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
   low only if its op is exact under rounding, forward and backward
   (:func:`amp_fx.ir.op_properties.exact_under_rounding_at`: views, ``relu``,
   a ``cat`` of distinct values; not ``expand``, ``repeat``, a ``cat`` of
   copies, or ``clamp``, whose backward masks at a bound that rounding can
   cross) and every reader rounds its result low anyway.  A residual ``add``
   of an fp32 stream stays fp32, as under autocast.
6. ``networkx.minimum_cut`` solves it; ties go to the greedy side.
7. A free node whose new dtype is not what following its inputs gives is
   repainted ``"low"``/``"fp32"`` (reason ``"placed low: min-cut"``);
   ``insert_casts`` writes the casts.  The placement is kept only if the casts
   it implies (:func:`amp_fx.ir.analysis.planned_casts`, read off the dtype
   analysis of each paint) move fewer bytes than the greedy placement's.
   The pass runner then stores the analysis of the final paint (the pass
   ensures ``"dtypes"``): the cost model's own analysis of it when it made
   one, else a new one.

Graph inputs whose dtype is unknown (no example inputs) are costed as fp32:
their casts are guarded at run time, but placed by the same cut.

The cut problem (rules 1-5: who is free, what each cast weighs, what keeps
precision) is built in :mod:`amp_fx.ir.cast_placement`; this pass solves it,
turns the sides back into a paint (rule 7) and measures it.

Stats: ``cast_bytes_greedy`` and ``cast_bytes_min_cut`` per forward (measured
that way) and one report line.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.fx as fx

from amp_fx.ir import meta
from amp_fx.ir.analysis import Analysis, ValueInfo, analyse
from amp_fx.ir.cast_costs import planned_casts, static_numel
from amp_fx.ir.cast_placement import CastProblem, build_problem, dtypes_as_read
from amp_fx.ir.pass_manager import PassContext, PassResult, amp_pass

__all__ = ["minimize_casts", "CastProblem", "build_problem", "measure_cast_bytes", "cost_view"]

logger = logging.getLogger(__name__)  # amp_fx.passes.minimize_casts


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
    return analyse(gm, ctx, paint, assume_inputs=torch.float32, repaint=repaint)


def _same_paint(analysis: Analysis, paint: dict) -> bool:
    return all(analysis.decisions.get(node) == decision for node, decision in paint.items())


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
    return static_numel(meta.shape(node)) is not None


def _paint_of(node: fx.Node) -> tuple[str, str, str]:
    return node.meta.get(meta.DECISION, "follow"), node.meta.get(meta.REASON, ""), node.meta.get(meta.RULE, "")


def _report_line(greedy: int, placed: int, moved: dict, free: int, estimated: bool, greedy_kept_because: str) -> str:
    approx = "~" if estimated else ""
    tail = " (sizes estimated: shapes unknown or symbolic)" if estimated else ""
    if not moved:
        why = f"greedy placement kept, {greedy_kept_because}" if greedy_kept_because else "greedy placement is already minimal"
        return f"cast bytes per forward {approx}{greedy:,}: {why} ({free} free nodes){tail}"
    to_low = sum(1 for side in moved.values() if side == 0)
    saved = greedy - placed
    return (f"cast bytes per forward {approx}{greedy:,} greedy -> {approx}{placed:,} min-cut "
            f"({saved:,} saved, {100.0 * saved / greedy:.0f}%); {len(moved)} nodes moved: "
            f"{to_low} to low, {len(moved) - to_low} to fp32{tail}")


@amp_pass(kind="repaint", requires=("meta", "paint", "dtypes"), ensures=("dtypes",))
def minimize_casts(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Repaint free nodes so that the casts move the fewest bytes (see module docstring)."""
    import networkx as nx  # loaded on first use: `import amp_fx` stays light
    graph = gm.graph
    if any(node.meta.get(meta.INSERTED) for node in graph.nodes):
        return PassResult(gm, False, {"skipped": "the graph already has its casts (minimize_casts runs before insert_casts)"})
    current = {node: _paint_of(node) for node in graph.nodes}
    # A second run starts from the greedy paint again, so it finds the same placement.
    original = {node: tuple(node.meta.get(meta.PLACED_FROM, current[node])) for node in graph.nodes}
    paint = {node: original[node][0] for node in graph.nodes}
    greedy = cost_view(gm, ctx, dict(paint))
    dtypes = dtypes_as_read(greedy)
    problem, free_kind = build_problem(gm, ctx, paint, greedy)
    greedy_bytes, estimated = measure_cast_bytes(gm, ctx, paint, greedy)
    placed_bytes, moved, target = greedy_bytes, {}, dict(original)
    # Why a cut the solver found was not taken; empty when the greedy paint is the optimum.
    greedy_kept_because = ""
    sides: dict = {}
    new_analysis: Optional[Analysis] = None
    if problem.free:
        try:
            sides = problem.solve()
        except nx.NetworkXUnbounded:  # pins that contradict each other: keep the greedy paint
            logger.debug("contradictory constraints; greedy placement kept")
            sides = {}
            greedy_kept_because = "the nodes' pins contradict each other"
        realized = _realize(gm, ctx, free_kind, sides, paint) if sides else None
        if realized is not None:
            new_paint, new_analysis = realized
            new_dtypes = dtypes_as_read(new_analysis)
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
                    greedy_kept_because = "the min-cut one measures no fewer bytes"
            elif changed:
                # The safety net: a cut must not change what a node outside it computes. Say which node it hit.
                outside = ", ".join(n.name for n in changed if n not in sides)
                greedy_kept_because = f"the min-cut one would change nodes it may not move ({outside})"
    modified = False
    for node in graph.nodes:
        if target[node] != current[node]:
            node.meta[meta.DECISION], node.meta[meta.REASON], node.meta[meta.RULE] = target[node]
            modified = True
        if node in moved:
            node.meta[meta.PLACED_FROM] = original[node]
        elif node.meta.pop(meta.PLACED_FROM, None) is not None:
            modified = True
    # The answer insert_casts reads is the one for the final paint: the runner stores it ("dtypes" is ensured),
    # taking the cost model's analysis of that paint when one was made, else running the analysis again.
    kept = None
    if modified:
        final = {node: node.meta[meta.DECISION] for node in graph.nodes}
        kept = next((a for a in (new_analysis, greedy) if a is not None and a.complete and _same_paint(a, final)), None)
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
        "report_lines": [_report_line(greedy_bytes, placed_bytes, moved, len(problem.free), estimated, greedy_kept_because)],
    }
    return PassResult(gm, modified, stats, analysis=kept)
