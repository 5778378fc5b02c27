"""Quickstart: convert a small model at each Apex level, read the report, train a few steps.

Run: python examples/quickstart.py
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_fx


class TinyClassifier(nn.Module):
    """Conv + BatchNorm stem, a LayerNorm'd MLP head: a bit of every table."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.conv = nn.Conv2d(1, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.norm = nn.LayerNorm(16 * 4 * 4)
        self.fc1 = nn.Linear(16 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2)
        x = self.norm(x.flatten(1))
        return self.fc2(F.gelu(self.fc1(x)))


def main() -> None:
    torch.manual_seed(0)
    model = TinyClassifier()
    x, y = torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,))

    with torch.no_grad():
        reference = model(x)
    print("level  out dtype  max |err| vs fp32  casts/forward  weight casts")
    for level in ("O0", "O1", "O2", "O3"):
        converted = amp_fx.convert(model, level, dtype=torch.bfloat16)
        with torch.no_grad():
            out = converted(x)
        totals = converted.amp_report.totals()
        err = (out.float() - reference).abs().max().item()
        print(f"{level:5}  {str(out.dtype):10} {err:17.4f}  {totals['casts_inserted']:13d}  {totals['weight_casts']:12d}")

    converted = amp_fx.convert(model, "O1", dtype=torch.bfloat16)
    print("\nThe O1 report:\n")
    print(converted.amp_report)
    print("\nThe rewritten graph:\n")
    print(converted.code)

    # Training: the GradScaler protocol (bf16 needs no scaling; the scaler knows).
    scaler = amp_fx.LossScaler(dtype=torch.bfloat16)
    optimizer = torch.optim.SGD(converted.parameters(), lr=0.1)
    for step in range(5):
        optimizer.zero_grad()
        loss = F.cross_entropy(converted(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
