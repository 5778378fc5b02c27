"""Fused norm kernels that keep fp32 precision forward and backward without casting their input.

:func:`layer_norm_fp32_stats` is an affine ``layer_norm`` for a low-precision
input with fp32 weight and bias.  Its forward is CPU's mixed-dtype kernel
(statistics and affine transform in fp32, one rounding to the input's dtype:
what the cast form's cast back gives).  Saved for backward: the low input,
not an fp32 copy of it (half the memory of the cast form).

Backward, two kernels, each the one that is precise for its part:

- the input gradient from CPU's mixed-dtype ``native_layer_norm_backward``
  (low ``grad`` and input, fp32 statistics and weight): computed in fp32 and
  rounded once to the input's dtype, as the cast form's cast back rounds it
  (equal to it but for fp32 summation order), with no cast at all;
- the weight and bias gradients from the fp32 kernel on the fp32 values of
  the low input and gradient (two casts): CPU's mixed kernel accumulates
  them in the low dtype, far less precise than the cast form.  The one
  precise kernel that reads low tensors and accumulates them in fp32,
  ``native_group_norm_backward`` (one group, one element per channel), costs
  more than these two casts, so they stay.

The measured errors and times behind these choices are in docs/performance.md
("Fused norms"); ``tests/passes/test_fuse_precision.py`` asserts the precision.

torch.func: the Function has a ``setup_context`` and a ``vmap`` rule, so
``grad``, ``vjp``, ``vmap`` (per-sample gradients) and their compositions
run it.  Under ``vmap`` with an unbatched weight and bias the batch folds
into the rows (layer_norm normalises the trailing dims only) and this same
Function runs; with batched weights (model ensembles) it runs the cast form.
Forward-mode AD (``jvp``, ``jacfwd``) raises an ``AmpNotImplementedError``
that names the fix: convert with ``fuse_precision=False``.

torch.compile: the Function is no barrier to an inner compiler.  Under Dynamo a subclass without the
``jvp`` runs (Dynamo breaks the graph at a Function that defines one), and AOTAutograd
traces it into ``native_layer_norm``, ``native_layer_norm_backward`` and
``_to_copy`` (aten ops), which inductor decomposes and fuses with their
neighbours as it does autocast's ``layer_norm`` (``tests/dynamo/
test_backend_inner_graph.py``; ``benchmarks/compile_step_time.py --kernels``
compares the generated kernels).

``passes/fuse_precision`` retargets fused affine ``layer_norm`` nodes to it;
generated code imports it from here (a registered fx builtin).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch.fx import Proxy
from torch.fx.graph import _register_custom_builtin

from amp_fx.errors import AmpNotImplementedError
from amp_fx.graph_ops.casts import _record

__all__ = ["layer_norm_fp32_stats", "LayerNormFp32Stats"]


def _fp32(stat: torch.Tensor) -> torch.Tensor:
    """``stat`` as fp32, through ``_to_copy`` itself: ``.float()`` would make torch.export assert the traced dtype."""
    return torch.ops.aten._to_copy.default(stat, dtype=torch.float32)


def _affine(x: torch.Tensor, normalized_shape: tuple, weight: Optional[torch.Tensor],
            bias: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The fp32 weight and bias that select CPU's mixed-dtype kernel: an identity affine where there is none.

    Without fp32 weights CPU runs its all-low kernel, whose statistics come back
    rounded to the low dtype (the backward then reads a rounded rstd: a larger
    input-gradient error than the cast form's), and whose input gradient is computed low.
    """
    if weight is None and bias is None and x.dtype in (torch.bfloat16, torch.float16):
        ones = torch.ones(normalized_shape, dtype=torch.float32, device=x.device)
        return ones, torch.zeros_like(ones)
    return weight, bias


def _wrapped(t: torch.Tensor) -> bool:
    """True for a tensor a torch.func transform wraps (batched, or tracked by an inner ``grad``).

    Under Dynamo, False: it cannot trace the functorch query, and the backward it traces is decomposed by
    AOTAutograd into ops that run on mixed dtypes (a transform around a compiled model wraps the compiled call).
    """
    if torch.compiler.is_compiling():
        return False
    return torch._C._functorch.maybe_get_level(t) != -1


class LayerNormFp32Stats(torch.autograd.Function):
    """Affine layer_norm of a low input with fp32 weight/bias: mixed-dtype forward, fp32-precise backward.

    Outputs ``(out, mean, rstd)``; the statistics are fp32 and not differentiable
    (:func:`layer_norm_fp32_stats` returns ``out``).
    """

    @staticmethod
    def forward(x: torch.Tensor, normalized_shape: tuple, weight: Optional[torch.Tensor],
                bias: Optional[torch.Tensor], eps: float) -> tuple:
        w, b = _affine(x, normalized_shape, weight, bias)
        out, mean, rstd = torch.native_layer_norm(x, normalized_shape, w, b, eps)
        # The CPU kernel returns fp32 statistics; the meta kernel says the input's dtype.  The copy makes traced
        # graphs (fake runs, AOT, export) agree with the real kernel; it costs one (rows,)-sized copy each.
        return out, _fp32(mean), _fp32(rstd)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        x, normalized_shape, weight, bias, _ = inputs
        _, mean, rstd = output
        ctx.save_for_backward(x, mean, rstd, weight, bias)
        ctx.normalized_shape = tuple(normalized_shape)
        ctx.mark_non_differentiable(mean, rstd)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _grad_mean: Any = None, _grad_rstd: Any = None) -> tuple:
        x, mean, rstd, weight, bias = ctx.saved_tensors
        needs_x, _, needs_w, needs_b, _ = ctx.needs_input_grad
        needs_w = needs_w and weight is not None
        needs_b = needs_b and bias is not None
        shape = ctx.normalized_shape
        dx = dw = db = None
        if _wrapped(grad) or _wrapped(x):
            # Under a torch.func transform (vmap's batch rule splits the mixed kernel into ops of mixed dtypes that
            # do not run): the cast form's fp32 backward, one kernel for all three.
            dx, dw, db = torch.ops.aten.native_layer_norm_backward(
                grad.float(), x.float(), shape, mean, rstd, weight, bias, [needs_x, needs_w, needs_b])
            return (dx.to(x.dtype) if dx is not None else None), None, dw, db, None
        if needs_x:
            # Mixed kernel: fp32 math from the low input and gradient, one rounding to x's dtype, no casts.
            w, b = _affine(x, shape, weight, bias)
            dx = torch.ops.aten.native_layer_norm_backward(grad, x, shape, mean, rstd, w, b, [True, False, False])[0]
        if needs_w or needs_b:
            # fp32 kernel on the fp32 values: the weight and bias gradients accumulate in fp32 (see module docstring).
            _, dw, db = torch.ops.aten.native_layer_norm_backward(
                grad.float(), x.float(), shape, mean, rstd, weight, bias, [False, needs_w, needs_b])
        return dx, None, dw, db, None

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        raise AmpNotImplementedError(
            "forward-mode AD (torch.func.jvp, jacfwd, hessian) does not run amp_fx's fused layer_norm "
            "(layer_norm_fp32_stats, written by the fuse_precision pass): convert with fuse_precision=False, "
            "whose cast form forward-mode AD runs, or use reverse mode (grad, vjp, jacrev).")

    @staticmethod
    def vmap(info: Any, in_dims: tuple, x: torch.Tensor, normalized_shape: tuple, weight: Optional[torch.Tensor],
             bias: Optional[torch.Tensor], eps: float) -> tuple:
        x_dim, _, w_dim, b_dim, _ = in_dims
        if w_dim is None and b_dim is None:
            # One weight for the whole batch: the batch is more rows of the same layer_norm.
            moved = x.movedim(x_dim, 0) if x_dim is not None else x.expand(info.batch_size, *x.shape)
            return LayerNormFp32Stats.apply(moved, normalized_shape, weight, bias, eps), (0, 0, 0)
        # A weight per sample (an ensemble): the cast form, whose ops torch.func batches itself.
        batch = info.batch_size

        def per_sample(t: Optional[torch.Tensor], dim: Optional[int]) -> Optional[torch.Tensor]:
            if t is None:
                return None
            return t.movedim(dim, 0) if dim is not None else t.expand(batch, *t.shape)

        xs, ws, bs = per_sample(x, x_dim), per_sample(weight, w_dim), per_sample(bias, b_dim)
        out, mean, rstd = torch.native_layer_norm(xs.float(), normalized_shape, None, None, eps)
        lead = (slice(None),) + (None,) * (xs.dim() - 1 - len(normalized_shape))  # (batch, 1.., *normalized_shape)
        if ws is not None:
            out = out * ws[lead]
        if bs is not None:
            out = out + bs[lead]
        return (out.to(x.dtype), mean, rstd), (0, 0, 0)


class _LayerNormFp32StatsTraced(LayerNormFp32Stats):
    """:class:`LayerNormFp32Stats` as Dynamo traces it: the same forward, backward and vmap, torch's default jvp.

    Dynamo graph-breaks at an ``autograd.Function`` that defines ``jvp`` (even one that only raises), which would
    cut a compiled model into one graph per fused norm, with eager code between them that no inner compiler fuses.
    torch's default jvp refuses forward-mode AD too, with torch's own message.
    """

    jvp = torch.autograd.Function.jvp


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
    function = _LayerNormFp32StatsTraced if torch.compiler.is_compiling() else LayerNormFp32Stats
    return function.apply(input, tuple(normalized_shape), weight, bias, eps)[0]


# Generated code (print, to_folder, pickles) names it as a builtin imported from this module.
_register_custom_builtin(layer_norm_fp32_stats.__name__, f"from amp_fx.graph_ops.fused_norms import {layer_norm_fp32_stats.__name__}",
                         layer_norm_fp32_stats)
