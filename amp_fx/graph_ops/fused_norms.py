"""Fused norm kernels that keep fp32 precision forward and backward without casting their input.

:func:`layer_norm_fp32_stats` is an affine ``layer_norm`` for a low-precision
input with fp32 weight and bias.  Its forward is CPU's mixed-dtype kernel
(statistics and affine transform in fp32, one rounding to the input's dtype:
what the cast form's cast back gives).  Its backward is the cast form's own
math -- ``native_layer_norm_backward`` on the fp32 upcast of the saved low
input -- because CPU's mixed-dtype backward accumulates the weight and bias
gradients in the low dtype (~1% relative error on 256x1024 bf16, against
~1e-7 for the cast form).  Saved for backward: the low input, not an fp32
copy of it (half the memory of the cast form).

``passes/fuse_precision`` retargets fused affine ``layer_norm`` nodes to it;
generated code imports it from here (a registered fx builtin).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch.fx import Proxy
from torch.fx.graph import _register_custom_builtin

from amp_fx.graph_ops.casts import _record

__all__ = ["layer_norm_fp32_stats", "LayerNormFp32Stats"]


def _fp32(stat: torch.Tensor) -> torch.Tensor:
    """``stat`` as fp32, through ``_to_copy`` itself: ``.float()`` would make torch.export assert the traced dtype."""
    return torch.ops.aten._to_copy.default(stat, dtype=torch.float32)


class LayerNormFp32Stats(torch.autograd.Function):
    """Affine layer_norm of a low input with fp32 weight/bias: mixed-dtype forward, fp32 (cast form) backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, normalized_shape: Sequence[int], weight: Optional[torch.Tensor],
                bias: Optional[torch.Tensor], eps: float) -> torch.Tensor:
        if weight is None and bias is None and x.dtype in (torch.bfloat16, torch.float16):
            # Without fp32 weights CPU runs its all-low kernel, whose statistics come back rounded to the low
            # dtype (the backward then reads a rounded rstd: 1.15x the cast form's input-gradient error).
            # An identity affine in fp32 selects the mixed kernel: the same output, fp32 statistics.
            ones = torch.ones(normalized_shape, dtype=torch.float32, device=x.device)
            out, mean, rstd = torch.native_layer_norm(x, normalized_shape, ones, torch.zeros_like(ones), eps)
        else:
            out, mean, rstd = torch.native_layer_norm(x, normalized_shape, weight, bias, eps)
        # The CPU kernel returns fp32 statistics; the meta kernel says the input's dtype.  The copy makes traced
        # graphs (fake runs, AOT, export) agree with the real kernel; it costs one (rows,)-sized copy each.
        ctx.save_for_backward(x, _fp32(mean), _fp32(rstd), weight, bias)
        ctx.normalized_shape = tuple(normalized_shape)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, mean, rstd, weight, bias = ctx.saved_tensors
        needs_x, _, needs_w, needs_b, _ = ctx.needs_input_grad
        mask = [needs_x, needs_w and weight is not None, needs_b and bias is not None]
        if not any(mask):
            return None, None, None, None, None
        # Exactly the cast form: an fp32 layer_norm backward on the fp32 values of the low input and gradient.
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(
            grad.float(), x.float(), ctx.normalized_shape, mean, rstd, weight, bias, mask)
        return (dx.to(x.dtype) if dx is not None else None), None, dw, db, None


def layer_norm_fp32_stats(input: torch.Tensor, normalized_shape: Sequence[int], weight: Optional[torch.Tensor] = None,
                          bias: Optional[torch.Tensor] = None, eps: float = 1e-5) -> torch.Tensor:
    """``F.layer_norm`` of a low-precision input with fp32 weight/bias, precise as the cast form (see module docstring).

    Same signature as :func:`torch.nn.functional.layer_norm`, so a graph node
    can be retargeted between the two.  The result has the input's dtype.
    """
    if any(isinstance(a, Proxy) for a in (input, weight, bias)):
        return _record(layer_norm_fp32_stats, (input, normalized_shape, weight, bias, eps), {})
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    return LayerNormFp32Stats.apply(input, tuple(normalized_shape), weight, bias, eps)


# Generated code (print, to_folder, pickles) names it as a builtin imported from this module.
_register_custom_builtin(layer_norm_fp32_stats.__name__, f"from amp_fx.graph_ops.fused_norms import {layer_norm_fp32_stats.__name__}",
                         layer_norm_fp32_stats)
