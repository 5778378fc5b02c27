"""One runner for every amp_fx benchmark: a preset names a script and the arguments a documented figure came from.

Run from a checkout (the folder is not installed; each script imports amp_fx from the checkout)::

    python benchmarks/run.py --list                      # every preset, its command and what it measures
    python benchmarks/run.py quick                       # tiny sizes, every mode, about a minute on 2 cores
    python benchmarks/run.py o2-step-sgd -- --rounds 5   # arguments after ``--`` go to the script, last wins
    python benchmarks/run.py o2-step-sgd --dry-run       # print the command, run nothing

A preset runs its script in a fresh interpreter (``python benchmarks/<script> <args>``), exactly the
command docs/performance.md gives for its table, so a figure and its preset cannot drift apart.  The
scripts stay runnable on their own; ``--help`` after ``--`` shows a script's own options.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

__all__ = ["PRESETS", "Preset", "command", "main"]


@dataclass(frozen=True)
class Preset:
    """A benchmark script, the arguments a documented figure was measured with, and what it measures."""

    script: str
    args: tuple[str, ...]
    what: str


PRESETS: dict[str, Preset] = {
    "quick": Preset("benchmark.py", ("--quick",), "every model and mode at tiny sizes (aot_eager): checks the set-up"),
    "full": Preset("benchmark.py", (), "training-step tables of docs/performance.md: full sizes, inductor, 1 thread"),
    "issue14": Preset("benchmark.py", ("--preset", "issue14", "--model", "mlp,transformer,gpt", "--inference",
                                       "--no-scaling"), "the summary ratios to autocast (training and inference) of docs/performance.md"),
    "issue41": Preset("benchmark.py", ("--preset", "issue14", "--model", "mlp,transformer,gpt", "--no-scaling", "--sgd", "fused",
                                       "--modes", 'torch.autocast,amp_fx O1,amp_fx O2,compile+autocast,compile(backend="amp_fx"),compile(convert O2)',
                                       "--rounds", "15", "--profile-rounds", "3", "--clock", "cpu"),
                      "issue 41's table: O1/O2/compiled vs autocast, SGD(fused=True) on every side, CPU-time clock, bytes moved per step"),
    "o2-one-pass": Preset("bench_o2_step.py", ("--optimizer", "sgd", "--one-pass", "--sgd-impl", "fused", "--rounds", "9",
                                               "--repeats", "2"),
                          "issue 41's lever 2 measured: O2 with update + bf16 copy in one compiled pass (a prototype) vs O2, O1, autocast"),
    "inference": Preset("benchmark.py", ("--inference-only", "--preset", "issue", "--model", "mlp,gpt", "--rounds", "9"),
                        "eval()/no_grad throughput: O1 with cached weight casts vs autocast vs fp32"),
    "fused": Preset("benchmark.py", ("--inference-only", "--fused", "--model", "mlp,gpt", "--rounds", "9"),
                    "the fused-norm lever: a GroupNorm CNN at O1 with and without fuse_precision"),
    "accumulation": Preset("benchmark.py", ("--preset", "issue14", "--model", "mlp,gpt", "--accumulation-only",
                                            "--rounds", "15", "--repeats", "1"),
                           "gradient accumulation, 4 micro-batches per step: O1 step cache, O2, fp32 accumulation"),
    "transformer": Preset("benchmark.py", ("--preset", "issue", "--no-compile", "--model", "transformer"),
                          "the 6x512 encoder at seq 128, eager modes only"),
    "cuda-fp16": Preset("benchmark.py", ("--device", "cuda", "--dtype", "fp16"), "the training tables on a CUDA GPU, fp16"),
    "o2-step-sgd": Preset("bench_o2_step.py", ("--optimizer", "sgd", "--rounds", "15"),
                          "O2's master-weight step vs autocast + SGD(foreach=True), CPU-time clock"),
    "o2-step-adamw": Preset("bench_o2_step.py", ("--optimizer", "adamw", "--rounds", "15"),
                            "O2's master-weight step vs autocast + AdamW(fused=True), CPU-time clock"),
    "o2-step-wide": Preset("bench_o2_step.py", ("--optimizer", "sgd", "--width", "4096", "--depth", "2", "--batch", "64",
                                                "--rounds", "7", "--repeats", "2"),
                           "O2's step on a wide model, where the kept gradient buffers cost most"),
    "convert-time": Preset("bench_convert_time.py", (), "what example inputs cost convert(): a 96-layer encoder with and without"),
    "coverage-figures": Preset("coverage_figures.py", (),
                               "issue 40's figures: share of GEMM FLOPs run low, eager autocast vs the amp_fx backend, "
                               "for models whose graphs break (TransformerEncoder with a mask, LSTMs)"),
    "coverage-figures-before": Preset("coverage_figures.py", ("--before",),
                                      "coverage-figures with amp_fx's eager mode between graphs off (before issue 40)"),
    "compile-step": Preset("compile_step_time.py", ("--model", "mlp,transformer,gpt", "--clock", "cpu", "--rounds", "9"),
                           "the compiled route: backend='amp_fx' against compiled autocast, the same step on both sides"),
    "compile-kernels": Preset("compile_step_time.py", ("--model", "mlp,transformer,gpt", "--preset", "quick", "--kernels"),
                              "inductor's kernels and buffers for backend='amp_fx' and for compiled autocast, per graph"),
    "gpu-check": Preset("gpu_check.py", (), "one table on one CUDA GPU: O1/O2 vs autocast + GradScaler, fp16/bf16, eager/compiled"),
    "gpu-check-smoke": Preset("gpu_check.py", ("--smoke",), "gpu-check at tiny sizes on CPU (aot_eager): checks the script"),
}


def command(name: str, extra: tuple[str, ...] = ()) -> list[str]:
    """The command line preset ``name`` runs, with ``extra`` arguments appended (argparse: the last one wins)."""
    if name not in PRESETS:
        raise SystemExit(f"run.py: no preset {name!r}; the presets are: {', '.join(PRESETS)} (--list describes them)")
    preset = PRESETS[name]
    return [sys.executable, os.path.join(HERE, preset.script), *preset.args, *extra]


def describe() -> str:
    """One line per preset: its name, the command it runs, what it measures."""
    width = max(len(name) for name in PRESETS)
    lines = []
    for name, preset in PRESETS.items():
        shown = " ".join(["benchmarks/" + preset.script, *map(shlex.quote, preset.args)])
        lines.append(f"{name:<{width}}  {shown}\n{'':<{width}}    {preset.what}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    """Run the preset the command line names (or list them); return the script's exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: tuple[str, ...] = ()
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], tuple(argv[cut + 1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="presets:\n" + describe(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("preset", nargs="?", help="the preset to run (see --list)")
    parser.add_argument("--list", action="store_true", help="list the presets and exit")
    parser.add_argument("--dry-run", action="store_true", help="print the command the preset runs, run nothing")
    args = parser.parse_args(argv)
    if args.list or args.preset is None:
        print(describe())
        return 0
    cmd = command(args.preset, extra)
    print("+ " + " ".join(shlex.quote(part) for part in cmd), flush=True)
    if args.dry_run:
        return 0
    return subprocess.call(cmd, cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main())
