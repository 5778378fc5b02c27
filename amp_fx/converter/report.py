"""ConversionReport: what was decided for every node, and why, plus per-pass stats."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx

from amp_fx.ir.cast_nodes import is_inserted_cast
from amp_fx.ir.cast_costs import cast_bytes
from amp_fx.ir import meta
from amp_fx.ir.meta import float_dtype
from amp_fx.errors import AmpKeyError, did_you_mean

__all__ = ["ConversionReport", "NodeRecord", "build_report"]

_COMPUTE_DECISIONS = ("low", "fp32", "follow", "promote")


def _dtype_name(dtype: Optional[torch.dtype]) -> Optional[str]:
    return None if dtype is None else str(dtype).replace("torch.", "")


def _node_dtype(node: fx.Node) -> Optional[str]:
    """The dtype column: a value's dtype, or "bfloat16 if floating" where the analysis does not know it is floating.

    A guarded cast (``amp_cast``) of an input of unknown dtype casts only floating
    tensors: integer ids pass through it unchanged.
    """
    name = _dtype_name(float_dtype(node))
    if name is not None and meta.is_float(node) is not True and meta.INSERTED.get(node):
        return f"{name} if floating"
    return name


@dataclass
class NodeRecord:
    """One node of the rewritten graph: what it is, where it came from, what was decided."""

    name: str
    op: Optional[str]
    module: str
    decision: str
    reason: str
    rule: str
    dtype: Optional[str]
    source: Optional[str] = None
    inserted: bool = False
    cast_bytes: Optional[int] = None


@dataclass
class ConversionReport:
    """Every decision of one conversion; ``str()`` is a table, ``to_dict()`` is JSON-ready."""

    level: str
    dtype: str
    route: str
    nodes: list[NodeRecord] = field(default_factory=list)
    passes: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    # -- totals -----------------------------------------------------------
    def count(self, decision: str) -> int:
        """Number of original nodes with ``decision``."""
        return sum(1 for r in self.nodes if r.decision == decision and not r.inserted)

    @property
    def casts(self) -> list[NodeRecord]:
        """The casts amp_fx inserted (the model's own casts are not counted)."""
        return [r for r in self.nodes if r.inserted and r.decision == "cast" and r.op == "to"]

    @property
    def weight_casts(self) -> int:
        """Casts of parameters and buffers."""
        return sum(1 for r in self.casts if "weight cast" in r.reason)

    @property
    def cast_bytes(self) -> Optional[int]:
        """Bytes the inserted casts read and write per forward (None when shapes are unknown)."""
        sizes = [r.cast_bytes for r in self.casts]
        return None if not sizes or any(s is None for s in sizes) else sum(sizes)

    @property
    def unknown_ops(self) -> dict[str, int]:
        """Ops in no table, with how often each occurs."""
        out: dict[str, int] = {}
        for r in self.nodes:
            if r.rule == "unknown":
                out[r.op or "?"] = out.get(r.op or "?", 0) + 1
        return out

    def totals(self) -> dict[str, Any]:
        """Headline numbers: decisions, casts, weight casts, cast bytes, unknown ops."""
        return {
            **{f"{d}_nodes": self.count(d) for d in _COMPUTE_DECISIONS},
            "casts_inserted": len(self.casts),
            "weight_casts": self.weight_casts,
            "cast_bytes_per_forward": self.cast_bytes,
            "unknown_ops": self.unknown_ops,
        }

    def node(self, name: str) -> NodeRecord:
        """The record of the node called ``name``."""
        for record in self.nodes:
            if record.name == name:
                return record
        names = [record.name for record in self.nodes]
        raise AmpKeyError(
            f"no node {name!r} in the report.{did_you_mean(str(name), names)} Names are those of the rewritten "
            f"graph's nodes ({len(names)} here: [r.name for r in report.nodes] lists them, print(report) shows them)."
        )

    # -- output -----------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (``json.dumps(report.to_dict())`` works)."""
        return {
            "level": self.level, "dtype": self.dtype, "route": self.route,
            "totals": self.totals(), "notes": list(self.notes),
            "passes": json.loads(json.dumps(self.passes, default=str)),
            "nodes": [asdict(r) for r in self.nodes],
        }

    def to_json(self, **kwargs: Any) -> str:
        """The report as a JSON string."""
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ConversionReport":
        """Rebuild a report from :meth:`to_dict` output."""
        return cls(level=data["level"], dtype=data["dtype"], route=data["route"],
                   nodes=[NodeRecord(**r) for r in data["nodes"]], passes=data.get("passes", {}),
                   notes=list(data.get("notes", [])))

    def __str__(self) -> str:
        t = self.totals()
        lines = [
            f"amp_fx conversion: level {self.level}, dtype {self.dtype}, traced with {self.route}",
            f"  low {t['low_nodes']} | fp32 {t['fp32_nodes']} | follow {t['follow_nodes']} | promote {t['promote_nodes']}"
            + (f" | fp8 {self.count('fp8')}" if self.count("fp8") else "") + " nodes; "
            f"{t['casts_inserted']} casts inserted ({t['weight_casts']} of weights)"
            + (f", {t['cast_bytes_per_forward']} cast bytes per forward" if t["cast_bytes_per_forward"] is not None else ""),
        ]
        if t["unknown_ops"]:
            lines.append(f"  unknown ops (in no table: decided by the level or on_unknown_op; each row says how): {t['unknown_ops']}")
        lines.extend(f"  note: {n}" for n in self.notes)
        # A pass may add lines of its own (minimize_casts' cast bytes, pad_gemm's shapes).
        lines.extend(f"  {name}: {line}" for name, stats in self.passes.items() for line in stats.get("report_lines", ()))
        rows = [("node", "op", "module", "decision", "dtype", "reason")]
        rows += [(r.name, r.op or "", r.module or "", r.decision, r.dtype or "?", r.reason)
                 for r in self.nodes if r.decision not in ("none",)]
        widths = [min(max(len(str(row[i])) for row in rows), 32) for i in range(5)]
        for row in rows:
            lines.append("  " + "  ".join(str(c)[:w].ljust(w) for c, w in zip(row[:5], widths)) + "  " + row[5])
        return "\n".join(lines)

    __repr__ = __str__


def build_report(gm: fx.GraphModule, *, level: str, dtype: torch.dtype, route: str, passes: dict, notes: list[str] = ()) -> ConversionReport:
    """Read the rewritten graph's annotations into a :class:`ConversionReport`."""
    records = []
    for node in gm.graph.nodes:
        inserted = bool(meta.INSERTED.get(node))
        reason = meta.REASON.get(node, "")
        if inserted and meta.WEIGHT_CAST.get(node) and "weight cast" not in reason:
            reason = f"{reason} (weight cast)"
        # pad_gemm's padded weight casts are casts too: the padded copy is the cast copy.
        is_cast = is_inserted_cast(node) or (inserted and meta.CAST_OF.get(node) is not None)
        records.append(NodeRecord(
            name=node.name,
            op=meta.OP.get(node) if not is_cast else "to",
            module=meta.MODULE_PATH.get(node, ""),
            decision=meta.DECISION.get(node, "none"),
            reason=reason,
            rule=meta.RULE.get(node, "inserted" if inserted else ""),
            dtype=_node_dtype(node),
            source=meta.SOURCE.get(node),
            inserted=inserted,
            cast_bytes=cast_bytes(node) if is_cast else None,
        ))
    return ConversionReport(level=level, dtype=_dtype_name(dtype), route=route, nodes=records,
                            passes=dict(passes), notes=list(notes))
