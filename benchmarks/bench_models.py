"""The models that ``benchmarks/benchmark.py`` times: each returns its own scalar loss.

Every model takes ``(inputs, target)`` and computes its loss inside
``forward``, so that autocast regions, amp_fx's conversion and the compilers
all see (and may cast) the loss the same way; the training loop only calls
``backward`` on what comes back.

All four trace with ``torch.fx.symbolic_trace`` (the attention blocks are
written by hand with ``F.scaled_dot_product_attention``, views through
``unflatten``/``flatten`` instead of shape unpacking).  :class:`ExportOnly`
wraps a model with a shape check fx cannot trace, for the ``torch.export``
route of ``convert()``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["MLP", "ConvNet", "Block", "Encoder", "GPT", "ExportOnly", "BenchCase", "SIZES", "PRESETS", "build_case", "MODEL_NAMES"]


class MLP(nn.Module):
    """``depth`` Linear+GELU(+LayerNorm with ``norm``) layers and a classifier head; cross-entropy loss."""

    def __init__(self, d_in: int = 1024, hidden: int = 1024, depth: int = 4, classes: int = 10, norm: bool = False):
        super().__init__()
        dims = [d_in] + [hidden] * depth
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.norms = nn.ModuleList(nn.LayerNorm(hidden) if norm else nn.Identity() for _ in range(depth))
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        for layer, norm in zip(self.layers, self.norms):
            x = norm(F.gelu(layer(x)))
        return F.cross_entropy(self.head(x), labels)


class ConvNet(nn.Module):
    """Three Conv-BatchNorm-ReLU stages (stride 2 after the first), global pooling, Linear head."""

    def __init__(self, channels: int = 3, width: int = 32, classes: int = 10):
        super().__init__()
        widths = [channels, width, 2 * width, 4 * width]
        self.convs = nn.ModuleList(
            nn.Conv2d(a, b, 3, stride=1 if i == 0 else 2, padding=1, bias=False)
            for i, (a, b) in enumerate(zip(widths[:-1], widths[1:]))
        )
        self.norms = nn.ModuleList(nn.BatchNorm2d(b) for b in widths[1:])
        self.head = nn.Linear(widths[-1], classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        for conv, norm in zip(self.convs, self.norms):
            x = F.relu(norm(conv(x)))
        return F.cross_entropy(self.head(x.mean((2, 3))), labels)


class Block(nn.Module):
    """Pre-LN transformer block: LayerNorm, fused qkv, SDPA, projection, LayerNorm, GELU MLP."""

    def __init__(self, d: int, heads: int, causal: bool):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (b, t, 3d) -> 3 x (b, heads, t, d/heads) without unpacking x.shape (fx cannot iterate a Proxy).
        q, k, v = self.qkv(self.ln1(x)).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4).unbind(0)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        x = x + self.proj(attn.transpose(1, 2).flatten(2))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Encoder(nn.Module):
    """Transformer encoder over fp32 features: blocks, final LayerNorm, mean pool, classifier."""

    def __init__(self, d: int = 512, heads: int = 8, layers: int = 6, classes: int = 10):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, heads, causal=False) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.ln(x).mean(1)), labels)


class GPT(nn.Module):
    """GPT-style decoder: token + position embeddings, causal blocks, LM head tied to the token embedding."""

    def __init__(self, vocab: int = 8192, d: int = 256, heads: int = 4, layers: int = 4, context: int = 128):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads, causal=True) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        nn.init.normal_(self.wte.weight, std=0.02)  # GPT-2's init: logits start near uniform
        nn.init.normal_(self.wpe.weight, std=0.02)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.size(1), device=ids.device)
        x = self.wte(ids) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln(x), self.wte.weight)  # tied: the head is the embedding matrix
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class ExportOnly(nn.Module):
    """``model`` behind a data-dependent shape check: fx cannot trace it, ``torch.export`` can."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3:  # a Python branch on a traced value: symbolic_trace raises here
            raise ValueError("expected (batch, tokens, features)")
        return self.model(x, labels)


@dataclass
class BenchCase:
    """A model to time and a batch for it (inputs on the requested device)."""

    name: str
    model: nn.Module
    inputs: tuple
    description: str


# Sizes per model and preset.  "full" is the default: sized so that a bf16 step on a
# 2-core CPU without native bf16 GEMMs (AVX2 only: PyTorch then runs bf16 matmuls in
# its reference kernels, 10-100x slower than fp32) takes well under a second.  "issue"
# is the size issue 7 names (6 x 512 encoder, seq 128): seconds per bf16 step there.
# "issue14" is issue 14's: MLP 6 x (Linear 1024 -> GELU -> LayerNorm) at batch 256, a 4-layer
# d512 encoder at batch 8 x 128, a 4-block d512 GPT with a tied embedding.
SIZES: dict[str, dict[str, dict]] = {
    "mlp": {"full": dict(batch=128, d_in=256, hidden=256, depth=4),
            "quick": dict(batch=16, d_in=64, hidden=64, depth=2),
            "issue": dict(batch=256, d_in=1024, hidden=1024, depth=4),
            "issue14": dict(batch=256, d_in=1024, hidden=1024, depth=6, norm=True)},
    "cnn": {"full": dict(batch=16, image=32, width=16),
            "quick": dict(batch=4, image=8, width=8),
            "issue": dict(batch=32, image=32, width=32),
            "issue14": dict(batch=32, image=32, width=32)},
    "transformer": {"full": dict(batch=2, seq=64, d=128, heads=4, layers=6),
                    "quick": dict(batch=2, seq=16, d=32, heads=4, layers=2),
                    "issue": dict(batch=4, seq=128, d=512, heads=8, layers=6),
                    "issue14": dict(batch=8, seq=128, d=512, heads=8, layers=4)},
    "gpt": {"full": dict(batch=2, seq=64, d=128, heads=4, layers=4, vocab=2048),
            "quick": dict(batch=2, seq=16, d=32, heads=4, layers=2, vocab=128),
            "issue": dict(batch=4, seq=128, d=256, heads=4, layers=4, vocab=8192),
            "issue14": dict(batch=8, seq=128, d=512, heads=8, layers=4, vocab=8192)},
}
PRESETS = ("full", "quick", "issue", "issue14")
MODEL_NAMES = tuple(SIZES)


def _mlp(s: dict, device: str) -> BenchCase:
    model = MLP(s["d_in"], s["hidden"], s["depth"], norm=s.get("norm", False))
    x = torch.randn(s["batch"], s["d_in"], device=device)
    labels = torch.randint(0, 10, (s["batch"],), device=device)
    return BenchCase("mlp", model, (x, labels), f"MLP {s['depth']}x{s['hidden']}{' +LayerNorm' if s.get('norm') else ''}, batch {s['batch']}")


def _cnn(s: dict, device: str) -> BenchCase:
    model = ConvNet(width=s["width"])
    x = torch.randn(s["batch"], 3, s["image"], s["image"], device=device)
    labels = torch.randint(0, 10, (s["batch"],), device=device)
    return BenchCase("cnn", model, (x, labels), f"CNN+BN width {s['width']}, batch {s['batch']}x3x{s['image']}x{s['image']}")


def _transformer(s: dict, device: str) -> BenchCase:
    model = Encoder(s["d"], s["heads"], s["layers"])
    x = torch.randn(s["batch"], s["seq"], s["d"], device=device)
    labels = torch.randint(0, 10, (s["batch"],), device=device)
    return BenchCase("transformer", model, (x, labels),
                     f"encoder {s['layers']}L d={s['d']} h={s['heads']}, batch {s['batch']}x{s['seq']}")


def _gpt(s: dict, device: str) -> BenchCase:
    model = GPT(s["vocab"], s["d"], s["heads"], s["layers"], context=s["seq"])
    ids = torch.randint(0, s["vocab"], (s["batch"], s["seq"]), device=device)
    targets = torch.randint(0, s["vocab"], (s["batch"], s["seq"]), device=device)
    return BenchCase("gpt", model, (ids, targets),
                     f"GPT {s['layers']}L d={s['d']} vocab {s['vocab']} (tied), batch {s['batch']}x{s['seq']}")


_BUILDERS: dict[str, Callable[[dict, str], BenchCase]] = {"mlp": _mlp, "cnn": _cnn, "transformer": _transformer, "gpt": _gpt}


def build_case(name: str, *, preset: str = "full", device: str = "cpu", seed: int = 0, **overrides) -> BenchCase:
    """Build model ``name`` at the sizes of ``preset``, with ``overrides`` applied to them."""
    sizes = dict(SIZES[name][preset])
    sizes.update({k: v for k, v in overrides.items() if v is not None and k in sizes})
    torch.manual_seed(seed)
    case = _BUILDERS[name](sizes, device)
    case.model.to(device)
    return case
