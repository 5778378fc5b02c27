"""Group a converted graph's nodes into module blocks, so a real model's picture fits a screen.

A 12-layer GPT-2 has some 800 nodes: drawn one box each, it is a column tens of
thousands of pixels tall.  Grouped, it is one box per transformer block, each
with its nodes' decisions and casts summed.  At module depth ``depth``, a
block is a run of consecutive nodes (in graph order) whose module paths share
the same first ``depth`` components (``transformer.h.3`` at depth 3); the
nodes between such blocks whose paths are shallower (embeddings, a final norm,
top-level code) form "glue" blocks, one per run, named by the modules they
hold.  A parameter (``get_attr``) joins the block of its first user, so a block
carries its own weights and their casts.  Inputs and the output stay
single nodes; a block of one node is drawn as that node.

:func:`group_blocks` picks the deepest module depth whose picture fits
``max_size`` pixels, so a model is shown at the finest grain that fits.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import torch.fx as fx

from amp_fx.ir import meta
from amp_fx.ir.cast_costs import cast_bytes

__all__ = ["Block", "Item", "group_blocks", "blocks_at_depth"]


@dataclass(eq=False)
class Block:
    """Consecutive nodes of one module subtree, drawn as one box."""

    key: Optional[str]  # the module path prefix all its nodes share; None for a glue block (shallower paths)
    index: int  # the block's position among the picture's items (its HTML anchor)
    nodes: list[fx.Node] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"block-{self.index}"

    def modules(self) -> list[str]:
        """The module paths of the block's nodes, in order of first appearance ("(top level)" for none)."""
        return list(dict.fromkeys(_module_of(n) for n in self.nodes if n.op != "get_attr"))

    @property
    def title(self) -> str:
        if self.key is not None:
            return self.key
        counts = Counter(_module_of(n) for n in self.nodes if n.op != "get_attr")
        if not counts:
            return "(parameters)"
        main = max(counts, key=counts.get)  # the module most of the glue belongs to names it
        return main + (f" +{len(counts) - 1}" if len(counts) > 1 else "")

    def cast_bytes(self) -> int:
        """Bytes the block's inserted casts write per forward (0 when shapes are unknown)."""
        return sum(cast_bytes(n) or 0 for n in self.nodes if meta.INSERTED.get(n) and meta.DECISION.get(n) == "cast")


Item = Union[fx.Node, Block]

# torch.export names code outside any module this way in its module stacks: it is top-level code.
_EXPORT_TOP_LEVEL = "_empty_nn_module_stack_from_metadata_hook"


def _module_of(node: fx.Node) -> str:
    path = meta.MODULE_PATH.get(node) or ""
    return "(top level)" if not path or path.startswith(_EXPORT_TOP_LEVEL) else path


def _prefix(node: fx.Node, depth: int) -> Optional[str]:
    """The first ``depth`` components of the node's module path; None where the path is shallower (glue)."""
    parts = (meta.MODULE_PATH.get(node) or "").split(".")
    return ".".join(parts[:depth]) if parts[0] and len(parts) >= depth else None


def blocks_at_depth(graph: fx.Graph, depth: int) -> list[Item]:
    """The picture's items when nodes are grouped by their module path's first ``depth`` components."""
    items: list[Item] = []
    owner: dict[fx.Node, Block] = {}
    current: Optional[Block] = None
    deferred: list[fx.Node] = []
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            items.append(node)
            current = None
            continue
        if node.op == "get_attr":
            deferred.append(node)  # placed with its first user, below
            continue
        key = _prefix(node, depth)
        if current is None or current.key != key:
            current = Block(key, len(items))
            items.append(current)
        current.nodes.append(node)
        owner[node] = current
    for node in deferred:
        first_user = min((u for u in node.users if u in owner), key=lambda u: owner[u].index, default=None)
        if first_user is None:
            items.append(node)
        else:
            owner[first_user].nodes.insert(0, node)
            owner[node] = owner[first_user]
    # A block of one node says no more than the node: draw the node.
    return [item.nodes[0] if isinstance(item, Block) and len(item.nodes) == 1 else item for item in items]


def group_blocks(graph: fx.Graph, fits: Callable[[list[Item]], bool], depth: Optional[int] = None) -> list[Item]:
    """The finest grouping whose picture ``fits``: module depth ``depth`` if given, else the deepest that fits."""
    if depth is not None:
        return blocks_at_depth(graph, depth)
    deepest = max(((meta.MODULE_PATH.get(n) or "").count(".") + 1 for n in graph.nodes if meta.MODULE_PATH.get(n)), default=1)
    for level in range(deepest, 0, -1):
        items = blocks_at_depth(graph, level)
        if fits(items):
            return items
    return blocks_at_depth(graph, 1)
