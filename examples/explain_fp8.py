"""Which GEMMs of a GPT-2-small-sized model should run fp8?  ``recipe="auto"`` decides and ``amp_fx.explain`` says why.

The model: 12 pre-norm blocks, d_model 768, 12 heads, vocabulary 50257 -- the
GEMMs of GPT-2 small (qkv 768 -> 2304, proj 768 -> 768, fc 768 -> 3072,
fc2 3072 -> 768, lm_head 768 -> 50257), weights N(0, 0.02) as GPT-2 initialises
them (untrained: no download).  The conversion calibrates on one small batch
(``--calib-tokens``, default 64, so it runs in seconds on a CPU) and predicts each
GEMM's time for ``--tokens`` rows (default 8192) on ``--device``'s roofline
(h100, h200, b200).  Prints the explain table.

    python examples/explain_fp8.py                      # h100, M = 8192
    python examples/explain_fp8.py --device b200 --vocab 50304 --tokens 32768
"""

from __future__ import annotations

import argparse
import math
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_fx


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, layers: int = 12, d: int = 768, heads: int = 12, vocab: int = 50257, positions: int = 1024):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(positions, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "fc2.weight")) else 0.02)

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="h100", help="cost-model profile: h100, h200, b200")
    parser.add_argument("--tokens", type=int, default=8192, help="M to predict for")
    parser.add_argument("--calib-tokens", type=int, default=64, help="rows of the calibration batch")
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d", type=int, default=768, help="d_model (heads: d // 64)")
    parser.add_argument("--error-budget", type=float, default=0.05)
    parser.add_argument("--min-gain", type=float, default=0.05)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = GPT(layers=args.layers, d=args.d, heads=max(args.d // 64, 1), vocab=args.vocab)
    ids = torch.randint(0, args.vocab, (1, args.calib_tokens))
    config = amp_fx.Fp8Config(recipe="auto", device=args.device, tokens=args.tokens, error_budget=args.error_budget,
                              min_gain=args.min_gain)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", amp_fx.Fp8NothingConvertedWarning)
        gm = amp_fx.convert(model, "O1", example_inputs=(ids,), fp8=config)
    print(amp_fx.explain(gm))
    for warning in caught:
        if isinstance(warning.message, amp_fx.Fp8NothingConvertedWarning):
            print(f"\nwarning: {warning.message}")


if __name__ == "__main__":
    main()
