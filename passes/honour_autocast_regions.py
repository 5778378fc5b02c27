"""Rewrite: honour the user's own ``torch.autocast`` regions in a Dynamo graph, then remove them.

Dynamo records ``with torch.autocast(...)`` inside a model as a pair of
nodes, ``_enter_autocast(device_type, dtype, enabled, cache_enabled)`` and
``_exit_autocast(ctx)``.  Left in the graph, the inner compiler would trace
the region under autocast and cast a second time on top of amp_fx's casts.
This pass runs after ``assign_precision`` (the paint exists) and before
``insert_casts`` (nothing is cast yet):

1. Walk the graph in order with a stack of open regions for the graph's
   device type; the innermost region is the one in force.
2. Inside a region with ``enabled=False``, every computing node is pinned to
   fp32 (decision "fp32", rule "autocast"): the model's author turned
   autocast off to get full precision there.
3. Inside a region with ``enabled=True`` the level's tables decide, as
   autocast's own lists would; a region asking for another low dtype than the
   conversion's is noted in the stats (amp_fx has one low dtype per graph).
4. A policy rule beats a region, a region beats the tables.  The model's own
   casts (``x.float()``), graph inputs and outputs keep their decision.
5. The enter/exit nodes of those regions are erased: the casts become explicit.

Regions for another device type than the graph's do nothing to its ops under
eager autocast either; they are left in place.  Graphs without autocast
nodes (every graph ``convert()`` traces) are returned untouched.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.fx as fx

from amp_fx.pass_manager import PassContext, PassResult

__all__ = ["honour_autocast_regions", "is_autocast_enter", "is_autocast_exit"]

logger = logging.getLogger("amp_fx.passes.honour_autocast_regions")

_KEEP = frozenset({"cast", "none", "entry", "exit"})


def is_autocast_enter(node: fx.Node) -> bool:
    """True for Dynamo's ``torch.amp.autocast_mode._enter_autocast`` node."""
    return node.op == "call_function" and node.target is getattr(torch.amp.autocast_mode, "_enter_autocast", None)


def is_autocast_exit(node: fx.Node) -> bool:
    """True for Dynamo's ``torch.amp.autocast_mode._exit_autocast`` node."""
    return node.op == "call_function" and node.target is getattr(torch.amp.autocast_mode, "_exit_autocast", None)


def _region_args(node: fx.Node) -> tuple[str, Optional[torch.dtype], bool]:
    """(device_type, dtype, enabled) of an enter node, as torch.autocast reads them."""
    names = ("device_type", "dtype", "enabled", "cache_enabled")
    values: dict[str, Any] = dict(zip(names, node.args))
    values.update(node.kwargs)
    enabled = values.get("enabled", True)
    return str(values.get("device_type")), values.get("dtype"), True if enabled is None else bool(enabled)


def _graph_device(gm: fx.GraphModule, ctx: PassContext) -> str:
    """The device type of the graph's floating tensors (the backend may tell it through ctx.extra)."""
    if "device_type" in ctx.extra:
        return ctx.extra["device_type"]
    for node in gm.graph.nodes:
        value = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.device.type
    return "cpu"


def _pin(node: fx.Node, reason: str) -> None:
    if node.meta.get("amp_fx.inplace"):
        reason = f"{reason} (in-place: computed out of place in fp32, written back)"
    node.meta["amp_fx.decision"] = "fp32"
    node.meta["amp_fx.reason"] = reason
    node.meta["amp_fx.rule"] = "autocast"


def honour_autocast_regions(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Pin ops of ``autocast(enabled=False)`` regions to fp32 and erase the region nodes."""
    device = _graph_device(gm, ctx)
    stack: list[tuple[fx.Node, bool, Optional[torch.dtype]]] = []
    region_nodes: list[fx.Node] = []
    pinned = regions = foreign = 0
    other_dtype: set[str] = set()
    for node in list(gm.graph.nodes):
        if is_autocast_enter(node):
            device_type, dtype, enabled = _region_args(node)
            if device_type != device:
                foreign += 1
                continue
            stack.append((node, enabled, dtype))
            region_nodes.append(node)
            regions += 1
            if enabled and dtype is not None and dtype != ctx.low:
                other_dtype.add(str(dtype).replace("torch.", ""))
            continue
        if is_autocast_exit(node):
            entered = node.args[0] if node.args else None
            if any(entry is entered for entry, _, _ in stack):
                while stack and stack[-1][0] is not entered:
                    stack.pop()
                stack.pop()
                region_nodes.append(node)
            continue
        if not stack or stack[-1][1]:
            continue
        if node.op != "call_function" and node.op != "call_method" and node.op != "call_module":
            continue
        if node.meta.get("amp_fx.decision") in _KEEP or node.meta.get("amp_fx.rule") == "policy":
            continue
        if node.meta.get("amp_fx.is_tensor") is False and node.meta.get("amp_fx.is_float") is False:
            continue
        _pin(node, f"inside the model's torch.autocast({device!r}, enabled=False) region: fp32")
        pinned += 1
    # Exits first: each reads its enter node.
    for node in sorted(region_nodes, key=lambda n: not is_autocast_exit(n)):
        if not node.users:
            gm.graph.erase_node(node)
    if regions:
        logger.debug("honoured %d autocast regions, pinned %d nodes to fp32", regions, pinned)
    stats = {"regions": regions, "pinned_fp32": pinned, "other_device_regions": foreign}
    if other_dtype:
        stats["region_dtypes_not_honoured"] = sorted(other_dtype)
    return PassResult(gm, bool(region_nodes), stats)
