"""torch.func over converted modules: functional_call, grad and vmap per-sample gradients at O1 and O2 (issue 24, item 3).

The fused layer_norm (``fuse_precision``, on by default) is an autograd
Function with a ``setup_context`` and a ``vmap`` rule; ``fuse_precision=False``
runs the cast form, plain ops.  At O2 ``functional_call`` with the fp32 masters
runs the graph on their low copies, cast in the call, and the gradients reach
the fp32 tensors.

Bounds.  Every GEMM runs in bf16 (unit roundoff u = 2**-8) on both amp_fx and
autocast, with fp32 accumulation; a gradient here passes through three GEMM
roundings and the norm's one, so each side is within about 4u of fp32 in norm
per tensor.  The tests allow 4u = 2**-6 (1.6%) against fp32, and against
autocast twice that (both sides' errors add).  autocast runs CPU's layer_norm
in bf16 with its mixed kernel, whose weight and bias gradients accumulate in
bf16 (about 2% off on wide layers, less on these 32 columns), which the 2**-5
bound against autocast covers; amp_fx's fp32 norm is the closer one to fp32,
and the tests check that too.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

import amp_fx
from amp_fx.errors import AmpNotImplementedError
from amp_fx.graph_ops.fused_norms import layer_norm_fp32_stats

U = 2 ** -8  # bf16 unit roundoff
TO_FP32 = 4 * U
TO_AUTOCAST = 8 * U


class Net(nn.Module):
    """Linear, GELU, LayerNorm, Linear, GELU, LayerNorm, Linear: the benchmark MLP's pattern, small."""

    def __init__(self):
        super().__init__()
        self.fc1, self.ln1 = nn.Linear(16, 32), nn.LayerNorm(32)
        self.fc2, self.ln2 = nn.Linear(32, 32), nn.LayerNorm(32)
        self.head = nn.Linear(32, 4)
        with torch.no_grad():  # non-trivial affines, so their gradients carry the norm's math
            for ln in (self.ln1, self.ln2):
                ln.weight.uniform_(0.5, 1.5)
                ln.bias.uniform_(-0.2, 0.2)

    def forward(self, x):
        x = self.ln1(F.gelu(self.fc1(x)))
        return self.head(self.ln2(F.gelu(self.fc2(x))))


def _setup(level: str, fuse: bool):
    torch.manual_seed(0)
    model = Net()
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    gm = amp_fx.convert(model, level, dtype=torch.bfloat16, example_inputs=(x,), fuse_precision=fuse)
    fused = [n for n in gm.graph.nodes if n.target is layer_norm_fp32_stats]
    assert len(fused) == (2 if fuse else 0)  # the test runs the form it names
    return model, gm, x, y


def _loss(module, params, x, y):
    return F.cross_entropy(functional_call(module, params, (x,)).float(), y)


def _per_sample(module, params, x, y):
    """vmap over the batch of grad of one sample's loss: per-sample gradients, name -> (batch, *shape)."""
    one = lambda p, xi, yi: _loss(module, p, xi[None], yi[None])
    return vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)


def _reference_per_sample(model, x, y, autocast: bool):
    """Per-sample gradients of the fp32 model, one backward per sample, in fp32 or under torch.autocast."""
    out = {name: [] for name, _ in model.named_parameters()}
    for i in range(len(x)):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = F.cross_entropy(model(x[i:i + 1]).float(), y[i:i + 1])
        loss.backward()
        for name, p in model.named_parameters():
            out[name].append(p.grad.clone())
    model.zero_grad(set_to_none=True)
    return {name: torch.stack(g) for name, g in out.items()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-wise relative difference of each sample's gradient, the largest over the batch."""
    a, b = a.double().flatten(1), b.double().flatten(1)
    return ((a - b).norm(dim=1) / b.norm(dim=1).clamp_min(1e-30)).max().item()


def _params(level: str, model: nn.Module, gm: nn.Module) -> dict:
    """What a user differentiates: the converted module's own parameters at O1, the fp32 masters at O2."""
    source = model if level == "O2" else gm
    return {name: p.detach() for name, p in source.named_parameters()}


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "cast-form"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_vmap_per_sample_gradients_against_fp32_and_autocast(level, fuse):
    """Per-sample gradients (vmap of grad) are fp32 tensors within 4u of fp32's and 8u of autocast's, for every parameter."""
    model, gm, x, y = _setup(level, fuse)
    ours = _per_sample(gm, _params(level, model, gm), x, y)
    fp32 = _reference_per_sample(copy.deepcopy(model), x, y, autocast=False)
    autocast = _reference_per_sample(copy.deepcopy(model), x, y, autocast=True)
    assert set(ours) == set(fp32)
    for name, g in ours.items():
        assert g.dtype == torch.float32 and g.shape == fp32[name].shape, name
        assert torch.isfinite(g).all(), name
        assert _rel(g, fp32[name]) <= TO_FP32, (name, _rel(g, fp32[name]))
        assert _rel(g, autocast[name]) <= TO_AUTOCAST, (name, _rel(g, autocast[name]))
    # The norms' affine gradients are where the fp32 norm shows: never further from fp32 than autocast's bf16 norm,
    # beyond one bf16 rounding of slack for the shared GEMMs upstream.
    for name in ("ln1.weight", "ln2.weight", "ln1.bias", "ln2.bias"):
        assert _rel(ours[name], fp32[name]) <= _rel(autocast[name], fp32[name]) + U, name


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "cast-form"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_grad_of_the_batch_loss_against_autocast(level, fuse):
    """torch.func.grad of the batch loss: within 4u of fp32's gradients and 8u of autocast's, and the mean of the
    per-sample gradients (other GEMM shapes, so other bf16 roundings: both within 4u of fp32, so within 8u)."""
    model, gm, x, y = _setup(level, fuse)
    params = _params(level, model, gm)
    ours = grad(lambda p: _loss(gm, p, x, y))(params)
    references = {}
    for autocast in (False, True):
        reference = copy.deepcopy(model)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = F.cross_entropy(reference(x).float(), y)
        loss.backward()
        references[autocast] = {n: p.grad for n, p in reference.named_parameters()}
    summed = {n: g.sum(0) / len(x) for n, g in _per_sample(gm, params, x, y).items()}  # mean loss: the average
    for name, g in ours.items():
        assert g.dtype == torch.float32, name
        assert _rel(g[None], references[False][name][None]) <= TO_FP32, name
        assert _rel(g[None], references[True][name][None]) <= TO_AUTOCAST, name
        assert _rel(g[None], summed[name][None]) <= 2 * TO_FP32, name


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "cast-form"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_functional_call_runs_the_given_tensors_and_leaves_the_module_as_it_was(level, fuse):
    """functional_call with the module's own values gives gm(x) bit for bit (the same kernels); with other values
    it computes with them (at O2 fp32 values run as their bf16 roundings: equal to passing those); afterwards the
    module holds its own tensors again, and the gradients reach the tensors passed, in their dtype."""
    model, gm, x, _ = _setup(level, fuse)
    own = {n: p for n, p in gm.named_parameters()}
    expected = gm(x)
    assert torch.equal(functional_call(gm, _params(level, model, gm), (x,)), expected)
    scaled = {n: (2 * p).requires_grad_() for n, p in _params(level, model, gm).items()}
    out = functional_call(gm, scaled, (x,))
    assert not torch.equal(out, expected)
    rounded = {n: p.detach().to(own[n].dtype) for n, p in scaled.items()}
    assert torch.equal(functional_call(gm, rounded, (x,)), out)
    assert all(p is own[n] for n, p in gm.named_parameters())  # the module's own tensors are back
    assert torch.equal(gm(x), expected)
    out.float().square().sum().backward()
    for name, p in scaled.items():
        assert p.grad is not None and p.grad.dtype == p.dtype and torch.isfinite(p.grad).all(), name
    assert all(p.grad is None for p in gm.parameters())  # nothing leaked onto the module's own tensors


def test_vmap_over_an_ensemble_runs_each_member_as_its_own_call():
    """vmap over stacked parameters (a weight per member: the fused norm's cast-form rule): each member's output
    equals its own functional_call within 1 bf16 ulp (2u relative; the cast form rounds where the fused one does)."""
    model, gm, x, _ = _setup("O1", True)
    members = [{n: p.detach() * s for n, p in gm.named_parameters()} for s in (1.0, 0.5)]
    stacked = {n: torch.stack([m[n] for m in members]) for n in members[0]}
    out = vmap(lambda p: functional_call(gm, p, (x,)))(stacked)
    for i, member in enumerate(members):
        single = functional_call(gm, member, (x,))
        assert out[i].dtype == single.dtype
        torch.testing.assert_close(out[i].float(), single.float(), rtol=2 * U, atol=2 * U * single.abs().max().item())


def test_forward_mode_ad_names_the_fix():
    """jvp over the fused layer_norm raises an AmpError naming fuse_precision=False; the cast form runs it."""
    _, gm, x, _ = _setup("O1", True)
    with pytest.raises(AmpNotImplementedError, match="fuse_precision=False"):
        torch.func.jvp(gm, (x,), (torch.ones_like(x),))
    _, cast_form, _, _ = _setup("O1", False)
    out, tangent = torch.func.jvp(cast_form, (x,), (torch.ones_like(x),))
    assert tangent.shape == out.shape and torch.isfinite(tangent).all()
