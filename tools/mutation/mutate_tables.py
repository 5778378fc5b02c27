"""Mutate the op tables (amp_fx/ir/tables.py) one row at a time and run that op's decision tests.

mutmut makes no mutants of data (a dict literal of names is no operator), yet a wrong row is the
mutation that matters: an op in the wrong table is a wrong precision decision.  For every op of
every table this script makes two mutants, in process (the tables are live dicts; the registry's
caches are cleared), runs the op's own cases of ``tests/ir/test_table_dtypes.py`` (through
``amp_fx.convert`` and the report: the decision, and the dtype the op runs in) and the suite's
"every entry has a case" check, and restores the row:

- moved:   LOW, FP32, PROMOTE and BANNED -> FOLLOW (a GEMM left in fp32 input, a softmax run low,
           a cat left unpromoted, a banned op run silently); FOLLOW -> LOW;
- deleted: a FOLLOW op leaves its table (it becomes unknown: it follows, counted unknown in the report;
           deleting a row of another table makes the op follow, as its move does).

Usage (from the repository root; .ci/mutation.md)::

    nice -n 19 python tools/mutation/mutate_tables.py [--out /tmp/tables.json] [--ops softmax,mm]

Prints each surviving mutant and the totals; writes them to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import time
import warnings

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "ir")]

import torch  # noqa: E402

import amp_fx  # noqa: E402,F401
from amp_fx.ir import op_properties, tables  # noqa: E402

# Where a table's op goes when moved: the wrong decision most likely to pass unnoticed.
MOVES = {"low": "follow", "fp32": "follow", "promote": "follow", "banned": "follow", "follow": "low"}


def _checks() -> dict[str, list]:
    """op -> the calls of its cases in tests/ir/test_table_dtypes.py (each raises when the op is decided wrongly)."""
    import test_table_dtypes as T
    checks: dict[str, list] = {}
    for op, entries in T.low_cases().items():
        for _, module, inputs in entries:
            checks.setdefault(op, []).append(lambda op=op, m=T._with_arity(module, inputs), i=inputs: T.test_low_ops_run_low(op, m, i))
    for op, entries in T.fp32_cases().items():
        for _, module, inputs in entries:
            checks.setdefault(op, []).append(
                lambda op=op, m=T._with_arity(module, inputs), i=inputs: T.test_fp32_ops_run_fp32_even_on_low_input(op, m, i))
    for op, entries in T.promote_cases().items():
        for _, fn in entries:
            checks.setdefault(op, []).append(lambda op=op, fn=fn: T.test_promote_ops_run_in_the_widest_input_dtype(op, fn))
    for op, entries in T.follow_cases().items():
        for _, module, inputs in entries:
            checks.setdefault(op, []).append(
                lambda op=op, m=T._with_arity(module, inputs), i=inputs: T.test_follow_ops_keep_their_input_dtype(op, m, i))
    for op, fn, arity in T._one_tensor_follow_calls():  # test_follow_ops_without_a_case_..., one op at a time
        checks.setdefault(op, []).append(lambda call=(op, fn, arity): T.check_follow_calls([call]))
    checks["*"] = [T.test_every_table_entry_has_a_case]
    return checks


def _pytest_check(op: str):
    """Ops whose cases live elsewhere (no CPU kernel, shipped custom ops): their tests, through pytest, in process."""
    import pytest
    selections = {
        "cudnn_convolution": ["tests/ir/test_tables_and_keys.py", "-k", "cudnn"],
        "cudnn_convolution_transpose": ["tests/ir/test_tables_and_keys.py", "-k", "cudnn"],
        "binary_cross_entropy": ["tests/ir/test_table_dtypes.py", "-k", "banned"],
    }
    if "::" in op:
        selections[op] = ["tests/ir/test_custom_ops.py", "-k", "transformers"]
    if op not in selections:
        return None
    args = [os.path.join(ROOT, a) if a.endswith(".py") else a for a in selections[op]]
    def run() -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            code = pytest.main([*args, "-x", "-q", "-p", "no:cacheprovider", "--no-header"])
        _raise_unless_passed(code)
    return run


def _raise_unless_passed(code) -> None:
    if int(code) != 0:
        raise AssertionError(f"pytest exit status {int(code)}")


def _forget() -> None:
    op_properties.of.cache_clear()
    op_properties.known_ops.cache_clear()


def _killed(calls: list) -> tuple[bool, str]:
    for call in calls:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.manual_seed(0)
                call()
        except Exception as error:  # an AssertionError, or a conversion or run that failed: killed either way
            return True, f"{type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else ''}"
    return False, ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="tables_mutants.json")
    parser.add_argument("--ops", default="", help="comma-separated ops to mutate (default: every row)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    checks = _checks()
    rows = tables._rows()
    snapshot = {category: dict(table) for category, table in rows.items()}
    only = set(filter(None, args.ops.split(",")))
    # Deleting a LOW/FP32/PROMOTE/BANNED row makes it unknown, which follows: the same decision as its move.
    mutants = [(op, category, kind) for category, table in snapshot.items() for op in table
               for kind in ("moved", "deleted") if (not only or op in only) and (kind == "moved" or category == "follow")]
    print(f"{len(mutants)} table mutants (every row moved, FOLLOW rows deleted too)", flush=True)
    survivors, totals, start = [], {"killed": 0, "survived": 0}, time.monotonic()
    for op, category, kind in mutants:
        reason = rows[category].pop(op)
        if kind == "moved":
            rows[MOVES[category]][op] = reason
        _forget()
        calls = checks.get(op, []) + [c for c in [_pytest_check(op)] if c] + checks["*"]
        try:
            killed, why = _killed(calls)
        finally:
            for name, table in rows.items():  # restore, in the original order
                table.clear()
                table.update(snapshot[name])
            _forget()
        totals["killed" if killed else "survived"] += 1
        if not killed:
            where = f"-> {MOVES[category]}" if kind == "moved" else "deleted"
            print(f"SURVIVED {op} ({category}) {where}; {len(calls) - 1} case(s)", flush=True)
            survivors.append({"op": op, "table": category, "mutant": kind, "to": MOVES[category] if kind == "moved" else None,
                              "cases": len(calls) - 1})
    print(f"totals: {totals} in {time.monotonic() - start:.0f}s", flush=True)
    with open(args.out, "w") as f:
        json.dump({"mutants": len(mutants), "totals": totals, "survivors": survivors}, f, indent=1)


if __name__ == "__main__":
    main()
