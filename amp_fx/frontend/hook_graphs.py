"""Find the hook sites in a converted module's graphs, and bind them to the module that holds them."""

from __future__ import annotations

import weakref
from typing import Iterator

import torch.fx as fx
import torch.nn as nn

from amp_fx.frontend.hook_sites import HookSite

__all__ = ["is_boundary", "graph_modules", "sites_of", "bind_sites"]


def is_boundary(node: fx.Node) -> bool:
    """True for the enter/exit nodes of a hook boundary."""
    return node.op == "call_function" and getattr(node.target, "_amp_fx_hook_boundary", False) is True


def graph_modules(gm: nn.Module) -> Iterator[fx.GraphModule]:
    """``gm`` and the graph modules it holds (checkpointed regions), not other converted modules inside it."""
    yield gm
    todo = list(gm.children())
    while todo:
        module = todo.pop()
        if "amp_config" in module.__dict__:
            continue
        if isinstance(module, fx.GraphModule):
            yield module
        todo.extend(module.children())
        # a checkpointed region keeps its body out of _modules (amp_fx/frontend/checkpoint_regions.py)
        todo.extend(v for k, v in module.__dict__.items() if isinstance(v, fx.GraphModule) and k != "_modules")


def sites_of(gm: nn.Module) -> list[HookSite]:
    """The hook sites in ``gm``'s graphs."""
    found: dict[str, HookSite] = {}
    for graph_module in graph_modules(gm):
        for node in graph_module.graph.nodes:
            if is_boundary(node):
                found.setdefault(node.target.site.uid, node.target.site)
    return list(found.values())


def bind_sites(gm: nn.Module) -> None:
    """Make each hook site in ``gm``'s graphs read ``gm``'s modules (after construction, deepcopy, unpickling)."""
    for graph_module in graph_modules(gm):
        replaced: dict[str, HookSite] = {}
        for node in graph_module.graph.nodes:
            if not is_boundary(node):
                continue
            site = node.target.site
            owner = site.owner() if site.owner is not None else None
            if owner is gm:
                continue
            if owner is None:
                site.owner = weakref.ref(gm)
                continue
            new = replaced.get(site.uid) or replaced.setdefault(site.uid, site.rebound(gm))
            node.target = getattr(new, node.target.kind)
        if replaced:
            graph_module.recompile()
