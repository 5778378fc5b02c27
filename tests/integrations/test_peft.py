"""peft LoRA: ``amp_fx.convert(peft_model, example_kwarg_inputs=...)`` works and only the adapters train (issue 24, item 1).

PeftModel's forward is ``(*args, **kwargs)``; the torch.export route names
each keyword input in the traced signature so ``dynamic_shapes`` can key
them (amp_fx/frontend/export_route.py).  Real peft and transformers, tiny
models from configs.
"""

from __future__ import annotations

import copy

import pytest
import torch

import amp_fx

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

# LoRA gradients against torch.autocast's, relative to each gradient's largest entry.  O1 runs the same
# bf16 GEMMs as autocast on the same fp32 weights: differences come from where casts sit and from bf16
# accumulation order (a few roundoffs of 2**-8); measured 0.015 (GPT-2) and 0.013 (Llama), and autocast
# itself is 0.016-0.023 off fp32's -> 3e-2.  O2 also holds every weight in bf16 (one more roundoff per
# product); measured 0.018 -> 4e-2.
GRAD_ATOL = {"O1": 3e-2, "O2": 4e-2}
LOSS_RTOL = 1e-2  # the mean of 22 token losses near ln(128) = 4.85: bf16 logits move it far less than 1%


def _gpt2():
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64, bos_token_id=0, eos_token_id=0,
        attn_implementation="sdpa", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    # no task_type: a plain PeftModel, whose forward is (*args, **kwargs) -- the case issue 24 measured
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], lora_dropout=0.0,
                             init_lora_weights=False, fan_in_fan_out=True)
    return peft.get_peft_model(model, config)


def _llama():
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        attn_implementation="sdpa"))
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                             init_lora_weights=False, task_type="CAUSAL_LM")
    return peft.get_peft_model(model, config)


def _batch(seed: int = 0):
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def _autocast_grads(model, batch):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_lora_converts_trains_only_adapters_and_matches_autocast(build, level):
    torch.manual_seed(0)
    model = build().train()
    batch = _batch()
    reference = copy.deepcopy(model)
    expected_loss, expected = _autocast_grads(reference, batch)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    lora = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    if level == "O1":
        gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16, example_kwarg_inputs=batch)
    else:  # O2: bf16 weights, fp32 masters (the model's own parameters) stepped by MasterWeightOptimizer
        gm, optimizer = amp_fx.initialize(model, optimizer, opt_level="O2", dtype=torch.bfloat16,
                                          example_kwarg_inputs=batch)
        assert isinstance(optimizer, amp_fx.MasterWeightOptimizer)
    assert gm.amp_report.route == "torch.export"
    assert sorted(n for n, p in gm.named_parameters() if p.requires_grad) == sorted(trainable)

    loss = gm(**batch).loss
    torch.testing.assert_close(loss.float(), expected_loss.float(), rtol=LOSS_RTOL, atol=0)
    loss.backward()
    ours = dict(gm.named_parameters())
    for name in trainable:
        grad, want = ours[name].grad.float(), expected[name]
        scale = want.abs().max()
        assert scale > 0
        torch.testing.assert_close(grad / scale, want / scale, atol=GRAD_ATOL[level], rtol=0)
    assert all(p.grad is None for n, p in gm.named_parameters() if not p.requires_grad)

    optimizer.step()
    optimizer.zero_grad()
    for _ in range(2):
        gm(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    current = dict(model.named_parameters())
    assert all(torch.equal(current[n], value) for n, value in frozen.items())  # base weights bit-identical
    assert all(not torch.equal(current[n], value) for n, value in lora.items())  # every adapter moved
    if level == "O2":  # the bf16 copies of the base weights never change either
        assert all(torch.equal(ours[n], value.to(ours[n].dtype)) for n, value in frozen.items() if n in ours)
    assert gm(**batch).loss < loss  # and the steps lowered the loss


def test_lora_dropout_follows_train_and_eval_of_one_conversion():
    """lora_dropout applies in train mode only; eval matches the PeftModel's eval under autocast.

    Converted with labels, called without them: PeftModel's ``**kwargs`` forward lets a caller omit them.
    """
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=128, n_positions=32, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["c_attn"], lora_dropout=0.5,
                                                       init_lora_weights=False, fan_in_fan_out=True)).train()
    batch = _batch()
    ids = batch["input_ids"]
    gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16, example_kwarg_inputs=batch)
    assert gm(**batch).loss is not None and gm(input_ids=ids).loss is None
    torch.manual_seed(1)
    a = gm(input_ids=ids).logits
    torch.manual_seed(2)
    assert not torch.equal(a, gm(input_ids=ids).logits)
    gm.eval()
    evaluated = gm(input_ids=ids).logits
    assert torch.equal(evaluated, gm(input_ids=ids).logits)
    model.eval()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(input_ids=ids).logits
    # one bf16 block of width 32: logits within a few bf16 roundoffs (measured 0.004 at width 64)
    torch.testing.assert_close(evaluated.float(), expected.float(), atol=3e-2, rtol=0)
