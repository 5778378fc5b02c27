"""The figures the O1 cast code's design rests on, measured (docs/performance.md, "## O1 casts").

Run from a checkout::

    python benchmarks/bench_o1_casts.py                # both measurements, 1 thread, CPU-time clock
    python benchmarks/bench_o1_casts.py --only cache   # or: sink, levers
    python benchmarks/bench_o1_casts.py --only levers --model mlp --rounds 11

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

``levers``: what O1's step spends above autocast's, one difference at a time
(``benchmark.py --cast-diff`` lists them; the benchmark's models and steps,
``SGD(fused=True)``, CPU-time clock, interleaved rounds): O1 as shipped; with
the fused LayerNorm's backward as autocast runs it (CPU's one mixed-dtype
kernel for the input, weight and bias gradients, the last two summed in bf16,
instead of two upcasts and an fp32 kernel for them); without the
``LossScaler`` (bf16 needs no scaling; the scaler's inf/NaN check is a pass
over every gradient autocast's recipe does not make); both.  The variants are
patched in this process only, to size levers that live in other modules.
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

__all__ = ["cache_checks", "sink_peaks", "o1_levers", "main"]

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


def _layer_norm_backward_as_autocast(ctx, grad, _grad_mean=None, _grad_rstd=None):
    """``LayerNormFp32Stats.backward`` as autocast's ``NativeLayerNormBackward0``: one mixed-dtype kernel for all three."""
    from amp_fx.graph_ops import fused_norms

    x, mean, rstd, weight, bias = ctx.saved_tensors
    needs_x, _, needs_w, needs_b, _ = ctx.needs_input_grad
    w, b = fused_norms._affine(x, ctx.normalized_shape, weight, bias)
    dx, dw, db = torch.ops.aten.native_layer_norm_backward(grad, x, ctx.normalized_shape, mean, rstd, w, b,
                                                           [needs_x, needs_w and weight is not None, needs_b and bias is not None])
    return dx, None, dw if weight is not None else None, db if bias is not None else None, None


def layer_norm_grad_errors(rows: int = 256, width: int = 1024) -> dict[str, float]:
    """Relative error against fp64 of a bf16 LayerNorm's weight gradient: CPU's mixed kernel (autocast's) vs amp_fx's."""
    torch.manual_seed(0)
    x, grad = torch.randn(rows, width).bfloat16(), torch.randn(rows, width).bfloat16()
    weight, bias = torch.randn(width) * 0.1 + 1, torch.randn(width) * 0.1
    _, mean, rstd = torch.native_layer_norm(x, (width,), weight, bias, 1e-5)
    reference = (grad.double() * (x.double() - mean.double()) * rstd.double()).sum(0)
    backward = torch.ops.aten.native_layer_norm_backward
    mixed = backward(grad, x, (width,), mean, rstd, weight, bias, [False, True, False])[1]
    upcast = backward(grad.float(), x.float(), (width,), mean, rstd, weight, bias, [False, True, False])[1]

    def error(dw: torch.Tensor) -> float:
        return ((dw.double() - reference).norm() / reference.norm()).item()

    return {"autocast (CPU's mixed kernel, summed in bf16)": error(mixed),
            "amp_fx O1 (two upcasts, fp32 kernel)": error(upcast)}


def o1_levers(model: str, rounds: int = 11, repeats: int = 3, preset: str = "issue14") -> dict[str, tuple[float, float, float]]:
    """Per variant: (median ms per step, median ratio to autocast, its lower and upper quartile)."""
    from bench_models import build_case
    from bench_modes import build_trainer
    from amp_fx.graph_ops import fused_norms

    case = build_case(model, preset=preset, device="cpu")
    autocast = build_trainer("torch.autocast", case.model, case.inputs, "cpu", torch.bfloat16, "aot_eager", "fused")
    o1 = build_trainer("amp_fx O1", case.model, case.inputs, "cpu", torch.bfloat16, "aot_eager", "fused")
    shipped_backward, scaler = fused_norms.LayerNormFp32Stats.backward, o1.scaler
    as_autocast = staticmethod(_layer_norm_backward_as_autocast)
    variants = {"O1 as shipped": (shipped_backward, scaler), "O1, LayerNorm backward as autocast's": (as_autocast, scaler),
                "O1, no LossScaler": (shipped_backward, None), "O1, both": (as_autocast, None)}
    for trainer in (autocast, o1):
        trainer.warm_up(3)
    times: dict[str, list[float]] = {"torch.autocast": [], **{name: [] for name in variants}}
    order = list(times)
    try:
        for index in range(rounds):
            for name in order if index % 2 == 0 else order[::-1]:
                trainer = autocast
                if name in variants:
                    fused_norms.LayerNormFp32Stats.backward, o1.scaler = variants[name]
                    trainer = o1
                trainer.zero()
                trainer.work()
                start = time.process_time()
                for _ in range(repeats):
                    trainer.zero()
                    trainer.work()
                times[name].append((time.process_time() - start) / repeats)
    finally:
        fused_norms.LayerNormFp32Stats.backward, o1.scaler = shipped_backward, scaler
    out = {}
    for name, per_round in times.items():
        ratios = [t / b for t, b in zip(per_round, times["torch.autocast"])]
        q = statistics.quantiles(ratios, n=4, method="inclusive")
        out[name] = (statistics.median(per_round) * 1e3, statistics.median(ratios), q[0], q[2])
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("cache", "sink", "levers"), default=None)
    parser.add_argument("--model", default="mlp", help="comma-separated models for levers (default mlp)")
    parser.add_argument("--rounds", type=int, default=11, help="interleaved rounds for levers (default 11)")
    parser.add_argument("--inner", default="inductor", help="torch.compile backend under amp_fx for sink (default inductor)")
    parser.add_argument("--d", type=int, default=64, help="the encoder's width for sink (default 64)")
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    results: dict = {}
    try:
        from benchmark import cpu_capability

        print(f"torch {torch.__version__}, 1 thread, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
        print(cpu_capability())
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
        if args.only in (None, "levers"):
            print("\nLayerNorm weight gradient, 256x1024 bf16, relative error against fp64:")
            for label, err in layer_norm_grad_errors().items():
                print(f"  {label}: {err:.1e}")
            for model in args.model.split(","):
                results[f"levers {model}"] = figures = o1_levers(model, rounds=args.rounds)
                print(f"\nO1 levers, {model} (issue14 sizes, SGD(fused=True), CPU-time clock, {args.rounds} interleaved rounds "
                      "x 3 steps): ms/step, x autocast [quartiles]")
                for name, (ms, ratio, low, high) in figures.items():
                    print(f"  {name}: {ms:.1f} ms, {ratio:.3f} [{low:.3f}-{high:.3f}]")
    finally:
        torch.set_num_threads(threads)
    return results


if __name__ == "__main__":
    main()
