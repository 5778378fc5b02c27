"""A small model factory for the ``python -m amp_fx inspect`` demo.

    python -m amp_fx inspect examples/inspect_factory.py:build --level O1 --dtype bf16 \
        --input-shape 8,3,32,32 --out graph.html

The model touches every colour of the picture: convolution and Linear run
low, GroupNorm and log_softmax stay fp32, ReLU and the pooling follow.
"""

import torch.nn as nn
import torch.nn.functional as F

__all__ = ["TinyClassifier", "build"]


class TinyClassifier(nn.Module):
    """Conv -> GroupNorm -> ReLU -> global mean -> Linear -> log_softmax."""

    def __init__(self, channels: int = 3, width: int = 8, classes: int = 10):
        super().__init__()
        self.conv = nn.Conv2d(channels, width, 3, padding=1)
        self.norm = nn.GroupNorm(2, width)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        x = F.relu(self.norm(self.conv(x)))
        return self.head(x.mean((2, 3))).log_softmax(-1)


def build() -> nn.Module:
    """The demo model, with default sizes (expects inputs of shape N,3,H,W)."""
    return TinyClassifier()
