"""Inference throughput: amp_fx O1 (weight casts cached) against torch.autocast and fp32, in eval() under no_grad.

``benchmarks/benchmark.py --inference`` prints one table per model and batch
size.  Modes, each on its own copy of the model in ``eval()`` under
``torch.no_grad()``:

- ``fp32``: the model as it is;
- ``torch.autocast``: the model under ``torch.autocast`` (it casts every
  weight on every forward);
- ``amp_fx O1``: ``convert(O1)``: its weight casts are cached after the first
  forward (:mod:`amp_fx.graph_ops.cast_cache`);
- ``amp_fx O1 no cache``: ``convert(O1, cache_casts=False)``, the lever off.

Forwards are timed in interleaved rounds (:class:`bench_measure.RoundTimer`);
ratios are per round against ``torch.autocast`` and against ``fp32`` (median
and quartiles).  "param casts/fwd" counts the casts that read a parameter in
one forward after the warm-up, with :class:`bench_measure.CastCounter`'s rule.
"""

from __future__ import annotations

import copy
import statistics
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import amp_fx
from bench_measure import RoundTimer, spread
from bench_models import build_case

__all__ = ["INFERENCE_MODES", "bench_inference", "print_inference", "ParamCastCounter"]

INFERENCE_MODES = ("fp32", "torch.autocast", "amp_fx O1", "amp_fx O1 no cache")


class ParamCastCounter(TorchDispatchMode):
    """Counts dtype-changing casts whose source is one of ``params`` (``_to_copy``, or ``to`` under inference mode)."""

    def __init__(self, params: Any) -> None:
        super().__init__()
        self.ptrs = {p.data_ptr() for p in params}
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if (source is not None and func.overloadpacket.__name__ in ("_to_copy", "to") and isinstance(out, torch.Tensor)
                and out.dtype != source.dtype and source.data_ptr() in self.ptrs):
            self.count += 1
        return out


def _forward(mode: str, base: torch.nn.Module, inputs: tuple, dtype: torch.dtype, device: str) -> tuple[Callable, list]:
    """A no-grad forward of ``mode`` and the parameters it reads."""
    model = copy.deepcopy(base).eval()
    params = list(model.parameters())
    if mode.startswith("amp_fx"):
        module = amp_fx.convert(model, "O1", dtype=dtype, cache_casts=mode == "amp_fx O1")
    else:
        module = model

    def run() -> None:
        with torch.no_grad():
            if mode == "torch.autocast":
                with torch.autocast(device, dtype=dtype):
                    module(*inputs)
            else:
                module(*inputs)
    return run, params


def bench_inference(name: str, batch: int, args: Any, dtype: torch.dtype) -> dict:
    """Time every inference mode on model ``name`` at ``batch``; return rows by mode."""
    case = build_case(name, preset=args.preset, device=args.device, batch=batch)
    steps, casts = {}, {}
    for mode in INFERENCE_MODES:
        run, params = _forward(mode, case.model, case.inputs, dtype, args.device)
        for _ in range(max(2, args.warmup)):
            run()
        with ParamCastCounter(params) as counter:
            run()
        steps[mode], casts[mode] = run, counter.count
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    timer = RoundTimer(steps, sync)
    timer.run(args.rounds, max(args.repeats, 5))
    rows = {}
    for mode in INFERENCE_MODES:
        vs_autocast, vs_fp32 = timer.ratios(mode, "torch.autocast"), timer.ratios(mode, "fp32")
        rows[mode] = {"ms": timer.stats[mode].median * 1e3, "param_casts": casts[mode],
                      "speedup_autocast": statistics.median(1 / r for r in vs_autocast),
                      "speedup_fp32": statistics.median(1 / r for r in vs_fp32),
                      "spread_autocast": spread([1 / r for r in vs_autocast])}
    return {"name": name, "batch": batch, "description": case.description, "rows": rows}


def print_inference(result: dict) -> None:
    print(f"\ninference, eval() + no_grad: {result['description'].rsplit(', batch', 1)[0]}, batch {result['batch']}")
    print("| mode | ms/forward | speed x autocast [IQR] | speed x fp32 | param casts/fwd |\n|---|---|---|---|---|")
    for mode, row in result["rows"].items():
        lo, hi = row["spread_autocast"]
        print(f"| {mode} | {row['ms']:.2f} | {row['speedup_autocast']:.2f} [{lo:.2f}-{hi:.2f}] | "
              f"{row['speedup_fp32']:.2f} | {row['param_casts']} |", flush=True)


def inference_targets(result: dict) -> list[tuple[str, bool, str]]:
    """Issue 14's inference targets for one table: (target, met, figures)."""
    row = result["rows"]["amp_fx O1"]
    return [("O1 inference: no parameter cast after the first forward", row["param_casts"] == 0, f"{row['param_casts']} casts"),
            ("O1 inference >= 1.3x autocast's throughput", row["speedup_autocast"] >= 1.3, f"{row['speedup_autocast']:.2f}x"),
            ("O1 inference >= 1.0x fp32's throughput", row["speedup_fp32"] >= 1.0, f"{row['speedup_fp32']:.2f}x")]
