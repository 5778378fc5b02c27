"""O2's update alone, chunked against plain route (issue 41): ``scaler.step(mw); scaler.update()`` on fixed gradients.

Run from a checkout::

    python benchmarks/bench_o2_update.py --optimizer sgd      # or adamw; --rounds, --chunk-mib

The benchmark MLP's parameters (6 x (Linear 1024, LayerNorm 1024), as ``bench_o2_step.py``), converted to O2
bf16, each with a fixed random bf16 gradient; two ``MasterWeightOptimizer`` + ``LossScaler(dtype=bf16)`` over
copies of it: ``chunked`` (the route amp_fx takes) and ``plain`` (a no-op step pre-hook on the inner optimizer
keeps the chunked route off). No forward or backward: what differs between the routes is only the update.
Interleaved rounds (the order alternates), ``repeats`` updates each, the process's CPU time; prints the
median update time of each route and the median of the per-round ratios chunked / plain with quartiles.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

import amp_fx  # noqa: E402
from amp_fx.runtime import chunked_step  # noqa: E402
from bench_measure import spread  # noqa: E402
from bench_o2_step import make_mlp  # noqa: E402
from benchmark import cpu_capability  # noqa: E402

OPTIMIZERS = {"sgd": (torch.optim.SGD, {"lr": 1e-6, "momentum": 0.9}), "adamw": (torch.optim.AdamW, {"lr": 1e-6})}


def build(base: torch.nn.Module, optimizer: str, chunked: bool):
    model = copy.deepcopy(base)
    gm = amp_fx.convert(model, "O2", dtype=torch.bfloat16)
    cls, options = OPTIMIZERS[optimizer]
    mw = amp_fx.MasterWeightOptimizer(cls(model.parameters(), **options), gm)
    if not chunked:
        mw.optimizer.register_step_pre_hook(lambda *args: None)
    gen = torch.Generator().manual_seed(1)
    for p in gm.parameters():
        p.grad = (torch.randn(p.shape, generator=gen) * 1e-3).to(p.dtype)
    return mw, amp_fx.LossScaler(dtype=torch.bfloat16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizer", default="sgd", choices=tuple(OPTIMIZERS))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunk-mib", type=float, default=None, help="override chunked_step.CHUNK_BYTES")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.chunk_mib is not None:
        chunked_step.CHUNK_BYTES = int(args.chunk_mib * 2**20)
    torch.manual_seed(0)
    base = make_mlp()
    routes = {"chunked": build(base, args.optimizer, True), "plain": build(base, args.optimizer, False)}
    times: dict[str, list[float]] = {name: [] for name in routes}
    for name, (mw, scaler) in routes.items():
        for _ in range(2):
            scaler.step(mw)
            scaler.update()
        print(f"{name}: {mw.last_step_route}")
    for r in range(args.rounds):
        for name in (list(routes) if r % 2 == 0 else list(routes)[::-1]):
            mw, scaler = routes[name]
            each = []
            for _ in range(args.repeats):
                start = time.process_time()
                scaler.step(mw)
                scaler.update()
                each.append(time.process_time() - start)
            times[name].append(statistics.median(each))
    ratios = [a / b for a, b in zip(times["chunked"], times["plain"])]
    low, high = spread(ratios)
    print(f"torch {torch.__version__}, 1 thread; {cpu_capability()}; {args.optimizer}; "
          f"CHUNK_BYTES {chunked_step.CHUNK_BYTES}; {args.rounds} rounds x {args.repeats}; clock: cpu")
    print(f"update ms: chunked {statistics.median(times['chunked']) * 1e3:.2f}, "
          f"plain {statistics.median(times['plain']) * 1e3:.2f}; chunked / plain "
          f"{statistics.median(ratios):.3f} [{low:.3f}, {high:.3f}]")


if __name__ == "__main__":
    main()
