"""Step hooks registered on a MasterWeightOptimizer: they force the plain route, see the masters' true gradients,
and a gradient edit they make (of the masters' or of the module's low gradients) is stepped on every route and dtype."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

import amp_fx


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        return self.b(F.relu(self.a(x)))


DATA = [(torch.randn(8, 8, generator=torch.Generator().manual_seed(i)), torch.arange(8) % 4) for i in range(2)]


def build(dtype, **sgd):
    torch.manual_seed(0)
    model = Net()
    gm = amp_fx.convert(model, "O2", dtype=dtype)
    opt = amp_fx.MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, **sgd), gm)
    return model, gm, opt


def train(gm, opt, dtype):
    scaler = amp_fx.LossScaler(dtype=dtype)
    for x, y in DATA:
        opt.zero_grad()
        scaler.scale(F.cross_entropy(gm(x), y)).backward()
        assert scaler.step(opt)
        scaler.update()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_wrapper_hook_sees_the_true_master_gradients_on_the_plain_route(dtype):
    seen = {}
    for where in ("inner", "wrapper", "global"):  # a hook on the inner optimizer always saw the masters' gradients
        model, gm, opt = build(dtype, momentum=0.9)
        grads = []

        def hook(o, args, kwargs):
            if o is not opt.optimizer or where == "inner":  # (a global hook runs for both: count the wrapper's)
                grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])

        if where == "global":
            handle = register_optimizer_step_pre_hook(hook)
        else:
            handle = (opt if where == "wrapper" else opt.optimizer).register_step_pre_hook(hook)
        try:
            train(gm, opt, dtype)
        finally:
            handle.remove()
        assert opt.last_step_route.startswith("optimizer.step (")
        assert len(grads) == 2 and all(len(g) == 4 for g in grads)
        seen[where] = (grads[-1], [p.detach().clone() for p in model.parameters()])
    for where in ("wrapper", "global"):
        for mine, theirs in zip(seen[where][0], seen["inner"][0]):
            assert torch.equal(mine, theirs)  # the same unscaled fp32 gradients, bit for bit
        for mine, theirs in zip(seen[where][1], seen["inner"][1]):
            assert torch.equal(mine, theirs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("target", ["low", "master"])
@pytest.mark.parametrize("sgd", [{}, {"foreach": False}], ids=["fused", "loop"])
def test_gradient_edit_in_wrapper_pre_hook_is_stepped(dtype, target, sgd):
    model, gm, opt = build(dtype, **sgd)
    start = [p.detach().clone() for p in model.parameters()]
    edited = []

    def zero_grads(o, args, kwargs):
        params = gm.parameters() if target == "low" else amp_fx.master_params(o)
        grads = [p.grad for p in params if p.grad is not None]
        for grad in grads:
            grad.zero_()
        edited.append(len(grads))

    opt.register_step_pre_hook(zero_grads)
    train(gm, opt, dtype)
    assert edited == [4, 4]
    for master, before in zip(model.parameters(), start):
        assert torch.equal(master.detach(), before)  # plain SGD on zero gradients does not move


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_gradient_scaled_in_wrapper_pre_hook_scales_the_update(dtype):
    """Halving the low gradients in the hook steps as half the learning rate would (the factor reaches the
    fp32 masters' gradients exactly: a power of two)."""
    model, gm, opt = build(dtype)

    def halve(o, args, kwargs):
        for p in gm.parameters():
            p.grad.mul_(0.5)

    opt.register_step_pre_hook(halve)
    train(gm, opt, dtype)
    ref_model, ref_gm, ref_opt = build(dtype)
    for group in ref_opt.param_groups:
        group["lr"] = 0.05
    train(ref_gm, ref_opt, dtype)
    for mine, theirs in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(mine.detach(), theirs.detach(), rtol=1e-6, atol=1e-7)


def test_skipped_step_runs_no_wrapper_hook_when_the_wrapper_holds_the_scaler():
    model, gm, _ = build(torch.float16)
    scaler = amp_fx.LossScaler(dtype=torch.float16)
    opt = amp_fx.MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), gm, scaler=scaler)
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    x, y = DATA[0]
    opt.zero_grad()
    scaler.scale(F.cross_entropy(gm(x), y) * float("inf")).backward()
    assert opt.step() is False and calls == []
    scaler.update()
    opt.zero_grad()
    scaler.scale(F.cross_entropy(gm(x), y)).backward()
    assert opt.step() is True and calls == ["pre", "post"]


def test_low_gradient_set_by_a_hook_under_fp32_grad_accumulation_is_refused():
    """There the low gradients are freed into the masters': a hook's low gradient could not be carried over."""
    torch.manual_seed(0)
    model = Net()
    gm = amp_fx.convert(model, "O2", dtype=torch.bfloat16)
    opt = amp_fx.MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), gm, fp32_grad_accumulation=True)

    def set_low(o, args, kwargs):
        gm.b.bias.grad = torch.zeros_like(gm.b.bias)

    handle = opt.register_step_pre_hook(set_low)
    x, y = DATA[0]
    F.cross_entropy(gm(x), y).backward()
    with pytest.raises(amp_fx.AmpValueError, match=r"\['b.bias'\].*amp_fx.master_params"):
        opt.step()
    handle.remove()
    gm.b.bias.grad = None
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append(sum(p.grad is not None for p in amp_fx.master_params(o))))
    opt.step()
    assert seen == [4]
