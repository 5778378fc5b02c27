"""Training step time under torch.compile: fp32, + torch.autocast, and backend="amp_fx" (bf16, CPU).

Run from a checkout::

    python benchmarks/compile_step_time.py                          # d=256, batch 8 x 64 tokens, 1 thread
    python benchmarks/compile_step_time.py --width 512 --tokens 128 --rounds 7

One process, one thread (``torch.set_num_threads(1)``).  Every variant
trains its own copy of the same pre-norm attention block (SGD, MSE loss).
After warm-up (which includes compilation), the variants are timed in
interleaved rounds so that load from other processes hits all of them
alike; the table gives the median step time over the rounds.

bf16 pays off only where the CPU has native bf16 GEMMs (AVX512-BF16 or AMX:
``grep -o 'avx512_bf16\|amx_bf16' /proc/cpuinfo``).  On an AVX2-only CPU
oneDNN emulates them and both bf16 variants are far slower than fp32; the
comparison that still holds there is autocast against amp_fx.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

import amp_fx  # noqa: E402


class Block(nn.Module):
    """Pre-norm transformer block: LayerNorm, qkv Linear, causal SDPA, out Linear, GELU MLP."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


def make_step(model: nn.Module, autocast: bool):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step(x, target):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(x)
        loss = F.mse_loss(out.float(), target)
        loss.backward()
        opt.step()
        return loss

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (median is reported)")
    parser.add_argument("--steps", type=int, default=3, help="steps per variant per round")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    base = Block(args.width, args.heads)
    x = torch.randn(args.batch, args.tokens, args.width)
    target = torch.randn_like(x)

    variants = {
        "torch.compile fp32": make_step(torch.compile(copy.deepcopy(base)), autocast=False),
        "torch.compile + torch.autocast bf16": make_step(torch.compile(copy.deepcopy(base)), autocast=True),
        'torch.compile(backend="amp_fx") bf16': make_step(
            torch.compile(copy.deepcopy(base), backend="amp_fx", options={"dtype": torch.bfloat16}), autocast=False),
    }
    losses = {}
    for name, step in variants.items():  # warm-up: compiles forward and backward
        start = time.perf_counter()
        for _ in range(2):
            losses[name] = step(x, target).item()
        print(f"warm-up {name}: {time.perf_counter() - start:.1f} s (loss {losses[name]:.4f})", flush=True)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for index in range(args.rounds):
        for name, step in variants.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                step(x, target)
            times[name].append((time.perf_counter() - start) / args.steps)
        print(f"round {index + 1}/{args.rounds}: " + ", ".join(f"{t[-1] * 1e3:.0f}" for t in times.values()) + " ms/step",
              flush=True)
    print(f"\nBlock d={args.width}, batch {args.batch} x {args.tokens} tokens, {args.threads} thread(s), "
          f"median of {args.rounds} rounds x {args.steps} steps (torch {torch.__version__})")
    fp32 = statistics.median(times["torch.compile fp32"])
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"  {name:40s} {median * 1e3:8.1f} ms/step  ({fp32 / median:.2f}x vs fp32)")


if __name__ == "__main__":
    main()
