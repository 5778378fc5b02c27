"""``cache_casts="training"``: at O1 each weight is cast once per optimizer step under gradient accumulation.

The cache (amp_fx/graph_ops/cast_cache.py) serves one low copy per parameter version across training forwards;
each use is its own autograd node, so every micro-batch's backward reaches the fp32 weight.  Tests: casts per step
counted with a dispatch mode, a cache never stale (optimizer steps, fused and foreach included, load_state_dict,
in-place writes under no_grad), gradients and training equal to the uncached form bit for bit, the copies freed at
the step.  The inference scope (``cache_casts=True``) is tested in test_cast_cache.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_fx
from cast_cache_probes import MODELS, ParamCasts, _mlp
from amp_fx.errors import AmpTypeError
from amp_fx.graph_ops.cast_cache import cached_cast, cast_cache_bytes, cast_cache_size
from amp_fx.passes.cache_weight_casts import cache_weight_casts
from pass_check import check

K = 4  # micro-batches per optimizer step


def _loss(out):
    return out.float().square().mean()


def _convert(model, scope):
    return amp_fx.convert(model, "O1", dtype=torch.bfloat16, cache_casts=scope)


@pytest.mark.parametrize("name", list(MODELS))
def test_each_weight_is_cast_once_per_optimizer_step_and_the_copies_are_freed_at_the_step(name):
    build, make = MODELS[name]
    model = build()
    plain_model = copy.deepcopy(model)
    gm, plain = _convert(model, "training"), _convert(plain_model, False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
    plain_opt = torch.optim.SGD(plain_model.parameters(), lr=0.1, momentum=0.9, foreach=True)
    batches = [make(4) for _ in range(K)]
    with ParamCasts(plain_model.parameters()) as probe:
        _loss(plain(batches[0])).backward()
    per_forward = probe.count  # the uncached form casts every cast weight in every forward
    plain_opt.zero_grad()
    low_bytes = {"mlp": 2 * sum(p.numel() for n, p in model.named_parameters() if not n.startswith("3.")),
                 "gpt": 2 * sum(p.numel() for n, p in model.named_parameters() if not n.startswith("ln."))}[name]
    assert per_forward > 0
    for _ in range(2):
        counts = []
        for x in batches:
            with ParamCasts(model.parameters()) as probe:
                _loss(gm(x)).backward()
            counts.append(probe.count)
        assert counts == [per_forward] + [0] * (K - 1), counts
        # One low copy per cast weight, held until the step (2 bytes per element of bf16)
        assert cast_cache_size() == per_forward and cast_cache_bytes() == low_bytes
        opt.step()
        assert cast_cache_size() == 0 and cast_cache_bytes() == 0  # freed at the step
        opt.zero_grad()
    with ParamCasts(plain_model.parameters()) as probe:
        for x in batches:
            _loss(plain(x)).backward()
    assert probe.count == K * per_forward  # what the cache saves: K - 1 casts per weight per step


@pytest.mark.parametrize("name", list(MODELS))
def test_gradients_and_training_equal_the_uncached_form_bit_for_bit(name):
    """Both sides run the same kernels on the same inputs: the cached copy is the very cast ``w.to(bf16)`` makes,
    the GEMMs get the same bf16 operands, the backward's ``grad.to(float32)`` is ToCopyBackward's own kernel,
    AccumulateGrad adds the micro-batches in the same order, and both SGDs are ``foreach=True``."""
    build, make = MODELS[name]
    model = build()
    plain_model = copy.deepcopy(model)
    gm, plain = _convert(model, "training"), _convert(plain_model, False)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, foreach=True)
    plain_opt = torch.optim.SGD(plain_model.parameters(), lr=0.5, momentum=0.9, foreach=True)
    for step in range(3):
        for _ in range(K):
            x = make(4)
            loss, plain_loss = _loss(gm(x)) / K, _loss(plain(x)) / K
            assert torch.equal(loss, plain_loss)
            loss.backward()
            plain_loss.backward()
        for (n, p), q in zip(model.named_parameters(), plain_model.parameters()):
            assert p.grad is not None and torch.equal(p.grad, q.grad), (step, n)
        opt.step()
        plain_opt.step()
        opt.zero_grad()
        plain_opt.zero_grad()
    for p, q in zip(model.parameters(), plain_model.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("name", list(MODELS))
def test_forwards_whose_backward_runs_in_one_pass_add_their_gradients_in_fp32(name):
    """Two forwards, then one backward of both losses (a siamese or real/fake pair): the cached cast's node is lent
    to the first use only, the second gets its own, so each use's low gradient is cast up on its own and the fp32
    sums equal the uncached form's bit for bit (same kernels); micro-batches after it still get one cast per step."""
    build, make = MODELS[name]
    model = build()
    plain_model = copy.deepcopy(model)
    gm, plain = _convert(model, "training"), _convert(plain_model, False)
    for module in (gm, plain):
        torch.manual_seed(1)
        a, b = make(4), make(4)
        (_loss(module(a)) + 2 * _loss(module(b))).backward()
        for _ in range(2):
            _loss(module(make(4))).backward()
    for p, q in zip(model.parameters(), plain_model.parameters()):
        assert p.grad is not None and torch.equal(p.grad, q.grad)
    with ParamCasts(model.parameters()) as probe:
        _loss(gm(make(4))).backward()
    assert probe.count == 0


def test_double_backward_through_a_served_cast_equals_the_uncached_form():
    """A gradient penalty differentiates the input gradient again: the saved low weight must still lead to the fp32
    weight.  Same kernels on both sides (as above), so bit for bit."""
    model = _mlp()
    plain_model = copy.deepcopy(model)
    gm, plain = _convert(model, "training"), _convert(plain_model, False)
    for module in (gm, gm, plain, plain):  # twice each: the second forward is served from the cache
        torch.manual_seed(1)
        x = torch.randn(4, 16, requires_grad=True)
        (grad_x,) = torch.autograd.grad(_loss(module(x)), x, create_graph=True)
        grad_x.square().sum().backward()
    for p, q in zip(model.parameters(), plain_model.parameters()):
        assert p.grad is not None and torch.equal(p.grad, q.grad)


def _optimizer(kind, model):
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.5)
    if kind == "sgd_fused":
        return torch.optim.SGD(model.parameters(), lr=0.5, fused=True)
    if kind == "adamw_fused":
        return torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    return torch.optim.AdamW(model.parameters(), lr=0.05, foreach=True)


@pytest.mark.parametrize("change", ["sgd", "sgd_fused", "adamw_foreach", "adamw_fused", "load_state_dict", "no_grad_mul"])
def test_the_cache_is_never_stale_after_a_change(change):
    """After any change to the weights, the next forward equals a fresh uncached conversion's bit for bit (same
    kernels).  torch's fused CPU steps update in place without bumping ``_version`` (torch 2.13): the optimizer
    step hook is what catches them."""
    torch.manual_seed(0)
    model = _mlp()
    gm = _convert(model, "training")
    x = torch.randn(8, 16)
    for _ in range(2):  # the second forward is served from the cache
        before = gm(x)
        _loss(before).backward()
    if change == "load_state_dict":
        gm.load_state_dict({k: v * 0.5 for k, v in model.state_dict().items()})
    elif change == "no_grad_mul":
        with torch.no_grad():
            model[0].weight.mul_(2)
    else:
        _optimizer(change, model).step()
    after = gm(x)
    with torch.no_grad():
        fresh = _convert(model, False)(x)
    assert not torch.equal(after.detach(), before.detach())
    assert torch.equal(after.detach(), fresh)


def test_eval_forwards_between_micro_batches_are_served_the_same_copy():
    model = _mlp()
    gm = _convert(model, "training")
    x = torch.randn(4, 16)
    _loss(gm(x)).backward()
    with torch.no_grad(), ParamCasts(model.parameters()) as probe:
        evaluated = gm(x)
    assert probe.count == 0
    with ParamCasts(model.parameters()) as probe:
        trained = gm(x)
    assert probe.count == 0 and torch.equal(trained.detach(), evaluated)


def test_a_write_through_data_is_the_documented_hazard_until_clear_cast_cache():
    """``p.data.add_()`` bumps no version and no optimizer stepped: the old copy is served (README, cast_cache's
    docstring); ``gm.clear_cast_cache()`` makes the next forward a fresh conversion's, bit for bit."""
    model = _mlp()
    gm = _convert(model, "training")
    x = torch.randn(4, 16)
    before = gm(x).detach()
    for i in (0, 2, 4):  # the Linear weights: cast (the LayerNorm's run fp32 in its fused kernel, uncast)
        model[i].weight.data.add_(0.25)
    assert torch.equal(gm(x).detach(), before)  # stale, as documented
    gm.clear_cast_cache()
    with torch.no_grad():
        assert torch.equal(gm(x), _convert(model, False)(x))


def test_option_values_and_report():
    with pytest.raises(AmpTypeError, match="'training'"):
        amp_fx.convert(_mlp(), "O1", cache_casts="train")
    gm = _convert(_mlp(), "training")
    assert "one cast per optimizer step" in str(gm.amp_report)
    casts = [n for n in gm.graph.nodes if n.target is cached_cast]
    assert len(casts) == 6 and all(n.kwargs == {"training": True} for n in casts)
    inference = _convert(_mlp(), True)
    assert all(n.kwargs == {} for n in inference.graph.nodes if n.target is cached_cast)
    x = torch.randn(2, 16)
    with ParamCasts(inference.parameters()) as probe:
        inference(x)
        inference(x)
    assert probe.count == 2 * len(casts)  # the inference scope: training forwards cast every time


def test_compiled_training_casts_in_the_graph_and_matches_eager():
    model = _mlp()
    plain_model = copy.deepcopy(model)
    compiled = torch.compile(_convert(model, "training"), backend="eager")
    plain = _convert(plain_model, False)
    x = torch.randn(4, 16)
    _loss(compiled(x)).backward()
    _loss(plain(x)).backward()
    assert cast_cache_size() == 0  # traced as plain casts
    for p, q in zip(model.parameters(), plain_model.parameters()):
        assert torch.equal(p.grad, q.grad)


class Checkpointed(nn.Module):
    """A checkpointed block: its backward recomputes the forward, served casts included."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(lambda t: F.gelu(self.fc1(t)), x, use_reentrant=False)
        return self.fc2(h)


def test_checkpointed_regions_and_the_pass_contract():
    """The pass contract on the training scope (outputs and gradients against fp32, idempotent, lint clean), and a
    checkpointed block whose recomputation is served the cached copy: gradients equal the uncached form bit for bit
    (same kernels, as above)."""
    x = torch.randn(2, 16)
    gm = check(cache_weight_casts, _mlp(), (x,), example_inputs=(x,), cache_casts="training", delta=0,
               expect_modified=True)
    assert sum(n.target is cached_cast and n.kwargs == {"training": True} for n in gm.graph.nodes) == 6
    model = Checkpointed()
    plain_model = copy.deepcopy(model)
    gm, plain = _convert(model, "training"), _convert(plain_model, False)
    for _ in range(2):
        x = torch.randn(4, 16)
        _loss(gm(x)).backward()
        _loss(plain(x)).backward()
    for p, q in zip(model.parameters(), plain_model.parameters()):
        assert torch.equal(p.grad, q.grad)
