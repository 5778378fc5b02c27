"""The fused-norm lever alone: a GroupNorm CNN trained at O1 with and without ``fuse_precision``, against autocast.

``benchmarks/benchmark.py --fused`` prints one table.  The model is
:class:`bench_models.ConvNet` with ``nn.GroupNorm`` in place of BatchNorm
(GroupNorm is on the fp32 list, fed by a low convolution and read by one: the
case :mod:`amp_fx.passes.fuse_precision` fuses).  Each mode trains its own copy
with SGD; steps are timed in interleaved rounds (ratio to autocast per round,
median and quartiles), casts counted per step with
:class:`bench_measure.CastCounter`.
"""

from __future__ import annotations

import copy
import statistics
from typing import Any

import torch
import torch.nn as nn

import amp_fx
from bench_measure import CastCounter, RoundTimer, spread
from bench_models import ConvNet

__all__ = ["bench_fused", "print_fused", "GroupNormNet"]

FUSED_MODES = ("torch.autocast", "amp_fx O1", "amp_fx O1 fuse_precision=False")


class GroupNormNet(ConvNet):
    """:class:`ConvNet` with GroupNorm (8 groups) instead of BatchNorm."""

    def __init__(self, channels: int = 3, width: int = 32, classes: int = 10):
        super().__init__(channels, width, classes)
        self.norms = nn.ModuleList(nn.GroupNorm(8, n.num_features) for n in self.norms)


def bench_fused(args: Any, dtype: torch.dtype, batch: int = 16, image: int = 32, width: int = 32) -> dict:
    """Time the three modes' training steps; return rows by mode."""
    torch.manual_seed(0)
    base = GroupNormNet(width=width)
    x = torch.randn(batch, 3, image, image, device=args.device)
    labels = torch.randint(0, 10, (batch,), device=args.device)
    steps, casts, fused = {}, {}, {}
    for mode in FUSED_MODES:
        model = copy.deepcopy(base).to(args.device)
        if mode == "torch.autocast":
            module = model
        else:
            module = amp_fx.convert(model, "O1", dtype=dtype, fuse_precision=mode == "amp_fx O1")
            fused[mode] = module.amp_report.passes.get("fuse_precision", {}).get("fused", 0)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9, foreach=True)

        def step(module: Any = module, opt: Any = opt, autocast: bool = mode == "torch.autocast") -> None:
            opt.zero_grad(set_to_none=True)
            with torch.autocast(args.device, dtype=dtype, enabled=autocast):
                loss = module(x, labels)
            loss.backward()
            opt.step()

        for _ in range(max(2, args.warmup)):
            step()
        with CastCounter() as counter:
            step()
        steps[mode], casts[mode] = step, counter.count
    timer = RoundTimer(steps, torch.cuda.synchronize if args.device == "cuda" else (lambda: None))
    timer.run(args.rounds, args.repeats)
    rows = {}
    for mode in FUSED_MODES:
        ratios = timer.ratios(mode, "torch.autocast")
        rows[mode] = {"ms": timer.stats[mode].median * 1e3, "ratio": statistics.median(ratios), "spread": spread(ratios),
                      "casts": casts[mode], "fused": fused.get(mode, "-")}
    return {"description": f"GroupNorm CNN width {width}, batch {batch}x3x{image}x{image}", "rows": rows}


def print_fused(result: dict) -> None:
    print(f"\nfused norms, training step: {result['description']}")
    print("| mode | ms/step | x autocast [IQR] | casts/step | norms fused |\n|---|---|---|---|---|")
    for mode, row in result["rows"].items():
        lo, hi = row["spread"]
        print(f"| {mode} | {row['ms']:.2f} | {row['ratio']:.3f} [{lo:.3f}-{hi:.3f}] | {row['casts']} | {row['fused']} |", flush=True)
