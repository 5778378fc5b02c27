"""CompiledReport: the conversion reports of every graph Dynamo handed the amp_fx backend for one model.

It also keeps what Dynamo did *not* hand over (:class:`DynamoBreak`: frames
it skipped, graph breaks), so that a model that ran in fp32 because of
Dynamo says so (:attr:`CompiledReport.nothing_converted`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from amp_fx.converter.report import ConversionReport, NodeRecord

__all__ = ["CompiledReport", "GraphReport", "DynamoBreak", "publish", "last_published"]

# The ways out when Dynamo leaves nothing to convert; the warning and the report both say them.
FIXES = ("torch._dynamo.explain(model)(*inputs) lists every graph break; amp_fx.convert(model, 'O1', "
         "example_inputs=(...)) converts without Dynamo (the torch.export route)")

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


@dataclass(frozen=True)
class DynamoBreak:
    """Something Dynamo did instead of handing the backend a graph: it skipped a frame or broke its graph.

    ``kind`` is ``"frame skipped"`` (the whole frame ran eagerly), ``"graph
    break"`` (the code around the break ran eagerly) or ``"compile failed"``;
    ``frame`` the function's name, ``where`` its ``file:line``, ``at`` the
    ``file:line`` where Dynamo stopped (None if unknown), ``reason`` Dynamo's
    reason shortened to its titles and explanations, ``hints`` Dynamo's own
    hints, ``compile_id`` Dynamo's compile id (``"frame/recompile"``).
    """

    kind: str
    frame: str
    where: str
    reason: str
    at: Optional[str] = None
    hints: tuple[str, ...] = ()
    compile_id: str = "?"

    def __str__(self) -> str:
        verb = {"frame skipped": "skipped", "graph break": "broke the graph of",
                "compile failed": "failed to compile"}.get(self.kind, self.kind)
        at = f", at {self.at}" if self.at else ""
        return f"Dynamo {verb} {self.frame} ({self.where}{at}) because: {self.reason}"


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
    breaks: list[DynamoBreak] = field(default_factory=list)
    # True once amp_fx's eager mode covers the model's calls: what Dynamo runs eagerly gets the tables' decisions
    # (amp_fx.dynamo.between_graphs); False where it could not be entered, and those ops ran fp32.
    eager_decided: bool = False

    def add(self, compile_id: str, name: str, report: ConversionReport, region: Optional[str] = None) -> None:
        """Record one more converted graph (``region``: the higher-order op whose body it is, if any)."""
        self.graphs.append(GraphReport(compile_id, name, report, region))

    def clear(self) -> None:
        """Forget every graph (``torch._dynamo.reset()`` discards the compiled code they belong to)."""
        self.graphs.clear()
        self.breaks.clear()

    @property
    def low_graphs(self) -> int:
        """How many converted graphs (region bodies included) hold at least one low-precision op."""
        return sum(1 for report in self if report.count("low"))

    @property
    def nothing_converted(self) -> bool:
        """True when Dynamo skipped or broke this model's frames and no graph amp_fx saw holds a low-precision op.

        The model then ran in fp32 because of Dynamo, not because it had
        nothing to convert: a function with no GEMM whose graphs Dynamo
        captured whole is not counted (its ``breaks`` are empty).
        """
        return bool(self.breaks) and self.low_graphs == 0

    def hints(self) -> list[str]:
        """Dynamo's own hints for every skip and break, each once, in order."""
        out: list[str] = []
        for event in self.breaks:
            out.extend(hint for hint in event.hints if hint not in out)
        return out

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
            "notes": list(self.notes), "nothing_converted": self.nothing_converted, "eager_decided": self.eager_decided,
            "breaks": [dataclasses.asdict(event) for event in self.breaks],
            "graphs": [{"compile_id": g.compile_id, "name": g.name, "region": g.region, **g.report.to_dict()}
                       for g in self.graphs],
        }

    def to_json(self, **kwargs: Any) -> str:
        """The report as a JSON string."""
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        t = self.totals()
        lines = []
        if self.nothing_converted:
            # Said first: every number below is zero because of it.
            lines.append(f"nothing converted: {self.breaks[0]}")
            if self.eager_decided:
                lines.append("  (it ran eagerly, uncompiled, with amp_fx's eager decisions: see amp_fx.coverage)")
            lines.extend(f"  and: {event}" for event in self.breaks[1:])
            lines.extend(f"  Dynamo's hint: {hint}" for hint in self.hints())
            lines.append(f"  {FIXES}")
        lines += [
            f"amp_fx compiler backend: level {self.level}, dtype {self.dtype}, inner backend {self.inner}, "
            f"{t['graphs']} graph(s)" + (f" + {t['region_bodies']} region bodies" if t["region_bodies"] else ""),
            f"  low {t['low_nodes']} | fp32 {t['fp32_nodes']} | follow {t['follow_nodes']} | promote {t['promote_nodes']} nodes; "
            f"{t['casts_inserted']} casts inserted ({t['weight_casts']} of weights)",
        ]
        lines.extend(f"  note: {n}" for n in self.notes)
        if not self.nothing_converted:
            ran = "eager, amp_fx's eager decisions" if self.eager_decided else "eager (fp32)"
            lines.extend(f"  {ran}: {event}" for event in self.breaks)
        for index, graph in enumerate(self.graphs):
            lines.append(f"-- graph g{index} (compile id {graph.compile_id}, {graph.name})")
            lines.extend("  " + line for line in str(graph.report).splitlines())
        return "\n".join(lines)

    __repr__ = __str__


# The report of the model compiled (or recompiled, or skipped by Dynamo) last.
_LAST: list[Optional[CompiledReport]] = [None]


def publish(report: CompiledReport) -> None:
    """Make ``report`` the one :func:`amp_fx.last_report` returns."""
    _LAST[0] = report


def last_published() -> Optional[CompiledReport]:
    """The report :func:`publish` was given last, or None."""
    return _LAST[0]
