"""Draw a converted graph coloured by precision: Graphviz where installed, networkx's layered layout otherwise.

Colours: green runs low, blue runs fp32, orange is a cast, grey follows its
input (its border says which dtype arrived); inputs, parameters and the
output are white.  Labels carry the node, its op, its module path, and its
dtype and shape; hovering a node shows the decision's reason and source line.

``draw(converted, "graph.svg")`` uses Graphviz ``dot`` when it is on PATH and
a layered layout from networkx (``topological_generations``, ``multipartite_layout``;
inline SVG) when it is not, so a
file is always written; ``.html`` wraps the picture with a legend (and an
optional summary), ``.dot`` writes the Graphviz source.
"""

from __future__ import annotations

import html
import os
import shutil
import subprocess
from collections import Counter
from typing import Any, Optional, Union

import networkx as nx
import torch
import torch.fx as fx

from amp_fx.ir.cast_costs import cast_bytes
from amp_fx.ir import meta
from amp_fx.ir.meta import float_dtype
from amp_fx.inspection.draw_blocks import Block, Item, group_blocks
from amp_fx.errors import AmpRuntimeError, AmpTypeError, AmpValueError

__all__ = ["draw", "dot_source", "builtin_svg", "category", "COLOURS", "MAX_SIZE"]

# category -> (fill, stroke)
COLOURS = {
    "low": ("#a6e3a1", "#2f8a2f"),
    "fp32": ("#a8c8f5", "#2a5fb0"),
    "cast": ("#ffbf69", "#c86b00"),
    "follow": ("#e4e4e4", "#888888"),
    "io": ("#ffffff", "#666666"),
}
_LEGEND = (("low", "low precision"), ("fp32", "fp32"), ("cast", "cast"), ("follow", "follows its input"))
_LOW = (torch.float16, torch.bfloat16)
_BOX_W, _BOX_H, _GAP_X, _GAP_Y, _MARGIN, _LEGEND_H = 172, 58, 18, 34, 16, 28
# The picture's default bound: a graph drawn node by node that would not fit is grouped into module blocks.
MAX_SIZE = (2000, 2000)
Group = Union[str, int, None]


def category(node: fx.Node) -> str:
    """The colour class of ``node``: low, fp32, cast, follow, or io (inputs, parameters, output)."""
    decision = meta.DECISION.get(node, "none")
    if decision == "cast":
        return "cast"
    if decision in ("low", "fp32"):
        return decision
    if decision in ("follow", "promote"):
        return "follow"
    return "io"


def _stroke(node: fx.Node) -> str:
    kind = category(node)
    if kind == "follow":
        dtype = float_dtype(node)
        return COLOURS["low"][1] if dtype in _LOW else COLOURS["fp32"][1] if dtype == torch.float32 else COLOURS["follow"][1]
    return COLOURS[kind][1]


def _dtype(node: fx.Node) -> str:
    dtype = float_dtype(node)
    return "" if dtype is None else str(dtype).replace("torch.", "")


def _label(node: fx.Node) -> list[str]:
    op = meta.OP.get(node) or (node.op if node.op in ("placeholder", "output") else str(node.target))
    shape = meta.shape(node)
    shape_text = "x".join(str(s) for s in shape) if shape else ""
    return [f"{node.name}: {op}", meta.MODULE_PATH.get(node) or "", f"{_dtype(node)} {shape_text}".strip()]


def _tooltip(node: fx.Node) -> str:
    parts = [f"{node.name}: {meta.DECISION.get(node, 'none')} - {meta.REASON.get(node, '')}"]
    source = meta.SOURCE.get(node)
    if source:
        # File name only: pictures get shared, local directory names need not be.
        path, sep, rest = str(source).partition(":")
        parts.append(os.path.basename(path) + sep + rest)
    return "\n".join(parts)


def _bytes_text(size: int) -> str:
    return f"{size} B" if size < 1024 else f"{size / 1024:.1f} KB" if size < 1024 ** 2 else f"{size / 1024 ** 2:.1f} MB"


def _edge_label(node: fx.Node) -> str:
    size = cast_bytes(node) if meta.INSERTED.get(node) and meta.DECISION.get(node) == "cast" else None
    return _bytes_text(size) if size else ""


# -- Graphviz -----------------------------------------------------------------------
def _dot_quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def dot_source(converted: fx.GraphModule, group: Group = None, max_size: tuple[int, int] = MAX_SIZE) -> str:
    """Graphviz DOT source of the converted graph: one cluster per module, nodes coloured by precision.

    With ``group`` (as :func:`draw`), a graph that would not fit is drawn as module blocks instead.
    """
    items = _items(converted, group, max_size)
    if any(isinstance(item, Block) for item in items):
        return _dot_blocks(items)
    lines = ["digraph amp_fx {", "  rankdir=TB;", '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];',
             '  edge [fontname="Helvetica", fontsize=8, color="#777777"];']
    by_module: dict[str, list[fx.Node]] = {}
    for node in converted.graph.nodes:
        by_module.setdefault(meta.MODULE_PATH.get(node) or "", []).append(node)

    def emit(node: fx.Node, indent: str) -> None:
        fill = COLOURS[category(node)][0]
        label = "\n".join(line for line in _label(node) if line)
        lines.append(f"{indent}{_dot_quote(node.name)} [label={_dot_quote(label)}, fillcolor={_dot_quote(fill)}, "
                     f"color={_dot_quote(_stroke(node))}, tooltip={_dot_quote(_tooltip(node))}];")

    # Nested clusters follow the module tree: "a.b" sits inside "a".
    paths = sorted(p for p in by_module if p)
    tree: dict[str, list[str]] = {}
    for path in paths:
        parent = next((p for p in reversed(paths) if path.startswith(p + ".")), "")
        tree.setdefault(parent, []).append(path)

    def cluster(path: str, indent: str) -> None:
        lines.append(f"{indent}subgraph {_dot_quote('cluster_' + path)} {{")
        lines.append(f'{indent}  label={_dot_quote(path)}; style="rounded,dashed"; color="#999999"; fontname="Helvetica"; fontsize=9;')
        for node in by_module.get(path, []):
            emit(node, indent + "  ")
        for child in tree.get(path, []):
            cluster(child, indent + "  ")
        lines.append(f"{indent}}}")

    for node in by_module.get("", []):
        emit(node, "  ")
    for top in tree.get("", []):
        cluster(top, "  ")
    for node in converted.graph.nodes:
        for source in node.all_input_nodes:
            label = _edge_label(node)
            attrs = f" [label={_dot_quote(label)}]" if label else ""
            lines.append(f"  {_dot_quote(source.name)} -> {_dot_quote(node.name)}{attrs};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _dot_blocks(items: list[Item]) -> str:
    """DOT source of a grouped picture: one box per block or single node, edges between them."""
    lines = ["digraph amp_fx {", "  rankdir=TB;", '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];',
             '  edge [color="#777777"];']
    for item in items:
        if isinstance(item, Block):
            kind, label, tip = _block_category(item), _block_label(item), _block_tooltip(item)
            extra = f', penwidth=2.5, URL={_dot_quote("#" + item.name + "-nodes")}'
        else:
            kind, label, tip, extra = category(item), _label(item), _tooltip(item), ""
        text = "\n".join(line for line in label if line)
        lines.append(f"  {_dot_quote(item.name)} [label={_dot_quote(text)}, fillcolor={_dot_quote(COLOURS[kind][0])}, "
                     f"tooltip={_dot_quote(tip)}{extra}];")
    inputs = _edges(items)
    for item in items:
        for source in inputs[item]:
            lines.append(f"  {_dot_quote(source.name)} -> {_dot_quote(item.name)};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _graphviz_svg(source: str, dot: str) -> str:
    done = subprocess.run([dot, "-Tsvg"], input=source, capture_output=True, text=True, timeout=120)
    if done.returncode != 0 or "<svg" not in done.stdout:
        raise AmpRuntimeError(f"Graphviz dot failed (exit {done.returncode}): {done.stderr.strip()[:500]}")
    # Drop the XML prolog and DOCTYPE so the SVG can be inlined in HTML too.
    return done.stdout[done.stdout.index("<svg"):]


# -- the built-in picture: networkx's layers, drawn as SVG --------------------------------
# The layout works on items: graph nodes, or module blocks (amp_fx/inspection/draw_blocks.py) standing for many.
def _edges(items: list[Item]) -> dict[Item, list[Item]]:
    """Each item's inputs among ``items`` (edges inside a block, and to nodes not drawn, are dropped)."""
    owner: dict[fx.Node, Item] = {}
    for item in items:
        for node in item.nodes if isinstance(item, Block) else (item,):
            owner[node] = item
    inputs: dict[Item, list[Item]] = {item: [] for item in items}
    for item in items:
        for node in item.nodes if isinstance(item, Block) else (item,):
            for source in node.all_input_nodes:
                other = owner.get(source)
                if other is not None and other is not item and other not in inputs[item]:
                    inputs[item].append(other)
    return inputs


def _layers(items: list[Item], inputs: dict[Item, list[Item]]) -> list[list[Item]]:
    """Items per layer, top to bottom, in graph order within a layer (networkx lays them out).

    A layer is a topological generation counted back from the output, so a parameter and its cast sit
    just above their first user instead of all in the first row; graph inputs stay in the first row.
    ``multipartite_layout`` places each layer's items side by side; its order is read back per row.
    """
    graph = nx.DiGraph()
    graph.add_nodes_from(items)
    graph.add_edges_from((source, item) for item in items for source in inputs[item])
    generations = list(nx.topological_generations(graph.reverse(copy=False)))
    for back, generation in enumerate(generations):
        for item in generation:
            is_input = not isinstance(item, Block) and item.op == "placeholder"
            # An input's users are all at least one layer below the top: pinning it there keeps edges pointing down.
            graph.nodes[item]["layer"] = 0 if is_input else len(generations) - 1 - back
    position = nx.multipartite_layout(graph, subset_key="layer", align="horizontal")
    rows: dict[int, list[Item]] = {}
    for item in items:
        rows.setdefault(graph.nodes[item]["layer"], []).append(item)
    return [sorted(rows[layer], key=lambda item: position[item][0]) for layer in sorted(rows)]


def _text(x: float, y: float, text: str, cls: str) -> str:
    limit = 27
    shown = text if len(text) <= limit else text[: limit - 1] + "\u2026"
    return f'<text x="{x:.0f}" y="{y:.0f}" class="{cls}">{html.escape(shown)}</text>'


def _size(layers: list[list[Item]]) -> tuple[float, float]:
    """Width and height in pixels of the built-in picture of ``layers``."""
    widest = max(len(row) for row in layers)
    width = 2 * _MARGIN + widest * _BOX_W + (widest - 1) * _GAP_X
    height = 2 * _MARGIN + _LEGEND_H + len(layers) * _BOX_H + (len(layers) - 1) * _GAP_Y
    return width, height


def _layout(items: list[Item]) -> tuple[list[list[Item]], dict[Item, list[Item]]]:
    inputs = _edges(items)
    return _layers(items, inputs), inputs


def _fits(items: list[Item], max_size: tuple[int, int]) -> bool:
    width, height = _size(_layout(items)[0])
    return width <= max_size[0] and height <= max_size[1]


def _block_category(block: Block) -> str:
    """A block's colour: the precision most of its computing nodes run in."""
    counts = Counter(category(n) for n in block.nodes)
    return max(("low", "fp32", "follow"), key=lambda kind: counts[kind]) if any(counts[k] for k in ("low", "fp32", "follow")) else "io"


def _block_label(block: Block) -> list[str]:
    counts = Counter(category(n) for n in block.nodes)
    decided = ", ".join(f"{counts[k]} {k}" for k in ("low", "fp32") if counts[k])
    size = block.cast_bytes()
    casts = f"{counts['cast']} casts" + (f", {_bytes_text(size)}" if size else "") if counts["cast"] else "no casts"
    return [block.title, f"{len(block.nodes)} nodes" + (f": {decided}" if decided else ""), casts]


def _block_tooltip(block: Block) -> str:
    counts = Counter(meta.DECISION.get(n, "none") for n in block.nodes)
    return (f"{block.title}: {len(block.nodes)} nodes (" + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) + ")\n"
            + "modules: " + ", ".join(block.modules()))


def _svg(items: list[Item], links: bool) -> str:
    """The built-in SVG of ``items``; with ``links``, each block links to its section of the HTML page."""
    layers, inputs = _layout(items)
    width, height = _size(layers)
    where: dict[Item, tuple[float, float]] = {}
    for r, row in enumerate(layers):
        row_w = len(row) * _BOX_W + (len(row) - 1) * _GAP_X
        x0 = (width - row_w) / 2
        for i, item in enumerate(row):
            where[item] = (x0 + i * (_BOX_W + _GAP_X), _MARGIN + _LEGEND_H + r * (_BOX_H + _GAP_Y))
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" viewBox="0 0 {width:.0f} {height:.0f}" '
        'font-family="Helvetica, Arial, sans-serif">',
        "<style>.n{font-size:11px;font-weight:bold}.m{font-size:10px;fill:#444}.d{font-size:10px;fill:#222}"
        ".e{fill:none;stroke:#8a8a8a;stroke-width:1.2}.b{font-size:9px;fill:#c86b00}.l{font-size:11px}</style>",
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="6" markerHeight="6" orient="auto">'
        '<path d="M0,0 L10,5 L0,10 z" fill="#8a8a8a"/></marker></defs>',
    ]
    for i, (kind, text) in enumerate(_LEGEND):
        x = _MARGIN + i * 130
        fill, stroke = COLOURS[kind]
        out.append(f'<rect x="{x}" y="{_MARGIN}" width="14" height="14" rx="3" fill="{fill}" stroke="{stroke}"/>'
                   f'<text x="{x + 19}" y="{_MARGIN + 11}" class="l">{text}</text>')
    for item in items:
        for source in inputs[item]:
            (sx, sy), (tx, ty) = where[source], where[item]
            x1, y1, x2, y2 = sx + _BOX_W / 2, sy + _BOX_H, tx + _BOX_W / 2, ty
            mid = (y1 + y2) / 2
            out.append(f'<path class="e" d="M{x1:.0f},{y1:.0f} C{x1:.0f},{mid:.0f} {x2:.0f},{mid:.0f} {x2:.0f},{y2:.0f}" marker-end="url(#arrow)"/>')
            label = "" if isinstance(item, Block) else _edge_label(item)
            if label:
                out.append(f'<text x="{x2 + 4:.0f}" y="{y2 - 4:.0f}" class="b">{label}</text>')
    for item in items:
        x, y = where[item]
        if isinstance(item, Block):
            kind, (name, module, dtype), tip, ident = _block_category(item), _block_label(item), _block_tooltip(item), item.name
            stroke = COLOURS["cast"][1] if any(category(n) == "cast" for n in item.nodes) else COLOURS[kind][1]
            cls, width_px = f"block {kind}", 2.5
        else:
            kind, (name, module, dtype), tip, ident = category(item), _label(item), _tooltip(item), item.name
            stroke, cls, width_px = _stroke(item), f"node {kind}", 1.5
        box = (f'<g class="{cls}" id="{html.escape(ident)}"><title>{html.escape(tip)}</title>'
               f'<rect x="{x:.0f}" y="{y:.0f}" width="{_BOX_W}" height="{_BOX_H}" rx="7" fill="{COLOURS[kind][0]}" stroke="{stroke}" stroke-width="{width_px}"/>'
               + _text(x + 8, y + 17, name, "n") + _text(x + 8, y + 33, module, "m") + _text(x + 8, y + 49, dtype, "d") + "</g>")
        out.append(f'<a href="#{ident}-nodes">{box}</a>' if links and isinstance(item, Block) else box)
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _items(converted: fx.GraphModule, group: Group, max_size: tuple[int, int]) -> list[Item]:
    """What the picture draws: every node, or module blocks (``group``: "auto", "module", a depth, or None)."""
    nodes = list(converted.graph.nodes)
    if group is None or group is False or (group == "auto" and _fits(nodes, max_size)):
        return nodes
    depth = group if isinstance(group, int) and not isinstance(group, bool) else None
    return group_blocks(converted.graph, lambda items: _fits(items, max_size), depth)


def builtin_svg(converted: fx.GraphModule, group: Group = None, max_size: tuple[int, int] = MAX_SIZE) -> str:
    """An SVG of the converted graph laid out in layers by depth (no Graphviz needed); ``group`` as :func:`draw`."""
    return _svg(_items(converted, group, max_size), links=False)


def _block_sections(items: list[Item]) -> str:
    """One folded section per block, holding the picture of its nodes; a block's box in the overview opens it."""
    sections = []
    for item in items:
        if isinstance(item, Block):
            sections.append(f'<details id="{item.name}-nodes"><summary>{html.escape(" - ".join(_block_label(item)))}</summary>'
                            f"{_svg(item.nodes, links=False)}</details>")
    if not sections:
        return ""
    # Following a block's link opens its section (a details element does not open itself on a fragment).
    script = ("<script>function openBlock(){var d=document.getElementById(location.hash.slice(1));"
              "if(d&&d.tagName==='DETAILS'){d.open=true;d.scrollIntoView();}}"
              "window.addEventListener('hashchange',openBlock);openBlock();</script>")
    return "<h3>Blocks</h3>" + "".join(sections) + script


def _html(svg: str, title: str, summary: Optional[str], sections: str = "") -> str:
    body = f"<pre>{html.escape(summary)}</pre>" if summary else ""
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            "<style>body{font-family:Helvetica,Arial,sans-serif;margin:1.5em}pre{background:#f6f6f6;padding:1em}"
            "details{margin:.4em 0}summary{cursor:pointer}</style>"
            f"</head><body><h2>{html.escape(title)}</h2>{body}<div class=\"graph\">{svg}</div>{sections}</body></html>\n")


def draw(converted: fx.GraphModule, path: str, *, engine: str = "auto", title: Optional[str] = None, summary: Any = None,
         group: Group = "auto", max_size: tuple[int, int] = MAX_SIZE) -> str:
    """Write a picture of ``converted`` to ``path`` (.svg, .html or .dot) and return the path.

    ``engine``: ``"auto"`` uses Graphviz ``dot`` when it is on PATH and the
    built-in layout otherwise; ``"graphviz"`` requires ``dot``; ``"builtin"``
    never calls it.  ``summary`` (a :class:`amp_fx.inspection.summary.Summary` or
    text) is printed above the picture in HTML.

    ``group``: ``"auto"`` (default) draws every node when the picture fits
    ``max_size`` pixels (width, height; measured on the built-in layout) and
    otherwise one box per module block, at the deepest module depth that fits
    (a 12-layer GPT: one box per transformer block, its decisions and casts
    summed); ``"module"`` always groups; an int groups at that module depth;
    ``None`` never groups.  In ``.html`` each block's box opens a section with
    the picture of its nodes.
    """
    if not isinstance(converted, fx.GraphModule):
        raise AmpTypeError(f"draw expects the converted GraphModule, got {type(converted).__name__}")
    extension = os.path.splitext(path)[1].lower()
    if extension not in (".svg", ".html", ".htm", ".dot", ".gv"):
        raise AmpValueError(f"draw writes .svg, .html or .dot files, not {extension or 'a path without extension'!r}")
    if engine not in ("auto", "graphviz", "builtin"):
        raise AmpValueError(f"engine must be 'auto', 'graphviz' or 'builtin', got {engine!r}")
    if not (group in (None, "auto", "module") or (isinstance(group, int) and not isinstance(group, bool) and group >= 1)):
        raise AmpValueError(f"group must be 'auto', 'module', a module depth >= 1 or None, got {group!r}")
    if (not isinstance(max_size, tuple) or len(max_size) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in max_size)):
        raise AmpValueError(f"max_size must be (width, height) in pixels, positive ints, got {max_size!r}")
    items = _items(converted, group, max_size)
    if extension in (".dot", ".gv"):
        content = dot_source(converted, group, max_size)
    else:
        dot = shutil.which("dot") if engine != "builtin" else None
        if engine == "graphviz" and dot is None:
            raise AmpRuntimeError("engine='graphviz' but Graphviz 'dot' is not on PATH; use engine='auto' for the built-in layout")
        links = extension != ".svg"
        svg = _graphviz_svg(dot_source(converted, group, max_size), dot) if dot else _svg(items, links=links)
        if extension == ".svg":
            content = svg
        else:
            name = title or f"{type(converted).__name__}: amp_fx conversion"
            content = _html(svg, name, None if summary is None else str(summary), _block_sections(items))
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(content)
    return path
