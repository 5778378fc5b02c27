"""Hugging Face transformers models (built from a config, no download) under backend="amp_fx"."""

from __future__ import annotations

import copy

import pytest
import torch

import amp_fx

transformers = pytest.importorskip("transformers")


def _gpt2():
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32, bos_token_id=0, eos_token_id=0,
        use_cache=False, attn_implementation="sdpa", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 128, (2, 16))
    return model, {"input_ids": ids, "labels": ids}


def _bert():
    config = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=128,
        max_position_embeddings=32, attn_implementation="eager", hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=3,
    )
    model = transformers.BertForSequenceClassification(config)
    return model, {"input_ids": torch.randint(0, 128, (2, 16)), "labels": torch.tensor([0, 2])}


@pytest.mark.slow
@pytest.mark.parametrize("build", [_gpt2, _bert], ids=["gpt2", "bert"])
def test_transformers_model_compiles_agrees_and_trains(build):
    """GPT-2 / BERT compile with backend="amp_fx", agree with fp32 within bf16 tolerance, and train 5 steps."""
    torch.manual_seed(0)
    model, batch = build()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="amp_fx", options={"inner": "aot_eager"})
    out = compiled(**batch)
    expected = reference(**batch)
    report = amp_fx.last_report()
    assert report.count("low") >= 8  # q/k/v/out/MLP GEMMs of two layers ran low
    assert report.count("fp32") >= 4  # layer norms, softmax / loss stayed fp32
    torch.testing.assert_close(out.logits.float(), expected.logits, atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(out.loss, expected.loss, atol=2e-2, rtol=1e-2)

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = amp_fx.LossScaler(dtype=torch.bfloat16)
    losses = []
    for _ in range(5):
        opt.zero_grad(set_to_none=True)
        loss = compiled(**batch).loss
        scaler.scale(loss).backward()
        assert scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert losses[-1] < losses[0] - 0.1, losses
