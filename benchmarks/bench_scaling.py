"""How ``amp_fx.convert`` time grows with model size, and what the ``torch.export`` route costs.

- :func:`convert_vs_depth`: a hand-written pre-LN encoder (symbolic tracing)
  at several depths; nodes in the converted graph, seconds, microseconds
  per node.  Flat time per node means conversion is linear in model size.
- :func:`export_route`: the same encoder behind a Python shape check
  (:class:`bench_models.ExportOnly`), so fx cannot trace it and ``convert``
  falls back to ``torch.export`` with example inputs; compares the whole
  ``convert`` with ``torch.export.export`` alone.

Each figure is the best of ``tries`` runs: the machine's noise only ever
adds time, so the minimum is the closest to the work itself.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

import amp_fx
from bench_models import Encoder, ExportOnly

__all__ = ["convert_vs_depth", "export_route", "best_of"]


def best_of(fn: Callable[[], object], tries: int) -> tuple[float, object]:
    """Smallest wall time of ``tries`` calls of ``fn``, and the last result."""
    best, result = float("inf"), None
    for _ in range(tries):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def convert_vs_depth(depths: list[int], width: int = 128, heads: int = 4, level: str = "O1", tries: int = 2,
                     dtype: torch.dtype = torch.bfloat16) -> list[tuple]:
    """Rows of (layers, nodes, convert seconds, microseconds per node) for a symbolic encoder."""
    rows = []
    for depth in depths:
        torch.manual_seed(0)
        model = Encoder(width, heads, depth)
        seconds, gm = best_of(lambda: amp_fx.convert(model, level, dtype=dtype), tries)
        nodes = len(gm.graph.nodes)
        rows.append((depth, nodes, seconds, seconds / nodes * 1e6))
        del model, gm
    return rows


def export_route(layers: int = 6, width: int = 128, heads: int = 4, batch: int = 2, seq: int = 16, tries: int = 3,
                 level: str = "O1", dtype: torch.dtype = torch.bfloat16) -> dict:
    """Seconds of ``torch.export.export`` alone and of ``convert`` on the export route, and their ratio."""
    torch.manual_seed(0)
    model = ExportOnly(Encoder(width, heads, layers))
    inputs = (torch.randn(batch, seq, width), torch.randint(0, 10, (batch,)))
    export_s = convert_s = float("inf")
    for _ in range(tries):  # interleaved, so a slow spell of the machine hits both
        seconds, _ = best_of(lambda: torch.export.export(model, inputs, strict=False), 1)
        export_s = min(export_s, seconds)
        seconds, gm = best_of(lambda: amp_fx.convert(model, level, dtype=dtype, example_inputs=inputs), 1)
        convert_s = min(convert_s, seconds)
    route = getattr(gm.amp_report, "route", None)
    return {"layers": layers, "nodes": len(gm.graph.nodes), "export_s": export_s, "convert_s": convert_s,
            "ratio": convert_s / export_s, "route": route}
