"""fp8 GEMMs bit for bit against torchao's ``convert_to_float8_training`` (0.18) on the same model.

Rule under test: a GEMM amp_fx makes fp8 computes exactly what torchao's
Float8Linear computes -- forward output, input gradient and every parameter
gradient ``torch.equal`` -- for the tensorwise and rowwise recipes, emulated
(fp32 ``mm`` of the dequantized operands) and through ``torch._scaled_mm``
(which this CPU build runs).  Both sides run the same kernels on the same
fp8 operands, so equality holds on any CPU.
"""

from __future__ import annotations

import pytest
import torch

import amp_fx
from fp8_models import MLP, Block, fp8_everywhere, run, torchao_model

RECIPES = [("tensorwise", False), ("tensorwise", True), ("rowwise", False), ("rowwise", True)]


def _assert_same(ours, theirs):
    out, x_grad, grads = ours
    ref_out, ref_x_grad, ref_grads = theirs
    assert torch.equal(out, ref_out), (out - ref_out).abs().max()
    assert torch.equal(x_grad, ref_x_grad), (x_grad - ref_x_grad).abs().max()
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        assert grads[name] is not None, name
        assert torch.equal(grads[name], ref_grads[name]), (name, (grads[name] - ref_grads[name]).abs().max())


@pytest.mark.parametrize("recipe,emulate", RECIPES)
@pytest.mark.parametrize("level", ["O1", "O3"])
def test_bf16_mlp_matches_torchao(recipe, emulate, level):
    """A bf16 MLP at O1 or O3: both Linears fp8, every value equal to torchao's."""
    model = MLP().bfloat16()
    x = torch.randn(2, 8, 32, dtype=torch.bfloat16)
    grad = torch.randn(2, 8, 32)
    gm = amp_fx.convert(model, level, example_inputs=(x,), fp8=fp8_everywhere(recipe, emulate))
    assert gm.amp_report.count("fp8") == 2
    _assert_same(run(gm, x, grad), run(torchao_model(model, recipe, emulate), x, grad))


@pytest.mark.parametrize("recipe,emulate", RECIPES)
def test_bf16_transformer_block_matches_torchao(recipe, emulate):
    """A bf16 transformer block at O3: q/k/v, out and MLP Linears fp8 (attention's matmuls stay bf16, as in torchao)."""
    model = Block().bfloat16()
    x = torch.randn(2, 16, 32, dtype=torch.bfloat16)
    grad = torch.randn(2, 16, 32)
    gm = amp_fx.convert(model, "O3", example_inputs=(x,), fp8=fp8_everywhere(recipe, emulate))
    fp8 = [r.name for r in gm.amp_report.nodes if r.decision == "fp8"]
    assert len(fp8) == 4, gm.amp_report
    _assert_same(run(gm, x, grad), run(torchao_model(model, recipe, emulate), x, grad))


@pytest.mark.parametrize("recipe,emulate", [("tensorwise", False), ("rowwise", False), ("tensorwise", True)])
def test_fp32_model_at_o1_is_torchao_rounded_once(recipe, emulate):
    """An fp32 Linear at O1: amp_fx quantizes the fp32 input and weight as torchao does, and rounds the GEMM's output to bf16.

    The bound: with an upstream gradient that bf16 holds exactly (so both sides quantize the same grad_output),
    the input and weight gradients are equal; the output is torchao's rounded once to bf16 (ours comes out of the
    same kernel in bf16), and the bias adds two roundings: bf16(bias) and the bf16 sum.  With u = 2**-8 (bf16's unit
    roundoff), |ours - torchao| <= u * (|gemm| + |bias| + |ours|), gemm = the bias-free GEMM.  The bias gradient is
    the same sum rounded to bf16 once: |diff| <= u * |torchao's|.
    """
    model = torch.nn.Linear(64, 32)
    x = torch.randn(4, 8, 64)
    grad = torch.randn(4, 8, 32).bfloat16().float()
    gm = amp_fx.convert(model, "O1", example_inputs=(x,), fp8=fp8_everywhere(recipe, emulate))
    ours = run(gm, x, grad)
    theirs = run(torchao_model(model, recipe, emulate), x, grad)
    assert torch.equal(ours[1], theirs[1])
    assert torch.equal(ours[2]["weight"], theirs[2]["weight"])
    u = 2.0 ** -8
    gemm = theirs[0] - model.bias.detach()
    bound = u * (gemm.abs() + model.bias.detach().abs() + ours[0].abs())
    assert ((ours[0] - theirs[0]).abs() <= bound).all()
    assert not torch.equal(ours[0], theirs[0])  # the rounding is there: the bound is not vacuous
    assert ((ours[2]["bias"] - theirs[2]["bias"]).abs() <= u * theirs[2]["bias"].abs()).all()


def test_fp32_mlp_at_o1_gemm_output_rounded_once():
    """Without a bias the forward output of a single fp8 GEMM is exactly torchao's rounded to bf16."""
    model = torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(4, 64)
    gm = amp_fx.convert(model, "O1", example_inputs=(x,), fp8=fp8_everywhere("tensorwise", False))
    ref = torchao_model(model, "tensorwise", False)
    assert torch.equal(gm(x), ref(x).bfloat16().float())


def _upstream_grad(gm, x, loss_fn):
    """(our output, the gradient ``loss_fn`` sends into it, x.grad and the parameters' gradients) of one step."""
    x = x.detach().clone().requires_grad_()
    out = gm(x)
    loss = loss_fn(out)
    (grad,) = torch.autograd.grad(loss, out, retain_graph=True)
    loss.backward()
    return out.detach(), grad, x.grad, {n: p.grad for n, p in gm.named_parameters()}


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp32_linear_cross_entropy_grads_are_torchaos_of_the_bf16_rounded_grad(recipe):
    """An fp32 Linear at O1 under cross_entropy: the gradients are exactly torchao's backward of bf16(grad_output).

    The GEMM's output is bf16 (O1's promise), so the fp32 gradient cross_entropy sends back is rounded to bf16
    at the output cast before the fp8 GEMM quantizes it to e5m2: torchao, on the fp32 model, quantizes the fp32
    gradient directly.  Fed that same bf16-rounded gradient, torchao's input and weight gradients equal ours bit
    for bit; its bias gradient is the same row sum, ours rounded to bf16 once (u = 2**-8).
    """
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 48)
    x, labels = torch.randn(32, 64), torch.randint(0, 48, (32,))
    gm = amp_fx.convert(model, "O1", example_inputs=(x,), fp8=fp8_everywhere(recipe, False))
    _, grad, x_grad, grads = _upstream_grad(gm, x, lambda out: torch.nn.functional.cross_entropy(out, labels))
    assert not torch.equal(grad, grad.bfloat16().float())  # the rounding happens: the claim is not vacuous
    _, ref_x_grad, ref_grads = run(torchao_model(model, recipe, False), x, grad.bfloat16().float())
    assert torch.equal(x_grad, ref_x_grad), (x_grad - ref_x_grad).abs().max()
    assert torch.equal(grads["weight"], ref_grads["weight"])
    assert ((grads["bias"] - ref_grads["bias"]).abs() <= 2.0 ** -8 * ref_grads["bias"].abs()).all()


def test_fp32_linear_grads_within_one_e5m2_step_of_torchaos():
    """With an fp32 grad_output bf16 cannot hold, our gradients are torchao's within the bound derived here.

    Ours quantizes d_a = q(bf16(g)), torchao d_r = q(g), each with its own tensorwise scale s (from its own amax):
    |q(y) - y| <= 2**-3 |y| (e5m2's unit roundoff) + 2**-17 / s (half its smallest subnormal, unscaled), and
    |bf16(g) - g| <= 2**-9 |g|, so |d_a - d_r| <= 2**-3 (|g| + |bf16 g|) + 2**-9 |g| + 2**-17 (1/s_a + 1/s_r).
    Both sides multiply by the same dequantized weight w_q (the fp32 weight, the same scale), accumulating in
    float32 (gamma = K 2**-24 of each side's |d| @ |w_q|): |grad_x_a - grad_x_r| <= |d_a - d_r| @ |w_q| + gamma.
    The weight gradient likewise, with the dequantized input x_q.
    """
    from amp_fx.graph_ops.fp8_ops import E4M3, E5M2, amax_to_scale, quantize

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 48, bias=False)
    x, g = torch.randn(32, 64), torch.randn(32, 48)
    gm = amp_fx.convert(model, "O1", example_inputs=(x,), fp8=fp8_everywhere("tensorwise", False))
    ours = run(gm, x, g)
    theirs = run(torchao_model(model, "tensorwise", False), x, g)

    def dequantized(t, dtype):
        scale = amax_to_scale(t.abs().max(), dtype)
        return quantize(t, scale, dtype).float() / scale, scale

    g16 = g.bfloat16().float()
    (d_a, s_a), (d_r, s_r) = dequantized(g16, E5M2), dequantized(g, E5M2)
    w_q, _ = dequantized(model.weight.detach(), E4M3)
    x_q, _ = dequantized(x, E4M3)
    step = 2.0 ** -3 * (g.abs() + g16.abs()) + 2.0 ** -9 * g.abs() + 2.0 ** -17 * (1 / s_a + 1 / s_r)
    assert ((d_a - d_r).abs() <= step).all()  # the per-element claim itself
    # input gradient: grad_x = d @ w_q
    gamma_x = 48 * 2.0 ** -24 * ((d_a.abs() + d_r.abs()) @ w_q.abs())
    bound_x = step @ w_q.abs() + gamma_x
    assert ((ours[1] - theirs[1]).abs() <= bound_x).all()
    # weight gradient: grad_w = d.t() @ x_q
    gamma_w = 32 * 2.0 ** -24 * ((d_a.abs() + d_r.abs()).t() @ x_q.abs())
    bound_w = step.t() @ x_q.abs() + gamma_w
    assert ((ours[2]["weight"] - theirs[2]["weight"]).abs() <= bound_w).all()
    assert not torch.equal(ours[1], theirs[1])  # they do differ: the bound is what holds
