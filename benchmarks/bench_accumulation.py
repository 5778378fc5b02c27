"""Gradient accumulation: k micro-batches per optimizer step, amp_fx O1/O2 against torch.autocast.

``benchmarks/benchmark.py --accumulation`` prints one table per model.  The
batch of the model's case is cut into ``--micro-batches`` pieces (default 4);
a step is ``zero_grad``, then forward and backward of each piece's loss / k,
then one optimizer step.  Every mode trains its own copy with
``SGD(momentum=0.9, foreach=True)`` (torch's fastest SGD on the device, on
every side).  Modes:

- ``torch.autocast``: casts every weight in every micro-batch's forward (its
  cast cache lives for one forward); no scaler for bf16, GradScaler for fp16;
- ``amp_fx O1``: ``convert(O1)``: casts each weight in every forward, too;
- ``amp_fx O1 step cache``: ``convert(O1, cache_casts="training")``: each
  weight cast once per optimizer step (:mod:`amp_fx.graph_ops.cast_cache`);
- ``amp_fx O2``: low parameters, masters through ``MasterWeightOptimizer``;
  the micro-batches accumulate in the low ``.grad`` (bf16 rounding k times);
- ``amp_fx O2 fp32 accum``: ``MasterWeightOptimizer(...,
  fp32_grad_accumulation=True)``: each low gradient added into the fp32
  master gradient as it is made (:mod:`amp_fx.runtime.fp32_grad_accumulation`).

amp_fx modes step through :class:`amp_fx.LossScaler` as amp_fx documents it.
Steps are timed in interleaved rounds (:class:`bench_measure.RoundTimer`),
ratios per round against ``torch.autocast`` (median and quartiles);
"casts/step" counts dtype-changing kernels in one step
(:class:`bench_measure.CastCounter`), "peak MiB" the step's transient peak
above what was allocated when it began, and "non-GEMM ms" the profiled self time
of every op but GEMMs, convolutions and attention, the better of two profiled
steps (:func:`bench_measure.profile_step`; CPU only).  On a CPU without native
bf16 GEMMs (AVX2) the emulated GEMMs are most of a step, the same in every mode,
so the non-GEMM ratio is the part the modes change.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
from typing import Any, Callable

import torch

import amp_fx
from amp_fx.runtime import LossScaler, MasterWeightOptimizer
from bench_measure import CastCounter, RoundTimer, profile_step, spread
from bench_models import build_case

__all__ = ["ACCUMULATION_MODES", "bench_accumulation", "print_accumulation", "accumulation_targets"]

ACCUMULATION_MODES = ("torch.autocast", "amp_fx O1", "amp_fx O1 step cache", "amp_fx O2", "amp_fx O2 fp32 accum")
LR = 1e-4


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9, foreach=True)


def _pieces(inputs: tuple, k: int) -> list[tuple]:
    """The case's batch cut into ``k`` micro-batches along dimension 0."""
    chunks = [t.chunk(k) for t in inputs]
    return [tuple(c[i] for c in chunks) for i in range(k)]


def _step_fn(mode: str, base: torch.nn.Module, micro: list[tuple], device: str, dtype: torch.dtype) -> Callable[[], None]:
    """One optimizer step of ``mode`` over the micro-batches ``micro`` (on its own copy of ``base``)."""
    model = copy.deepcopy(base)
    k = len(micro)
    region: Callable[[], Any] = contextlib.nullcontext
    scaler: Any = None
    if mode == "torch.autocast":
        module, opt = model, _sgd(model.parameters())
        region = lambda: torch.autocast(device, dtype=dtype)  # noqa: E731
        scaler = torch.amp.GradScaler(device) if dtype == torch.float16 else None
    elif mode.startswith("amp_fx O1"):
        module = amp_fx.convert(model, "O1", dtype=dtype, cache_casts="training" if mode.endswith("cache") else False)
        opt, scaler = _sgd(module.parameters()), LossScaler(dtype=dtype)
    else:
        module = amp_fx.convert(model, "O2", dtype=dtype)
        opt = MasterWeightOptimizer(_sgd(model.parameters()), module, fp32_grad_accumulation=mode.endswith("accum"))
        scaler = LossScaler(dtype=dtype)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        for inputs in micro:
            with region():
                loss = module(*inputs) / k
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
    return step


def bench_accumulation(name: str, args: Any, dtype: torch.dtype) -> dict:
    """Time every accumulation mode on model ``name``; return rows by mode."""
    k = args.micro_batches
    case = build_case(name, preset=args.preset, device=args.device, batch=getattr(args, "batch", None))
    if case.inputs[0].shape[0] < k:  # (the quick sizes): one sample per micro-batch at least
        case = build_case(name, preset=args.preset, device=args.device, batch=k)
    if case.inputs[0].shape[0] % k:
        raise ValueError(f"{name}: batch {case.inputs[0].shape[0]} does not split into {k} equal micro-batches; "
                         f"pass --batch a multiple of --micro-batches")
    micro = _pieces(case.inputs, k)
    steps, rows = {}, {}
    for mode in ACCUMULATION_MODES:
        step = _step_fn(mode, case.model, micro, args.device, dtype)
        for _ in range(max(2, args.warmup)):
            step()
        with CastCounter() as counter:
            step()
        profiled = [profile_step(step, args.device) for _ in range(2)]
        steps[mode], rows[mode] = step, {"casts": counter.count, "cast_bytes": counter.bytes,
                                         "peak_bytes": max(p[0] for p in profiled),
                                         "other_s": min(p[2] for p in profiled)}
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    timer = RoundTimer(steps, sync)
    timer.run(args.rounds, args.repeats)
    for mode in ACCUMULATION_MODES:
        ratios = timer.ratios(mode, "torch.autocast")
        rows[mode].update(ms=timer.stats[mode].median * 1e3, ratio=statistics.median(ratios), spread=spread(ratios),
                          other_ratio=rows[mode]["other_s"] / rows["torch.autocast"]["other_s"])
    return {"name": name, "k": k, "description": case.description, "rows": rows}


def print_accumulation(result: dict, capability: str = "") -> None:
    print(f"\ngradient accumulation, {result['k']} micro-batches per step: {result['description']}"
          + (f" ({capability})" if capability else ""))
    print("| mode | ms/step | x autocast [IQR] | non-GEMM ms | non-GEMM x | casts/step | peak MiB |\n"
          "|---|---|---|---|---|---|---|")
    for mode, row in result["rows"].items():
        lo, hi = row["spread"]
        print(f"| {mode} | {row['ms']:.1f} | {row['ratio']:.2f} [{lo:.2f}-{hi:.2f}] | {row['other_s'] * 1e3:.1f} | "
              f"{row['other_ratio']:.2f} | {row['casts']} ({row['cast_bytes'] / 2**20:.1f} MiB) | "
              f"{row['peak_bytes'] / 2**20:.1f} |", flush=True)


def accumulation_targets(result: dict) -> list[tuple[str, bool, str]]:
    """Issue 27's accumulation targets: (target, met, figures)."""
    rows, out = result["rows"], []
    for mode, limit in (("amp_fx O1 step cache", 0.85), ("amp_fx O2 fp32 accum", 0.70)):
        ratio = rows[mode]["ratio"]
        out.append((f"{mode} <= {limit}x autocast with {result['k']} micro-batches", ratio <= limit, f"{ratio:.2f}"))
    casts = rows["amp_fx O1 step cache"]["casts"]
    out.append(("O1 step cache casts <= autocast's", casts <= rows["torch.autocast"]["casts"],
                f"{casts} vs {rows['torch.autocast']['casts']}"))
    return out
