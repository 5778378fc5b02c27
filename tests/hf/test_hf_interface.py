"""A converted Hugging Face model keeps config, generation_config, generate and save_pretrained (issue 12, point 6)."""

from __future__ import annotations

import copy

import pytest
import torch

import amp_fx
from hf_models import batch, gpt2, transformers


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_generate_uses_the_converted_weights_under_autocast(level):
    """generate() is the model's own (with its cache), run under autocast with the converted module's weights."""
    torch.manual_seed(0)
    model = gpt2().eval()
    converted = amp_fx.convert(model, level, dtype=torch.bfloat16, example_kwarg_inputs=batch("gpt2"))
    assert converted.config.n_layer == 2 and converted.config is not model.config
    assert converted.generation_config.eos_token_id == 0 and converted.can_generate()
    prompt = batch("gpt2", size=1, length=4)["input_ids"]
    tokens = converted.generate(prompt, max_new_tokens=6, do_sample=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = copy.deepcopy(model).generate(prompt, max_new_tokens=6, do_sample=False)
    assert tokens.shape == (1, 10) and torch.equal(tokens, expected)
    # generate() reads the converted module's current weights (O1: the model's own; O2: copied from the low ones)
    with torch.no_grad():  # the final norm outputs zeros: every logit is 0, greedy decoding picks token 0
        converted.get_parameter("transformer.ln_f.weight").zero_()
        converted.get_parameter("transformer.ln_f.bias").zero_()
    assert not torch.equal(converted.generate(prompt, max_new_tokens=6, do_sample=False), tokens)
    assert (model.transformer.ln_f.weight.abs().sum() == 0) == (level == "O1")  # O1 shares the model's parameters


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_save_pretrained_writes_fp32_weights_that_from_pretrained_loads(level, tmp_path):
    """save_pretrained writes the converted module's weights in fp32, with config; from_pretrained gives the same model."""
    torch.manual_seed(0)
    model = gpt2().eval()
    data = batch("gpt2")
    converted = amp_fx.convert(model, level, dtype=torch.bfloat16, example_kwarg_inputs=data)
    with torch.no_grad():  # an update the fp32 model has not seen
        converted.get_parameter("transformer.h.0.mlp.c_fc.bias").add_(0.5)
    converted.config.summary_type = "edited"  # the converted module's config is what is written
    converted.save_pretrained(tmp_path)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    assert {p.dtype for p in loaded.parameters()} == {torch.float32}
    assert loaded.config.summary_type == "edited" and model.config.summary_type != "edited"
    state, original = converted.state_dict(), copy.deepcopy(model.state_dict())
    changed = "transformer.h.0.mlp.c_fc.bias"
    for name, tensor in loaded.state_dict().items():
        # O1 trains the model's own fp32 weights; O2 writes the fp32 master where it still rounds to the
        # low weight, and the widened low weight where that has moved on (the bias updated above)
        expected = state[name] if level == "O1" or name == changed else original[name]
        torch.testing.assert_close(tensor, expected, atol=0, rtol=0, msg=name)
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()  # ties kept
    with torch.no_grad():
        torch.testing.assert_close(converted(**data).logits.float(), loaded(**data).logits, atol=5e-2, rtol=5e-2)
