"""Checks of a ``register_op`` row against the op torch defines: its name, its schema, its call shapes.

A registered row is the only thing the passes know about a custom op, so a wrong row turns into a
wrong rewrite (``pad_gemm`` padding the activation where the weight is, ``fp8_gemms`` reading an
(N, K) weight as (K, N)) and a raw shape error on the first call.  What can be checked is checked as
early as it can be:

- at registration, when torch knows the op: the name (:func:`check_op_name`: an op missing from a
  namespace torch has loaded is a misspelling) and the GEMM signature against the op's schema
  (:func:`check_gemm_schema`: positions in range, distinct, tensor-typed; every tensor argument
  named as activation, weight or bias);
- at convert (``find_gemm``, read by ``pad_gemm`` and ``fp8_gemms``), for an op registered before
  its library was imported: the schema again; and wherever the example inputs give shapes, the
  weight layout (:func:`check_gemm_shapes`: K of the weight is the activation's last dim, N is the
  result's last dim, the bias has N entries).

Each failure is an :class:`~amp_fx.errors.AmpValueError` that names the row and the fix.
"""

from __future__ import annotations

import difflib
from functools import lru_cache
from typing import Any, Optional

import torch

from amp_fx.errors import AmpValueError

__all__ = ["op_schema", "op_packet", "check_op_name", "check_gemm_schema", "check_gemm_shapes", "gemm_flops",
           "flop_formula"]

_TORCH_NAMESPACES = ("aten", "prim", "prims", "quantized", "_quant")


def _loaded_ops() -> set:
    """``"ns::name"`` of every op the dispatcher knows now."""
    return {n.split(".")[0] for n in torch._C._dispatch_get_all_op_names()}


def op_schema(op: str) -> Optional[Any]:
    """The default overload's schema of custom op ``"ns::name"``, or None while torch does not know it."""
    namespace, _, name = op.partition("::")
    try:
        return getattr(getattr(torch.ops, namespace), name).default._schema
    except (AttributeError, RuntimeError):
        return None


def op_packet(op: str) -> Optional[Any]:
    """``torch.ops.ns.name`` (the overload packet a dispatch mode sees) of ``"ns::name"``, or None while not loaded."""
    namespace, _, name = op.partition("::")
    try:
        return getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return None


def check_op_name(op: str) -> None:
    """Refuse a custom op name that torch does not know in a namespace whose library is loaded (a misspelling).

    An op whose namespace torch has not loaded at all is accepted: a library may register its rows
    before it imports the module that defines its ops; its schema is checked at convert.
    """
    loaded = _loaded_ops()
    namespace = op.split("::")[0]
    if op in loaded or not any(name.startswith(namespace + "::") for name in loaded):
        return
    close = difflib.get_close_matches(op, sorted(n for n in loaded if n.startswith(namespace + "::")), n=3, cutoff=0.6)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    raise AmpValueError(f"register_op({op!r}): torch has ops in namespace {namespace!r} but not this one.{hint} "
                        "Give the name torch.library.custom_op defined (or register the row before importing "
                        "the library, when its namespace is not loaded yet)")


def _describe(sig: Any) -> str:
    bias = "" if sig.bias is None else f", bias={sig.bias}"
    return f"GemmSig(activation={sig.activation}, weight={sig.weight}{bias}, weight_layout={sig.weight_layout!r})"


def _is_tensor(argument: Any) -> bool:
    kind = argument.type
    if isinstance(kind, torch.OptionalType):
        kind = kind.getElementType()
    return isinstance(kind, torch.TensorType)


def _check_positions(op: str, sig: Any) -> None:
    """Positions are non-negative ints, activation and weight given, the three distinct (no schema needed)."""
    positions = {"activation": sig.activation, "weight": sig.weight, "bias": sig.bias,
                 "groups": sig.groups, "transposed": sig.transposed}
    for role, position in positions.items():
        if position is None and role in ("bias", "groups", "transposed"):
            continue
        if isinstance(position, bool) or not isinstance(position, int) or position < 0:
            raise AmpValueError(f"register_op({op!r}): {_describe(sig)}: {role} must be the non-negative position "
                                f"of a positional argument of the op, got {position!r}")
    operands = [p for p in (sig.activation, sig.weight, sig.bias) if p is not None]
    if len(set(operands)) != len(operands):
        raise AmpValueError(f"register_op({op!r}): {_describe(sig)} names one argument twice: activation, weight "
                            "and bias are three different arguments of the op")


def check_gemm_schema(op: str, sig: Any) -> tuple:
    """Check ``sig`` against ``op``'s schema; return the operands' keyword names (``sig.names`` without a schema)."""
    _check_positions(op, sig)
    schema = op_schema(op)
    return sig.names if schema is None else _check_against(op, sig, schema)


@lru_cache(maxsize=None)
def _check_against(op: str, sig: Any, schema: Any) -> tuple:
    arguments = schema.arguments
    signature = ", ".join(f"{i}: {a.name}: {a.type}" for i, a in enumerate(arguments))
    roles = {"activation": sig.activation, "weight": sig.weight, "bias": sig.bias}
    for role, position in roles.items():
        if position is None:
            continue
        if position >= len(arguments) or arguments[position].kwarg_only:
            raise AmpValueError(f"register_op({op!r}): {_describe(sig)}: {role}={position} is past the op's "
                                f"positional arguments ({signature}); give the {role}'s position")
        if not _is_tensor(arguments[position]):
            raise AmpValueError(f"register_op({op!r}): {_describe(sig)}: {role}={position} is argument "
                                f"{arguments[position].name!r} of type {arguments[position].type}, not a tensor "
                                f"({signature})")
    named = {p for p in roles.values() if p is not None}
    for i, argument in enumerate(arguments):
        if i not in named and _is_tensor(argument):
            fix = f"pass bias={i} if it is the bias" if sig.bias is None else "a GEMM row reads no other tensor"
            raise AmpValueError(f"register_op({op!r}): {_describe(sig)} does not name tensor argument {i} "
                                f"{argument.name!r} ({signature}): {fix}; the passes that read the row (pad_gemm, "
                                "fp8_gemms) rewrite activation, weight and bias only")
    names = tuple(arguments[p].name if p is not None else None for p in (sig.activation, sig.weight, sig.bias))
    if any(sig.names) and tuple(sig.names)[:3] != names:
        raise AmpValueError(f"register_op({op!r}): {_describe(sig)}: names={sig.names} but the op's schema names "
                            f"those arguments {names}; leave names out (they are read off the schema)")
    return names


def _k_and_n(sig: Any, w_shape: tuple) -> tuple:
    """(K, N) of the weight under the row's layout (None where its rank does not allow it)."""
    if sig.weight_layout == "NK" and len(w_shape) >= 2:
        return w_shape[-1], w_shape[-2]
    if sig.weight_layout == "KN" and len(w_shape) >= 2:
        return w_shape[-2], w_shape[-1]
    return None, None


def check_gemm_shapes(op: str, sig: Any, where: str, a_shape: Optional[tuple], w_shape: Optional[tuple],
                      b_shape: Optional[tuple], out_shape: Optional[tuple]) -> None:
    """Refuse a row whose weight layout or operand positions do not fit one call's shapes (``where`` names the call).

    Checked for ``"NK"`` and ``"KN"`` rows where the shapes are known: the weight's K is the
    activation's last dim, its N the result's last dim, a bias has N (or 1) entries in its last dim.
    """
    if sig.weight_layout not in ("NK", "KN") or a_shape is None or w_shape is None or len(w_shape) < 2 \
            or not a_shape or not all(isinstance(s, int) for s in (*a_shape, *w_shape)):
        return
    k, n = _k_and_n(sig, w_shape)
    problems = []
    if a_shape[-1] != k:
        problems.append(f"the weight's K ({'last' if sig.weight_layout == 'NK' else 'second-last'} dim) is {k} but "
                        f"the activation's last dim is {a_shape[-1]}")
    if out_shape and isinstance(out_shape[-1], int) and out_shape[-1] != n:
        problems.append(f"the weight's N is {n} but the result's last dim is {out_shape[-1]}")
    if b_shape and isinstance(b_shape[-1], int) and b_shape[-1] not in (n, 1):
        problems.append(f"the bias's last dim is {b_shape[-1]}, not N={n}")
    if not problems:
        return
    other = "KN" if sig.weight_layout == "NK" else "NK"
    k2, n2 = _k_and_n(type(sig)(sig.activation, sig.weight, sig.bias, other), w_shape)
    hint = f" weight_layout={other!r} fits these shapes." if a_shape[-1] == k2 and \
        (not out_shape or out_shape[-1] == n2) else " Check which argument is the activation and which the weight."
    raise AmpValueError(f"register_op({op!r}) row {_describe(sig)} does not fit call {where}: activation "
                        f"{tuple(a_shape)}, weight {tuple(w_shape)}, result "
                        f"{tuple(out_shape) if out_shape else '?'}: {'; '.join(problems)}.{hint} Fix the row "
                        "(register_op(..., gemm=GemmSig(...), replace=True)) before converting")


def gemm_flops(sig: Any, w_shape: tuple, out_shape: tuple) -> int:
    """2 x (result elements) x K: the multiply-adds of a GEMM or convolution row (0 where the shapes do not say)."""
    if sig.weight_layout == "conv":
        k = 1
        for size in w_shape[1:]:
            k *= size
    else:
        k = _k_and_n(sig, w_shape)[0]
    if not k or not out_shape:
        return 0
    points = 1
    for size in out_shape:
        points *= size
    return 2 * points * k


def flop_formula(sig: Any):
    """A ``FlopCounterMode`` formula for a registered GEMM row: called with shapes, ``out_shape=`` its result's."""
    def formula(*args: Any, out_shape: Any = None, **kwargs: Any) -> int:
        names = tuple(sig.names) + (None,) * 3
        weight = args[sig.weight] if len(args) > sig.weight else kwargs.get(names[1])
        if weight is None or not isinstance(out_shape, (tuple, torch.Size)):
            return 0
        return gemm_flops(sig, tuple(weight), tuple(out_shape))
    return formula
