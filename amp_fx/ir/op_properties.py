"""What each op is, in one place: the registry every pass asks, keyed by canonical op name.

A canonical name is what :mod:`amp_fx.ir.op_keys` makes of a node, the name ``meta.OP`` holds.
The autocast lists stay data in :mod:`amp_fx.ir.tables` (table class and reason, data movement,
norms, export checks); this module reads them and defines every other property a pass decides
by, each once, as the set of ops that have it.  :func:`of` gathers them into one frozen
:class:`OpProperties` per op; an op listed nowhere gets the defaults (nothing known about it).
Adding a built-in op: its table entry in ``tables.py``, then here each property it has.  A
``torch.library`` custom op is keyed ``"ns::name"`` (``op_keys`` names it so on every route); a
library adds its whole row in one call, :func:`register_op` (table, reason, GEMM signature with
its weight layout, fp8 eligibility, norm kind, fused norm form).  One listed nowhere is unknown, and
``passes/assign_precision.py`` gives it one dtype for its inputs.  Passes read the row
(``gemm``, ``fp8``, ``norm``, ``fused_form``) and never test an op's name.

Rounding.  Two passes let an op run in the low dtype where its result is rounded low anyway,
which rounds its input instead of its output (``minimize_casts`` moving an fp32 node low,
``fuse_precision`` passing a fused norm's low result through it).  That is exact when

- **forward** (``rounding_forward``): ``f(round(x)) == round(f(x))`` for every ``x``.  Ops that
  select, move, negate or clamp values qualify (round-to-nearest is monotone and symmetric);
  ``threshold(x, t, v)`` does not (an ``x`` just above ``t`` rounds onto it and becomes ``v``).
- **backward** (``backward``): the backward at ``round(x)`` gives what the backward at ``x`` gives.
  ``"moves"``: each gradient element goes to one input element chosen by position, or is zeroed by
  a sign test (relu, abs) that rounding changes only on underflow to zero; ``"none"``: no
  gradient reaches the input.  Not exact: ``"masks"`` (zeroes gradients past a bound: rounding
  carries an input within half an ulp of the bound across it, e.g. ``clamp(max=1)`` of 1.003),
  ``"routes"`` (max pooling: rounding can tie a window and route its gradient to another element;
  overlapping windows sum), ``"sums"`` (expand, repeat, gathers: the sum would run in the low
  dtype), ``"computes"`` (the default).

:func:`exact_under_rounding_at` is the one question both passes ask (fuse_precision also lets
``"routes"`` through, as measured in ``tests/passes/test_fuse_precision.py``).  Where
the passes' old lists disagreed, and why the registry answers as it does, is shown op by op in
``tests/ir/test_op_properties.py``.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from functools import lru_cache
from types import MappingProxyType
from typing import Callable, Mapping, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.node import map_arg

from amp_fx.errors import AmpTypeError, AmpValueError, AmpWarning
from amp_fx.graph_ops.fused_norms import layer_norm_fp32_stats
from amp_fx.ir import gemm_rows, meta, tables

__all__ = ["OpProperties", "FusedForm", "GemmSig", "register_op", "RegisteredOp", "registered_gemms", "of", "exact_under_rounding",
           "exact_under_rounding_at", "known_ops", "CAST_OPS", "NAMED_CASTS", "FUSED_FORMS", "HOOK_BOUNDARY_OPS",
           "HOOK_VALUE_OP", "BACKWARD_KINDS", "WEIGHT_LAYOUTS", "NORM_KINDS"]

_LOW_DTYPES = frozenset({torch.bfloat16, torch.float16})


@dataclass(frozen=True)
class FusedForm:
    """A mixed-dtype kernel that computes an fp32 op from its low input and fp32 weights (passes/fuse_precision.py)."""

    devices: frozenset  # device types on which it was verified as precise as the cast form
    description: str  # what the report says it runs
    dtypes: frozenset = _LOW_DTYPES  # the low input dtypes it was verified for
    affine_only: bool = True  # verified only with a weight or bias (without: the kernel's input gradient is low)
    retarget: Optional[Callable] = None  # a precise function the call is pointed at when fused
    calls: tuple = ()  # with ``retarget``: the call targets that may be pointed at it (others keep the cast form)


WEIGHT_LAYOUTS = ("KN", "NK", "conv")


@dataclass(frozen=True)
class GemmSig:
    """Where a GEMM op reads its activation, weight and bias, and how its weight is laid out.

    Positions count the op's positional arguments; ``names`` are the same three arguments' keyword
    names (a call may pass them by name; :func:`register_op` reads them off a registered op's schema).
    ``weight_layout``: ``"KN"`` (``x @ W``, W's last two dims are K x N: ``mm``'s ``mat2``), ``"NK"``
    (``x @ W.T``, W is N x K: ``F.linear``'s weight) or ``"conv"`` (N x K/groups x kernel).
    ``groups`` / ``transposed``: a convolution's positions of those arguments; ``unit_scalars``:
    keyword scalars a plain GEMM leaves at 1 (``addmm``'s ``beta`` and ``alpha``).
    """

    activation: int
    weight: int
    bias: Optional[int] = None
    weight_layout: str = "KN"
    names: tuple = (None, None, None)
    groups: Optional[int] = None
    transposed: Optional[int] = None
    unit_scalars: tuple = ()

    def operands(self) -> tuple:
        """((position, keyword name), ...) of activation, weight and bias (bias position None: it has none)."""
        names = tuple(self.names) + (None,) * (3 - len(self.names))
        return tuple(zip((self.activation, self.weight, self.bias), names[:3]))

    @property
    def arity(self) -> int:
        """How many positional arguments its activation, weight and bias take at most."""
        return 1 + max(p for p in (self.activation, self.weight, self.bias) if p is not None)


def _group(value: object, *names: str) -> dict[str, object]:
    return dict.fromkeys(names, value)


# -- what an op's result shares ----------------------------------------------
# Ops whose result is a view of their first input (getitem only with basic, non-tensor indices;
# reshape/flatten when the layout allows): a write into it writes into the input.
_VIEWS = frozenset({
    "view", "reshape", "flatten", "unflatten", "permute", "transpose", "t", "expand", "expand_as", "squeeze",
    "unsqueeze", "narrow", "select", "slice", "detach", "alias", "view_as", "split", "chunk", "unbind",
    "split_with_sizes", "tensor_split", "hsplit", "vsplit", "dsplit", "diagonal", "as_strided", "unfold", "movedim",
    "moveaxis", "swapaxes", "swapdims", "adjoint", "unsafe_view", "_unsafe_view", "getitem",
})

# -- casts ------------------------------------------------------------------
# Ops that are themselves casts: never decided, only read.  The named ones say their target.
_CASTS: Mapping[str, Optional[torch.dtype]] = MappingProxyType({
    "float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16, "double": torch.float64,
    **_group(None, "to", "type_as", "type", "_to_copy", "amp_cast"),
})
CAST_OPS = frozenset(_CASTS)
NAMED_CASTS: Mapping[str, torch.dtype] = MappingProxyType({k: v for k, v in _CASTS.items() if v is not None})
# Tensor methods that cast to an integer or bool dtype (not decided: they make no float).
_NON_FLOAT_CASTS = frozenset({"long", "int", "bool", "short", "byte", "char"})

# -- rounding (see the module docstring) --------------------------------------
_MAX_POOLS = ("max_pool1d", "max_pool2d", "max_pool3d", "adaptive_max_pool1d", "adaptive_max_pool2d")
# embedding_bag sums or averages rows; max_pool2d_with_indices returns indices, which ties move.
_ROUNDING_FORWARD = (tables.DATA_MOVEMENT - {"embedding_bag"}) | {
    "relu", "relu6", "neg", "abs", "sign", "clamp", "clamp_min", "clamp_max", "hardtanh", "cat", "stack", *_MAX_POOLS}
BACKWARD_KINDS = ("moves", "none", "masks", "routes", "sums", "computes")
_BACKWARD: Mapping[str, str] = MappingProxyType({
    **_group("moves",
             "view", "reshape", "flatten", "unflatten", "permute", "transpose", "t", "contiguous", "squeeze",
             "unsqueeze", "narrow", "select", "slice", "flip", "roll", "clone", "identity", "pad", "constant_pad_nd",
             "tril", "triu", "alias", "unsafe_view", "_unsafe_view", "getitem", "split", "chunk", "unbind",
             "split_with_sizes", "masked_select", "view_as", "lift_fresh_copy", "getattr", "cat", "stack",
             "relu", "neg", "abs", "diagonal", "movedim", "moveaxis", "swapaxes", "swapdims", "adjoint",
             "tensor_split", "hsplit", "vsplit", "dsplit"),
    **_group("none", "detach", "zeros_like", "ones_like", "empty_like", "full_like", "new_zeros", "new_ones",
             "new_empty", "new_full", "size", "dim", "numel", "one_hot", "sign",
             "sym_size", "sym_stride", "sym_numel", "sym_storage_offset"),
    **_group("masks", "clamp", "clamp_min", "clamp_max", "hardtanh", "relu6", "threshold"),
    **_group("routes", *_MAX_POOLS, "max_pool2d_with_indices"),
    # masked_fill may broadcast its input over the mask; scatter/setitem gather what they wrote.
    **_group("sums", "expand", "expand_as", "repeat", "tile", "repeat_interleave", "index_select", "gather",
             "scatter", "setitem", "embedding", "embedding_bag", "masked_fill",
             # overlapping windows read one element several times: its gradient is their sum
             "unfold", "as_strided"),
})

# -- placement (passes/minimize_casts.py) --------------------------------------
# Ops that compute a float tensor from float tensors and are legal in either precision: a FOLLOW
# node of one is free to move between low and fp32.  (expand_as/view_as are not: their second
# input gives only a shape.  cat/stack are PROMOTE ops, which move with their inputs.)
_EITHER_PRECISION = frozenset({
    "add", "sub", "mul", "div", "where", "maximum", "minimum", "lerp", "rsub",
    "relu", "relu6", "neg", "abs", "sign", "clamp", "clamp_min", "clamp_max", "hardtanh", "threshold",
    "gelu", "silu", "sigmoid", "tanh", "leaky_relu", "elu", "selu", "celu", "hardswish", "hardsigmoid",
    "mish", "sqrt", "square", "sin", "cos", "erf",
    "view", "reshape", "flatten", "unflatten", "permute", "transpose", "t", "contiguous", "squeeze",
    "unsqueeze", "narrow", "select", "slice", "flip", "roll", "clone", "detach", "identity", "pad",
    "constant_pad_nd", "tril", "triu", "alias", "unsafe_view", "_unsafe_view", "getitem", "cat", "stack",
    "expand", "repeat", "index_select", "gather", "masked_fill", "max_pool1d", "max_pool2d", "max_pool3d",
    "avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d",
    "adaptive_avg_pool3d", "dropout", "mean", "amax", "amin",
})
# Ops that read several tensors and run in the widest of them themselves (add(fp32, low) needs no cast).
_NATIVE_PROMOTION = frozenset({"add", "sub", "mul", "div", "where", "maximum", "minimum", "lerp", "rsub"})
# Ops a cast of a parameter may be hoisted above (passes/dedupe_casts.py): one tensor in, exact under
# rounding.  Not expand: its backward would sum over the broadcast in the low dtype.
_CAST_HOISTABLE = frozenset({
    "t", "transpose", "permute", "view", "reshape", "contiguous", "unsqueeze", "squeeze",
    "flatten", "getitem", "select", "narrow", "detach", "view_as", "alias", "unflatten",
})
# Ops whose result is larger than their input by a factor read off literal arguments (cost estimates).
_GROWS = frozenset({"repeat", "tile", "repeat_interleave", "expand"})

# -- kernels ------------------------------------------------------------------
# (Not batch_norm: CPU's mixed backward gives a 1.17x larger input-gradient error than the cast form
# against fp64.  At O1 batch_norm follows its input anyway; only a policy pins it fp32.)
# layer_norm: bf16 only (fp16: CPU's mixed forward differs from the cast form in ~1e-4 of the outputs, 1 ulp,
# and a 200-step fp16 run drifted from autocast; bf16 is bitwise), and only its F.layer_norm / torch.layer_norm
# calls, pointed at layer_norm_fp32_stats (a leaf module or an aten form would run CPU's own mixed backward,
# which rounds dx, dw, db low).  With or without weight and bias.
_FUSED_FORMS: dict[str, FusedForm] = {
    "group_norm": FusedForm(frozenset({"cpu"}), "group_norm"),
    "instance_norm": FusedForm(frozenset({"cpu"}), "instance_norm"),
    "layer_norm": FusedForm(frozenset({"cpu"}), "layer_norm without weight and bias", dtypes=frozenset({torch.bfloat16}),
                            affine_only=False, retarget=layer_norm_fp32_stats,
                            calls=(F.layer_norm, torch.layer_norm, layer_norm_fp32_stats)),
}
FUSED_FORMS: Mapping[str, FusedForm] = MappingProxyType(_FUSED_FORMS)
# Where F.layer_norm/group_norm and F.batch_norm/instance_norm take their weight and bias.
_WEIGHT_BIAS_ARGS: dict[str, tuple] = {"layer_norm": (2, 3), "group_norm": (2, 3), "batch_norm": (3, 4),
                                       "instance_norm": (3, 4)}
# GEMMs passes/pad_gemm.py pads and passes/fp8_gemms.py may make fp8: where their operands are, the weight's layout.
_LINEAR = GemmSig(0, 1, 2, "NK", ("input", "weight", "bias"))
_CONV = GemmSig(0, 1, 2, "conv", ("input", "weight", "bias"), groups=6)
_GEMMS: dict[str, GemmSig] = {
    "linear": _LINEAR,
    "matmul": GemmSig(0, 1, None, "KN", ("input", "other")), "mm": GemmSig(0, 1, None, "KN", ("input", "mat2")),
    "bmm": GemmSig(0, 1, None, "KN", ("input", "mat2")),
    "addmm": GemmSig(1, 2, 0, "KN", ("mat1", "mat2", "input"), unit_scalars=("beta", "alpha")),
    "baddbmm": GemmSig(1, 2, 0, "KN", ("batch1", "batch2", "input"), unit_scalars=("beta", "alpha")),
    "conv1d": _CONV, "conv2d": _CONV, "conv3d": _CONV,
    "convolution": GemmSig(0, 1, 2, "conv", ("input", "weight", "bias"), groups=8, transposed=6),
    # What passes/fp8_gemms.py makes of a GEMM (amp_fx/graph_ops/fp8_ops.py): pad_gemm, which runs after it,
    # lists them with the final graph's GEMMs (never pads them: their K and N are multiples of 16 already).
    "fp8_linear": GemmSig(0, 1, None, "NK", ("x", "weight")), "fp8_matmul": GemmSig(0, 1, None, "KN", ("x", "other")),
}
# GEMMs that may run as scaled fp8 GEMMs (amp_fx/ir/fp8_rules.py), each verified against torchao
# (tests/fp8/test_fp8_torchao.py).  addmm: bias + x @ W, as Hugging Face's Conv1D computes.
_FP8: set = {"linear", "matmul", "mm", "addmm"}

# -- module hook boundaries (amp_fx/frontend/module_hooks.py) --------------------
# enter/exit pass a token; module_hook_value(x, token, i) is x as the hooks left it.
HOOK_BOUNDARY_OPS = frozenset({"module_hook_enter", "module_hook_exit"})
HOOK_VALUE_OP = "module_hook_value"

# -- result kinds for the analysis's dtype-only mode (amp_fx/ir/dtype_rules.py) --
# Ops in LOW or FP32 whose tensor result is floating whatever arrives; these keep an integer input's dtype.
_INTEGER_PRESERVING = frozenset({"sum", "prod", "cumsum", "cumprod", "pow"})
_NON_FLOAT_RESULT = frozenset({
    "eq", "ne", "lt", "le", "gt", "ge", "isfinite", "isnan", "isinf", "logical_and", "logical_or", "logical_not",
    "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not", "argmax", "argmin", "any", "all", "one_hot", "equal",
    "nonzero", "searchsorted", "bucketize",
})
_NON_TENSOR_RESULT = frozenset({"size", "dim", "numel", "ndimension", "nelement", "stride", "is_floating_point",
                                "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "item", "tolist", "equal", "is_contiguous", "data_ptr"})
# Ops that return several tensors (their items are read with getitem).
_TUPLE_RESULT = frozenset({"split", "chunk", "unbind", "split_with_sizes", "topk", "sort", "var_mean", "std_mean",
                           "lstm", "gru", "rnn_tanh", "rnn_relu", "native_dropout", "max_pool2d_with_indices",
                           "multi_head_attention"})
# Data movement keeps its first input's dtype, except where an index tensor comes first (F.embedding).
_NOT_FIRST_DTYPE = frozenset({"embedding", "embedding_bag", "one_hot"})
_REAL_OF_COMPLEX = frozenset({"view_as_real", "real", "imag", "abs", "angle"})
_COMPLEX_RESULT = frozenset({"view_as_complex", "polar", "complex"})


@dataclass(frozen=True)
class OpProperties:
    """Everything amp_fx knows about one canonical op (defaults: nothing known)."""

    name: Optional[str]
    table: str = "unknown"  # low | fp32 | promote | banned | follow | unknown (amp_fx/ir/tables.py)
    reason: str = ""  # the table's one-line reason
    data_movement: bool = False  # only moves data: follows its input at every level
    view: bool = False  # returns a view of its first input
    may_alias: bool = False  # its result may share memory with its first input (views, data movement, casts)
    cast: bool = False  # a cast the model wrote (never decided, only read)
    cast_dtype: Optional[torch.dtype] = None  # a named cast's target (x.half() -> float16)
    non_float_cast: bool = False  # x.long(), x.bool(): an integer or bool tensor
    rounding_forward: bool = False  # f(round(x)) == round(f(x))
    backward: str = "computes"  # one of BACKWARD_KINDS
    either_precision: bool = False  # free to move between low and fp32 (minimize_casts)
    native_promotion: bool = False  # runs in the widest of several inputs by itself
    cast_hoistable: bool = False  # a parameter's cast may be hoisted above it (dedupe_casts)
    grows: bool = False  # result larger than its input by literal factors (repeat, expand)
    fused_form: Optional[FusedForm] = None  # a verified mixed-dtype kernel for its fp32 decision
    weight_bias_args: Optional[tuple] = None  # positions of weight and bias (norms)
    gemm: Optional[GemmSig] = None  # a GEMM's operands and weight layout (pad_gemm, fp8_gemms)
    norm: Optional[str] = None  # "statistics" (fp32 under keep_batchnorm_fp32) | "input_dtype" (follows its input)
    loss: bool = False  # a loss (or the log_softmax of one): fp32 at O2 under keep_losses_fp32
    hook: Optional[str] = None  # "boundary" (enter/exit token) | "value" (a value out of a boundary)
    export_check: bool = False  # a check torch.export records: no result, no arithmetic
    float_result: bool = False  # its tensor result is floating whatever arrives
    non_float_result: bool = False  # its result is never floating
    non_tensor_result: bool = False  # its result is not a tensor
    tuple_result: bool = False  # returns several tensors
    keeps_first_dtype: bool = False  # its result has its first input's dtype
    real_of_complex: bool = False  # the real part of a complex input is real
    complex_result: bool = False  # makes complex values
    fp8: bool = False  # a GEMM that may run as a scaled fp8 GEMM (amp_fx/ir/fp8_rules.py; verified against torchao)

    @property
    def exact_under_rounding(self) -> bool:
        """Forward and backward commute with rounding: it may run low where its result is rounded low anyway."""
        return self.rounding_forward and self.backward in ("moves", "none")


@lru_cache(maxsize=None)
def of(op: Optional[str]) -> OpProperties:
    """The properties of canonical op ``op`` (None, or an op listed nowhere: the defaults)."""
    if op is None:
        return OpProperties(None)
    table = tables.table_of(op)
    norm = tables.NORMS.get(op)
    return OpProperties(
        name=op, table=table, reason=tables.all_tables()[table][op] if table != "unknown" else "",
        data_movement=op in tables.DATA_MOVEMENT, view=op in _VIEWS,
        may_alias=op in _VIEWS or op in tables.DATA_MOVEMENT or op in CAST_OPS,
        cast=op in CAST_OPS, cast_dtype=_CASTS.get(op), non_float_cast=op in _NON_FLOAT_CASTS,
        rounding_forward=op in _ROUNDING_FORWARD, backward=_BACKWARD.get(op, "computes"),
        either_precision=op in _EITHER_PRECISION, native_promotion=op in _NATIVE_PROMOTION,
        cast_hoistable=op in _CAST_HOISTABLE, grows=op in _GROWS, fused_form=FUSED_FORMS.get(op),
        weight_bias_args=_WEIGHT_BIAS_ARGS.get(op), gemm=_GEMMS.get(op), norm=norm, loss=op in tables.LOSSES,
        hook="boundary" if op in HOOK_BOUNDARY_OPS else "value" if op == HOOK_VALUE_OP else None,
        export_check=op in tables.EXPORT_CHECKS,
        float_result=table in ("low", "fp32") and op not in _INTEGER_PRESERVING,
        non_float_result=op in _NON_FLOAT_RESULT, non_tensor_result=op in _NON_TENSOR_RESULT,
        tuple_result=op in _TUPLE_RESULT,
        keeps_first_dtype=op in tables.DATA_MOVEMENT and op not in _NOT_FIRST_DTYPE,
        real_of_complex=op in _REAL_OF_COMPLEX, complex_result=op in _COMPLEX_RESULT, fp8=op in _FP8,
    )


def exact_under_rounding(op: Optional[str]) -> bool:
    """``of(op).exact_under_rounding``: forward and backward commute with rounding (module docstring)."""
    return of(op).exact_under_rounding


def exact_under_rounding_at(node: fx.Node, *, routes: bool = False) -> bool:
    """The node's op commutes with rounding forward and backward at this use (``routes``: max pooling counts too).

    ``x[idx]`` with a tensor index is a gather.  A node that reads one value
    twice (``cat([x] * 64)``) is not exact either: autograd sums the
    gradients of the copies into that value, in the low dtype were the node
    run low (measured: x.grad 3.6x further from fp64 than autocast's for
    64 copies), so its backward sums like ``repeat``'s.
    """
    op = node.meta.get(meta.OP)
    props = of(op)
    if not (props.exact_under_rounding or (routes and props.rounding_forward and props.backward == "routes")):
        return False
    if op == "getitem":
        indices: list[fx.Node] = []
        map_arg(node.args[1:], indices.append)
        return not indices
    uses: list[fx.Node] = []
    map_arg((node.args, node.kwargs), uses.append)
    return len(uses) == len(set(uses))


@lru_cache(maxsize=None)
def known_ops() -> frozenset:
    """Every op some table or property names (a policy's ``op:`` name outside these is a likely misspelling)."""
    named = set().union(*tables.all_tables().values(), CAST_OPS, _VIEWS, _BACKWARD, _EITHER_PRECISION, _GEMMS,
                        _NON_FLOAT_RESULT, _NON_TENSOR_RESULT, _TUPLE_RESULT, HOOK_BOUNDARY_OPS, {HOOK_VALUE_OP})
    return frozenset(named)


# -- a library's own ops: one row, one call -------------------------------------
_TORCH_NAMESPACES = ("aten", "prim", "prims", "quantized", "_quant")


class RegisteredOp:
    """What :func:`register_op` returns: ``remove()`` takes its registration out again (tests; a library reloading).

    Registrations of one op stack: ``remove()`` of the current one restores the row it replaced
    (a shipped row, or an earlier registration's); removing one that is no longer current (a later
    ``replace=True`` registration stands over it, or it was removed already) is refused, so a stale
    handle never takes out another registration's row.
    """

    def __init__(self, op: str, replaced: Optional[dict]):
        self.op = op
        self._replaced = replaced  # the row this registration replaced (None: the op had none)

    def remove(self) -> None:
        """Take this registration's row out and restore the row it replaced (none: the op becomes unknown)."""
        stack = _REGISTRATIONS.get(self.op, [])
        if not stack or stack[-1] is not self:
            state = "a later registration replaced it; remove that one first" if self in stack else "removed already"
            raise AmpValueError(f"{self!r}.remove(): this registration is not the op's current row ({state})")
        stack.pop()
        if not stack:
            del _REGISTRATIONS[self.op]
        _take_row(self.op)
        if self._replaced is not None:
            _put_row(self.op, self._replaced)
        _forget()

    def __repr__(self) -> str:
        return f"RegisteredOp({self.op!r})"


_REGISTRATIONS: dict[str, list] = {}  # op -> its registrations, the current one last


def _take_row(op: str) -> Optional[dict]:
    """Remove every property of ``op`` from the tables and registries; return them (None: it had none)."""
    row = {"tables": {name: rows.pop(op) for name, rows in tables._rows().items() if op in rows},
           "fp8": op in _FP8}
    for key, data in (("gemm", _GEMMS), ("fused_form", _FUSED_FORMS), ("weight_bias", _WEIGHT_BIAS_ARGS),
                      ("norm", tables._norm_rows())):
        if op in data:
            row[key] = data.pop(op)
    _FP8.discard(op)
    return row if len(row) > 2 or row["tables"] or row["fp8"] else None


def _put_row(op: str, row: dict) -> None:
    for name, reason in row["tables"].items():
        tables._rows()[name][op] = reason
    for key, data in (("gemm", _GEMMS), ("fused_form", _FUSED_FORMS), ("weight_bias", _WEIGHT_BIAS_ARGS),
                      ("norm", tables._norm_rows())):
        if key in row:
            data[op] = row[key]
    if row["fp8"]:
        _FP8.add(op)


def registered_gemms() -> dict:
    """{"ns::name": GemmSig} of every custom op with a GEMM row (FLOP counts read them: torch sees no GEMM inside)."""
    return {op: sig for op, sig in _GEMMS.items() if "::" in op}


def _forget() -> None:
    of.cache_clear()
    known_ops.cache_clear()


def _warn_autocast_rule(op: str, table: str) -> None:
    """Warn that a ``torch.library.register_autocast`` rule of ``op`` decides it, not the row's table."""
    keys = [key for key in ("AutocastCPU", "AutocastCUDA", "AutocastXPU", "AutocastMPS")
            if gemm_rows.op_schema(op) is not None and torch._C._dispatch_has_kernel_for_dispatch_key(op, key)]
    if keys:
        warnings.warn(f"register_op({op!r}, table={table!r}): the op has its own autocast rule "
                      f"(torch.library.register_autocast: {', '.join(keys)}), which decides its precision on "
                      f"that device as under torch.autocast; the row's table applies on other devices, its other "
                      f"facts (gemm, fp8, norm) everywhere. To decide it yourself: policy={{'op:{op}': ...}}",
                      AmpWarning, stacklevel=3)


NORM_KINDS = {"statistics": "fp32", "input_dtype": "follow"}  # register_op's norm=, and the table each goes with


def _check_row(op: str, table: str, reason: str, gemm: Optional[GemmSig], fp8: bool, fused_form: Optional[FusedForm],
               weight_bias: Optional[tuple], norm: Optional[str]) -> None:
    if not isinstance(op, str) or op.count("::") != 1 or not all(op.split("::")) \
            or op.split("::")[0] in _TORCH_NAMESPACES:
        raise AmpValueError(f"register_op takes a custom op's qualified name 'namespace::name', as torch.library "
                            f"defines it, got {op!r}; PyTorch's own ops are rows of amp_fx/ir/tables.py")
    if table not in tables.all_tables():
        raise AmpValueError(f"register_op({op!r}): table must be one of {sorted(tables.all_tables())}, got {table!r}")
    if not isinstance(reason, str) or not reason.strip():
        raise AmpValueError(f"register_op({op!r}): give the one-line reason the report shows for its decision")
    if gemm is not None:
        if not isinstance(gemm, GemmSig):
            raise AmpTypeError(f"register_op({op!r}): gemm takes a GemmSig(activation=, weight=, bias=, "
                               f"weight_layout=), got {type(gemm).__name__}")
        if gemm.weight_layout not in WEIGHT_LAYOUTS:
            raise AmpValueError(f"register_op({op!r}): weight_layout must be one of {WEIGHT_LAYOUTS}, "
                                f"got {gemm.weight_layout!r}")
        if table != "low":
            raise AmpValueError(f"register_op({op!r}): a GEMM signature is for ops in the 'low' table (the passes "
                                f"that read it pad and quantize low GEMMs), got table={table!r}")
    if fp8 and (gemm is None or gemm.weight_layout == "conv"):
        raise AmpValueError(f"register_op({op!r}, fp8=True) needs gemm=GemmSig(..., weight_layout='NK' or 'KN'): "
                            "an fp8 GEMM is x @ W.T or x @ W (plus bias) with a 2-D weight")
    if fused_form is not None:
        if not isinstance(fused_form, FusedForm):
            raise AmpTypeError(f"register_op({op!r}): fused_form takes a FusedForm, got {type(fused_form).__name__}")
        if table != "fp32" or weight_bias is None:
            raise AmpValueError(f"register_op({op!r}): a fused form is for an fp32 norm and needs weight_bias="
                                "(weight position, bias position)")
    if norm is not None:
        if norm not in NORM_KINDS:
            raise AmpValueError(f"register_op({op!r}): norm must be one of {sorted(NORM_KINDS)} (\"statistics\": it "
                                f"computes mean/variance of its input, like layer_norm; \"input_dtype\": it takes a low "
                                f"input with fp32 statistics, like batch_norm), got {norm!r}")
        if table != NORM_KINDS[norm]:
            raise AmpValueError(f"register_op({op!r}, norm={norm!r}) goes with table={NORM_KINDS[norm]!r} (as "
                                f"{'layer_norm' if norm == 'statistics' else 'batch_norm'}'s row), got table={table!r}")


def register_op(op: str, *, table: Optional[str] = None, reason: Optional[str] = None, gemm: Optional[GemmSig] = None, fp8: bool = False,
                norm: Optional[str] = None, fused_form: Optional[FusedForm] = None, weight_bias: Optional[tuple] = None,
                replace: bool = False) -> RegisteredOp:
    """Give custom op ``"ns::name"`` its whole row: table and reason, GEMM signature, fp8 eligibility, norm kind.

    A library calls it beside its ``torch.library`` definition, before converting::

        amp_fx.register_op("mylib::dense", table="low", reason="GEMM: runs low like linear",
                           gemm=amp_fx.GemmSig(activation=0, weight=1, bias=2, weight_layout="NK"), fp8=True)

    ``table``: ``"low"``, ``"fp32"``, ``"promote"``, ``"follow"`` or ``"banned"``; ``gemm``: where its
    operands are and the weight's layout (``pad_gemm`` pads it); ``fp8=True``: it computes
    ``x @ W.T + b`` (``"NK"``) or ``x @ W + b`` (``"KN"``) and nothing else, so ``fp8_gemms`` may
    run it as a scaled fp8 GEMM; ``norm``: a normalisation, whose parameters and buffers stay fp32 under
    ``keep_batchnorm_fp32`` (O2's default), ``"statistics"`` with ``table="fp32"`` (it computes mean and
    variance of its input: fp32 at every level, as ``layer_norm``) or ``"input_dtype"`` with
    ``table="follow"`` (it takes a low input with fp32 statistics and parameters, as ``batch_norm``);
    ``fused_form`` with ``weight_bias=(w, b)``: an fp32 norm with
    a verified mixed-dtype kernel (``fuse_precision``).  An op that has a row already is refused
    unless ``replace=True``.  Returns a handle whose ``remove()`` takes the row out (restoring the one it
    replaced).  The name and ``gemm`` are checked against the op torch defines, here when torch has
    loaded its namespace, and ``gemm``'s layout against each call's shapes at convert
    (:mod:`amp_fx.ir.gemm_rows`); an op with a ``torch.library.register_autocast`` rule is warned
    about: that rule decides it on its device.
    """
    _check_row(op, table, reason, gemm, fp8, fused_form, weight_bias, norm)
    if tables.table_of(op) == "unknown":  # a shipped row may name an op whose library is not loaded
        gemm_rows.check_op_name(op)
    names = gemm_rows.check_gemm_schema(op, gemm) if gemm is not None else None
    _warn_autocast_rule(op, table)
    if not replace and (tables.table_of(op) != "unknown" or op in _GEMMS):
        raise AmpValueError(f"register_op: {op!r} has a row already ({tables.table_of(op)}); pass replace=True to "
                            "replace it")
    replaced = _take_row(op)
    tables._rows()[table][op] = reason
    if gemm is not None:
        _GEMMS[op] = dataclasses.replace(gemm, names=names)
    if fp8:
        _FP8.add(op)
    if norm is not None:
        tables._norm_rows()[op] = norm
    if fused_form is not None:
        _FUSED_FORMS[op] = fused_form
        _WEIGHT_BIAS_ARGS[op] = tuple(weight_bias)
    _forget()
    handle = RegisteredOp(op, replaced)
    _REGISTRATIONS.setdefault(op, []).append(handle)
    return handle
