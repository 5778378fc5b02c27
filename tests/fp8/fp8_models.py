"""Small models and the torchao reference run for the fp8 tests (dims multiples of 16, a few thousand weights)."""

from __future__ import annotations

import copy
import math
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

import amp_fx


class MLP(nn.Module):
    """Two Linear layers with a GELU between them."""

    def __init__(self, d: int = 32, hidden: int = 64):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """A pre-norm transformer block: causal attention (q/k/v/out Linear) and an MLP."""

    def __init__(self, d: int = 32, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.mlp = MLP(d, 2 * d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        attn = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1) @ v
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


def torchao_config(recipe: str, emulate: bool) -> Float8LinearConfig:
    """torchao's config for ``recipe`` ("tensorwise" | "rowwise"), emulated or through torch._scaled_mm."""
    base = Float8LinearConfig.from_recipe_name(recipe)
    return Float8LinearConfig(**{**base.__dict__, "emulate": emulate})


def torchao_model(model: nn.Module, recipe: str, emulate: bool) -> nn.Module:
    """A copy of ``model`` with every Linear swapped for torchao's Float8Linear."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return convert_to_float8_training(copy.deepcopy(model), config=torchao_config(recipe, emulate))


def run(model: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(output as fp32, input gradient, {parameter name: gradient}) of one forward and backward of ``sum(out * grad)``."""
    x = x.detach().clone().requires_grad_()
    out = model(x).float()
    (out * grad).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in model.named_parameters()}


def fp8_everywhere(recipe: str, emulate: bool) -> amp_fx.Fp8Config:
    """The amp_fx recipe matching torchao's, on every eligible GEMM (the tests' GEMMs are too small for "auto")."""
    return amp_fx.Fp8Config(recipe=recipe, emulate=emulate, size_rule="all")
