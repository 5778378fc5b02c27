"""The overflow report: which node broke, how big its value was, and the policy entry that pins it to fp32.

The search in :mod:`amp_fx.inspection.find_overflow` decides *where* the low
graph first went non-finite while its fp32 twin stayed finite; this module
turns that node and its two values into an :class:`OverflowReport`.  In a
module with fp8 GEMMs every report also carries ``fp8``, the per-GEMM
saturation table of the same run (:class:`~amp_fx.inspection.fp8_view.Fp8Report`),
and a run without inf/NaN reports the first fp8 GEMM that clamped values at
its format's max (:func:`saturation_at`): fp8 saturates silently where fp16
overflows to inf.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx

from amp_fx.ir import meta
from amp_fx.ir.cast_nodes import is_inserted_cast
from amp_fx.inspection.fp8_view import Fp8Report
from amp_fx.inspection.twin_run import CALL_OPS
from amp_fx.inspection.values import max_abs, nonfinite_count, value_dtype

__all__ = ["OverflowReport", "pin_override", "pin_targets", "report_at", "overflowed", "saturation_at"]


def pin_override(node: fx.Node) -> dict[str, str]:
    """The policy entry that pins ``node`` to fp32: its innermost module, else its op."""
    module = meta.MODULE_PATH.get(node) or ""
    if module:
        return {f"module:{module}": "fp32"}
    op = meta.OP.get(node) or str(node.target)
    return {f"op:{op}": "fp32"}


def pin_targets(node: fx.Node) -> list[fx.Node]:
    """The nodes to pin when ``node`` overflowed: a cast's consumers (they asked for low), else the node."""
    if is_inserted_cast(node):
        users = [u for u in node.users if u.op in CALL_OPS and not meta.INSERTED.get(u)]
        return users or [node]
    return [node]


@dataclass
class OverflowReport:
    """Where precision broke: the node, its module and source line, how big the value was, and the fix."""

    phase: str  # "forward" or "backward"
    node: str
    op: Optional[str]
    module: str
    source: Optional[str]
    decision: str
    dtype: Optional[str]
    max_abs: float  # the largest |value| the fp32 twin computed there
    dtype_max: Optional[float]  # the largest finite value of ``dtype``
    nonfinite: int  # inf/NaN elements in the low-precision value
    override: dict[str, str] = field(default_factory=dict)
    pin_nodes: list[str] = field(default_factory=list)
    gradient_of: Optional[str] = None  # backward: the input whose gradient broke
    # backward: the largest power-of-two loss scale under which this gradient fits ``dtype``.
    safe_loss_scale: Optional[float] = None
    kind: str = "overflow"  # "overflow" (inf/NaN) or "fp8 saturation" (an fp8 GEMM clamped at its format's max)
    operand: Optional[str] = None  # fp8 saturation: "input", "weight" or "grad_output"
    saturated: Optional[float] = None  # fp8 saturation: the fraction of that operand's values clamped
    fp8: Optional[Fp8Report] = None  # a module with fp8 GEMMs: every GEMM's saturation in this run

    def __str__(self) -> str:
        if self.kind == "fp8 saturation":
            return self._saturation_text()
        return self._overflow_text() + (f"\n{self.fp8}" if self.fp8 is not None else "")

    def _saturation_text(self) -> str:
        lines = [
            f"{self.phase} fp8 saturation at node {self.node!r} (op {self.op}, module {self.module or '<root>'!r}): "
            f"{self.saturated:.3%} of its {self.operand} clamped at {self.dtype}'s max {self.dtype_max:g} "
            f"(max |x| = {self.max_abs:.4g}, quantized with a scale from earlier steps)",
        ]
        if self.source:
            lines.append(f"  source: {self.source}")
        if self.override:
            lines.append(f"  keep it bf16 with policy={self.override!r}, raise fp8 margin=, or use fp8='tensorwise' "
                         "(current scaling never clamps)")
        if self.fp8 is not None:
            lines.append(str(self.fp8))
        return "\n".join(lines)

    def _overflow_text(self) -> str:
        what = "output" if self.phase == "forward" else f"backward (gradient of its input {self.gradient_of!r})"
        lines = [
            f"{self.phase} overflow at node {self.node!r} (op {self.op}, module {self.module or '<root>'!r}, decision {self.decision})",
            f"  its {what} holds {self.nonfinite} inf/NaN in {self.dtype}; the fp32 twin's is finite with max |x| = {self.max_abs:.4g}"
            + (f" ({self.dtype} max is {self.dtype_max:.4g})" if self.dtype_max else ""),
        ]
        if self.source:
            lines.append(f"  source: {self.source}")
        if self.override:
            lines.append(f"  pin it with policy={self.override!r}" + (f" (pins {', '.join(self.pin_nodes)})" if self.pin_nodes else ""))
        else:
            lines.append("  no policy can pin it: lower the loss scale or cast the model outputs to fp32")
        if self.safe_loss_scale is not None:
            lines.append(f"  a loss scale of {self.safe_loss_scale:g} or less keeps this gradient in range "
                         f"(a gradient is stored in its value's dtype, so pinning only moves an overflow this large upstream)")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        from dataclasses import asdict

        return asdict(self)


def report_at(phase: str, node: fx.Node, low: Any, twin: Any, gradient_of: Optional[str] = None,
              loss_scale: Optional[float] = None) -> OverflowReport:
    """The report for ``node``, whose low value ``low`` overflowed while the twin's ``twin`` did not."""
    dtype = value_dtype(low)
    targets = pin_targets(node) if node.op != "output" else []
    override: dict[str, str] = {}
    for target in targets:
        override.update(pin_override(target))
    biggest, safe = max_abs(twin), None
    if loss_scale is not None and dtype is not None and biggest > 0:
        safe = 2.0 ** math.floor(math.log2(loss_scale * float(torch.finfo(dtype).max) / biggest))
    return OverflowReport(
        phase=phase, node=node.name, op=meta.OP.get(node) or (str(node.target) if node.op != "output" else "output"),
        module=meta.MODULE_PATH.get(node) or "", source=meta.SOURCE.get(node),
        decision=meta.DECISION.get(node, "none"), dtype=str(dtype).replace("torch.", "") if dtype else None,
        max_abs=biggest, dtype_max=float(torch.finfo(dtype).max) if dtype else None,
        nonfinite=nonfinite_count(low), override=override, pin_nodes=[t.name for t in targets], gradient_of=gradient_of,
        safe_loss_scale=safe,
    )


def saturation_at(phase: str, node: fx.Node, operand: str, row: dict[str, Any], dtype: torch.dtype,
                  table: Fp8Report, policy_op: Optional[str] = None) -> OverflowReport:
    """The report for fp8 GEMM ``node`` whose ``operand`` saturated (``row``: its line of ``table``)."""
    module = meta.MODULE_PATH.get(node) or ""
    # "low" keeps the GEMM out of fp8 (its bf16 GEMM cannot clamp); by op when it has no module of its own.
    override = {f"module:{module}": "low"} if module else {f"op:{policy_op or 'linear'}": "low"}
    return OverflowReport(
        phase=phase, node=node.name, op=meta.OP.get(node), module=module, source=meta.SOURCE.get(node),
        decision=meta.DECISION.get(node, "fp8"), dtype=str(dtype).replace("torch.", ""), max_abs=row["amax"],
        dtype_max=float(torch.finfo(dtype).max), nonfinite=0, override=override, pin_nodes=[node.name],
        kind="fp8 saturation", operand=operand, saturated=row["saturated"], fp8=table,
    )


def overflowed(low: Any, twin: Any) -> bool:
    """Whether the low value holds inf/NaN while the fp32 twin's is finite: precision, not the model, broke."""
    return nonfinite_count(low) > 0 and nonfinite_count(twin) == 0
