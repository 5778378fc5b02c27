"""Run mutmut's mutants of one amp_fx module against a narrow test selection, each in a fork of a warm process.

mutmut (PyPI, 2.x) makes the mutants; this script runs them.  mutmut's own runner starts a fresh
``pytest`` per mutant, which pays torch's import and the tests' collection (seconds) every time; here
a parent imports torch, amp_fx and the selected test modules once and forks a child per mutant.  The
child executes the mutated source inside the already imported module and points every other amp_fx
and test module's names at the new objects (the file on disk is never written), then runs
``pytest.main`` on the selection.  Stages: a mutant the first (fast) selection does not kill runs the
next one.  A child past ``--timeout`` is killed and counted as a timeout (mutmut counts it killed).

Usage (from the repository root; see .ci/mutation.md)::

    nice -n 19 python tools/mutation/run_mutants.py amp_fx/ir/cast_placement.py \\
        --stage "tests/passes/test_minimize_casts.py -k 'not zoo and not random'" \\
        --stage "tests/passes/test_minimize_casts.py tests/ir/test_op_property_decisions.py" \\
        --timeout 120 --out /tmp/mutants.json

Prints one line per mutant (killed / SURVIVED / timeout) and writes every survivor's diff to ``--out``.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import shlex
import signal
import sys
import time


def _mutants(path: str) -> list:
    import mutmut
    source = open(path).read()
    context = mutmut.Context(source=source, filename=path)
    ids = mutmut.list_mutations(context)
    out = []
    for mutation_id in ids:
        mutated, count = mutmut.mutate(mutmut.Context(source=source, filename=path, mutation_id=mutation_id))
        assert count == 1, (mutation_id, count)
        out.append((mutation_id, mutated))
    return out


_OURS = ("amp_fx", "passes", "tests", "conftest")


def _rebind(module: str, source: str) -> None:
    """Execute the mutated source in the imported module, and point every other module's names at its new objects."""
    target = sys.modules[module]
    before = dict(vars(target))
    exec(compile(source, target.__file__, "exec"), vars(target))
    moved = {id(old): vars(target)[name] for name, old in before.items()
             if name in vars(target) and vars(target)[name] is not old}
    for name, other in list(sys.modules.items()):
        if other is target or name.split(".")[0] not in _OURS:
            continue
        for attr, value in list(vars(other).items()):
            if id(value) in moved:
                setattr(other, attr, moved[id(value)])


def _run_child(module: str, source: str, args: list) -> int:
    """In the forked child: turn the warm module into the mutant and run pytest; the exit status is pytest's."""
    import pytest
    _rebind(module, source)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    return int(pytest.main([*args, "-x", "-q", "-p", "no:cacheprovider", "--no-header"]))


def _run(module: str, source: str, args: list, timeout: float) -> str:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = _run_child(module, source, args)
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            return "survived" if code == 0 else "killed"
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "timeout"
        time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="the module to mutate, e.g. amp_fx/ir/cast_placement.py")
    parser.add_argument("--stage", action="append", required=True,
                        help="pytest arguments of one stage (shell-quoted); later stages run only on survivors")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds a stage may take per mutant")
    parser.add_argument("--only", default="", help="mutant indices to run, e.g. 3,7-20 (default: all)")
    parser.add_argument("--out", default="mutants.json", help="where survivors' diffs are written")
    parser.add_argument("--no-baseline", action="store_true", help="skip checking that the unmutated module passes")
    args = parser.parse_args()

    import torch  # noqa: F401  (warm: every child inherits it)
    import networkx  # noqa: F401
    import pytest  # noqa: F401
    torch.set_num_threads(1)
    sys.path.insert(0, os.getcwd())
    import importlib

    path = os.path.relpath(args.path)
    module = path[:-3].replace(os.sep, ".")
    original = open(path).read()
    mutants = _mutants(path)
    only = {int(i) for part in args.only.split(",") if part
            for i in (range(int(part.split("-")[0]), int(part.split("-")[1]) + 1) if "-" in part else [int(part)])}
    stages = [shlex.split(stage) for stage in args.stage]
    imported = importlib.import_module(module)
    assert os.path.samefile(imported.__file__, path), f"{module} imports from {imported.__file__}, not ./{path}"
    # Warm: import the selected test modules (and conftest) once; every child's pytest finds them imported.
    devnull, saved = os.open(os.devnull, os.O_WRONLY), os.dup(1)
    os.dup2(devnull, 1)
    pytest.main([arg for stage in stages for arg in stage if not arg.startswith("-") and "/" in arg]
                + ["--collect-only", "-q", "-p", "no:cacheprovider"])
    os.dup2(saved, 1)
    print(f"{len(mutants)} mutants of {path}; {len(stages)} stage(s)", flush=True)

    # The unmutated module must pass every stage, or every mutant would look killed.
    for stage in [] if args.no_baseline else stages:
        result = _run(module, original, stage, args.timeout * 3)
        assert result == "survived", f"the unmutated {path} does not pass {stage}: {result}"

    results, survivors = {}, []
    for index, (mutation_id, mutated) in enumerate(mutants):
        if only and index not in only:
            continue
        start = time.monotonic()
        for stage in stages:
            result = _run(module, mutated, stage, args.timeout)
            if result != "survived":
                break
        results[result] = results.get(result, 0) + 1
        diff = "".join(line for line in difflib.unified_diff(original.splitlines(True), mutated.splitlines(True), n=0)
                       if line[:1] in "+-" and line[:3] not in ("+++", "---"))
        line = mutation_id.line_number + 1
        print(f"[{index:3d}] line {line:4d} {result.upper() if result == 'survived' else result:8s} "
              f"{time.monotonic() - start:5.1f}s  {diff.strip().splitlines()[-1].strip()[:100]}", flush=True)
        if result == "survived":
            survivors.append({"index": index, "line": line, "diff": diff})
    print("totals:", results, flush=True)
    with open(args.out, "w") as f:
        json.dump({"path": path, "mutants": len(mutants), "totals": results, "survivors": survivors}, f, indent=1)


if __name__ == "__main__":
    main()
