"""What example inputs cost ``amp_fx.convert``: the dtype analysis fake-runs every op.

Converts the 96-layer encoder of :mod:`bench_scaling` (symbolic tracing) with
and without ``example_inputs`` and prints both times, their ratio and the
seconds of each pass.  Each figure is the best of ``--tries`` runs, the two
interleaved, so a slow spell of the machine hits both.

    python benchmarks/bench_convert_time.py [--layers 96] [--tries 3]
"""

from __future__ import annotations

import argparse
import time

import torch

import amp_fx
from bench_models import Encoder


def measure(layers: int, tries: int) -> dict:
    """Best seconds of convert() without and with example inputs, and the per-pass seconds of each."""
    torch.manual_seed(0)
    model = Encoder(128, 4, layers)
    example = (torch.randn(2, 16, 128), torch.randint(0, 10, (2,)))
    best = {"without": float("inf"), "with": float("inf")}
    passes = {}
    for _ in range(tries):
        for name, kwargs in (("without", {}), ("with", {"example_inputs": example})):
            start = time.perf_counter()
            gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16, **kwargs)
            seconds = time.perf_counter() - start
            if seconds < best[name]:
                best[name] = seconds
                passes[name] = {p: round(s["seconds"], 3) for p, s in gm.amp_report.passes.items()}
    return {"layers": layers, "nodes": len(gm.graph.nodes), **best, "ratio": best["with"] / best["without"], "passes": passes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=96)
    parser.add_argument("--tries", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    r = measure(args.layers, args.tries)
    print(f"encoder, {r['layers']} layers, {r['nodes']} nodes: convert {r['without']:.2f} s without example inputs, "
          f"{r['with']:.2f} s with them: ratio {r['ratio']:.2f}")
    for name in ("without", "with"):
        print(f"  {name:7} " + ", ".join(f"{p} {s}" for p, s in r["passes"][name].items()))


if __name__ == "__main__":
    main()
