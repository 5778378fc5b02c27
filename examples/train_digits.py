"""Train a small CNN on scikit-learn's digits at O0-O3 in fp16 and bf16 and print one table.

    python examples/train_digits.py                 # GradScaler-style API
    python examples/train_digits.py --api apex      # amp_fx.initialize + amp_fx.scale_loss
    python examples/train_digits.py --epochs 20 --threads 2

The digits set (1797 8x8 grey images of 0-9) ships with scikit-learn, so this
needs no download. The split is fixed (1397 train / 400 test) and every run
starts from the same weights and sees the batches in the same order, so the
accuracy differences come from precision alone.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from _common import print_rows, setup_run
import amp_fx
from amp_fx.runtime import LossScaler, MasterWeightOptimizer

LR, MOMENTUM, BATCH = 0.1, 0.9, 64  # LR: the one-cycle schedule's peak
RUNS = (("O0", None), ("O1", torch.float16), ("O1", torch.bfloat16), ("O2", torch.float16),
        ("O2", torch.bfloat16), ("O3", torch.float16), ("O3", torch.bfloat16))


def load_digits(test_size: int = 400, seed: int = 0):
    """(x_train, y_train, x_test, y_test): images as (N, 1, 8, 8) float32 in [0, 1], labels int64."""
    from sklearn.datasets import load_digits as sk_load_digits

    data = sk_load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    test, train = order[:test_size], order[test_size:]
    return x[train], y[train], x[test], y[test]


class DigitsCNN(nn.Module):
    """conv-BN-ReLU-pool, conv-ReLU, linear: ~3k parameters (fp16 convolutions are slow on CPUs)."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.head = nn.Linear(2 * width * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.relu(self.conv2(x))
        return self.head(x.flatten(1))


@dataclass
class Result:
    level: str
    dtype: str
    accuracy: float  # percent on the test split
    final_scale: float
    skipped: int
    sec_per_epoch: float


def _setup(model: nn.Module, level: str, dtype, api: str):
    """(module to train, optimizer to step, scaler or None for Apex, a function returning the scalers)."""
    if api == "apex":
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        gm, optimizer = amp_fx.initialize(model, optimizer, opt_level=level, dtype=dtype, verbosity=0)
        return gm, optimizer, None, amp_fx.apex.amp.loss_scalers()
    gm = amp_fx.convert(model, level, dtype=dtype)
    if level == "O2":  # the model's fp32 parameters are the masters
        optimizer = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM), gm)
    else:  # O0/O1 share the model's parameters; O3 steps the module's low ones
        optimizer = torch.optim.SGD(gm.parameters(), lr=LR, momentum=MOMENTUM)
    scaler = LossScaler(dtype=dtype or torch.float32)  # scales for fp16, off (but still skipping) otherwise
    return gm, optimizer, scaler, [scaler]


def evaluate(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Test accuracy in percent (eval mode: batch norm uses its running statistics)."""
    module.eval()
    with torch.no_grad():
        correct = (module(x).float().argmax(1) == y).sum().item()
    module.train()
    return 100.0 * correct / len(y)


def train(level: str, dtype, data, epochs: int = 10, api: str = "gradscaler", seed: int = 0) -> Result:
    """Train one :class:`DigitsCNN` at ``level`` / ``dtype`` and measure it."""
    x_train, y_train, x_test, y_test = data
    torch.manual_seed(seed)
    model = DigitsCNN()
    gm, optimizer, scaler, scalers = _setup(model, level, dtype, api)
    steps_per_epoch = -(-len(y_train) // BATCH)
    # One cycle settles training at a low learning rate, so runs that differ only in rounding end
    # at the same accuracy instead of wherever the last noisy steps left them.
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=LR, total_steps=epochs * steps_per_epoch)
    gen = torch.Generator().manual_seed(seed + 1)
    start = time.perf_counter()
    for _ in range(epochs):
        order = torch.randperm(len(y_train), generator=gen)
        for i in range(0, len(order), BATCH):
            idx = order[i:i + BATCH]
            optimizer.zero_grad()
            loss = F.cross_entropy(gm(x_train[idx]).float(), y_train[idx])
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                scaler.step_scheduler(schedule)  # advances only after a real step
            else:
                with amp_fx.scale_loss(loss, optimizer) as scaled_loss:
                    scaled_loss.backward()
                if optimizer.step() is not False:  # False: skipped (inf/NaN gradients)
                    schedule.step()
    elapsed = time.perf_counter() - start
    return Result(level, "fp32" if dtype is None else str(dtype).replace("torch.", ""),
                  evaluate(gm, x_test, y_test), scalers[0].get_scale(), sum(s.skipped_steps for s in scalers),
                  elapsed / epochs)


def main(argv=None) -> list[Result]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--api", choices=("gradscaler", "apex"), default="gradscaler")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest for a model this small)")
    args = parser.parse_args(argv)
    setup_run()
    torch.set_num_threads(args.threads)
    data = load_digits()
    results = [train(level, dtype, data, args.epochs, args.api) for level, dtype in RUNS]
    rows = [("level", "dtype", "test acc %", "vs O0", "final loss scale", "skipped steps", "s / epoch")]
    base = results[0].accuracy
    for r in results:
        rows.append((r.level, r.dtype, f"{r.accuracy:.2f}", f"{r.accuracy - base:+.2f}", f"{r.final_scale:g}",
                     r.skipped, f"{r.sec_per_epoch:.3f}"))
    print_rows(f"digits: {len(data[1])} train / {len(data[3])} test images, {args.epochs} epochs, "
               f"SGD(momentum={MOMENTUM}), one-cycle LR to {LR}, batch {BATCH}, {args.api} API, "
               f"{torch.get_num_threads()} thread(s)", rows)
    return results


if __name__ == "__main__":
    main()
