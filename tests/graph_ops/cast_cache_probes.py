"""Shared by the cast-cache tests: a cast counter, two models (an MLP and a tied GPT-ish block), and a fixture that
empties the cache around each test (the cache is process-global)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from amp_fx.graph_ops.cast_cache import clear_cast_cache


class ParamCasts(TorchDispatchMode):
    """Counts casts (``_to_copy`` or ``to`` to another dtype) that read one of ``params``."""

    def __init__(self, params):
        super().__init__()
        self.ptrs = {p.data_ptr() for p in params}
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        source = args[0] if args else None
        # (Under inference_mode the dispatcher shows aten.to itself, not its _to_copy.)
        if (func.overloadpacket.__name__ in ("_to_copy", "to") and isinstance(source, torch.Tensor)
                and source.data_ptr() in self.ptrs and out.dtype != source.dtype):
            self.count += 1
        return out


class GPTish(nn.Module):
    """Tied embedding, a pre-LN block with SDPA, LM head: weights read twice (tied) and through views."""

    def __init__(self, vocab=64, d=32):
        super().__init__()
        self.wte, self.ln, self.qkv, self.proj = nn.Embedding(vocab, d), nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, ids):
        x = self.wte(ids)
        q, k, v = self.qkv(self.ln(x)).unflatten(-1, (3, 4, -1)).permute(2, 0, 3, 1, 4).unbind(0)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2))
        return F.linear(x, self.wte.weight)


def _mlp():
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.LayerNorm(16), nn.Linear(16, 4))


MODELS = {"mlp": (_mlp, lambda b: torch.randn(b, 16)), "gpt": (GPTish, lambda b: torch.randint(0, 64, (b, 8)))}


@pytest.fixture
def empty_cast_cache():
    clear_cast_cache()
    yield
    clear_cast_cache()
