"""The overflow report: which node broke, how big its value was, and the policy entry that pins it to fp32.

The search in :mod:`amp_fx.inspection.find_overflow` decides *where* the low
graph first went non-finite while its fp32 twin stayed finite; this module
turns that node and its two values into an :class:`OverflowReport`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx

from amp_fx.ir import meta
from amp_fx.ir.cast_nodes import is_inserted_cast
from amp_fx.inspection.twin_run import CALL_OPS
from amp_fx.inspection.values import max_abs, nonfinite_count, value_dtype

__all__ = ["OverflowReport", "pin_override", "pin_targets", "report_at", "overflowed"]


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

    def __str__(self) -> str:
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


def overflowed(low: Any, twin: Any) -> bool:
    """Whether the low value holds inf/NaN while the fp32 twin's is finite: precision, not the model, broke."""
    return nonfinite_count(low) > 0 and nonfinite_count(twin) == 0
