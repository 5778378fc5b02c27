"""The pass pipeline a level asks for, shared by ``convert()`` and the compiler backend.

Every pass runs inside the pass runner (:mod:`amp_fx.ir.pass_manager`):
the level's pipeline, then -- once the report has been read off the graph,
so that it lists a checkpointed region's nodes as if inline -- the passes of
:data:`AFTER_REPORT`, which outline those regions.
"""

from __future__ import annotations

from typing import Optional

import torch.fx as fx

from amp_fx.ir.config import AmpConfig
from amp_fx.ir.pass_manager import AmpPass, PassContext, run_passes
from amp_fx.converter.report import ConversionReport, build_report
from amp_fx.passes.analyse_dtypes import analyse_dtypes
from amp_fx.passes.assign_precision import assign_precision
from amp_fx.passes.cache_weight_casts import cache_weight_casts
from amp_fx.passes.cast_params import cast_params
from amp_fx.passes.dedupe_casts import dedupe_casts
from amp_fx.passes.fold_casts import fold_casts
from amp_fx.passes.fp8_gemms import fp8_gemms
from amp_fx.passes.fuse_precision import fuse_precision
from amp_fx.passes.honour_autocast_regions import honour_autocast_regions
from amp_fx.passes.insert_casts import insert_casts
from amp_fx.passes.minimize_casts import minimize_casts
from amp_fx.passes.outline_checkpoints import outline_checkpoints
from amp_fx.passes.pad_gemm import pad_gemm
from amp_fx.passes.paint_fp8 import paint_fp8
from amp_fx.passes.propagate_meta import propagate_meta
from amp_fx.passes.retarget_dtype_constants import retarget_dtype_constants
from amp_fx.passes.share_cast_grads import share_cast_grads

__all__ = ["build_pipeline", "rewrite_graph", "AFTER_REPORT"]

# Run after the report is read: checkpointed regions move into submodules (the trace's notes go to the report).
AFTER_REPORT: tuple[AmpPass, ...] = (outline_checkpoints,)


def build_pipeline(config: AmpConfig, *, own_params: bool) -> list[AmpPass]:
    """The passes for ``config``: analyses first, then rewrites.

    ``own_params`` says whether the graph module owns its parameters (O2/O3
    under ``convert()``); a compiler backend never does.
    """
    if config.op_mode == "none":
        return [propagate_meta, analyse_dtypes]
    # honour_autocast_regions repaints ops inside a Dynamo graph's own
    # torch.autocast regions; it changes nothing in graphs without them.
    pipeline: list[AmpPass] = [propagate_meta, assign_precision, honour_autocast_regions]
    # A policy's "fp8" paints low; fp8_gemms (below) makes the eligible GEMMs fp8 once the casts are final.
    pipeline.append(paint_fp8)
    if config.cast_params and own_params:
        pipeline.append(cast_params)
    # One dtype analysis of the paint: every later pass, the report and the views read it.
    pipeline.append(analyse_dtypes)
    if config.minimize_casts:
        pipeline.append(minimize_casts)
    if config.fuse_precision:
        # On the final paint: fused norms need no casts, so insert_casts writes none for them.
        pipeline.append(fuse_precision)
    # On the final paint and its analysis, before the casts: finfo(fp32).min read in bf16 becomes finfo(bf16).min.
    pipeline += [retarget_dtype_constants, insert_casts, dedupe_casts, fold_casts]
    # On the final casts: an fp8 GEMM bypasses its operands' low casts (it quantizes what they read).
    pipeline.append(fp8_gemms)
    if config.pad_gemm is not False:
        # "auto" pads on CUDA only; the pass reads the device from the context and says so in the report.
        pipeline.append(pad_gemm)
    pipeline.append(share_cast_grads)  # after the GEMM passes, which look through an operand's cast
    if config.cache_casts:
        # Last: every other pass sees plain casts; inference then reuses each weight's cast.
        pipeline.append(cache_weight_casts)
    return pipeline


def rewrite_graph(gm: fx.GraphModule, ctx: PassContext, *, own_params: bool, notes: Optional[list[str]] = None) -> tuple[fx.GraphModule, ConversionReport]:
    """Run the level's pipeline on ``gm`` (in place), build its report, then run :data:`AFTER_REPORT`."""
    pipeline = build_pipeline(ctx.config, own_params=own_params)
    gm = run_passes(gm, ctx, pipeline)
    report = build_report(gm, level=ctx.config.level, dtype=ctx.low, route=ctx.route, passes=ctx.stats, notes=notes or [])
    # The report's pass table is the pipeline's (build_report copied it); these passes hand the report only notes.
    gm = run_passes(gm, ctx, AFTER_REPORT, recompile=False, first_index=len(pipeline))
    for finishing in AFTER_REPORT:
        report.notes.extend(ctx.stats[finishing.__name__].get("notes", ()))
    return gm, report
