"""benchmarks/gpu_check.py runs end to end on CPU (--smoke) and prints its one table: every planned row, with numbers.

The GPU run itself needs a CUDA device; this checks that the script a GPU session runs unchanged builds
every mode (eager and compiled with aot_eager, fp16 and bf16, pad_gemm on and off) and prints the table.
"""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import gpu_check  # noqa: E402
import run  # noqa: E402


def _table_rows(out: str) -> list[list[str]]:
    lines = [line for line in out.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines]


def test_smoke_run_prints_the_header_and_every_row(capsys):
    """The benchmark runner's preset, as docs/performance.md gives it, run in this process (a fresh interpreter
    would import torch and amp_fx again for nothing): the preset's command is the script and its arguments."""
    command = run.command("gpu-check-smoke")
    assert command[:2] == [sys.executable, os.path.abspath(gpu_check.__file__)] and command[2:] == ["--smoke"]
    gpu_check.main(command[2:])
    rows = _table_rows(capsys.readouterr().out)
    assert rows[0] == list(gpu_check.HEADER)
    body = rows[1:]
    planned = gpu_check.plan_rows(["mlp", "gpt"], ["bf16", "fp16"], compiled=True, compiled_dtypes=["bf16"])
    assert len(body) == len(planned) == 26  # 2 models x (2 dtypes x 5 eager + 3 compiled bf16)
    assert len(gpu_check.plan_rows(["mlp", "gpt"], ["bf16", "fp16"], compiled=True)) == 32  # the GPU run: both
    for cells, row in zip(body, planned):
        assert cells[:4] == [row.model, row.dtype, row.world, row.mode]
        assert "error" not in cells[-1] and "not run" not in cells[-1], cells
        assert float(cells[5]) > 0  # ms/step
        ratio = float(cells[6])
        assert ratio == 1.0 if row.mode == "autocast" else 0 < ratio < 100
    assert {c[4] for c in body if c[2] == "eager" and c[3] != "autocast"} == {"on", "off"}


def test_without_a_gpu_the_full_run_says_so(capsys, monkeypatch):
    """No CUDA and no --smoke: a clear message and exit code 2, not a traceback."""
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_:
        gpu_check.main([])
    assert exit_.value.code == 2 and "no CUDA device" in capsys.readouterr().out
