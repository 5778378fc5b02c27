"""``benchmarks/benchmark.py --accumulation-only`` runs on tiny sizes and its cast counts add up."""

from __future__ import annotations

import os
import sys

import torch

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCHMARKS)

import benchmark  # noqa: E402
from bench_accumulation import ACCUMULATION_MODES  # noqa: E402
from bench_models import build_case  # noqa: E402


def test_accumulation_table_counts_one_weight_cast_per_step(capsys):
    """4 micro-batches on the quick MLP: the step cache casts each Linear's weight and bias once per step instead of
    4 times, so it counts 3 casts per such parameter fewer than plain O1; every mode trains."""
    results = benchmark.main(["--quick", "--model", "mlp", "--accumulation-only", "--rounds", "1", "--repeats", "1",
                              "--warmup", "1"])
    out = capsys.readouterr().out
    assert "gradient accumulation, 4 micro-batches per step" in out and "mkldnn bf16 supported" in out
    assert "convert() time vs depth" not in out  # --accumulation-only: no other tables
    rows = results["accumulation mlp"]["rows"]
    assert list(rows) == list(ACCUMULATION_MODES)
    cast_params = sum(isinstance(m, torch.nn.Linear) for m in build_case("mlp", preset="quick").model.modules()) * 2
    assert rows["amp_fx O1"]["casts"] - rows["amp_fx O1 step cache"]["casts"] == 3 * cast_params
    assert all(row["ms"] > 0 and row["casts"] > 0 for row in rows.values())
