"""Per-step time of O2's master-weight step against autocast + an fp32 optimizer and against O1 (issue 14).

Run from a checkout::

    python examples/bench_o2_step.py                      # AdamW, 9 rounds x 3 steps, 1 thread
    python examples/bench_o2_step.py --optimizer sgd --rounds 15

The model is an MLP of 6 x (Linear 1024->1024, GELU, LayerNorm), batch 256,
bf16 on CPU, MSE loss computed outside the module. Every mode trains its own
copy with the same optimizer class and learning rate:

- ``autocast``: ``torch.autocast`` + the optimizer over the fp32 parameters,
  ``foreach``/``fused`` left unset (torch steps CPU tensors one at a time);
  no scaler, as PyTorch's bf16 recipe. The baseline of every ratio.
- ``autocast fused``: the same with ``fused=True`` (SGD: ``foreach=True``),
  the faster step any autocast user can ask for.
- ``O1`` / ``O1 fused``: ``amp_fx.convert(model, "O1")`` and the same two
  optimizers over its (fp32) parameters, with ``amp_fx.LossScaler`` (bf16: no
  scaling, but the inf/NaN check and skip).
- ``O2``: ``amp_fx.convert(model, "O2")`` + ``MasterWeightOptimizer`` over
  the fp32 masters + ``LossScaler``: the lean step (one gradient copy per
  dtype group, the step fused or foreach as ``MasterWeightOptimizer`` chooses
  where the optimizer left it unset, one copy back).
- ``O2 loop``: the same with ``foreach=False``, i.e. the one-at-a-time step
  the inner optimizer took before ``MasterWeightOptimizer`` chose one.

Timing: modes run in interleaved rounds (rotated order), ``repeats`` steps
each; a mode's time in a round is the median of its steps, divided by the
baseline's in the same round; the table gives the median of those per-round
ratios and their quartiles. ``update`` is the part of the step after
``backward()``: scaler check and unscale, gradient copies, optimizer step,
copy back.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

import amp_fx  # noqa: E402
from bench_measure import spread  # noqa: E402
from benchmark import cpu_capability  # noqa: E402

__all__ = ["main", "make_mlp", "build_modes"]

BASELINE = "autocast"
OPTIMIZERS: dict[str, tuple[type, dict, dict]] = {
    # name -> (class, options, the faster implementation an autocast user can choose)
    "adamw": (torch.optim.AdamW, {"lr": 1e-4}, {"fused": True}),
    "adam": (torch.optim.Adam, {"lr": 1e-4}, {"fused": True}),
    "sgd": (torch.optim.SGD, {"lr": 1e-4, "momentum": 0.9}, {"foreach": True}),
}


def make_mlp(width: int = 1024, depth: int = 6) -> nn.Module:
    """``depth`` x (Linear width->width, GELU, LayerNorm)."""
    return nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width))])


class Mode:
    """One way to train: a module to run, an optimizer, an optional scaler and autocast; ``step()`` times its update."""

    def __init__(self, module: Callable, opt: Any, scaler: Any, autocast: bool, data: tuple) -> None:
        self.module, self.opt, self.scaler, self.autocast, self.data = module, opt, scaler, autocast, data
        self.last_update = float("nan")

    def step(self) -> None:
        x, y = self.data
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            out = self.module(x)
        loss = F.mse_loss(out.float(), y)
        loss = loss if self.scaler is None else self.scaler.scale(loss)
        loss.backward()
        start = time.perf_counter()
        if self.scaler is None:
            self.opt.step()
        else:
            self.scaler.step(self.opt)
            self.scaler.update()
        self.last_update = time.perf_counter() - start

    def skipped(self) -> int:
        return int(getattr(self.scaler, "skipped_steps", 0) or 0)


def build_modes(base: nn.Module, data: tuple, optimizer: str) -> dict[str, Mode]:
    """Every mode on its own deep copy of ``base``."""
    cls, options, faster = OPTIMIZERS[optimizer]
    modes: dict[str, Mode] = {}
    for name in (BASELINE, "autocast fused", "O1", "O1 fused", "O2", "O2 loop"):
        model = copy.deepcopy(base)
        impl = faster if name.endswith("fused") else {"foreach": False} if name.endswith("loop") else {}
        if name.startswith("autocast"):
            modes[name] = Mode(model, cls(model.parameters(), **options, **impl), None, True, data)
        elif name.startswith("O1"):
            gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16)
            scaler = amp_fx.LossScaler(dtype=torch.bfloat16)
            modes[name] = Mode(gm, cls(gm.parameters(), **options, **impl), scaler, False, data)
        else:
            gm = amp_fx.convert(model, "O2", dtype=torch.bfloat16)
            mw = amp_fx.MasterWeightOptimizer(cls(model.parameters(), **options, **impl), gm)
            modes[name] = Mode(gm, mw, amp_fx.LossScaler(dtype=torch.bfloat16), False, data)
    return modes


def time_rounds(modes: dict[str, Mode], rounds: int, repeats: int) -> dict[str, dict[str, list[float]]]:
    """Per mode, per round: the median step seconds and median update seconds of ``repeats`` steps."""
    names = list(modes)
    out = {name: {"step": [], "update": []} for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:  # rotate: no mode always follows the same one
            steps, updates = [], []
            for _ in range(repeats):
                start = time.perf_counter()
                modes[name].step()
                steps.append(time.perf_counter() - start)
                updates.append(modes[name].last_update)
            out[name]["step"].append(statistics.median(steps))
            out[name]["update"].append(statistics.median(updates))
    return out


def ratio_cell(values: list[float], base: list[float]) -> str:
    ratios = [a / b for a, b in zip(values, base)]
    low, high = spread(ratios)
    return f"{statistics.median(ratios):5.2f} [{low:.2f}, {high:.2f}]"


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizer", default="adamw", choices=tuple(OPTIMIZERS))
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1: a shared machine)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    base = make_mlp()
    data = (torch.randn(args.batch, 1024), torch.randn(args.batch, 1024))
    modes = build_modes(base, data, args.optimizer)
    inner = modes["O2"].opt.param_groups[0]
    print(f"torch {torch.__version__}, {args.threads} thread(s); {cpu_capability()}")
    print(f"torch.ops.mkldnn._is_mkldnn_bf16_supported() = {torch.ops.mkldnn._is_mkldnn_bf16_supported()}")
    print(f"MLP 6 x (Linear 1024->GELU->LayerNorm), {sum(p.numel() for p in base.parameters())} parameters, "
          f"batch {args.batch}, bf16, {args.optimizer}; O2's inner step: foreach={inner['foreach']} "
          f"fused={inner.get('fused')}; {args.rounds} rounds x {args.repeats} steps")
    for mode in modes.values():
        for _ in range(args.warmup):
            mode.step()
    times = time_rounds(modes, args.rounds, args.repeats)
    base_t = times[BASELINE]
    print(f"\n{'mode':16} {'step ms':>8} {'ratio to autocast':>20} {'update ms':>10} {'update ratio':>20} skipped")
    for name, t in times.items():
        print(f"{name:16} {statistics.median(t['step']) * 1e3:8.1f} {ratio_cell(t['step'], base_t['step']):>20} "
              f"{statistics.median(t['update']) * 1e3:10.1f} {ratio_cell(t['update'], base_t['update']):>20} "
              f"{modes[name].skipped():7d}")
    return times


if __name__ == "__main__":
    main()
