"""Backward through the amp_fx backend: low GEMMs in the AOT backward graph, fp32 grads, loss-scaled training."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

import amp_fx
import zoo
from probes import aot_capture




def _gemms(gm):
    names = ("mm", "addmm", "bmm")
    return [n for n in gm.graph.nodes if n.op == "call_function" and getattr(n.target, "_opname", None) in names]


def test_backward_gemms_run_low_and_param_grads_are_fp32():
    """The backward of every low forward GEMM is a low GEMM; parameter gradients arrive in fp32, close to fp32's."""
    inner, fw, bw = aot_capture()
    model, (x,), _ = zoo.build("mlp")
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend=amp_fx.backend(inner=inner))
    compiled(x).float().square().mean().backward()
    reference(x).square().mean().backward()
    (forward,), (backward,) = fw, bw
    assert len(_gemms(forward)) == 3 and all(n.meta["val"].dtype == torch.bfloat16 for n in _gemms(forward))
    # 3 Linear layers: grad of input for fc2/head, grad of weight for all three
    assert len(_gemms(backward)) == 5
    for gemm in _gemms(backward):
        assert [a.meta["val"].dtype for a in gemm.args if hasattr(a, "meta")] == [torch.bfloat16] * 2, gemm.name
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        assert param.grad.dtype == torch.float32, name
        torch.testing.assert_close(param.grad, ref.grad, atol=2e-2, rtol=5e-2)


def _train(model, steps, data, scaler_dtype):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = amp_fx.LossScaler(dtype=scaler_dtype, init_scale=2.0**10, growth_interval=5)
    losses = []
    for x, y in data[:steps]:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    return losses, scaler


def test_loss_scaled_training_matches_eager_converted_module():
    """20 fp16 steps with LossScaler: backend=amp_fx and the eager convert()ed module end with the same weights."""
    torch.manual_seed(0)
    model, _, _ = zoo.build("mlp")
    eager_model = copy.deepcopy(model)
    data = [(torch.randn(8, 16), torch.randint(0, 8, (8,))) for _ in range(20)]
    compiled = torch.compile(model, backend=amp_fx.backend(dtype=torch.float16, inner="aot_eager"))
    converted = amp_fx.convert(eager_model, level="O1", dtype=torch.float16)
    compiled_losses, compiled_scaler = _train(compiled, 20, data, torch.float16)
    eager_losses, eager_scaler = _train(converted, 20, data, torch.float16)
    assert compiled_scaler.get_scale() == eager_scaler.get_scale() > 1.0  # the scale really grew: scaling was on
    assert compiled_losses[-1] < compiled_losses[0]
    torch.testing.assert_close(torch.tensor(compiled_losses), torch.tensor(eager_losses), atol=5e-3, rtol=5e-3)
    for (name, p), q in zip(model.named_parameters(), eager_model.parameters()):
        assert p.dtype == torch.float32
        torch.testing.assert_close(p, q, atol=2e-3, rtol=2e-3, msg=name)
