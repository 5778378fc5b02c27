"""benchmarks/run.py: every preset names a script that exists and arguments that script accepts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "benchmarks")
sys.path.insert(0, BENCHMARKS)

import benchmark  # noqa: E402
import run  # noqa: E402


def test_every_preset_names_an_existing_script():
    assert {"quick", "full", "issue14", "accumulation", "o2-step-sgd", "gpu-check"} <= set(run.PRESETS)
    for name, preset in run.PRESETS.items():
        assert os.path.isfile(os.path.join(BENCHMARKS, preset.script)), name
        assert preset.what, name


@pytest.mark.parametrize("name", [n for n, p in run.PRESETS.items() if p.script == "benchmark.py"])
def test_benchmark_presets_parse_as_the_script_reads_them(name):
    """The arguments of each benchmark.py preset are options benchmark.py takes (argparse exits on a bad one)."""
    args = benchmark.parse_args(list(run.PRESETS[name].args))
    assert args.models and args.mode_list


def test_list_and_dry_run_print_the_command_and_run_nothing():
    listed = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "run.py"), "--list"],
                            capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert listed.returncode == 0, listed.stderr
    for name in run.PRESETS:
        assert f"\n{name} " in "\n" + listed.stdout, name
    dry = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "run.py"), "o2-step-sgd", "--dry-run", "--",
                          "--rounds", "3"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.strip().endswith("bench_o2_step.py --optimizer sgd --rounds 15 --rounds 3")


def test_an_unknown_preset_names_the_presets():
    with pytest.raises(SystemExit) as exit_:
        run.command("no-such-preset")
    assert "quick" in str(exit_.value) and "gpu-check" in str(exit_.value)
