"""Small Hugging Face models built from configs (no download) and their batches, for the HF-route tests."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")


def gpt2(**overrides):
    """GPT-2 LM head, 2 layers of width 64; its config keeps use_cache=True, as from_pretrained gives it."""
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64, bos_token_id=0, eos_token_id=0,
        attn_implementation="sdpa", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **overrides,
    )
    return transformers.GPT2LMHeadModel(config)


def bert(**overrides):
    """BERT sequence classifier, 2 layers of width 64, 3 labels."""
    config = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=128,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3,
        **overrides,
    )
    return transformers.BertForSequenceClassification(config)


def batch(kind: str, size: int = 2, length: int = 16, seed: int = 0) -> dict:
    """``input_ids`` and ``labels`` for ``kind`` ("gpt2": next-token labels, "bert": one class per row)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (size, length), generator=generator)
    if kind == "gpt2":
        return {"input_ids": ids, "labels": ids}
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.randint(0, 3, (size,), generator=generator)}


BUILDERS = {"gpt2": gpt2, "bert": bert}
