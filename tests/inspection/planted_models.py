"""Models built to break low precision at a known node, shared by the overflow and calibration tests."""

import torch
import torch.nn as nn


class Logits(nn.Module):
    """The attention logit product alone, so its module path names exactly one op."""

    def forward(self, q, kt):
        return q @ kt


class PlantedAttention(nn.Module):
    """q and k are 100 x the input, so q @ k^T reaches ~100^2 * |x|^2 > 65504: fp16 overflows there only."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.logits = Logits()
        with torch.no_grad():
            for layer in (self.q, self.k):
                layer.weight.copy_(100 * torch.eye(d))
                layer.bias.zero_()

    def forward(self, x):
        attn = self.logits(self.q(x), self.k(x).transpose(-1, -2)).softmax(-1)
        return attn @ self.v(x)

    def fp32_logits(self, x):
        """The planted node's value in fp32, computed without amp_fx."""
        return self.q(x) @ self.k(x).transpose(-1, -2)


class BigBackward(nn.Module):
    """fc2's weights are large: its forward fits fp16, but the gradient it sends to its input does not."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, 4)
        with torch.no_grad():
            self.fc2.weight.mul_(2000.0)
            self.fc2.bias.zero_()

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class IllConditioned(nn.Module):
    """fc reads h = inp(x) + 1000 and its rows sum to zero: the offset cancels, bf16's rounding of h does not."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.fc = nn.Linear(d, d)
        self.out = nn.Linear(d, 4)
        with torch.no_grad():
            self.fc.weight.sub_(self.fc.weight.mean(1, keepdim=True))

    def forward(self, x):
        h = self.inp(x) + 1000.0
        return self.out(torch.relu(self.fc(h)))
