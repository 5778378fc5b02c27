"""CompiledReport: the conversion reports of every graph Dynamo handed the amp_fx backend for one model."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from amp_fx.core.report import ConversionReport, NodeRecord

__all__ = ["CompiledReport", "GraphReport"]

_SUMMED = ("low_nodes", "fp32_nodes", "follow_nodes", "promote_nodes", "casts_inserted", "weight_casts")


@dataclass
class GraphReport:
    """One converted graph: Dynamo's compile id (``"frame/recompile"``), its code name, its report.

    ``region`` names the higher-order op (``"tag_activation_checkpoint"``,
    ``"invoke_subgraph"``, ...) when the graph is the body of one; None for
    a graph Dynamo captured.
    """

    compile_id: str
    name: str
    report: ConversionReport
    region: Optional[str] = None


@dataclass
class CompiledReport:
    """All graphs one compiled model was split into (graph breaks) or recompiled as, with combined totals.

    ``graphs`` holds a :class:`GraphReport` per converted graph, in compile
    order; ``report[i]`` is the i-th graph's :class:`ConversionReport`;
    ``totals()`` adds the per-graph totals up; ``nodes`` lists every node
    record with its node name prefixed by the graph's index (``"g1:linear"``).
    """

    level: str
    dtype: str
    inner: str
    graphs: list[GraphReport] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, compile_id: str, name: str, report: ConversionReport, region: Optional[str] = None) -> None:
        """Record one more converted graph (``region``: the higher-order op whose body it is, if any)."""
        self.graphs.append(GraphReport(compile_id, name, report, region))

    def clear(self) -> None:
        """Forget every graph (``torch._dynamo.reset()`` discards the compiled code they belong to)."""
        self.graphs.clear()

    # -- access -----------------------------------------------------------
    def __len__(self) -> int:
        return len(self.graphs)

    def __getitem__(self, index: int) -> ConversionReport:
        return self.graphs[index].report

    def __iter__(self) -> Iterator[ConversionReport]:
        return (graph.report for graph in self.graphs)

    @property
    def reports(self) -> list[ConversionReport]:
        """The per-graph reports, in compile order."""
        return [graph.report for graph in self.graphs]

    @property
    def nodes(self) -> list[NodeRecord]:
        """Every node record of every graph; names carry the graph index (``"g0:linear"``)."""
        out = []
        for index, graph in enumerate(self.graphs):
            for record in graph.report.nodes:
                out.append(NodeRecord(**{**record.__dict__, "name": f"g{index}:{record.name}"}))
        return out

    @property
    def weight_casts(self) -> int:
        """Casts of parameters and buffers, over all graphs."""
        return sum(report.weight_casts for report in self)

    def count(self, decision: str) -> int:
        """Number of original nodes with ``decision``, over all graphs."""
        return sum(report.count(decision) for report in self)

    def totals(self) -> dict[str, Any]:
        """Per-graph totals added up; ``cast_bytes_per_forward`` is None if any graph's is unknown."""
        out: dict[str, Any] = {key: 0 for key in _SUMMED}
        cast_bytes: Optional[int] = 0
        unknown: dict[str, int] = {}
        for report in self:
            totals = report.totals()
            for key in _SUMMED:
                out[key] += totals[key]
            graph_bytes = totals["cast_bytes_per_forward"]
            cast_bytes = None if cast_bytes is None or graph_bytes is None else cast_bytes + graph_bytes
            for op, n in totals["unknown_ops"].items():
                unknown[op] = unknown.get(op, 0) + n
        out["cast_bytes_per_forward"] = cast_bytes if self.graphs else None
        out["unknown_ops"] = unknown
        out["graphs"] = sum(1 for g in self.graphs if g.region is None)
        out["region_bodies"] = len(self.graphs) - out["graphs"]
        return out

    # -- output -----------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form: combined totals plus each graph's report."""
        return {
            "level": self.level, "dtype": self.dtype, "inner": self.inner, "totals": self.totals(),
            "notes": list(self.notes),
            "graphs": [{"compile_id": g.compile_id, "name": g.name, "region": g.region, **g.report.to_dict()}
                       for g in self.graphs],
        }

    def to_json(self, **kwargs: Any) -> str:
        """The report as a JSON string."""
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        t = self.totals()
        lines = [
            f"amp_fx compiler backend: level {self.level}, dtype {self.dtype}, inner backend {self.inner}, "
            f"{t['graphs']} graph(s)" + (f" + {t['region_bodies']} region bodies" if t["region_bodies"] else ""),
            f"  low {t['low_nodes']} | fp32 {t['fp32_nodes']} | follow {t['follow_nodes']} | promote {t['promote_nodes']} nodes; "
            f"{t['casts_inserted']} casts inserted ({t['weight_casts']} of weights)",
        ]
        lines.extend(f"  note: {n}" for n in self.notes)
        for index, graph in enumerate(self.graphs):
            lines.append(f"-- graph g{index} (compile id {graph.compile_id}, {graph.name})")
            lines.extend("  " + line for line in str(graph.report).splitlines())
        return "\n".join(lines)

    __repr__ = __str__
