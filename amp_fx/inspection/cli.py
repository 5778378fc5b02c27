"""The command line: ``python -m amp_fx inspect MODULE:FACTORY ...`` and ``python -m amp_fx tables``.

``inspect`` builds a model from a factory (a function or class that takes
no arguments), converts it with random inputs of the given shapes, prints the
summary and the per-node table, and with ``--out`` draws the graph.
``tables`` prints the op tables with the reason for each group.
Errors name the problem and exit with status 2 (bad usage) or 1 (conversion failed).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import os
import sys
import tempfile
import textwrap
from typing import Any, Callable, Optional, Sequence

from amp_fx.errors import AmpError, did_you_mean

__all__ = ["main", "build_parser", "load_factory", "parse_shape", "check_writable", "CliError"]

_INPUT_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32")
_TITLES = {
    "low": "run in the low dtype (float16 / bfloat16)",
    "fp32": "inputs cast to fp32, run in fp32",
    "promote": "run in the widest floating dtype among their inputs",
    "banned": "refused in low precision (allow_banned=True runs them in fp32)",
    "follow": "run in whatever dtype arrives",
}


class CliError(AmpError):
    """A usage problem; the message says what was wrong and what to give instead."""


# -- factory loading -----------------------------------------------------------------
_DRAW_EXTENSIONS = (".svg", ".html", ".htm", ".dot", ".gv")  # what amp_fx.draw writes

def _import_module(name: str) -> Any:
    if name.endswith(".py") or os.sep in name or "/" in name:
        path = os.path.abspath(name)
        if not os.path.isfile(path):
            raise CliError(f"no such file {name!r} (give MODULE:FACTORY as a dotted module or a path to a .py file)")
        module_name = os.path.splitext(os.path.basename(path))[0]
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, os.path.dirname(path))
        try:
            spec.loader.exec_module(module)
        except Exception as error:
            raise CliError(f"importing {name!r} failed: {type(error).__name__}: {error}") from error
        finally:
            sys.path.remove(os.path.dirname(path))
        return module
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        raise CliError(f"cannot import module {name!r}: {error} (is it on PYTHONPATH, or give a path like examples/file.py)") from error
    except Exception as error:
        raise CliError(f"importing module {name!r} failed: {type(error).__name__}: {error}") from error


def load_factory(spec: str) -> Callable[[], Any]:
    """Return the callable named by ``MODULE:FACTORY`` after checking it needs no arguments."""
    module_name, colon, attr = spec.rpartition(":")
    if not colon or not module_name or not attr:
        raise CliError(f"factory {spec!r} is not MODULE:FACTORY (e.g. examples.inspect_factory:build or examples/inspect_factory.py:build)")
    module = _import_module(module_name)
    factory: Any = module
    for part in attr.split("."):
        if not hasattr(factory, part):
            public = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
            raise CliError(f"module {module_name!r} has no attribute {attr!r}; its callables are: {', '.join(public) or 'none'}")
        factory = getattr(factory, part)
    if not callable(factory):
        raise CliError(f"{spec!r} is a {type(factory).__name__}, not a function or class that builds the model")
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return factory
    needed = [p.name for p in signature.parameters.values()
              if p.default is inspect.Parameter.empty and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    if needed:
        raise CliError(f"factory {spec!r} needs arguments ({', '.join(needed)}); give them defaults or point at a "
                       "function that takes none and builds the model")
    return factory


def parse_shape(text: str) -> tuple[int, ...]:
    """``"8,3,32,32"`` -> ``(8, 3, 32, 32)``."""
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError:
        shape = ()
    if not shape or any(s <= 0 for s in shape):
        raise CliError(f"--input-shape {text!r} is not a comma-separated list of positive integers (e.g. 8,3,32,32)")
    return shape


def _make_inputs(shapes: Sequence[tuple[int, ...]], dtype_name: str, int_high: int) -> tuple:
    import torch

    dtype = getattr(torch, dtype_name)
    if dtype.is_floating_point:
        return tuple(torch.randn(shape).to(dtype) for shape in shapes)
    return tuple(torch.randint(0, int_high, shape, dtype=dtype) for shape in shapes)


def _build_model(args: argparse.Namespace) -> tuple[Any, tuple]:
    import torch

    factory = load_factory(args.factory)
    try:
        model = factory()
    except Exception as error:
        raise CliError(f"factory {args.factory!r} raised {type(error).__name__}: {error}") from error
    if not isinstance(model, torch.nn.Module):
        raise CliError(f"factory {args.factory!r} returned {type(model).__name__}, expected a torch.nn.Module")
    if not args.input_shape:
        raise CliError("give the model's input shape, e.g. --input-shape 8,3,32,32 (repeat it for several inputs)")
    torch.manual_seed(args.seed)
    inputs = _make_inputs([parse_shape(s) for s in args.input_shape], args.input_dtype, args.int_high)
    try:
        with torch.no_grad():
            model(*inputs)
    except Exception as error:
        shapes = " ".join(",".join(map(str, x.shape)) for x in inputs)
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise CliError(f"input shape {shapes} ({args.input_dtype}) does not fit {type(model).__name__}: "
                       f"{type(error).__name__}: {first}") from error
    return model, inputs


def check_writable(flag: str, path: str) -> None:
    """Refuse an output path amp_fx could not write, before any work is done; never creates a folder."""
    if not path:
        raise CliError(f"{flag} needs a file name, e.g. {flag} {'report.json' if flag == '--json' else 'graph.html'}")
    if os.path.isdir(path):
        example = os.path.join(path, "report.json" if flag == "--json" else "graph.html")
        raise CliError(f"{flag} {path!r} is a folder; give a file in it, e.g. {flag} {example}")
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise CliError(f"{flag} {path!r}: {folder!r} is a file, not a folder; write into a folder instead")
    if not os.path.isdir(folder):
        raise CliError(f"{flag} {path!r}: the folder {folder!r} does not exist; create it first "
                       f"(mkdir -p {folder}) or write into an existing folder")
    try:
        # Creating a file is the only reliable test: root passes os.access() where /proc still refuses new files.
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise CliError(f"{flag} {path!r}: cannot create files in {folder!r} ({error.strerror or error}); "
                       "write into a folder you can write to, e.g. the current one") from error


# -- commands --------------------------------------------------------------------------
def _inspect(args: argparse.Namespace) -> int:
    from amp_fx.converter.api import convert
    from amp_fx.errors import AmpError
    from amp_fx.frontend.tracing import AmpTraceError
    from amp_fx.inspection import views

    if args.out and os.path.splitext(args.out)[1].lower() not in _DRAW_EXTENSIONS:
        raise CliError(f"--out {args.out!r}: amp_fx draws .svg, .html or .dot files (a .png needs Graphviz: "
                       f"write graph.dot, then run `dot -Tpng graph.dot -o graph.png`)")
    for flag, path in (("--out", args.out), ("--json", args.json)):
        if path:
            check_writable(flag, path)
    model, inputs = _build_model(args)
    policy = None
    if args.policy:
        try:
            policy = json.loads(args.policy)
        except json.JSONDecodeError as error:
            raise CliError(f"--policy is not JSON ({error}); e.g. --policy '{{\"module:head\": \"fp32\"}}'") from error
    try:
        converted = convert(model, args.level, dtype=args.dtype, example_inputs=inputs, policy=policy)
    except (AmpError, AmpTraceError, ValueError, TypeError) as error:
        print(f"amp_fx inspect: conversion failed: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    summary = views.summary(converted, inputs)
    print(summary)
    print()
    print(converted.amp_report)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"summary": summary.to_dict(), "report": converted.amp_report.to_dict()}, handle, indent=1, default=str)
        print(f"\nwrote {args.json}")
    if args.out:
        views.draw(converted, args.out, summary=summary, title=f"{args.factory}: amp_fx {args.level} {converted.amp_report.dtype}")
        print(f"\nwrote {args.out}")
    return 0


def _tables(args: argparse.Namespace) -> int:
    from amp_fx.ir import tables
    from amp_fx.ir.op_keys import op_name_of

    everything = tables.all_tables()
    if args.op:
        name = op_name_of(args.op)
        spelled = args.op if name == args.op else f"{args.op} ({name})"
        category = tables.table_of(name)
        if category == "unknown":
            hint = did_you_mean([name], sorted(set().union(*everything.values())))
            print(f"{spelled}: in no table -- it follows its input and is counted as unknown in the report.{hint}")
        else:
            print(f"{spelled}: {category} -- {everything[category][name]}")
        return 0
    if args.json:
        print(json.dumps({k: dict(v) for k, v in everything.items()}, indent=1))
        return 0
    print("amp_fx op tables (canonical ATen op names; an op in no table follows its input)")
    for category, table in everything.items():
        print(f"\n{category.upper()}: {_TITLES.get(category, '')}")
        groups: dict[str, list[str]] = {}
        for op, reason in table.items():
            groups.setdefault(reason, []).append(op)
        for reason, ops in groups.items():
            if category == "banned":
                print(f"  {ops[0]}:")
                print(textwrap.fill(reason, 96, initial_indent="    ", subsequent_indent="    "))
                continue
            print(f"  {reason}:")
            print(textwrap.fill(", ".join(sorted(ops)), 96, initial_indent="    ", subsequent_indent="    "))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m amp_fx`` argument parser."""
    parser = argparse.ArgumentParser(prog="python -m amp_fx", description="Inspect amp_fx mixed-precision conversions.")
    commands = parser.add_subparsers(dest="command", required=True)
    inspect_cmd = commands.add_parser("inspect", help="convert a model from a factory and show what was decided",
                                      description="Build a model from MODULE:FACTORY, convert it, print the summary and per-node table.")
    inspect_cmd.add_argument("factory", help="MODULE:FACTORY (dotted module or path/to/file.py) naming a callable with no required arguments")
    inspect_cmd.add_argument("--level", default="O1", choices=("O0", "O1", "O2", "O3"))
    inspect_cmd.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "bfloat16", "float16"))
    inspect_cmd.add_argument("--input-shape", action="append", default=[], metavar="N,C,H,W",
                             help="shape of one model input; repeat for several inputs")
    inspect_cmd.add_argument("--input-dtype", default="float32", choices=_INPUT_DTYPES)
    inspect_cmd.add_argument("--int-high", type=int, default=2, help="integer inputs are drawn from [0, INT_HIGH)")
    inspect_cmd.add_argument("--policy", help='JSON policy overrides, e.g. \'{"module:head": "fp32"}\'')
    inspect_cmd.add_argument("--out", help="draw the graph to this .svg, .html or .dot file")
    inspect_cmd.add_argument("--json", help="write the summary and report as JSON to this file")
    inspect_cmd.add_argument("--seed", type=int, default=0)
    tables_cmd = commands.add_parser("tables", help="print the op tables with their reasons")
    tables_cmd.add_argument("--op", help="look up one canonical op name")
    tables_cmd.add_argument("--json", action="store_true", help="print the tables as JSON")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; return the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _inspect(args) if args.command == "inspect" else _tables(args)
    except CliError as error:
        print(f"amp_fx {args.command}: error: {error}", file=sys.stderr)
        return 2
