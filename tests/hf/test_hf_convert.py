"""Hugging Face models through amp_fx.convert (the torch.export route): train, agree with fp32, new shapes (issue 12, point 6)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.export import Dim

import amp_fx
from probes import captured_because
from hf_models import BUILDERS, batch, gpt2


def _train(model, data, steps, level=None):
    """``steps`` AdamW steps on ``data`` (one batch per step); amp_fx.initialize at ``level`` unless None (fp32).

    Returns the trained module, the losses, and the first step's output and gradients (by the model's parameter
    names, taken before the optimizer steps).
    """
    names = {id(p): n for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if level is not None:
        model, optimizer = amp_fx.initialize(model, optimizer, opt_level=level, dtype=torch.bfloat16,
                                             example_kwarg_inputs=data[0])
    losses, first = [], None
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        out = model(**data[step])
        loss = out.loss
        if level is None:
            loss.backward()
        else:
            with amp_fx.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
        if step == 0:
            grads = {names[id(p)]: p.grad.clone() for p in model.parameters() if id(p) in names and p.grad is not None}
            first = (out.loss.detach(), out.logits.detach(), grads)
        optimizer.step()
        losses.append(loss.item())
    return model, losses, first


@pytest.mark.slow
@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_trains_five_steps_like_fp32_and_takes_a_new_sequence_length(kind, level):
    """5 steps with labels= (the HF loss in the graph) track fp32; then a batch of another size and length runs unconverted.

    At O1 the first step also checks the export route's forward and gradients: loss, logits and every parameter's
    gradient agree with fp32 within bf16 tolerance (O1 keeps the fp32 parameters, so the gradients are theirs).
    """
    torch.manual_seed(0)
    model = BUILDERS[kind]()
    reference = copy.deepcopy(model)
    data = [batch(kind, seed=step) for step in range(5)]
    converted, losses, first = _train(model, data, 5, level)
    _, expected, first_expected = _train(reference, data, 5)
    assert isinstance(converted, amp_fx.AmpGraphModule) and converted.amp_report.route == "torch.export"
    if level == "O1":
        _assert_first_step_agrees_with_fp32(converted, first, first_expected, {n for n, _ in reference.named_parameters()})
    weights = {p.dtype for p in converted.parameters()}
    assert weights == ({torch.float32} if level == "O1" else {torch.float32, torch.bfloat16})  # O2: norms stay fp32
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), atol=3e-2, rtol=2e-2)
    assert losses[-1] < losses[0]
    other = batch(kind, size=3, length=11, seed=9)  # batch 3, length 11: no reconversion, no guard failure
    with torch.no_grad():
        out, want = converted(**other), reference(**other)
    assert out.logits.shape == want.logits.shape
    torch.testing.assert_close(out.loss.float(), want.loss, atol=5e-2, rtol=2e-2)
    torch.testing.assert_close(out.logits.float(), want.logits, atol=8e-2, rtol=5e-2)


def _assert_first_step_agrees_with_fp32(converted, first, expected, names):
    """O1 on the export route: the first step's loss, logits and every parameter's gradient agree with fp32."""
    assert converted.amp_report.count("low") >= 8  # the GEMMs of two layers ran low
    (loss, logits, grads), (want_loss, want_logits, want_grads) = first, expected
    torch.testing.assert_close(loss, want_loss, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(logits.float(), want_logits, atol=5e-2, rtol=5e-2)
    assert grads.keys() == want_grads.keys() == names  # every parameter gets a gradient
    for name, grad in grads.items():
        scale = want_grads[name].abs().max().item() + 1e-6
        assert (grad - want_grads[name]).abs().max().item() <= 0.05 * scale + 1e-4, name


def test_cache_off_and_non_tensor_kwargs_are_constants():
    """No use_cache needed from the user (the trace is cacheless); return_dict given as an example is bound, not an input."""
    model = gpt2()
    assert model.config.use_cache
    converted = amp_fx.convert(model, example_kwarg_inputs={**batch("gpt2"), "return_dict": True})
    out = converted(**batch("gpt2", seed=1))  # called without return_dict / use_cache
    assert out.loss.dim() == 0 and out.logits.shape == (2, 16, 128)
    assert getattr(out, "past_key_values", None) is None
    assert model.config.use_cache is True and converted.config.use_cache is True  # the model's config untouched


def test_dynamic_shapes_keyword():
    """dynamic_shapes=False keeps the example's shapes; torch.export's own spec is accepted for the tensor inputs."""
    model = gpt2()
    data = batch("gpt2")
    static = amp_fx.convert(model, example_kwarg_inputs=data, dynamic_shapes=False)
    static(**batch("gpt2", seed=1))
    with pytest.raises(Exception, match="16|size|shape|[Gg]uard"):
        static(**batch("gpt2", length=12))
    seq = Dim("seq", min=2, max=64)
    spec = {"input_ids": {1: seq}, "labels": {1: seq}}
    dynamic = amp_fx.convert(model, example_kwarg_inputs=data, dynamic_shapes=spec)
    assert dynamic(**batch("gpt2", length=12)).logits.shape == (2, 12, 128)


def test_untraceable_without_examples_names_the_model_and_the_route():
    """fx cannot trace a transformers model: convert() captures from the call, and the report's note of the
    whole-graph failure names GPT2LMHeadModel and the example-input route (a single graph)."""
    _, message = captured_because(gpt2(), "GPT2LMHeadModel")
    assert "GPT2LMHeadModel" in message and "<root module>" not in message
    assert "example_kwarg_inputs={'input_ids'" in message and "backend='amp_fx'" in message


def test_a_size_one_batch_is_static_and_says_so():
    """An example with batch 1 cannot keep the batch dynamic (torch.export specialises 1): amp_fx warns at conversion."""
    with pytest.warns(UserWarning, match=r"kept input_ids.shape\[0\] == 1, labels.shape\[0\] == 1 static"):
        converted = amp_fx.convert(gpt2(), example_kwarg_inputs=batch("gpt2", size=1))
    assert converted(**batch("gpt2", size=1, length=9)).logits.shape == (1, 9, 128)  # the sequence is still dynamic
