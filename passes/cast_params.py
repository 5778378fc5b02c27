"""Rewrite: give an O2/O3 module low-precision parameters and buffers, once.

At O2 and O3 the converted module owns low-precision copies of the model's
floating parameters and buffers (``convert`` hands this pass a copy, so the
user's model keeps its fp32 tensors, which become the fp32 masters at O2).
Under ``keep_batchnorm_fp32`` the parameters and statistics of
normalisation ops stay fp32.  Which tensors belong to a norm is read from
the graph (the tensors a norm node consumes, or the whole leaf module it
calls), so it works on symbolic and ``torch.export`` graphs alike.

Records ``ctx.source_dtypes``: state-dict key -> original dtype,
so ``state_dict()`` can hand back the model's dtypes.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.node import map_arg

from amp_fx.core.pass_manager import PassContext, PassResult
from amp_fx.core.tables import NORM_OPS

__all__ = ["cast_params", "norm_tensor_names"]


def norm_tensor_names(gm: fx.GraphModule) -> set[str]:
    """Names of the parameters and buffers that normalisation ops consume."""
    names: set[str] = set()
    for node in gm.graph.nodes:
        if node.meta.get("amp_fx.op") not in NORM_OPS:
            continue
        if node.op == "call_module":
            module = gm.get_submodule(str(node.target))
            prefix = f"{node.target}."
            names.update(prefix + n for n, _ in module.named_parameters())
            names.update(prefix + n for n, _ in module.named_buffers())
        map_arg((node.args, node.kwargs), lambda n: names.add(n.meta["amp_fx.param"]) if n.meta.get("amp_fx.param") else None)
    return names


def cast_params(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Cast floating parameters and buffers to the low dtype (norms kept fp32 when asked)."""
    low = ctx.low
    keep = norm_tensor_names(gm) if ctx.config.keep_batchnorm_fp32 else set()
    # read only by the model's autocast(enabled=False) regions (honour_autocast_regions marks them): stay fp32
    keep |= {n.meta["amp_fx.param"] for n in gm.graph.nodes if n.meta.get("amp_fx.keep_fp32") and n.meta.get("amp_fx.param")}
    source_dtypes = ctx.source_dtypes
    cast = 0
    kept_float64 = []
    for name, tensor in list(gm.named_parameters()) + list(gm.named_buffers()):
        if tensor.dtype == torch.float64:  # never cast, as autocast never casts float64
            kept_float64.append(name)
            continue
        if not tensor.is_floating_point() or tensor.dtype == low or name in keep:
            continue
        source_dtypes.setdefault(name, tensor.dtype)
        tensor.data = tensor.data.to(low)
        cast += 1
    for node in gm.graph.nodes:
        name = node.meta.get("amp_fx.param")
        if node.op == "get_attr" and name and node.meta.get("amp_fx.is_float"):
            attr = gm
            for atom in name.split("."):
                attr = getattr(attr, atom)
            node.meta["amp_fx.orig_dtype"] = attr.dtype
            if attr.dtype != getattr(node.meta.get("val"), "dtype", attr.dtype):
                del node.meta["val"]  # a stale fp32 example value would make a later run cast it again
    return PassResult(gm, cast > 0, {"tensors_cast": cast, "kept_fp32": len(keep), "kept_float64": kept_float64})
