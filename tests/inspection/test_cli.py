"""The command line: end to end in a subprocess on the example factory and on bad input; the errors in process."""

import json
import os
import subprocess
import sys

import pytest

from amp_fx.ir import tables
from amp_fx.inspection.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*args):
    return subprocess.run([sys.executable, "-m", "amp_fx", *args], cwd=ROOT, capture_output=True, text=True, timeout=240)


def test_inspect_end_to_end(tmp_path):
    out, report = tmp_path / "report.html", tmp_path / "report.json"
    done = _run("inspect", "examples/inspect_factory.py:build", "--level", "O1", "--dtype", "bf16",
                "--input-shape", "2,3,8,8", "--out", str(out), "--json", str(report))
    assert done.returncode == 0, done.stderr
    # Summary first: conv and Linear are the only GEMMs and both run bf16.
    assert "GEMM FLOPs per forward: 100.0% of" in done.stdout
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines() if line.startswith("  ") and len(line.split()) > 4}
    assert rows["conv2d"][1:4] == ["conv2d", "conv", "low"] and rows["group_norm"][1:4] == ["group_norm", "norm", "fp32"]
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page and "amp_fx summary" in page
    data = json.loads(report.read_text())
    decisions = {n["name"]: n["decision"] for n in data["report"]["nodes"]}
    assert decisions["linear"] == "low" and decisions["log_softmax"] == "fp32"
    assert data["summary"]["low_flop_share"] == 1.0 and data["summary"]["casts"] == data["report"]["totals"]["casts_inserted"]


def test_inspect_bad_shape_in_a_subprocess_names_the_problem():
    done = _run("inspect", "examples.inspect_factory:build", "--input-shape", "2,8,8")
    assert done.returncode == 2
    assert "does not fit TinyClassifier" in done.stderr and "2,8,8" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("args, message", [
    (["examples.inspect_factory"], "is not MODULE:FACTORY"),
    (["examples.no_such_module:build"], "cannot import module 'examples.no_such_module'"),
    (["examples.inspect_factory:buidl"], "has no attribute 'buidl'; its callables are: TinyClassifier, build"),
    (["examples/inspect_factory.py:TinyClassifier.forward"], "needs arguments (self, x)"),
    (["examples/missing.py:build"], "no such file"),
    (["examples.inspect_factory:build", "--input-shape", "2,x,8"], "not a comma-separated list of positive integers"),
    (["examples.inspect_factory:build"], "give the model's input shape"),
    (["examples.inspect_factory:build", "--input-shape", "2,3,8,8", "--out", "graph.png"], "draws .svg, .html or .dot"),
])
def test_inspect_errors_name_the_problem(args, message, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["inspect", *args]) == 2
    assert message in capsys.readouterr().err


def test_tables_prints_every_group_with_its_reason(capsys):
    assert main(["tables"]) == 0
    text = capsys.readouterr().out
    for category, table in tables.all_tables().items():
        assert f"{category.upper()}:" in text
        for reason in set(table.values()):
            assert reason.split()[0] in text
    assert "scaled_dot_product_attention" in text and "binary_cross_entropy_with_logits" in text
    assert main(["tables", "--op", "softmax"]) == 0
    assert capsys.readouterr().out.strip() == f"softmax: fp32 -- {tables.FP32['softmax']}"
    assert main(["tables", "--op", "my_op"]) == 0 and "in no table" in capsys.readouterr().out
    assert main(["tables", "--op", "torch.matmul"]) == 0
    assert capsys.readouterr().out.strip() == f"torch.matmul (matmul): low -- {tables.LOW['matmul']}"
    assert main(["tables", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["low"]["linear"] == tables.LOW["linear"]
