"""Small models the tests share: one per family the issues name."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    """Three Linear layers with ReLU."""

    def __init__(self, d_in: int = 16, hidden: int = 32, d_out: int = 8):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.head(F.relu(self.fc2(F.relu(self.fc1(x)))))

    @staticmethod
    def example(batch: int = 4):
        return (torch.randn(batch, 16),)


class SmallCNN(nn.Module):
    """Conv-BN-ReLU-pool twice, then a Linear head."""

    def __init__(self, channels: int = 3, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.pool = nn.MaxPool2d(2)
        self.head = nn.Linear(16, classes)

    def forward(self, x):
        x = self.pool(F.relu(self.bn1(self.conv1(x))))
        x = F.relu(self.bn2(self.conv2(x)))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.head(x)

    @staticmethod
    def example(batch: int = 2):
        return (torch.randn(batch, 3, 8, 8),)


class Encoder(nn.Module):
    """nn.TransformerEncoder (2 layers); fx cannot trace it, torch.export can."""

    def __init__(self, d_model: int = 32, nhead: int = 4, layers: int = 2):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model, nhead, 2 * d_model, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, 4)

    def forward(self, x):
        return self.head(self.encoder(x))

    @staticmethod
    def example(batch: int = 2):
        return (torch.randn(batch, 6, 32),)


class LSTMTagger(nn.Module):
    """Embedding (integer ids) -> LSTM -> Linear."""

    def __init__(self, vocab: int = 50, d: int = 16, classes: int = 5):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.lstm = nn.LSTM(d, d, batch_first=True)
        self.head = nn.Linear(d, classes)

    def forward(self, ids):
        out, _ = self.lstm(self.embed(ids))
        return self.head(out[:, -1])

    @staticmethod
    def example(batch: int = 2):
        return (torch.randint(0, 50, (batch, 7)),)


class SDPABlock(nn.Module):
    """Pre-norm attention block written with F.scaled_dot_product_attention, plus an MLP."""

    def __init__(self, d: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))

    @staticmethod
    def example(batch: int = 2):
        return (torch.randn(batch, 6, 32),)


# name -> (factory, needs example inputs to trace)
CORE_MODELS = {
    "mlp": (MLP, False),
    "cnn": (SmallCNN, False),
    "encoder": (Encoder, True),
    "lstm": (LSTMTagger, False),
    "sdpa": (SDPABlock, False),
}


def build(name: str, seed: int = 0):
    """Return (model, example inputs, convert kwargs) for a core model, seeded."""
    torch.manual_seed(seed)
    factory, needs_examples = CORE_MODELS[name]
    model = factory()
    example = factory.example()
    kwargs = {"example_inputs": example} if needs_examples else {}
    return model, example, kwargs
