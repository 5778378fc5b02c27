"""The fp8 passes under the pass contract (tests/pass_check.py, after torch's test_cse_pass).

Rules under test: ``fp8_gemms`` rewrites each chosen GEMM in place (its
operands' low casts go, a state read and a bias add come), reports
``modified`` honestly, lints, and changes nothing when run again;
``paint_fp8`` repaints a policy's ``"fp8"`` low and nothing else; the
result stays near the fp32 model, forward and gradients.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from amp_fx.ir import meta
from amp_fx.passes.fp8_gemms import fp8_gemms
from amp_fx.passes.paint_fp8 import paint_fp8
from pass_check import check

# Output error bound vs fp32: each e4m3 operand is off by at most u4 = 2**-4 relative (3 mantissa bits, round to
# nearest), so |error| <= (2*u4 + u4**2) * sum_k |x_k||w_k| (plus bf16's far smaller roundings); for these 32- and
# 64-wide layers (default init, randn input) that sum stays under 0.8: atol 0.15.  A wrong scale or transpose is off
# by O(1).  Gradients (grad_output in e5m2) are checked element by element below, against their own bound.
ATOL = 0.15
U4, U5, U_BF16 = 2.0 ** -4, 2.0 ** -3, 2.0 ** -8


def _mlp():
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))


def test_fp8_gemms_contract():
    """Two biased Linears at O1: -3 casts (input, 2 weights), +2 state reads, +2 bias adds."""
    x = torch.randn(4, 32)
    gm = check(fp8_gemms, _mlp(), (x,), delta=1, expect_modified=True, example_inputs=(x,),
               fp8={"size_rule": "all"}, atol=ATOL, grads=False)
    assert [meta.DECISION.get(n) for n in gm.graph.nodes if meta.OP.get(n) == "fp8_linear"] == ["fp8", "fp8"]


def test_fp8_gemms_without_fp8_changes_nothing():
    x = torch.randn(4, 32)
    check(fp8_gemms, _mlp(), (x,), delta=0, expect_modified=False, example_inputs=(x,))


def test_paint_fp8_contract():
    """A policy's 'fp8' on one module: its nodes painted low, the graph untouched."""
    x = torch.randn(4, 32)
    gm = check(paint_fp8, _mlp(), (x,), delta=0, expect_modified=True, example_inputs=(x,),
               policy={"module:0": "fp8"}, finish=True, atol=ATOL, grads=False)
    ops = {meta.OP.get(n): meta.DECISION.get(n) for n in gm.graph.nodes}
    assert ops["fp8_linear"] == "fp8"  # after the rest of the pipeline: module 0's GEMM is fp8
    assert "linear" in ops  # module 2's stays a bf16 linear


def test_gradients_within_the_fp8_bound_of_fp32():
    """One Linear at O1: every gradient element within the bound its two quantized operands explain.

    grad_input[m, k] = sum_n g[m, n] w[n, k] with g in e5m2 (after the output's bf16 cast back) and w in e4m3:
    |error| <= (U5 + U4 + U5*U4 + U_BF16) * sum_n |g||w|; grad_weight likewise with x in e4m3 instead of w.
    """
    model = nn.Linear(32, 48, bias=False)
    x = torch.randn(8, 32, requires_grad=True)
    g = torch.linspace(-1, 1, 8 * 48).view(8, 48)
    import amp_fx

    gm = amp_fx.convert(model, "O1", example_inputs=(x,), fp8={"size_rule": "all"})
    x8 = x.detach().clone().requires_grad_()
    (gm(x8) * g).sum().backward()
    grad_w8, grad_x8 = model.weight.grad.clone(), x8.grad
    model.weight.grad = None
    (model(x) * g).sum().backward()
    rel = U5 + U4 + U5 * U4 + U_BF16
    w = model.weight.detach()
    assert ((grad_x8 - x.grad).abs() <= rel * (g.abs() @ w.abs()) + 1e-6).all()
    assert ((grad_w8 - model.weight.grad).abs() <= rel * (g.abs().t() @ x.detach().abs()) + 1e-6).all()
    assert not torch.equal(grad_w8, model.weight.grad)  # fp8 did run
