"""The figures the O1 cast code's design rests on, measured (docs/performance.md, "## O1 casts").

Run from a checkout::

    python benchmarks/bench_o1_casts.py                # both measurements, 1 thread, CPU-time clock
    python benchmarks/bench_o1_casts.py --only cache   # or: sink

``cache``: what ``graph_ops/cast_cache.py`` could check to see a write through
``p.data`` (which bumps no version counter), against the cast a cached read
saves, on one 1024x1024 fp32 weight: the cached read itself, the bf16 cast, a
``sum`` of the weight (cheaper, and not even sound: a write can keep it),
``torch.equal`` against a kept copy (sound, and dearer than the cast).

``sink``: ``passes/insert_casts.py`` moves each cast of a parameter to just
before its first reader (``_sink_to_first_reader``).  In a Dynamo graph the
parameters are placeholders, so without the move every cast sits at the top and
autograd casts every low weight gradient back last, keeping them all alive to
the end of backward.  Peak memory of a compiled training step
(``torch.compile(backend=amp_fx.backend(..., inner=...))``, inductor by default,
``--inner aot_eager`` for the graph's allocations as written), with and without
the move, 2-layer encoder.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from bench_measure import cpu_profile  # noqa: E402

__all__ = ["cache_checks", "sink_peaks", "main"]

MIB = 2.0**20


def _median_us(fn: Callable[[], object], rounds: int, repeats: int) -> float:
    """Median over ``rounds`` of the CPU time per call of ``fn`` (``repeats`` calls a round), in microseconds."""
    fn()
    per_round = []
    for _ in range(rounds):
        start = time.process_time()
        for _ in range(repeats):
            fn()
        per_round.append((time.process_time() - start) / repeats * 1e6)
    return statistics.median(per_round)


def cache_checks(rounds: int = 9, repeats: int = 50) -> dict[str, float]:
    """CPU microseconds of a cached read, the cast it saves, and two checks that could see a ``p.data`` write."""
    from amp_fx.graph_ops.cast_cache import cached_cast, clear_cast_cache

    weight = torch.nn.Parameter(torch.randn(1024, 1024))
    kept = weight.detach().clone()
    with torch.no_grad():
        cached_cast(weight, torch.bfloat16)  # fills the cache: later calls are cached reads
        figures = {
            "cached read (cached_cast under no_grad)": _median_us(lambda: cached_cast(weight, torch.bfloat16), rounds, repeats),
            "the bf16 cast it saves": _median_us(lambda: weight.to(torch.bfloat16), rounds, repeats),
            "sum of the weight (not sound)": _median_us(lambda: weight.sum(), rounds, repeats),
            "torch.equal against a kept copy": _median_us(lambda: torch.equal(weight, kept), rounds, repeats),
        }
    clear_cast_cache()
    return figures


def sink_peaks(inner: str = "inductor", layers: int = 2, d: int = 64, seq: int = 32, batch: int = 4) -> dict[str, float]:
    """Peak MiB of one compiled O1 training step, with and without moving parameter casts to their readers."""
    import amp_fx
    import amp_fx.passes.insert_casts as insert_casts

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
    x = torch.randn(batch, seq, d)
    peaks = {}
    for label, patch in (("casts before their first reader (shipped)", None),
                         ("casts at the top of the graph", mock.patch.object(insert_casts, "_sink_to_first_reader",
                                                                             lambda casts, keep: None))):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=amp_fx.backend(level="O1", dtype=torch.bfloat16, inner=inner))

        def step() -> None:
            model.zero_grad(set_to_none=True)
            compiled(x).float().square().mean().backward()

        if patch is None:
            step()
            step()
        else:
            with patch:
                step()
                step()
        model.zero_grad(set_to_none=True)
        peaks[label] = cpu_profile(step)[0] / MIB
    torch._dynamo.reset()
    return peaks


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("cache", "sink"), default=None)
    parser.add_argument("--inner", default="inductor", help="torch.compile backend under amp_fx for sink (default inductor)")
    parser.add_argument("--d", type=int, default=64, help="the encoder's width for sink (default 64)")
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    results: dict = {}
    try:
        print(f"torch {torch.__version__}, 1 thread, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
        if args.only in (None, "cache"):
            results["cache"] = cache_checks()
            print("\ncast cache: what a check for a p.data write would cost (1024x1024 fp32 weight, CPU time per call)")
            for label, us in results["cache"].items():
                print(f"  {label}: {us:.1f} us")
        if args.only in (None, "sink"):
            results["sink"] = sink_peaks(args.inner, d=args.d)
            print(f"\ncompiled O1 training step ({args.inner}), 2-layer encoder d{args.d}, batch 4x32: peak memory")
            for label, mib in results["sink"].items():
                print(f"  {label}: {mib:.3f} MiB")
    finally:
        torch.set_num_threads(threads)
    return results


if __name__ == "__main__":
    main()
