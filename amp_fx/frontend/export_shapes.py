"""Name the input size a torch.export-traced module was specialised to, and refuse a declared dynamic size the model fixes.

A module unlifted from a ``torch.export`` program checks its inputs' sizes
in a ``_guards_fn`` submodule, which fails with a bare ``AssertionError:
Guard failed: decoder_input_ids.size()[1] == 6``.  :func:`explain_guard_failures`
wraps that check so that a call with another size raises
:class:`~amp_fx.errors.AmpValueError` naming the input, the dimension, the
size it was specialised to, why, and the fix.

What is dynamic is read from the exported program itself (:func:`dimensions`):
a dimension is dynamic where its size is a symbol whose range constraint
(``ExportedProgram.range_constraints``) allows more than one value, fixed
otherwise.  For a fixed one, torch.export's shape environment records
where it replaced the symbol by the example's size (the guard's source
line: Mamba's CPU scan ``for index in range(seq_len)``); that line is the
reason the notes and the error give.

At conversion, a dimension the user declared dynamic (``dynamic_shapes=``
with a named ``Dim``) that the model fixes is a constraint violation in
torch.export: :func:`refuse_constraint_violation` turns it into an
``AmpValueError`` naming each such input dimension.  amp_fx refuses rather
than keeping the dimension static: the user asked for it to vary, and a
module that silently accepts one size only would break at the first other
batch.  (amp_fx's own defaults are ``Dim.AUTO``, which export keeps static
where the model fixes it, with a warning and a report note; see
:mod:`amp_fx.frontend.export_route`.)
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Mapping, Optional

import torch
import torch.fx as fx

from amp_fx.errors import PACKAGE, AmpValueError

__all__ = ["explain_guard_failures", "refuse_constraint_violation", "requested_dims", "declared_dims", "static_size",
           "Dimension", "dimensions", "shape_notes"]

# (input name, its sizes at conversion: an int where static, None where dynamic)
_Recorded = list[tuple[str, Optional[tuple[Optional[int], ...]]]]


def static_size(size: Any) -> Optional[int]:
    """An exported input's size as an int where it is static, else None.

    A dimension marked ``Dim.AUTO`` that the model fixes stays a SymInt whose
    expression is a constant (``6``), not an ``int``: it is static too.
    """
    if isinstance(size, int):
        return size
    as_int = getattr(getattr(size, "node", None), "maybe_as_int", None)
    return as_int() if callable(as_int) else None


@dataclasses.dataclass(frozen=True)
class Dimension:
    """One dimension of an exported program's input: dynamic or fixed, its range, and why export fixed it."""

    input: str
    dim: int
    size: int  # the example's size
    dynamic: bool
    bounds: Optional[tuple[int, Optional[int]]] = None  # a dynamic size's range constraint (None above: unbounded)
    reason: Optional[str] = None  # why torch.export fixed it, when it says: "at model.py:12 (for i in range(n):)"

    @property
    def name(self) -> str:
        return f"{self.input}.shape[{self.dim}]"


def _bound(value: Any) -> Optional[int]:
    """An int, or None for an unbounded end (torch's ``int_oo``, sympy's ``oo``) or no value."""
    if value is None or getattr(value, "is_finite", True) is False:
        return None
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError, AttributeError):
        return None


def _where_fixed(size: Any) -> Optional[str]:
    """The source line at which torch.export replaced ``size``'s symbol by a number (a guard such as ``s1 == 16``)."""
    node = getattr(size, "node", None)
    env = getattr(node, "shape_env", None)
    raw = getattr(node, "_expr", None)  # the symbol before replacements: expr already reads 16
    if env is None or raw is None:
        return None
    for symbol in sorted(getattr(raw, "free_symbols", ()), key=str):
        sloc = getattr(env, "replacements_slocs", {}).get(symbol)
        if sloc is None or not getattr(env.replacements.get(symbol), "is_number", False):
            continue
        frame = getattr(sloc, "framework_loc", None)
        if isinstance(frame, str) or frame is None:
            where = frame or getattr(sloc, "maybe_user_loc", None)
            if where:
                return f"at {where}"
            continue
        code = (frame.line or "").strip()
        where = f"{_short_path(frame.filename)}:{frame.lineno} in {frame.name}"
        return f"at {where} ({code})" if code else f"at {where}"
    return None


def _short_path(path: str) -> str:
    """``transformers/models/mamba/modeling_mamba.py`` for an installed package, a path from the working directory for the user's."""
    marker = f"site-packages{os.sep}"
    if marker in path:
        return path.rsplit(marker, 1)[1]
    try:
        relative = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return path
    return path if relative.startswith("..") else relative


def dimensions(values: Mapping[str, Any], range_constraints: Mapping[Any, Any]) -> list[Dimension]:
    """Every dimension of the exported program's tensor inputs, dynamic where its range constraint allows several sizes.

    ``values``: each user input's name and its value in the program (the
    placeholders' ``val``); ``range_constraints``: the program's own.
    """
    found = []
    for name, value in values.items():
        if not isinstance(value, torch.Tensor):
            continue
        for dim, size in enumerate(value.shape):
            fixed = static_size(size)
            if fixed is not None:
                reason = _where_fixed(size) or (f"torch.export specialises a size of {fixed} in an example"
                                                if fixed in (0, 1) else None)
                found.append(Dimension(name, dim, fixed, False, reason=reason))
                continue
            expr = size.node.expr
            hint = _bound(getattr(size.node, "hint", None))
            ranges = [range_constraints.get(symbol) for symbol in expr.free_symbols]
            if ranges and all(r is not None and r.lower == r.upper for r in ranges):
                found.append(Dimension(name, dim, hint if hint is not None else -1, False,
                                       reason=f"its range constraint allows one size only ({expr} in {ranges[0]})"))
                continue
            bounds = None
            if len(ranges) == 1 and ranges[0] is not None and getattr(expr, "is_symbol", False):
                bounds = (_bound(ranges[0].lower) or 0, _bound(ranges[0].upper))
            found.append(Dimension(name, dim, hint if hint is not None else -1, True, bounds=bounds))
    return found


def shape_notes(values: Mapping[str, Any], range_constraints: Mapping[Any, Any], reasons: bool = True) -> list[str]:
    """The report's notes: which input dimensions are dynamic (from the range constraints), which fixed, and (``reasons``) why."""
    dims = dimensions(values, range_constraints)
    by_input: dict[str, list[Dimension]] = {}
    for d in dims:
        by_input.setdefault(d.input, []).append(d)
    dynamic, static = [], []
    for name, of_input in by_input.items():
        sizes = ", ".join("?" if d.dynamic else str(d.size) for d in of_input)
        (dynamic if any(d.dynamic for d in of_input) else static).append(f"{name}[{sizes}]")
    notes = []
    if dynamic:
        notes.append(f"torch.export: dynamic dimensions (?) in {', '.join(dynamic)}")
        ranges = [f"{d.name} in [{d.bounds[0]}, {d.bounds[1] if d.bounds[1] is not None else 'inf'}]"
                  for d in dims if d.dynamic and d.bounds is not None]
        if ranges:
            notes.append(f"torch.export: range constraints {', '.join(ranges)}")
    if static:
        notes.append(f"torch.export: static shapes for {', '.join(static)} (pass dynamic_shapes= to change)")
    by_reason: dict[str, list[str]] = {}
    for d in dims:
        if reasons and not d.dynamic and d.reason is not None:
            by_reason.setdefault(d.reason, []).append(f"{d.name} == {d.size}")
    if by_reason:
        notes.append("; ".join(f"torch.export fixed {', '.join(names)} {reason}" for reason, names in by_reason.items()))
    return notes


def _static_sizes(value: Any) -> Optional[tuple[Optional[int], ...]]:
    if not isinstance(value, torch.Tensor):
        return None
    return tuple(static_size(s) for s in value.shape)


def _why_and_fix(name: str, dim: int, size: int, got: int, requested: set[tuple[str, int]],
                 reasons: Optional[Mapping[tuple[str, int], str]] = None) -> str:
    """Why export kept ``name.shape[dim]`` at ``size``, and what to do for a call with ``got`` there."""
    vary = (f"{PACKAGE}.convert(..., dynamic_shapes={{{name!r}: {{{dim}: torch.export.Dim.AUTO}}, ...}}) "
            "(list the other inputs' dynamic dimensions too)")
    if (name, dim) not in requested:
        return (f"the conversion did not declare it dynamic (dynamic_shapes=False, or a spec without it).\n"
                f"Fix: convert with {vary}, or with an example where {name}.shape[{dim}] is {got}.")
    if size in (0, 1):
        return (f"torch.export specialises a size of {size} in an example.\n"
                f"Fix: convert with an example where {name}.shape[{dim}] is 2 or more.")
    where = (reasons or {}).get((name, dim)) or ""
    return (f"the model fixes that size{' ' + where if where.startswith('at ') else ''} (torch.export kept it static instead of "
            "failing; the conversion warned).\n"
            f"Fix: call with {size} there, or convert another module with an example where {name}.shape[{dim}] "
            f"is {got}; to see what fixes it, convert with dynamic_shapes= giving that dimension a named "
            f"torch.export.Dim({(name + '_' + str(dim))!r}): the conversion then refuses, saying why.")


def _size_mismatch(recorded: _Recorded, args: tuple, requested: set[tuple[str, int]],
                   reasons: Optional[Mapping[tuple[str, int], str]] = None) -> Optional[str]:
    """The message for the first input whose rank or static size differs from the exported program's; None if all match."""
    for (name, sizes), value in zip(recorded, args):
        if sizes is None or not isinstance(value, torch.Tensor):
            continue
        if value.dim() != len(sizes):
            return (f"{name} has {value.dim()} dimensions, but the converted module was traced with torch.export "
                    f"from an example with {len(sizes)}: it only accepts that rank. Fix: convert with an example of this rank.")
        for dim, size in enumerate(sizes):
            if size is not None and value.shape[dim] != size:
                got = value.shape[dim]
                return (f"{name}.shape[{dim}] is {got}, but the converted module only accepts {size} there: "
                        f"torch.export specialised that dimension to {size} when amp_fx converted the model, because "
                        + _why_and_fix(name, dim, size, got, requested, reasons))
    return None


def _relation(guard: str) -> str:
    return (
        f"the inputs break a shape condition torch.export recorded when amp_fx converted the model ({guard}). "
        "The model requires it (a relation between sizes, or a bound its code checks). Fix: call with inputs that "
        "satisfy it, or convert with an example and dynamic_shapes= that describe the sizes you call with."
    )


def explain_guard_failures(module: fx.GraphModule, values: Mapping[str, Any], requested: set[tuple[str, int]],
                           reasons: Optional[Mapping[tuple[str, int], str]] = None) -> bool:
    """Make ``module``'s export guards raise AmpValueError naming the input, dimension and fix; False if it has none.

    ``values``: each user input's name and example value in the exported
    program, in the order the guards receive them; ``requested``: the
    (input, dimension) pairs the conversion asked to keep dynamic; ``reasons``:
    where export fixed a dimension (:attr:`Dimension.reason`).  A static
    size is checked before the guards run (also under torch.compile, where
    Dynamo traces the guards); any other guard's failure is explained after.
    """
    guards = getattr(module, "_guards_fn", None)
    if guards is None or not callable(getattr(guards, "forward", None)):
        return False
    original = guards.forward
    if getattr(original, "amp_fx_explains", None) is not None:
        return True  # already wrapped
    recorded: _Recorded = [(name, _static_sizes(value)) for name, value in values.items()]
    requested = set(requested)

    def forward(*args: Any) -> Any:
        mismatch = _size_mismatch(recorded, args, requested, reasons)
        if mismatch is not None:
            raise AmpValueError(mismatch)
        if torch.compiler.is_compiling():
            return original(*args)  # Dynamo traces the guards to build its own
        try:
            return original(*args)
        except AssertionError as error:
            raise AmpValueError(_relation(str(error).removeprefix("Guard failed: "))) from error

    forward.amp_fx_explains = original  # type: ignore[attr-defined]
    guards.forward = forward
    return True


def _specs(shapes: Any) -> list[tuple[str, int, Any]]:
    """(input, dimension, spec) for every dimension a ``dynamic_shapes`` mapping names (dict or tuple per input)."""
    if not isinstance(shapes, Mapping):
        return []
    found = []
    for name, dims in shapes.items():
        items = dims.items() if isinstance(dims, Mapping) else enumerate(dims) if isinstance(dims, (list, tuple)) else ()
        found += [(name, dim, spec) for dim, spec in items if isinstance(dim, int) and spec is not None]
    return found


def requested_dims(shapes: Any) -> set[tuple[str, int]]:
    """The (input, dimension) pairs a ``dynamic_shapes`` mapping asks to keep dynamic."""
    return {(name, dim) for name, dim, _ in _specs(shapes)}


def declared_dims(shapes: Any) -> dict[str, tuple[str, int]]:
    """Each named ``Dim`` in a ``dynamic_shapes=`` mapping -> the (input, dimension) it was declared on (the first)."""
    found: dict[str, tuple[str, int]] = {}
    for name, dim, spec in _specs(shapes):
        dim_name = getattr(spec, "__name__", None)
        if isinstance(dim_name, str):
            found.setdefault(dim_name, (name, dim))
    return found


def refuse_constraint_violation(error: BaseException, shapes: Any, model_name: str) -> None:
    """Raise AmpValueError for torch.export's constraint violation ``error`` (dynamic_shapes= the model contradicts); else return."""
    kind = getattr(error, "error_type", None)
    if getattr(kind, "name", None) != "CONSTRAINT_VIOLATION":
        return
    text = str(error)
    declared = declared_dims(shapes)
    header = re.search(r"Constraints violated \(([^)]*)\)", text)
    names = [n.strip() for n in header.group(1).split(",")] if header else []
    named = {(declared[n][0], declared[n][1]): f" (Dim {n!r})" for n in names if n in declared}
    for m in re.finditer(r"L\['([^']+)'\]\.size\(\)\[(\d+)\]", text):  # dimensions torch.export names itself
        named.setdefault((m.group(1), int(m.group(2))), "")
    where = [f"{name}.shape[{dim}]{dim_name}" for (name, dim), dim_name in named.items()]
    reasons = [line.strip() for line in text.splitlines() if line.strip().startswith("- ") or re.match(r"\s+\w+ = ", line)]
    raise AmpValueError(
        f"dynamic_shapes= declares {', '.join(where) or ', '.join(names) or 'a dimension'} of {model_name} dynamic, "
        "but torch.export found that the model does not allow it:\n  " + "\n  ".join(reasons or [text.splitlines()[0]])
        + "\namp_fx refuses rather than keeping it static behind your back. Fix: leave that dimension out of "
        "dynamic_shapes= (or give it torch.export.Dim.AUTO, which keeps it static where the model fixes it), or "
        "narrow its range as torch.export suggests above."
    ) from error
