"""Draw a converted graph coloured by precision: Graphviz where installed, a built-in layout otherwise.

Colours: green runs low, blue runs fp32, orange is a cast, grey follows its
input (its border says which dtype arrived); inputs, parameters and the
output are white.  Labels carry the node, its op, its module path, and its
dtype and shape; hovering a node shows the decision's reason and source line.

``draw(converted, "graph.svg")`` uses Graphviz ``dot`` when it is on PATH and
the built-in layered layout (inline SVG, no dependency) when it is not, so a
file is always written; ``.html`` wraps the picture with a legend (and an
optional summary), ``.dot`` writes the Graphviz source.
"""

from __future__ import annotations

import html
import os
import shutil
import subprocess
from typing import Any, Optional

import torch
import torch.fx as fx

from amp_fx.ir.cast_costs import cast_bytes
from amp_fx.ir import meta
from amp_fx.ir.meta import float_dtype
from amp_fx.errors import AmpRuntimeError, AmpTypeError, AmpValueError

__all__ = ["draw", "dot_source", "builtin_svg", "category", "COLOURS"]

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
_BOX_W, _BOX_H, _GAP_X, _GAP_Y, _MARGIN = 172, 58, 18, 34, 16


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


def _edge_label(node: fx.Node) -> str:
    size = cast_bytes(node) if meta.INSERTED.get(node) and meta.DECISION.get(node) == "cast" else None
    if not size:
        return ""
    return f"{size} B" if size < 1024 else f"{size / 1024:.1f} KB" if size < 1024 ** 2 else f"{size / 1024 ** 2:.1f} MB"


# -- Graphviz -----------------------------------------------------------------------
def _dot_quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def dot_source(converted: fx.GraphModule) -> str:
    """Graphviz DOT source of the converted graph: one cluster per module, nodes coloured by precision."""
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


def _graphviz_svg(source: str, dot: str) -> str:
    done = subprocess.run([dot, "-Tsvg"], input=source, capture_output=True, text=True, timeout=120)
    if done.returncode != 0 or "<svg" not in done.stdout:
        raise AmpRuntimeError(f"Graphviz dot failed (exit {done.returncode}): {done.stderr.strip()[:500]}")
    # Drop the XML prolog and DOCTYPE so the SVG can be inlined in HTML too.
    return done.stdout[done.stdout.index("<svg"):]


# -- the built-in layout --------------------------------------------------------------
def _layers(nodes: list[fx.Node]) -> dict[fx.Node, int]:
    """Layer of every node: longest path from the inputs; parameter chains sit just above their first user."""
    anchored: dict[fx.Node, bool] = {}
    height: dict[fx.Node, int] = {}
    depth: dict[fx.Node, int] = {}
    for node in nodes:
        preds = node.all_input_nodes
        anchored[node] = node.op == "placeholder" or any(anchored[p] for p in preds)
        if not anchored[node]:
            height[node] = 1 + max((height[p] for p in preds), default=-1)
            continue
        depth[node] = max([depth[p] + 1 for p in preds if anchored[p]] + [height[p] + 1 for p in preds if not anchored[p]], default=0)
    for node in reversed(nodes):
        if not anchored[node]:
            users = [depth[u] for u in node.users if u in depth]
            depth[node] = min(users) - 1 if users else height[node]
    return depth


def _order(nodes: list[fx.Node], depth: dict[fx.Node, int]) -> list[list[fx.Node]]:
    """Nodes per layer, ordered by a few barycentre sweeps to cut edge crossings."""
    rows: dict[int, list[fx.Node]] = {}
    for node in nodes:
        rows.setdefault(depth[node], []).append(node)
    layers = [rows[k] for k in sorted(rows)]
    for _ in range(2):
        for sweep in (range(1, len(layers)), range(len(layers) - 2, -1, -1)):
            position = {n: i for row in layers for i, n in enumerate(row)}
            for r in sweep:
                def centre(n: fx.Node) -> float:
                    near = [position[m] for m in (list(n.all_input_nodes) + list(n.users)) if m in position and abs(depth[m] - depth[n]) >= 1]
                    return sum(near) / len(near) if near else position[n]
                layers[r].sort(key=centre)
                position.update({n: i for i, n in enumerate(layers[r])})
    return layers


def _text(x: float, y: float, text: str, cls: str) -> str:
    limit = 27
    shown = text if len(text) <= limit else text[: limit - 1] + "\u2026"
    return f'<text x="{x:.0f}" y="{y:.0f}" class="{cls}">{html.escape(shown)}</text>'


def builtin_svg(converted: fx.GraphModule) -> str:
    """An SVG of the converted graph laid out in layers by depth (no Graphviz needed)."""
    nodes = list(converted.graph.nodes)
    depth = _layers(nodes)
    layers = _order(nodes, depth)
    widest = max(len(row) for row in layers)
    width = 2 * _MARGIN + widest * _BOX_W + (widest - 1) * _GAP_X
    legend_h = 28
    height = 2 * _MARGIN + legend_h + len(layers) * _BOX_H + (len(layers) - 1) * _GAP_Y
    where: dict[fx.Node, tuple[float, float]] = {}
    for r, row in enumerate(layers):
        row_w = len(row) * _BOX_W + (len(row) - 1) * _GAP_X
        x0 = (width - row_w) / 2
        for i, node in enumerate(row):
            where[node] = (x0 + i * (_BOX_W + _GAP_X), _MARGIN + legend_h + r * (_BOX_H + _GAP_Y))
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
    for node in nodes:
        for source in node.all_input_nodes:
            (sx, sy), (tx, ty) = where[source], where[node]
            x1, y1, x2, y2 = sx + _BOX_W / 2, sy + _BOX_H, tx + _BOX_W / 2, ty
            mid = (y1 + y2) / 2
            out.append(f'<path class="e" d="M{x1:.0f},{y1:.0f} C{x1:.0f},{mid:.0f} {x2:.0f},{mid:.0f} {x2:.0f},{y2:.0f}" marker-end="url(#arrow)"/>')
            label = _edge_label(node)
            if label:
                out.append(f'<text x="{x2 + 4:.0f}" y="{y2 - 4:.0f}" class="b">{label}</text>')
    for node in nodes:
        x, y = where[node]
        fill = COLOURS[category(node)][0]
        name, module, dtype = _label(node)
        out.append(f'<g class="node {category(node)}" id="{html.escape(node.name)}"><title>{html.escape(_tooltip(node))}</title>'
                   f'<rect x="{x:.0f}" y="{y:.0f}" width="{_BOX_W}" height="{_BOX_H}" rx="7" fill="{fill}" stroke="{_stroke(node)}" stroke-width="1.5"/>'
                   + _text(x + 8, y + 17, name, "n") + _text(x + 8, y + 33, module, "m") + _text(x + 8, y + 49, dtype, "d") + "</g>")
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _html(svg: str, title: str, summary: Optional[str]) -> str:
    body = f"<pre>{html.escape(summary)}</pre>" if summary else ""
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            "<style>body{font-family:Helvetica,Arial,sans-serif;margin:1.5em}pre{background:#f6f6f6;padding:1em}</style>"
            f"</head><body><h2>{html.escape(title)}</h2>{body}<div class=\"graph\">{svg}</div></body></html>\n")


def draw(converted: fx.GraphModule, path: str, *, engine: str = "auto", title: Optional[str] = None, summary: Any = None) -> str:
    """Write a picture of ``converted`` to ``path`` (.svg, .html or .dot) and return the path.

    ``engine``: ``"auto"`` uses Graphviz ``dot`` when it is on PATH and the
    built-in layout otherwise; ``"graphviz"`` requires ``dot``; ``"builtin"``
    never calls it.  ``summary`` (a :class:`amp_fx.inspection.summary.Summary` or
    text) is printed above the picture in HTML.
    """
    if not isinstance(converted, fx.GraphModule):
        raise AmpTypeError(f"draw expects the converted GraphModule, got {type(converted).__name__}")
    extension = os.path.splitext(path)[1].lower()
    if extension not in (".svg", ".html", ".htm", ".dot", ".gv"):
        raise AmpValueError(f"draw writes .svg, .html or .dot files, not {extension or 'a path without extension'!r}")
    if engine not in ("auto", "graphviz", "builtin"):
        raise AmpValueError(f"engine must be 'auto', 'graphviz' or 'builtin', got {engine!r}")
    if extension in (".dot", ".gv"):
        content = dot_source(converted)
    else:
        dot = shutil.which("dot") if engine != "builtin" else None
        if engine == "graphviz" and dot is None:
            raise AmpRuntimeError("engine='graphviz' but Graphviz 'dot' is not on PATH; use engine='auto' for the built-in layout")
        svg = _graphviz_svg(dot_source(converted), dot) if dot else builtin_svg(converted)
        if extension == ".svg":
            content = svg
        else:
            name = title or f"{type(converted).__name__}: amp_fx conversion"
            content = _html(svg, name, None if summary is None else str(summary))
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(content)
    return path
