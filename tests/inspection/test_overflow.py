"""find_overflow names the planted node, forward and backward; diagnose_collapse is what the loss scaler calls."""

import pytest
import torch
import torch.nn as nn

import amp_fx
from amp_fx.inspection.find_overflow import OverflowReport, ReproStep, diagnose_collapse
from planted_models import BigBackward, PlantedAttention

FP16 = torch.float16


def test_forward_names_the_logit_product_and_the_override_fixes_it():
    model, x = PlantedAttention(), torch.randn(2, 4, 16)
    converted = amp_fx.convert(model, "O1", dtype=FP16)
    assert not torch.isfinite(converted(x)).all()  # the plant works: plain O1 fp16 breaks
    report = amp_fx.find_overflow(converted, x)
    assert isinstance(report, OverflowReport)
    assert (report.phase, report.node, report.op, report.module, report.decision) == ("forward", "matmul", "matmul", "logits", "low")
    assert "return q @ kt" in report.source
    with torch.no_grad():
        expected = model.fp32_logits(x).abs().max().item()
    assert expected > 65504 and report.max_abs == pytest.approx(expected, rel=1e-6)
    assert report.dtype == "float16" and report.dtype_max == 65504.0
    assert report.override == {"module:logits": "fp32"} and report.pin_nodes == ["matmul"]
    pinned = amp_fx.convert(model, "O1", dtype=FP16, policy=report.override)
    with torch.no_grad():
        torch.testing.assert_close(pinned(x).float(), model(x), atol=2e-2, rtol=2e-2)
    assert amp_fx.find_overflow(pinned, x) is None


def test_an_overflowing_cast_is_pinned_through_its_consumer():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 4)

        def forward(self, x):
            return self.fc(x.exp())  # exp runs fp32 (deny list); its result no longer fits fp16

    model, x = Scaled(), torch.full((2, 8), 12.0)
    report = amp_fx.find_overflow(amp_fx.convert(model, "O1", dtype=FP16), x)
    assert report.decision == "cast" and report.op == "to"
    assert report.max_abs == pytest.approx(torch.exp(torch.tensor(12.0)).item(), rel=1e-6)
    assert report.pin_nodes == ["linear"] and report.override == {"module:fc": "fp32"}


def test_clean_model_and_bf16_report_nothing_and_leave_state_alone():
    import zoo

    model, example, _ = zoo.build("cnn")
    model.train()
    converted = amp_fx.convert(model, "O1", dtype=FP16)
    stats = model.bn1.running_mean.clone()
    assert amp_fx.find_overflow(converted, *example, backward=True) is None
    assert torch.equal(model.bn1.running_mean, stats)  # both runs' batch-norm updates were undone
    assert all(p.grad is None for p in model.parameters())  # gradients came from autograd.grad, not .backward()
    planted = PlantedAttention()
    assert amp_fx.find_overflow(amp_fx.convert(planted, "O1", dtype=torch.bfloat16), torch.randn(2, 4, 16)) is None


def test_backward_names_the_node_whose_gradient_overflows():
    model, x = BigBackward(), torch.randn(4, 16)
    converted = amp_fx.convert(model, "O1", dtype=FP16)
    assert amp_fx.find_overflow(converted, x, backward=True, loss_scale=1.0) is None
    report = amp_fx.find_overflow(converted, x, backward=True, loss_scale=1024.0)
    assert (report.phase, report.node, report.module, report.gradient_of) == ("backward", "linear_1", "fc2", "relu")
    # The fp32 gradient fc2 sends to its input, computed without amp_fx.
    hidden = torch.relu(model.fc1(x)).detach().requires_grad_()
    (grad,) = torch.autograd.grad(model.fc2(hidden).sum() * 1024.0, hidden)
    assert grad.abs().max().item() > 65504
    assert report.max_abs == pytest.approx(grad.abs().max().item(), rel=1e-3)
    assert report.override == {"module:fc2": "fp32"}
    assert report.safe_loss_scale == 2.0 ** int(torch.log2(torch.tensor(1024.0 * 65504 / report.max_abs)).floor())
    # The suggested scale fixes this gradient; following the suggestions walks the overflow up to fc1, then ends.
    scale, seen = 1024.0, []
    while (found := amp_fx.find_overflow(converted, x, backward=True, loss_scale=scale)) is not None:
        seen.append((found.node, found.module))
        scale = found.safe_loss_scale
    assert seen == [("linear_1", "fc2"), ("linear", "fc1")] and scale >= 1.0


def test_diagnose_collapse_reproduces_the_step_for_the_loss_scaler():
    model, x = BigBackward(), torch.randn(4, 16)
    target = torch.randint(0, 4, (4,))
    converted = amp_fx.convert(model, "O1", dtype=FP16)
    direct = amp_fx.find_overflow(converted, x, target=target, backward=True, loss_scale=4096.0)
    via_step = diagnose_collapse(lambda: ReproStep(converted, (x,), target, torch.nn.functional.cross_entropy), loss_scale=4096.0)
    via_tuple = diagnose_collapse(lambda: (converted, x, target), loss_scale=4096.0)
    assert direct.node == via_step.node == via_tuple.node == "linear_1"
    assert direct.max_abs == pytest.approx(via_step.max_abs) and "loss scale of" in str(via_step)
    with pytest.raises(TypeError, match="ReproStep"):
        diagnose_collapse(lambda: converted)
    with pytest.raises(TypeError, match="amp_fx.convert"):
        amp_fx.find_overflow(model, x)
