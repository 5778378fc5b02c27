"""The compiled route: ``torch.compile(model, backend="amp_fx")`` against ``torch.compile(model)`` under autocast (bf16, CPU).

Run from a checkout::

    python benchmarks/compile_step_time.py --model mlp,transformer,gpt --clock cpu     # step time, issue14 sizes
    python benchmarks/compile_step_time.py --model mlp --kernels --preset quick         # what inductor generated

Step time: each side trains its own copy of the same model (the models and
sizes of ``benchmarks/bench_models.py``; the model returns its loss), with
``SGD(momentum=0.9, fused=True)``, and the *same* step: ``zero_grad``,
forward, ``loss.backward()``, ``opt.step()`` -- no loss scaler on either
side (bf16 needs none; ``--amp-fx-scaler`` adds amp_fx's ``LossScaler``,
whose inf/NaN check the autocast recipe does not make, to the amp_fx side,
to show what that check costs).  One process, one thread; after warm-up
(which compiles), the sides run in interleaved rounds so that load from
other processes hits both alike; the table gives the median ratio over the
rounds and its quartiles.  ``--clock cpu`` times with this process's CPU
time (a shared machine).

``--kernels``: run one step of each side under
``torch._inductor.utils.run_and_get_code`` and print, per compiled graph
(forward, backward), the number of generated C++ kernels, extern kernels
(GEMMs) and the MiB of the buffers the generated code allocates: the
figures that say whether inductor fused amp_fx's graph as it fused
autocast's.

bf16 pays off only where the CPU has native bf16 GEMMs (AVX512-BF16 or AMX);
the header prints the flags and oneDNN's answer.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import math
import os
import re
import statistics
import subprocess
import sys
import time
from typing import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import amp_fx  # noqa: E402
from bench_models import PRESETS, build_case  # noqa: E402

SIDES = ("compile+autocast", 'compile(backend="amp_fx")')
_DTYPE_BYTES = {"torch.float32": 4, "torch.bfloat16": 2, "torch.float16": 2, "torch.int64": 8, "torch.int32": 4,
                "torch.bool": 1, "torch.uint8": 1, "torch.int8": 1, "torch.float64": 8}


def machine() -> str:
    """Date, CPU model, its bf16 flags and oneDNN's bf16 answer: printed with every table."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        text = ""
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Model name")), "?")
    flags = " ".join(f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if re.search(rf"\b{f}\b", text)) or "?"
    mkldnn = torch.ops.mkldnn._is_mkldnn_bf16_supported() if hasattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported") else "?"
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (f"{now}; {model}; lscpu flags: {flags}; mkldnn bf16 supported: {mkldnn}; "
            f"torch.backends.mkldnn enabled: {torch.backends.mkldnn.enabled}; torch {torch.__version__}")


def make_step(side: str, model: torch.nn.Module, inputs: tuple, amp_fx_scaler: bool) -> Callable[[], torch.Tensor]:
    """One training step of ``side`` on its own copy of ``model``."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9, fused=True)
    if side == "compile+autocast":
        compiled = torch.compile(model)

        def forward() -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return compiled(*inputs)
    else:
        compiled = torch.compile(model, backend="amp_fx", options={"dtype": torch.bfloat16})

        def forward() -> torch.Tensor:
            return compiled(*inputs)
    scaler = amp_fx.LossScaler(dtype=torch.bfloat16) if amp_fx_scaler and side != "compile+autocast" else None

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = forward()
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        return loss

    return step


def time_model(name: str, args: argparse.Namespace) -> None:
    case = build_case(name, preset=args.preset)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    steps = {side: make_step(side, case.model, case.inputs, args.amp_fx_scaler) for side in SIDES}
    for side, step in steps.items():
        start = time.perf_counter()
        for _ in range(2):
            loss = step()
        print(f"  warm-up {side}: {time.perf_counter() - start:.1f} s, loss {float(loss.detach()):.4f}", flush=True)
    times: dict[str, list[float]] = {side: [] for side in SIDES}
    for index in range(args.rounds):
        order = SIDES if index % 2 == 0 else SIDES[::-1]  # neither side always runs right after the other
        for side in order:
            start = clock()
            for _ in range(args.steps):
                steps[side]()
            times[side].append((clock() - start) / args.steps)
    report = amp_fx.last_report()
    print(f"  Dynamo graphs converted by amp_fx: {len(report.graphs) if report is not None else '?'}")
    ratios = [b / a for a, b in zip(times[SIDES[0]], times[SIDES[1]])]
    q1, median, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    scaler = " + amp_fx.LossScaler" if args.amp_fx_scaler else ""
    print(f"{case.description}: {args.rounds} rounds x {args.steps} steps, {args.clock} clock")
    print(f"  {SIDES[0]:28s} {statistics.median(times[SIDES[0]]) * 1e3:8.1f} ms/step")
    print(f"  {SIDES[1] + scaler:28s} {statistics.median(times[SIDES[1]]) * 1e3:8.1f} ms/step   "
          f"ratio {median:.3f} [{q1:.3f}-{q3:.3f}]", flush=True)


def _buffer_mib(code: str) -> float:
    """MiB of the buffers a generated wrapper allocates (``empty_strided_cpu(shape, stride, dtype)``)."""
    total = 0
    for shape, dtype in re.findall(r"empty_strided_cpu\(\(([^)]*)\), \([^)]*\), (torch\.\w+)\)", code):
        numel = math.prod(int(s) for s in shape.replace(" ", "").split(",") if s)
        total += numel * _DTYPE_BYTES.get(dtype, 4)
    return total / 2**20


def count_kernels(name: str, args: argparse.Namespace) -> None:
    from torch._inductor.utils import run_and_get_code

    case = build_case(name, preset=args.preset)
    print(f"{case.description}: inductor's generated code, one training step")
    for side in SIDES:
        torch._dynamo.reset()  # each side compiles as in a fresh process: no frame compiled for the other is reused
        step = make_step(side, case.model, case.inputs, amp_fx_scaler=False)
        _, codes = run_and_get_code(step)
        if side != "compile+autocast":
            report = amp_fx.last_report()
            print(f"  {side:28s} Dynamo graphs converted: {len(report.graphs) if report is not None else '?'}")
        for part, code in zip(("forward", "backward", "graph 3", "graph 4"), codes):
            fused = len(re.findall(r"^cpp_fused_\w+ = ", code, re.M))
            extern = len(re.findall(r"extern_kernels\.\w+\(", code))
            print(f"  {side:28s} {part:9s} C++ kernels {fused:3d}, extern kernels {extern:3d}, "
                  f"buffers {_buffer_mib(code):7.2f} MiB", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp,transformer,gpt", help="comma-separated: mlp, transformer, gpt, cnn")
    parser.add_argument("--preset", default="issue14", choices=PRESETS)
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds (the median ratio is reported)")
    parser.add_argument("--steps", type=int, default=3, help="steps per side per round")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    parser.add_argument("--amp-fx-scaler", action="store_true", help="amp_fx side steps through amp_fx.LossScaler(dtype=bf16)")
    parser.add_argument("--kernels", action="store_true", help="count inductor's kernels and buffers instead of timing")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(machine())
    print(f"{args.threads} thread(s), bf16, inductor, SGD(momentum=0.9, fused=True) on both sides")
    for name in args.model.split(","):
        (count_kernels if args.kernels else time_model)(name.strip(), args)


if __name__ == "__main__":
    main()
