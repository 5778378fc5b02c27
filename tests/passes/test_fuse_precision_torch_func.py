"""layer_norm_fp32_stats under torch.func: its vmap rule and its backward under a transform (issue 24, item 3).

The model-level tests (functional_call, per-sample gradients against fp32
and autocast at O1 and O2) are in tests/integrations/test_torch_func.py;
these check the function itself against its own eager results.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch
from torch.func import grad, vmap

from amp_fx.graph_ops.fused_norms import layer_norm_fp32_stats

BF16_ULP = 2 ** -7  # spacing of bf16 values in [1, 2)


def _ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |got - want| in bf16 ulps at the tensor's largest magnitude."""
    return ((got.float() - want.float()).abs().max() / (BF16_ULP * want.float().abs().max())).item()


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def _inputs(affine: bool):
    torch.manual_seed(0)
    x = (torch.randn(3, 6, 64) * 2 + 0.5).bfloat16()  # vmapped over dim 1: 6 samples of (3, 64)
    w = torch.rand(64) + 0.5 if affine else None
    b = torch.randn(64) * 0.1 if affine else None
    return x, w, b


@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
def test_vmap_forward_is_the_unbatched_call_per_sample(affine):
    """vmap over a middle dim folds the batch into rows of the same kernel: each sample's output is bit for bit
    the unbatched call's (every row is normalised on its own)."""
    x, w, b = _inputs(affine)
    batched = vmap(lambda xi: layer_norm_fp32_stats(xi, (64,), w, b, 1e-5), in_dims=1, out_dims=1)(x)
    assert batched.dtype == torch.bfloat16 and batched.shape == x.shape
    for i in range(x.shape[1]):
        assert torch.equal(batched[:, i], layer_norm_fp32_stats(x[:, i], (64,), w, b, 1e-5))


@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
def test_per_sample_gradients_equal_the_eager_backward(affine):
    """vmap(grad): per-sample input gradients within 1 bf16 ulp of each sample's eager backward (the mixed kernel
    there, the cast form's fp32 kernel under the transform: the same math, another fp32 summation order), and
    weight/bias gradients within 1e-5 relative (fp32 sums of the same products)."""
    x, w, b = _inputs(affine)
    g = torch.randn(3, 6, 64).bfloat16()

    def loss(x_i: torch.Tensor, g_i: torch.Tensor, w_: Optional[torch.Tensor], b_: Optional[torch.Tensor]):
        return (layer_norm_fp32_stats(x_i, (64,), w_, b_, 1e-5).float() * g_i.float()).sum()

    argnums = (0, 2, 3) if affine else (0,)
    per_sample = vmap(grad(loss, argnums=argnums), in_dims=(1, 1, None, None))(x, g, w, b)
    for i in range(x.shape[1]):
        leaves = [x[:, i].clone().requires_grad_()] + ([w.clone().requires_grad_(), b.clone().requires_grad_()] if affine else [])
        out = layer_norm_fp32_stats(leaves[0], (64,), *(leaves[1:] if affine else (None, None)), 1e-5)
        out.backward(g[:, i])
        assert per_sample[0][i].dtype == torch.bfloat16
        assert _ulps(per_sample[0][i], leaves[0].grad) <= 1.0, i
        for got, leaf in zip(per_sample[1:], leaves[1:]):
            assert got[i].dtype == torch.float32 and _rel(got[i], leaf.grad) < 1e-5, i


def test_per_member_weights_run_the_cast_form():
    """vmap over weights too (an ensemble): the cast form, within 1 bf16 ulp of each member's fused call."""
    x, w, b = _inputs(True)
    ws, bs = torch.stack([w, 2 * w]), torch.stack([b, -b])
    out = vmap(lambda w_, b_: layer_norm_fp32_stats(x, (64,), w_, b_, 1e-5))(ws, bs)
    for i in range(2):
        assert out[i].dtype == torch.bfloat16 and _ulps(out[i], layer_norm_fp32_stats(x, (64,), ws[i], bs[i], 1e-5)) <= 1.0
