"""Analysis: every value's dtype, shape and aliasing in the rewritten program (see :mod:`amp_fx.ir.analysis`).

Runs once the paint exists (after ``assign_precision``, the region passes
and ``cast_params``); ``minimize_casts`` analyses again if it repaints.
Nodes that could not be fake-run are listed in the report with the reason;
their readers' casts are guarded at run time.
"""

from __future__ import annotations

import torch.fx as fx

from amp_fx.ir.analysis import analyse
from amp_fx.ir.pass_manager import PassContext, PassResult

__all__ = ["analyse_dtypes"]


def analyse_dtypes(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Store the dtype analysis of the current paint on every node; never changes the graph."""
    analysis = analyse(gm, ctx)
    stats = {"mode": "fake" if analysis.fake_mode else "dtype-only", "unknown": dict(analysis.unknown)}
    if analysis.unknown:
        listed = "; ".join(f"{name} ({reason})" for name, reason in list(analysis.unknown.items())[:8])
        more = f" and {len(analysis.unknown) - 8} more" if len(analysis.unknown) > 8 else ""
        stats["report_lines"] = [f"could not fake-run {len(analysis.unknown)} node(s), their readers' casts are guarded "
                                 f"at run time: {listed}{more}"]
    return PassResult(gm, False, stats)
