"""A zoo of tiny Hugging Face architectures built from configs (no download), one per family amp_fx must convert.

Each entry builds a model of 2 layers, width 32, vocabulary 128, and a batch
of 2 sequences with a padded row and ``labels``, so the model's own loss runs
inside the converted graph.  The families: decoder-only (Qwen2), encoder-only
with ``finfo``-masked attention (DeBERTa-v2), encoder-decoder (BART), a
mixture of experts through transformers' grouped-GEMM custom op (Mixtral),
a custom autograd Function in training mode (BLOOM's GELU) and a state-space
model (Mamba, one layer: its reference scan loops over the sequence, and each layer costs seconds to trace).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB = 128
_COMMON = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64, vocab_size=VOCAB,
               max_position_embeddings=64)


@dataclass(frozen=True)
class ZooModel:
    """How to build one architecture and its batches."""

    name: str
    family: str
    build: Callable[[], torch.nn.Module]
    labels: str = "lm"  # "lm": next-token labels; "class": one of 3 classes per row; "seq2seq": target ids
    attention_mask: bool = True
    fixed_length: bool = False  # the model fixes the sequence length when exported (a loop over it)


def _qwen2():
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**_COMMON, num_key_value_heads=2))


def _deberta():
    config = transformers.DebertaV2Config(**_COMMON, num_labels=3, hidden_dropout_prob=0.0,
                                          attention_probs_dropout_prob=0.0,
                                          problem_type="single_label_classification")
    return transformers.DebertaV2ForSequenceClassification(config)


def _bart():
    config = transformers.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                     decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0,
                                     attention_dropout=0.0, activation_dropout=0.0)
    return transformers.BartForConditionalGeneration(config)


def _mixtral():
    config = transformers.MixtralConfig(**_COMMON, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    return transformers.MixtralForCausalLM(config)


def _bloom():
    config = transformers.BloomConfig(n_layer=2, hidden_size=32, n_head=4, vocab_size=VOCAB, hidden_dropout=0.0,
                                      attention_dropout=0.0)
    return transformers.BloomForCausalLM(config)


def _mamba():
    return transformers.MambaForCausalLM(transformers.MambaConfig(num_hidden_layers=1, hidden_size=32,
                                                                  vocab_size=VOCAB, state_size=8))


ZOO = {zoo.name: zoo for zoo in (
    ZooModel("qwen2", "decoder-only", _qwen2),
    ZooModel("deberta-v2", "encoder-only", _deberta, labels="class"),
    ZooModel("bart", "encoder-decoder", _bart, labels="seq2seq"),
    ZooModel("mixtral", "mixture of experts", _mixtral),
    ZooModel("bloom", "custom autograd Function", _bloom),
    ZooModel("mamba", "state space", _mamba, attention_mask=False, fixed_length=True),
)}


def zoo_batch(zoo: ZooModel, size: int = 2, length: int = 16, seed: int = 0) -> dict:
    """``input_ids`` (the second row padded for its last 4 positions where the model takes a mask) and ``labels``."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (size, length), generator=generator)
    batch = {"input_ids": ids}
    if zoo.attention_mask:
        mask = torch.ones_like(ids)
        mask[-1, -4:] = 0
        batch["attention_mask"] = mask
    if zoo.labels == "class":
        batch["labels"] = torch.randint(0, 3, (size,), generator=generator)
    elif zoo.labels == "seq2seq":
        batch["labels"] = torch.randint(1, VOCAB, (size, length // 2), generator=generator)
    else:
        batch["labels"] = ids.masked_fill(batch.get("attention_mask", torch.ones_like(ids)) == 0, -100)
    return batch
