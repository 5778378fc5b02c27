"""Analysis: every value's dtype, shape and aliasing in the rewritten program (see :mod:`amp_fx.ir.analysis`).

The pass runner owns the analysis (:mod:`amp_fx.ir.pass_manager`): this
pass requires ``"dtypes"``, so the runner runs the analysis of the paint
just before it, once the paint exists (after ``assign_precision``, the
region passes and ``cast_params``); it runs it again after a pass that
changes the paint (``minimize_casts``, ``fuse_precision``).  This pass
reports what the analysis found: fake or dtype-only mode, and the nodes that
could not be fake-run, listed in the report with the reason (their readers'
casts are guarded at run time).
"""

from __future__ import annotations

import torch.fx as fx

from amp_fx.ir.pass_manager import PassContext, PassResult, amp_pass

__all__ = ["analyse_dtypes"]


@amp_pass(kind="analysis", requires=("meta", "dtypes"))
def analyse_dtypes(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Report the dtype analysis of the current paint, which the runner stored on every node; never changes the graph."""
    analysis = ctx.analysis
    stats = {"mode": "fake" if analysis.fake_mode else "dtype-only", "unknown": dict(analysis.unknown)}
    if analysis.unknown:
        listed = "; ".join(f"{name} ({reason})" for name, reason in list(analysis.unknown.items())[:8])
        more = f" and {len(analysis.unknown) - 8} more" if len(analysis.unknown) > 8 else ""
        stats["report_lines"] = [f"could not fake-run {len(analysis.unknown)} node(s), their readers' casts are guarded "
                                 f"at run time: {listed}{more}"]
    return PassResult(gm, False, stats)
