"""Repaint: a policy's ``"fp8"`` paints its nodes ``low``; ``passes/fp8_gemms.py`` later makes their eligible GEMMs fp8.

``"fp8"`` is a policy decision (``{"module:mlp": "fp8"}``, ``{"op:linear": "fp8"}``):
the GEMMs it covers run in fp8 where ``can_fp8`` allows, whatever their size,
and every other op it covers runs low.  Until ``fp8_gemms`` rewrites them,
after the casts are final, those GEMMs are plain low GEMMs -- what
``insert_casts``, ``minimize_casts`` and the dtype analysis understand.  The
rule's reason stays on the node (``policy module 'mlp' -> fp8``), which is
how ``fp8_gemms`` and the report know it.
"""

from __future__ import annotations

import torch.fx as fx

from amp_fx.ir import meta
from amp_fx.ir.pass_manager import PassContext, PassResult, amp_pass

__all__ = ["paint_fp8"]


@amp_pass(kind="repaint", requires=("meta", "paint"), invalidates=("dtypes",))
def paint_fp8(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Paint a policy's ``"fp8"`` nodes ``low`` (their GEMMs become fp8 in ``fp8_gemms``)."""
    repainted = 0
    for node in gm.graph.nodes:
        if meta.DECISION.get(node) == "fp8":
            meta.DECISION.set(node, "low")
            # fp8_gemms rewrites this reason on every GEMM: "fp8 ..." where it made it fp8, why not where it did not.
            meta.REASON.set(node, f"{meta.REASON.get(node, '')}: low (fp8 applies to its GEMMs)")
            repainted += 1
    return PassResult(gm, repainted > 0, {"repainted": repainted})
