"""One-table GPU check: amp_fx O1/O2 against torch.autocast + GradScaler, fp16 and bf16, eager and compiled.

Run on a machine with one CUDA GPU (about 3 minutes; it stops starting rows
when ``--budget`` seconds have passed and marks the rest "not run")::

    python benchmarks/gpu_check.py
    python benchmarks/gpu_check.py --smoke      # tiny, CPU, compiled rows (bf16 only) with aot_eager: checks the script

It trains two models (the benchmark's ``MLP`` with LayerNorms and its ``GPT``
with a tied head at d 2048 and vocab 50257, the padding case: 50257 is not a
multiple of 8, so the head GEMM misses the tensor cores unless ``pad_gemm``
pads it) in every mode, with ``AdamW(fused=True)`` on every side:

- ``autocast``: ``torch.autocast`` + ``torch.amp.GradScaler`` (enabled for
  fp16 only, as PyTorch's recipes); the baseline of every ratio in its
  (model, dtype, eager/compiled) block.
- ``O1`` / ``O2``: ``amp_fx.convert`` (O2 with ``MasterWeightOptimizer``) and
  ``amp_fx.LossScaler``, with ``pad_gemm=True`` ("pad on") and ``False``
  ("pad off").
- compiled (``torch.compile``, inductor on a GPU): ``torch.compile(model)``
  under autocast; ``backend=amp_fx.backend(level="O1", inner="inductor")``;
  ``torch.compile(amp_fx.convert(model, "O2"))``.  Default ``pad_gemm`` there.

Per row: median step time of ``--steps`` timed steps after ``--warmup``
(synchronised), the ratio to its block's autocast row, and the peak memory
of the step (``torch.cuda.max_memory_allocated`` above what was allocated
before the row was built).  Rows run one after another (one model on the GPU
at a time); a row that fails prints its error in the table and the rest run.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

import amp_fx  # noqa: E402
from bench_models import GPT, MLP  # noqa: E402

__all__ = ["main", "HEADER", "SIZES", "plan_rows"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
HEADER = ("model", "dtype", "world", "mode", "pad_gemm", "ms/step", "x autocast", "peak MiB", "note")
# Sizes: full (one GPU) and smoke (CPU, seconds).  The GPT has one block: the padding case is its
# 50257-wide tied head, and one block keeps inductor's compile time inside the budget.
SIZES = {
    "full": {"mlp": dict(batch=4096, d_in=2048, hidden=2048, depth=6),
             "gpt": dict(batch=8, seq=512, d=2048, heads=16, layers=1, vocab=50257)},
    "smoke": {"mlp": dict(batch=8, d_in=32, hidden=32, depth=2),
              "gpt": dict(batch=2, seq=8, d=32, heads=2, layers=1, vocab=61)},
}
MIB = 2.0**20


@dataclass
class Row:
    model: str
    dtype: str
    world: str  # "eager" | "compiled"
    mode: str  # "autocast" | "O1" | "O2"
    pad: Optional[bool]  # None: the default ("auto")


def plan_rows(models: list[str], dtypes: list[str], compiled: bool, compiled_dtypes: Optional[list[str]] = None) -> list[Row]:
    """Every row, eager ones first (fast), then compiled ones (in ``compiled_dtypes``' order, default ``dtypes``)."""
    rows = []
    for model in models:
        for dtype in dtypes:
            rows.append(Row(model, dtype, "eager", "autocast", None))
            for mode in ("O1", "O2"):
                for pad in (True, False):
                    rows.append(Row(model, dtype, "eager", mode, pad))
    if compiled:
        for dtype in compiled_dtypes or dtypes:
            for model in models:
                rows += [Row(model, dtype, "compiled", mode, None) for mode in ("autocast", "O1", "O2")]
    return rows


def build_model(name: str, s: dict, device: str, seed: int = 0) -> tuple[torch.nn.Module, tuple]:
    """The fp32 model (its forward returns the loss) and one batch, on ``device``."""
    gen = torch.Generator().manual_seed(seed + 1)
    torch.manual_seed(seed)
    if name == "mlp":
        model = MLP(s["d_in"], s["hidden"], s["depth"], norm=True)
        inputs = (torch.randn(s["batch"], s["d_in"], generator=gen), torch.randint(0, 10, (s["batch"],), generator=gen))
    else:
        model = GPT(s["vocab"], s["d"], s["heads"], s["layers"], context=s["seq"])
        inputs = tuple(torch.randint(0, s["vocab"], (s["batch"], s["seq"]), generator=gen) for _ in range(2))
    return model.to(device), tuple(t.to(device) for t in inputs)


def make_step(row: Row, model: torch.nn.Module, inputs: tuple, device: str, inner: str) -> Callable[[], None]:
    """One training step of ``row``'s mode on ``model`` (which it may convert): forward, backward, scaler, AdamW."""
    dtype = DTYPES[row.dtype]
    fused = {"fused": True}
    if row.mode == "autocast":
        run = model if row.world == "eager" else torch.compile(model, backend=inner)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **fused)
        scaler = torch.amp.GradScaler(device, enabled=dtype == torch.float16)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device, dtype=dtype):
                loss = run(*inputs)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        return step
    pad = {} if row.pad is None else {"pad_gemm": row.pad}
    if row.world == "compiled" and row.mode == "O1":
        run = torch.compile(model, backend=amp_fx.backend(level="O1", dtype=dtype, inner=inner, **pad))
        opt: Any = torch.optim.AdamW(model.parameters(), lr=1e-4, **fused)
    else:
        gm = amp_fx.convert(model, row.mode, dtype=dtype, **pad)
        run = gm if row.world == "eager" else torch.compile(gm, backend=inner)
        if row.mode == "O2":
            opt = amp_fx.MasterWeightOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4, **fused), gm)
        else:
            opt = torch.optim.AdamW(gm.parameters(), lr=1e-4, **fused)
    scaler_ = amp_fx.LossScaler(dtype=dtype)

    def amp_step() -> None:
        opt.zero_grad(set_to_none=True)
        scaler_.scale(run(*inputs)).backward()
        scaler_.step(opt)
        scaler_.update()
    return amp_step


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _allocated(device: str) -> int:
    return torch.cuda.memory_allocated() if device == "cuda" else 0


def time_row(row: Row, base: torch.nn.Module, inputs: tuple, device: str, args: argparse.Namespace) -> tuple:
    """(median ms per step, peak MiB or None, note) for one row, on its own copy of ``base``."""
    if row.world == "compiled":
        torch._dynamo.reset()  # each row compiles afresh (no recompile limit reached across rows of one model)
    before = _allocated(device)
    model = copy.deepcopy(base)
    step = make_step(row, model, inputs, device, args.inner)
    start = time.perf_counter()
    step()  # the first step builds optimizer state (and compiles)
    _sync(device)
    first = time.perf_counter() - start
    for _ in range(args.warmup - 1):
        step()
    if device == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() - before) / MIB if device == "cuda" else None
    note = f"first step {first:.1f} s" if row.world == "compiled" else ""
    del step, model
    if device == "cuda":
        torch.cuda.empty_cache()
    return statistics.median(times) * 1e3, peak, note


def format_table(cells: list[tuple]) -> str:
    """A Markdown table of ``HEADER`` and ``cells``."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(str(c) for c in cell) + " |" for cell in cells]
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on CPU, a few steps; compiled rows with aot_eager (--no-compile: eager only)")
    parser.add_argument("--models", default="mlp,gpt")
    parser.add_argument("--dtypes", default="bf16,fp16")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per row (default 10; smoke 2)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per row, the first included (default 3; smoke 1)")
    parser.add_argument("--budget", type=float, default=150.0,
                        help="seconds after which no new row starts (a compiled row can take 30 s more)")
    parser.add_argument("--no-compile", action="store_true", help="eager rows only")
    parser.add_argument("--inner", default="inductor", help="torch.compile backend of the compiled rows")
    args = parser.parse_args(argv)
    args.steps = args.steps or (2 if args.smoke else 10)
    args.warmup = max(1, args.warmup or (1 if args.smoke else 3))
    return args


def main(argv: Optional[list[str]] = None) -> list[tuple]:
    args = parse_args(argv)
    if args.smoke:
        # CPU, tiny: the compiled rows run with aot_eager (no C++ compile), so every code path is exercised.
        device, sizes, compiled = "cpu", SIZES["smoke"], not args.no_compile
        args.inner = "aot_eager" if args.inner == "inductor" else args.inner
        torch.set_num_threads(1)
    else:
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device here; run it on a machine with a GPU, or pass --smoke to check "
                  "the script on CPU (tiny shapes).")
            raise SystemExit(2)
        device, sizes, compiled = "cuda", SIZES["full"], not args.no_compile
    models = [m for m in args.models.split(",") if m]
    dtypes = [d for d in args.dtypes.split(",") if d]
    where = torch.cuda.get_device_name(0) if device == "cuda" else "CPU (smoke)"
    print(f"gpu_check: torch {torch.__version__}, {where}; AdamW(fused=True) everywhere; "
          f"{args.warmup} warm-up + {args.steps} timed steps per row; compile backend "
          f"{args.inner if compiled else 'none'}")
    for name in models:
        print(f"  {name}: {sizes[name]}")
    start = time.perf_counter()
    cells, base_ms = [], {}
    bases: dict[str, tuple] = {}
    # smoke: compiled rows in the first dtype only (the same code as the other; keeps the check short)
    for row in plan_rows(models, dtypes, compiled, dtypes[:1] if args.smoke else None):
        pad = "default" if row.pad is None else ("on" if row.pad else "off")
        key = (row.model, row.dtype, row.world)
        if time.perf_counter() - start > args.budget:
            cells.append((row.model, row.dtype, row.world, row.mode, pad, "-", "-", "-", "not run (time budget)"))
            continue
        if row.model not in bases:
            bases[row.model] = build_model(row.model, sizes[row.model], device)
        try:
            ms, peak, note = time_row(row, *bases[row.model], device, args)
        except Exception as err:  # one failing row must not lose the table
            traceback.print_exc(limit=3)
            cells.append((row.model, row.dtype, row.world, row.mode, pad, "-", "-", "-",
                          f"error: {type(err).__name__}: {str(err).splitlines()[0][:80] if str(err) else ''}"))
            continue
        if row.mode == "autocast":
            base_ms[key] = ms
        ratio = f"{ms / base_ms[key]:.2f}" if key in base_ms else "-"
        cells.append((row.model, row.dtype, row.world, row.mode, pad, f"{ms:.2f}", ratio,
                      "-" if peak is None else f"{peak:.0f}", note))
    print()
    print(format_table(cells))
    print(f"\ntotal {time.perf_counter() - start:.0f} s")
    return cells


if __name__ == "__main__":
    main()
