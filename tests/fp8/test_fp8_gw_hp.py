"""Recipe ``rowwise_with_gw_hp`` bit for bit against torchao 0.18's ``Float8LinearConfig.from_recipe_name("rowwise_with_gw_hp")``.

Rule under test: forward as rowwise (e4m3, power-of-two row scales, fast accumulation); grad_input from a
rowwise e4m3 grad_output and a tensorwise power-of-two e4m3 weight; grad_weight a plain high-precision GEMM.
Both sides run the same kernels (``torch._scaled_mm`` or, emulated, an fp32 ``mm``) on the same operands, so
the output, the input gradient and every parameter gradient are ``torch.equal`` on any CPU.
"""

from __future__ import annotations

import pytest
import torch

import amp_fx
from fp8_models import MLP, Block, fp8_everywhere, run, torchao_model


def _assert_same(ours, theirs):
    for a, b in zip(ours[:2], theirs[:2]):
        assert torch.equal(a, b), (a - b).abs().max()
    assert ours[2].keys() == theirs[2].keys()
    for name, grad in ours[2].items():
        assert grad is not None and torch.equal(grad, theirs[2][name]), name


@pytest.mark.parametrize("emulate", [False, True])
@pytest.mark.parametrize("level", ["O1", "O3"])
def test_bf16_mlp_matches_torchao_gw_hp(emulate, level):
    """A bf16 MLP: both Linears rowwise_with_gw_hp, every value equal to torchao's."""
    torch.manual_seed(0)
    model = MLP().bfloat16()
    x = torch.randn(2, 8, 32, dtype=torch.bfloat16)
    grad = torch.randn(2, 8, 32)
    gm = amp_fx.convert(model, level, example_inputs=(x,), fp8=fp8_everywhere("rowwise_with_gw_hp", emulate))
    assert gm.amp_report.count("fp8") == 2
    _assert_same(run(gm, x, grad), run(torchao_model(model, "rowwise_with_gw_hp", emulate), x, grad))


@pytest.mark.parametrize("emulate", [False, True])
def test_bf16_block_matches_torchao_gw_hp(emulate):
    """A bf16 transformer block at O3: its four Linears rowwise_with_gw_hp, equal to torchao's."""
    torch.manual_seed(1)
    model = Block().bfloat16()
    x = torch.randn(2, 16, 32, dtype=torch.bfloat16)
    grad = torch.randn(2, 16, 32)
    gm = amp_fx.convert(model, "O3", example_inputs=(x,), fp8=fp8_everywhere("rowwise_with_gw_hp", emulate))
    assert gm.amp_report.count("fp8") == 4
    _assert_same(run(gm, x, grad), run(torchao_model(model, "rowwise_with_gw_hp", emulate), x, grad))


def test_gw_hp_weight_gradient_is_the_high_precision_gemm():
    """The weight gradient is exactly grad_out.t() @ x in bf16 (not quantized), unlike rowwise's, which differs."""
    torch.manual_seed(2)
    model = torch.nn.Linear(32, 48, bias=False).bfloat16()
    x = torch.randn(16, 32, dtype=torch.bfloat16)
    g = torch.randn(16, 48, dtype=torch.bfloat16)
    grads = {}
    for recipe in ("rowwise_with_gw_hp", "rowwise"):
        gm = amp_fx.convert(model, "O3", example_inputs=(x,), fp8=fp8_everywhere(recipe, False))
        gm(x).backward(g)
        grads[recipe] = gm.weight.grad.clone()
    assert torch.equal(grads["rowwise_with_gw_hp"], torch.mm(g.t(), x))
    assert not torch.equal(grads["rowwise"], torch.mm(g.t(), x))


def test_gw_hp_fp32_linear_at_o1_weight_grad_is_fp32_gemm():
    """An fp32 Linear at O1: the weight gradient is the fp32 GEMM of bf16(grad_output) and the fp32 input."""
    torch.manual_seed(3)
    model = torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(8, 64)
    gm = amp_fx.convert(model, "O1", example_inputs=(x,), fp8=fp8_everywhere("rowwise_with_gw_hp", False))
    out = gm(x)  # fp32 again at the graph's output (O1 keeps the model's output dtype); bf16 inside
    g = torch.randn(8, 32)
    out.backward(g)
    assert gm.weight.grad.dtype == torch.float32
    assert torch.equal(gm.weight.grad, torch.mm(g.bfloat16().float().t(), x))
