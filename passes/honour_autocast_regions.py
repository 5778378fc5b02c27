"""Rewrite: keep the model's own grad-mode and autocast regions, on every route.

The regions arrive as marker nodes (:mod:`amp_fx.frontend.regions`): written by
AmpTracer on the symbolic route, inlined from torch.export's higher-order
ops on the export route, and written by Dynamo itself under the compiler
backend.  This pass runs after ``assign_precision`` (the paint exists) and
before ``insert_casts`` (nothing is cast yet):

1. Walk the graph in order with the stack of open regions
   (:func:`amp_fx.frontend.regions.region_stacks`); for autocast, only regions of the
   graph's device type count, and the innermost one is in force.
2. ``autocast(enabled=False)``: every computing node is pinned to fp32
   (decision "fp32", rule "autocast"), as the model wrote it for fp32 weights,
   except where the model casts low itself inside the region (``x.half()``):
   what reads such a value runs as written ("follow").
3. An enabled region lets the level decide, as autocast's own lists would;
   a low op in a region whose dtype differs from the conversion's runs in the
   region's dtype (``meta.LOW_DTYPE``, read by the dtype analysis).
4. A policy rule beats a region, a region beats the tables.  The model's own
   casts, graph inputs and outputs keep their decision.  Every other node in
   a region reports rule ``autocast`` or ``grad-mode`` (the innermost region's
   kind), and the reason names the region.
5. Autocast markers of the graph's device are erased: the casts are explicit.
   Grad-mode markers stay: they set and restore grad mode at run time.
6. A parameter or input read under two grad modes gets one read (a view) per
   mode, so a cast of it is never shared between them: a cast made under
   ``no_grad`` must not feed an op that needs its gradient.

Regions for another device type than the graph's do nothing to its ops under
eager autocast either; they are left in place.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.fx as fx

from amp_fx.ir import meta, tables
from amp_fx.ir.pass_manager import PassContext, PassResult, amp_pass
from amp_fx.frontend.regions import NOTES_ATTR, Region, autocast_rule, marker_role, region_stacks, separate_grad_reads
from amp_fx.frontend.train_flags import FROZEN_ATTR

__all__ = ["honour_autocast_regions", "is_autocast_enter", "is_autocast_exit"]

logger = logging.getLogger(__name__)  # amp_fx.passes.honour_autocast_regions

_SKIP = frozenset({"none", "entry", "exit"})
_CALLS = frozenset({"call_function", "call_method", "call_module"})


def is_autocast_enter(node: fx.Node) -> bool:
    """True for an autocast region's enter marker (Dynamo's ``_enter_autocast`` or amp_fx's)."""
    return marker_role(node) == ("enter", "autocast")


def is_autocast_exit(node: fx.Node) -> bool:
    """True for an autocast region's exit marker."""
    return marker_role(node) == ("exit", "autocast")


def _returns_nothing(node: fx.Node) -> bool:
    """True for checks such as export's ``_assert_tensor_metadata``: they compute nothing to pin."""
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and not target._schema.returns


def _model_cast_dtype(node: fx.Node) -> Optional[torch.dtype]:
    """The floating dtype a cast the model wrote produces (``x.half()``, ``x.to(torch.bfloat16)``), if any."""
    if meta.DECISION.get(node) != "cast" or meta.INSERTED.get(node):
        return None
    named = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16, "double": torch.float64}
    if meta.OP.get(node) in named:
        return named[meta.OP.get(node)]
    dtypes = [a for a in list(node.args[1:]) + list(node.kwargs.values()) if isinstance(a, torch.dtype)]
    return dtypes[0] if len(dtypes) == 1 and dtypes[0].is_floating_point else None


def _repaint(node: fx.Node, regions: tuple[Region, ...], low: torch.dtype, written_low: set) -> Optional[str]:
    """Apply the innermost regions' rules to ``node``; return "fp32" when it was pinned.

    ``written_low`` holds the values that the model itself made low inside a
    disabled region (``x.half()``): ops reading them run as written, in
    that dtype, rather than being pinned back to fp32.
    """
    m = node.meta
    decision = m.get(meta.DECISION, "follow")
    autocast = [r for r in regions if r.kind == "autocast"]
    grads = [r for r in regions if r.kind == "grad"]
    reasons = []
    pinned = None
    computing = not (meta.is_tensor(node) is False and meta.is_float(node) is False) and not _returns_nothing(node)
    if autocast and not autocast[-1].enabled:
        if _model_cast_dtype(node) in (torch.float16, torch.bfloat16):
            written_low.add(node)
        elif decision != "cast" and computing and any(n in written_low for n in node.all_input_nodes):
            written_low.add(node)
            m[meta.DECISION] = "follow"
            m[meta.REASON] = (f"inside the model's {autocast[-1].describe()} region: runs as written "
                                     "(the model cast its inputs low itself)")
            autocast = []
            reasons.append("")
    if autocast:
        new_decision, low_dtype, reason = autocast_rule(autocast[-1], decision, low)
        if decision != "cast" and computing:
            if new_decision is not None:
                m[meta.DECISION] = pinned = new_decision
                if m.get(meta.INPLACE):
                    reason = f"{reason} (in-place: computed out of place in fp32, written back)"
                m[meta.REASON] = reason
            elif low_dtype is not None:
                m[meta.LOW_DTYPE] = low_dtype
                m[meta.REASON] = reason
            else:
                reasons.append(reason)
        else:
            reasons.append(f"inside the model's {autocast[-1].describe()} region")
    reasons += [f"inside the model's {r.describe()} region" for r in grads[-1:]]
    if reasons:
        m[meta.REASON] = "; ".join([m.get(meta.REASON, "")] + reasons).strip("; ")
    innermost = regions[-1]
    if not (innermost.kind == "grad" and m.get(meta.RULE) == "unknown"):
        m[meta.RULE] = "autocast" if innermost.kind == "autocast" else "grad-mode"
    return pinned


def _fp32_only(node: fx.Node, seen: set) -> tuple[bool, bool]:
    """(every reader of ``node`` ends in fp32, at least one of them is pinned by an autocast region)."""
    pinned = False
    for user in node.users:
        if user in seen:
            continue
        seen.add(user)
        m = user.meta
        if m.get(meta.DECISION) == "fp32":
            pinned |= m.get(meta.RULE) == "autocast"
        elif _returns_nothing(user):
            continue  # export's dtype assertions read values and compute nothing
        elif m.get(meta.DECISION) == "cast" and _casts_to_fp32(user):
            ok, deeper = _fp32_only(user, seen)
            if not ok:
                return False, False
            pinned |= deeper
        elif m.get(meta.DECISION) == "follow" and m.get(meta.OP) in tables.DATA_MOVEMENT:
            ok, deeper = _fp32_only(user, seen)
            if not ok:
                return False, False
            pinned |= deeper
        else:
            return False, False
    return True, pinned


def _casts_to_fp32(node: fx.Node) -> bool:
    """A model-written cast to fp32: ``x.float()``, ``x.to(torch.float32)`` or aten ``to``/``_to_copy``."""
    if meta.OP.get(node) == "float":
        return True
    dtypes = [a for a in list(node.args[1:]) + list(node.kwargs.values()) if isinstance(a, torch.dtype)]
    return dtypes == [torch.float32]


def _mark_fp32_only_weights(graph: fx.Graph) -> int:
    """Mark weights read only in ``autocast(enabled=False)`` regions (rotary ``inv_freq``): O2 keeps them fp32.

    Casting them low and back would round what the model's author asked to
    compute in fp32.
    """
    marked = 0
    for node in graph.nodes:
        if node.op == "get_attr" and meta.PARAM.get(node) and meta.is_float(node):
            ok, pinned = _fp32_only(node, set())
            if ok and pinned and not meta.KEEP_FP32.get(node):
                meta.KEEP_FP32.set(node, True)
                marked += 1
    return marked


@amp_pass(kind="rewrite", requires=("meta", "paint"), invalidates=("dtypes",))
def honour_autocast_regions(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Paint the nodes of the model's grad-mode and autocast regions and erase the autocast markers."""
    device = ctx.device_for(gm)
    graph = gm.graph
    stacks = region_stacks(graph)
    autocast_markers = [n for n in graph.nodes if marker_role(n) is not None and marker_role(n)[1] == "autocast"]
    foreign = [n for n in autocast_markers if marker_role(n)[0] == "enter" and n.args and n.args[0] != device]
    pinned = painted = 0
    written_low: set = set()
    for node in graph.nodes:
        role = marker_role(node)
        if role is not None and meta.DECISION.get(node) != "none":
            node.meta.update({meta.DECISION: "none", meta.RULE: "autocast" if role[1] == "autocast" else "grad-mode",
                              meta.REASON: f"the model's {role[1]} region marker ({role[0]})"})
            meta.note_value(node, is_tensor=False, is_float=False)
    for node, regions in stacks.items():
        relevant = tuple(r for r in regions if r.kind == "grad" or r.device == device)
        if not relevant or node.op not in _CALLS:
            continue
        if meta.DECISION.get(node) in _SKIP or meta.RULE.get(node) == "policy":
            continue
        if meta.GRAD_READ.get(node):
            continue  # a read separate_grad_reads wrote in an earlier run: it carries its own paint
        key = tuple(r.describe() for r in relevant)
        if meta.REGION.get(node) == key:
            continue  # painted by an earlier run
        meta.REGION.set(node, key)
        painted += 1
        if _repaint(node, relevant, ctx.low, written_low) == "fp32":
            pinned += 1
    # Exits first: each reads its enter node.
    erased = [n for n in autocast_markers if n not in foreign and not (marker_role(n)[0] == "exit" and n.args and n.args[0] in foreign)]
    removed = 0
    for node in sorted(erased, key=lambda n: not is_autocast_exit(n)):
        if not node.users:
            graph.erase_node(node)
            removed += 1
    kept = _mark_fp32_only_weights(graph)
    separated = separate_grad_reads(graph)
    grad_regions = len({id(r) for regions in stacks.values() for r in regions if r.kind == "grad"})
    regions = sum(1 for n in erased if is_autocast_enter(n))
    if regions or grad_regions:
        logger.debug("honoured %d autocast and %d grad-mode regions, pinned %d nodes to fp32", regions, grad_regions, pinned)
    stats = {"regions": regions, "grad_regions": grad_regions, "pinned_fp32": pinned, "painted": painted,
             "separate_grad_reads": separated, "weights_kept_fp32": kept, "other_device_regions": len(foreign)}
    lines = [f"{where}: forward branches on {path or 'the model'}.training; the graph keeps training={value} "
             "(.train()/.eval() warn)" for path, (value, where) in (getattr(gm, FROZEN_ATTR, None) or {}).items()
             if where != "traced with torch.export"]
    lines += list(getattr(graph, NOTES_ATTR, None) or ())
    if regions or grad_regions:
        lines.append(f"kept the model's regions: {regions} autocast, {grad_regions} grad-mode ({painted} nodes inside)")
    if lines:
        stats["report_lines"] = lines
    # Repainting and marking weights only write node.meta: the code changed only if markers went or reads were added.
    return PassResult(gm, removed > 0 or separated > 0, stats)
