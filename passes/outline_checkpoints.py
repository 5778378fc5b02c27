"""Rewrite: move each checkpointed region into a submodule run under ``torch.utils.checkpoint``; hand on the trace's notes.

Symbolic tracing inlines ``checkpoint(fn, x)``; the frontend tags the
region's nodes while tracing (:mod:`amp_fx.frontend.checkpoint_regions`),
and the whole pipeline runs on the inlined graph, so a region gets the
decisions and casts it would get without checkpointing.  This pass runs
last, after the report has been read (``amp_fx/converter/pipeline.py``,
``rewrite_graph``), so the report lists a region's nodes as if inline: it
outlines each region with the casts only it reads
(:func:`~amp_fx.frontend.checkpoint_regions.keep_checkpoints`).

It also takes the notes the trace left on the output node (what it fixed or
let through: :mod:`amp_fx.frontend.trace_guards`) and returns them, then one
note per region, as ``stats["notes"]`` for the report.
"""

from __future__ import annotations

import torch.fx as fx

from amp_fx.frontend.checkpoint_regions import keep_checkpoints
from amp_fx.frontend.trace_guards import take_trace_notes
from amp_fx.ir.pass_manager import PassContext, PassResult, amp_pass

__all__ = ["outline_checkpoints"]


# The outlined call has no value record (the region's body holds its nodes'): the dtype analysis no longer holds.
@amp_pass(kind="rewrite", invalidates=("dtypes",))
def outline_checkpoints(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Outline the checkpointed regions of ``gm`` (in place); return the trace's notes and one per region."""
    notes = take_trace_notes(gm)
    traced = len(notes)
    keep_checkpoints(gm, notes)
    regions = len(notes) - traced
    return PassResult(gm, regions > 0, {"regions": regions, "notes": notes})
