"""Concurrency and determinism: conversion gives the same graph whoever runs it, and whenever.

- Threads converting different models at once give the same generated code
  and decisions as one conversion at a time.
- Two separate processes (with different string-hash seeds, so any
  dependence on set or dict iteration order shows) generate the same code,
  byte for byte, and the same decisions.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import amp_fx
import zoo

HERE = os.path.dirname(os.path.abspath(__file__))  # tests/converter/: this module, imported by the subprocess
TESTS_DIR = os.path.dirname(HERE)  # tests/: zoo.py
REPO_ROOT = os.path.dirname(TESTS_DIR)
# (model, level, dtype, with example inputs): symbolic-trace and torch.export routes, every level, a leaf
# module with cast parameters, and FakeTensor propagation (which runs leaf modules such as BatchNorm).
CASES = [("mlp", "O1", "bf16", False), ("cnn", "O2", "bf16", False), ("sdpa", "O1", "fp16", True),
         ("lstm", "O1", "bf16", False), ("sdpa", "O3", "bf16", False), ("encoder", "O1", "bf16", True),
         ("cnn", "O1", "fp16", True), ("mlp", "O2", "fp16", True), ("lstm", "O2", "bf16", True)]
# Across processes, the symbolic route (torch.export's own determinism is torch's business, and slow).
PROCESS_CASES = [case for case in CASES if case[0] != "encoder"]


def fingerprint(name: str, level: str, dtype: str, with_examples: bool) -> dict:
    """What a conversion decided: the generated code and each node's decision (timings left out)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, example, kwargs = zoo.build(name)
        if with_examples:
            kwargs = {"example_inputs": example}
        gm = amp_fx.convert(model, level, dtype=dtype, **kwargs)
    decisions = [(r.name, r.op, r.decision, r.reason, r.dtype, r.inserted) for r in gm.amp_report.nodes]
    return {"code": gm.code, "decisions": decisions, "totals": gm.amp_report.totals(), "notes": gm.amp_report.notes}


def _digest(fp: dict) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True, default=str).encode()).hexdigest()


def test_threads_converting_different_models_at_once_get_the_graphs_of_one_at_a_time():
    """fx tracing patches torch.nn.Module for every thread: a conversion running BatchNorm (FakeTensor
    propagation) while another traced failed ("module is not installed as a submodule"), and parameter
    reads in one thread added nodes to another's trace.  convert() now runs one at a time."""
    alone = [fingerprint(*case) for case in CASES]
    for _ in range(2):
        with ThreadPoolExecutor(max_workers=4) as pool:
            together = list(pool.map(lambda case: fingerprint(*case), CASES))
        for case, a, b in zip(CASES, alone, together):
            assert b["code"] == a["code"], f"{case}: code differs when converted beside other models"
            assert b == a, f"{case}: decisions differ when converted beside other models"


def test_one_model_converted_from_many_threads_at_once():
    """The same model object, converted at O1 (parameters shared) and O2 (copied) from four threads:
    the O1 passes read the parameters another thread was tracing, which moved weight nodes."""
    model, example, _ = zoo.build("sdpa")
    expected = {level: amp_fx.convert(model, level).code for level in ("O1", "O2")}
    jobs = ["O1", "O2"] * 4
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda level: (level, amp_fx.convert(model, level)), jobs))
    for level, gm in results:
        assert gm.code == expected[level]
        assert gm(*example).shape == model(*example).shape
    assert all(p.dtype == torch.float32 for p in model.parameters())


_SCRIPT = """
import json, sys
sys.path[:0] = [{here!r}, {tests!r}, {root!r}]
import test_concurrency as t
print(json.dumps([t._digest(t.fingerprint(*case)) for case in t.PROCESS_CASES]))
"""


@pytest.mark.slow
def test_conversion_is_deterministic_across_processes():
    script = _SCRIPT.format(here=HERE, tests=TESTS_DIR, root=REPO_ROOT)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, TESTS_DIR, HERE, env.get("PYTHONPATH")) if p)
    runs = []
    for seed in ("1", "2"):
        runs.append(subprocess.Popen([sys.executable, "-c", script], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=dict(env, PYTHONHASHSEED=seed)))
    digests = []
    for run in runs:
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err[-3000:]
        digests.append(json.loads(out.strip().splitlines()[-1]))
    assert digests[0] == digests[1], "two processes generated different code or decisions"
    assert digests[0] == [_digest(fingerprint(*case)) for case in PROCESS_CASES], "a subprocess differs from this process"
