"""Models no whole graph captures, written in the styles of real programs (issue 40's table), for the capture tests.

Each entry: a builder, an input maker (``batch`` -> (args, kwargs)), and a loss from the output.  Every
forward here runs eagerly and under ``torch.autocast``; none symbolic-traces, so ``convert()`` without example
inputs captures them from the call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


class DcganGenerator(nn.Module):
    """Apex's DCGAN example: ``if input.is_cuda and self.ngpu > 1`` picks data_parallel."""

    def __init__(self, ngpu: int = 1, nz: int = 8, ngf: int = 4):
        super().__init__()
        self.ngpu = ngpu
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 2, 4, 1, 0, bias=False), nn.BatchNorm2d(ngf * 2), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf), nn.ReLU(True),
            nn.ConvTranspose2d(ngf, 3, 4, 2, 1, bias=False), nn.Tanh())

    def forward(self, input):
        if input.is_cuda and self.ngpu > 1:
            output = nn.parallel.data_parallel(self.main, input, range(self.ngpu))
        else:
            output = self.main(input)
        return output


class TinyGpt(nn.Module):
    """nanoGPT's model.py: a block-size ``assert`` and ``forward(idx, targets=None)``."""

    def __init__(self, vocab: int = 32, block_size: int = 16, dim: int = 16):
        super().__init__()
        self.block_size = block_size
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(block_size, dim)
        self.ln = nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT does

    def forward(self, idx, targets=None):
        b, t = idx.size()
        assert t <= self.block_size, f"Cannot forward sequence of length {t}, block size is only {self.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        q, k, v = self.qkv(self.ln(x)).chunk(3, dim=-1)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool, device=idx.device).triu(1), float("-inf"))
        x = x + self.proj(F.softmax(att, dim=-1) @ v)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits = self.lm_head(x[:, [-1], :])
            loss = None
        return logits, loss


class TimestepNet(nn.Module):
    """diffusers' timestep handling: a Python ``int`` or a tensor, ``assert`` on its rank, sinusoidal embedding."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.dim = dim
        self.time = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.body = nn.Linear(dim, dim)

    def forward(self, x, timestep):
        if not torch.is_tensor(timestep):
            timestep = torch.tensor([timestep], dtype=torch.long, device=x.device)
        assert timestep.ndim <= 1, "timestep must be a scalar or 1-d"
        timestep = timestep.expand(x.shape[0])
        freqs = torch.exp(-math.log(10000) * torch.arange(self.dim // 2, device=x.device) / (self.dim // 2))
        angles = timestep[:, None].float() * freqs[None]
        emb = self.time(torch.cat([angles.sin(), angles.cos()], dim=-1))
        return self.body(x + emb)


class NonzeroRouter(nn.Module):
    """Data-dependent size and branch: rows selected with ``nonzero()``, a branch on how many there are."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.inp, self.expert, self.out = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, 4)

    def forward(self, x):
        h = self.inp(x)
        rows = (h.sum(-1) > 0).nonzero().squeeze(-1)
        if rows.numel() > 0:
            h = h.index_add(0, rows, self.expert(h[rows]))
        return self.out(h)


class PoolingFunnel(nn.Module):
    """Funnel's ``pooling_mult``: a Python attribute set and updated in forward, read by later code."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(3))
        self.head = nn.Linear(dim, 4)

    def forward(self, x):
        self.pooling_mult = 1
        for block in self.blocks:
            x = torch.relu(block(x))
            if x.shape[1] > 2:
                x = F.avg_pool1d(x.transpose(1, 2), 2).transpose(1, 2)
                self.pooling_mult *= 2
        return self.head(x.mean(1)) * (1.0 / self.pooling_mult)


class Gate(nn.Module):
    """A graph break inside a submodule: ``.item()`` turns a tensor into the Python int that slices."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.score, self.proj = nn.Linear(dim, 1), nn.Linear(dim, dim)

    def forward(self, x):
        keep = int((self.score(x).squeeze(-1) > -1e9).sum(-1).max().item())
        return self.proj(x[:, :keep])


class GatedStack(nn.Module):
    def __init__(self, dim: int = 16):
        super().__init__()
        self.embed, self.gate, self.head = nn.Linear(dim, dim), Gate(dim), nn.Linear(dim, 4)

    def forward(self, x):
        return self.head(self.gate(self.embed(x)).mean(1))


class _Reversible(torch.autograd.Function):
    """Reformer's reversible layers: forward without saving activations, recomputed in backward."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, x, layers):
        ctx.layers = layers
        ctx.save_for_backward(x)
        with torch.no_grad():
            for layer in layers:
                x = x + layer(x)
        return x

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")  # the recomputation runs in the precision the forward ran in
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            y = x
            for layer in ctx.layers:
                y = y + layer(y)
            torch.autograd.backward(y, grad)
        return x.grad, None


class ReversibleNet(nn.Module):
    def __init__(self, dim: int = 16):
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(2))
        self.head = nn.Linear(dim, 4)

    def forward(self, x):
        return self.head(_Reversible.apply(self.embed(x), self.layers))


@dataclass
class Case:
    """One corpus model: how to build it, make inputs of a batch size, and take a loss of its output."""

    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[int], tuple[tuple, dict]]
    loss: Callable[[Any], torch.Tensor]
    between_graphs: bool = False  # GEMMs run between Dynamo graphs (decisions there: issue 40's item 2)


def _seq(n: int) -> tuple[tuple, dict]:
    return (torch.randn(n, 6, 16),), {}


def _gpt_inputs(n: int) -> tuple[tuple, dict]:
    idx = torch.randint(0, 32, (n, 5 + n))
    return (idx,), {"targets": torch.randint(0, 32, (n, 5 + n))}


CASES = [
    Case("dcgan_device_branch", DcganGenerator, lambda n: ((torch.randn(n, 8, 1, 1),), {}), lambda y: y.square().mean()),
    Case("nanogpt_assert_targets", TinyGpt, _gpt_inputs, lambda out: out[1]),
    Case("int_timestep", TimestepNet, lambda n: ((torch.randn(n, 16), 7 * n), {}), lambda y: y.square().mean()),
    Case("nonzero_branch", NonzeroRouter, lambda n: ((torch.randn(3 * n, 16),), {}), lambda y: y.square().mean()),
    Case("attribute_in_forward", PoolingFunnel, lambda n: ((torch.randn(n, 4 * n, 16),), {}), lambda y: y.square().mean()),
    Case("item_break_in_submodule", GatedStack, _seq, lambda y: y.square().mean()),
    Case("function_with_modulelist", ReversibleNet, lambda n: ((torch.randn(2 * n, 16),), {}), lambda y: y.square().mean(),
         between_graphs=True),
]
