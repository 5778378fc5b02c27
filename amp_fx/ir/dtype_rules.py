"""Dtype-only mode of the analysis: each op's result rule, derived from the op tables.

Used where a node cannot be fake-run: no example inputs (graph inputs' dtypes
unknown, no shapes), an input whose value is unknown, or an op with no fake
kernel.  Every rule reads the tables; none is a table of its own making
except the short lists below of ops whose *result kind* (not a tensor, not
floating, a tuple) the tables do not say.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
import torch.fx as fx

from amp_fx.ir import meta, tables
from amp_fx.graph_ops.casts import amp_cast, amp_promote
from amp_fx.ir.meta import ValueInfo, may_be_float_tensor
from amp_fx.ir.op_keys import CAST_OPS

__all__ = ["rule_value", "widest", "explicit_dtype", "opened_by_hooks"]

# -- result rules for dtype-only mode, all derived from the tables ----------
# Ops whose tensor result is floating whatever arrives (GEMMs, exp, softmax, losses).
_FLOAT_RESULT = (frozenset(tables.LOW) | frozenset(tables.FP32)) - {"sum", "prod", "cumsum", "cumprod", "pow"}
# Ops whose result is never floating, or is not a tensor at all.
_NON_FLOAT_RESULT = frozenset({
    "eq", "ne", "lt", "le", "gt", "ge", "isfinite", "isnan", "isinf", "logical_and", "logical_or", "logical_not",
    "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not", "argmax", "argmin", "any", "all", "one_hot", "equal",
    "nonzero", "searchsorted", "bucketize",
})
_NON_TENSOR_RESULT = frozenset({"size", "dim", "numel", "ndimension", "nelement", "stride", "is_floating_point",
                                "item", "tolist", "equal", "is_contiguous", "data_ptr"})
_NON_TENSOR_ATTRS = frozenset({"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "is_sparse", "layout"})
# Ops that return several tensors (their items are read with getitem).
_TUPLE_RESULT = frozenset({"split", "chunk", "unbind", "split_with_sizes", "topk", "sort", "var_mean", "std_mean",
                           "lstm", "gru", "rnn_tanh", "rnn_relu", "native_dropout", "max_pool2d_with_indices",
                           "multi_head_attention"})
# Data movement keeps its first input's dtype (an index or shape tensor takes no part; F.embedding's data is its 2nd input).
_KEEPS_FIRST_DTYPE = tables.DATA_MOVEMENT - {"embedding", "embedding_bag", "one_hot"}
_NAMED_CASTS = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16, "double": torch.float64}
_NON_FLOAT_CASTS = frozenset({"long", "int", "bool", "short", "byte", "char"})
# Complex numbers in and out: ops whose result is the real part of a complex input, and ops that make complex values.
_COMPLEX_TO_REAL = frozenset({"view_as_real", "real", "imag", "abs", "angle"})
_COMPLEX_RESULT = frozenset({"view_as_complex", "polar", "complex"})
# Module hook boundaries (amp_fx/frontend/module_hooks.py): enter/exit pass a token, and
# module_hook_value(x, token, i) is x as the hooks left it: x's shape, and a dtype known only at run
# time (opened_by_hooks), as a hook may return another one (out.float()) that autocast would take.
_HOOK_TOKENS = frozenset({"module_hook_enter", "module_hook_exit"})
_HOOK_VALUE = "module_hook_value"


def widest(dtypes: list[Optional[torch.dtype]]) -> Optional[torch.dtype]:
    if not dtypes or any(d is None for d in dtypes):
        return None
    result = dtypes[0]
    for d in dtypes[1:]:
        result = torch.promote_types(result, d)
    return result


def explicit_dtype(node: fx.Node) -> Optional[torch.dtype]:
    """A floating ``dtype=`` keyword the op was called with (``softmax(x, -1, dtype=torch.float32)``)."""
    dtype = node.kwargs.get("dtype")
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def _dtype_of(arg: Any, inputs: Mapping[fx.Node, ValueInfo]) -> tuple[bool, Optional[torch.dtype]]:
    """(is a dtype argument, the dtype) for ``arg``: a constant dtype, or a node that gives one (``h.dtype``).

    (True, None): a dtype known only at run time (``h.dtype`` of an unknown
    ``h``).  A node known to give something else (``h.device``) is no dtype.
    """
    if isinstance(arg, torch.dtype):
        return True, arg
    if not isinstance(arg, fx.Node) or arg not in inputs:
        return False, None
    info = inputs[arg]
    if info.has_value:
        return isinstance(info.fake, torch.dtype), info.fake if isinstance(info.fake, torch.dtype) else None
    if arg.op == "call_function" and arg.target is getattr and len(arg.args) > 1 and arg.args[1] in _NON_TENSOR_ATTRS:
        return arg.args[1] == "dtype", None
    return info.is_tensor is False and not info.container, None  # any other non-tensor value may be a dtype


def _cast_target(node: fx.Node, inputs: Mapping[fx.Node, ValueInfo]) -> tuple[Optional[bool], Optional[torch.dtype]]:
    """(is a float cast, its target) for a cast the model wrote.

    (True, dtype): a float cast to ``dtype``; (False, None): a cast to a
    non-float dtype; (None, dtype): to ``dtype`` if it is a float cast at all
    (``.to(other)`` of an ``other`` that may not be floating); (None, None): to
    a dtype known only at run time; (True, None): no dtype given, the input's
    dtype is kept (``.to(device)``), or ``amp_promote``.
    """
    op = node.meta.get(meta.OP)
    if op in _NAMED_CASTS:
        return True, _NAMED_CASTS[op]
    if node.target is amp_cast:
        return True, node.args[1] if len(node.args) > 1 else node.kwargs.get("dtype")
    if node.target is amp_promote:
        return True, None  # the widest of its inputs, known only at run time
    for arg in list(node.args[1:]) + list(node.kwargs.values()):
        is_dtype, dtype = _dtype_of(arg, inputs)
        if is_dtype:
            # .to(h.dtype): the dtype h has in the rewritten program, when the analysis knows it.
            if dtype is None:
                return None, None
            return dtype.is_floating_point, dtype if dtype.is_floating_point else None
        if isinstance(arg, fx.Node) and arg in inputs and inputs[arg].is_tensor is not False:
            info = inputs[arg]  # .to(other) / .type_as(other): other's dtype in the rewritten program
            if info.is_float is False:
                return False, None
            return (True if info.is_float is True else None), info.float_dtype
    return True, None


def _attribute_value(attribute: Any, owner: Optional[ValueInfo]) -> ValueInfo:
    """``x.shape``, ``out.values``, ``out.last_hidden_state``: what an attribute read gives in dtype-only mode.

    ``.values`` of ``max(dim)``/``sort``/``topk``/... is their floating result and
    ``.indices`` integers; any other attribute may be a floating tensor of any
    dtype, so it is unknown and its readers' casts are guarded.
    """
    if attribute == "dtype" and owner is not None and owner.is_tensor is True and not owner.container:
        # The owner's dtype in the rewritten program, when known: .to(h.dtype) then casts to it.
        dtype = owner.float_dtype if owner.is_float is True else owner.dtype if owner.is_float is False else None
        if dtype is not None:
            return ValueInfo(False, False, fake=dtype, has_value=True)
    if attribute in _NON_TENSOR_ATTRS:
        return ValueInfo.non_tensor()
    if attribute == "indices":
        return ValueInfo(True, False)
    if attribute == "values" and owner is not None and owner.container:
        return ValueInfo(None, None, owner.float_dtype)
    return ValueInfo()


def opened_by_hooks(node: fx.Node, info: ValueInfo, target: Optional[torch.dtype], inputs: Mapping[fx.Node, ValueInfo],
                    opened: Mapping[fx.Node, str]) -> tuple[ValueInfo, Optional[str]]:
    """``info`` with its floating dtype unknown where a module hook may change it, and why (None: ``info`` as is).

    A value out of a hook boundary may arrive in another floating dtype than
    traced (a forward hook returning ``out.float()``, a pre-hook ``.half()``);
    under autocast the next op casts what arrives, so here each reader that
    needs a dtype gets a guarded cast (``amp_cast``).  That holds for what
    follows such a value too (``h + 1``, ``h.view(...)``), up to an op that
    casts its inputs (``target``) or a cast to a fixed dtype.  Shape and fake
    value stay (the hook keeps the structure); non-floating values stay known.
    """
    hooked = node.meta.get(meta.OP) == _HOOK_VALUE
    reason = ("module hook boundary: a hook may hand on another floating dtype than traced" if hooked
              else next((opened[n] for n in inputs if n in opened), None))
    if reason is None:
        return info, None
    if node.op == "call_function" and node.target is getattr and node.args[1:2] == ("dtype",):
        return ValueInfo.non_tensor(), reason  # h.dtype: known only at run time, so .to(h.dtype) is guarded too
    if not may_be_float_tensor(info):
        return info, None
    if not hooked:
        if target is not None:
            return info, None  # the op casts its inputs: its result's dtype is known
        if node.meta.get(meta.OP) in CAST_OPS or node.target in (amp_cast, amp_promote):
            is_float_cast, dtype = _cast_target(node, inputs)
            if is_float_cast is False or dtype is not None:
                return info, None  # a cast to a fixed dtype
    if info.is_float is False and not info.container:
        return info, None
    return ValueInfo(info.is_tensor, None, None, None, info.shape, info.container, reason, info.fake, info.has_value), reason


def rule_value(node: fx.Node, decision: str, inputs: Mapping[fx.Node, ValueInfo], target: Optional[torch.dtype],
                gm: fx.GraphModule) -> ValueInfo:
    """Dtype-only mode: the op's result rule (see the module docstring, step 4)."""
    op = node.meta.get(meta.OP)
    if op in _NON_TENSOR_RESULT or (node.op == "call_method" and node.target in _NON_TENSOR_RESULT) or op in _HOOK_TOKENS:
        return ValueInfo.non_tensor()
    if op == _HOOK_VALUE and node.args and isinstance(node.args[0], fx.Node) and node.args[0] in inputs:
        passed = inputs[node.args[0]]
        return ValueInfo(passed.is_tensor, passed.is_float, passed.float_dtype, passed.dtype, passed.shape, passed.container)
    if node.op == "call_function" and node.target is getattr and len(node.args) > 1:
        return _attribute_value(node.args[1], inputs.get(node.args[0]) if isinstance(node.args[0], fx.Node) else None)
    if node.op == "call_method" and node.target in _NON_FLOAT_CASTS:
        return ValueInfo(True, False)
    first = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    first_info = inputs.get(first) if first is not None else None
    if op == "getitem" and first_info is not None and (first_info.container or first_info.is_tensor is None):
        # An item of a tuple of tensors (chunk, LSTM outputs): its dtype flows through.
        if first_info.container:
            return ValueInfo(None, None, first_info.float_dtype)
        return ValueInfo()
    if op in _TUPLE_RESULT and first_info is not None and first_info.is_float is not False and first_info.float_dtype:
        return ValueInfo(False, False, first_info.float_dtype if target is None else target, container=True)
    if op in _NON_FLOAT_RESULT:
        return ValueInfo(None, False)
    if decision == "cast" or op in CAST_OPS:
        is_float_cast, dtype = _cast_target(node, inputs)
        if is_float_cast is False:
            return ValueInfo(True, False)
        source = first_info
        if dtype is not None:
            known = is_float_cast is True and source is not None and source.is_float is True
            return ValueInfo(True if known else None, True if known else None, dtype, shape=source.shape if source else None)
        if is_float_cast is None:  # a target known only at run time: not the input's dtype, so unknown (guarded)
            return ValueInfo(shape=source.shape if source else None)
    complex_first = first_info is not None and first_info.dtype is not None and first_info.dtype.is_complex
    if op in _COMPLEX_TO_REAL and complex_first:
        real = first_info.dtype.to_real()
        return ValueInfo(True, True, real, real)
    if op == "view_as_complex" and first_info is not None and first_info.float_dtype is not None:
        return ValueInfo(True, False, None, first_info.float_dtype.to_complex())
    complex_in = next((i.dtype for i in inputs.values() if i.dtype is not None and i.dtype.is_complex), None)
    if complex_in is not None or op in _COMPLEX_RESULT:
        # ``h * phase`` with a complex phase is complex: never a float, never cast.
        return ValueInfo(True, False, None, complex_in)
    explicit = explicit_dtype(node)
    if explicit is not None:
        return ValueInfo(True, True, explicit)
    if isinstance(node.kwargs.get("dtype"), fx.Node):  # torch.zeros(n, dtype=h.dtype), x.new_ones(n, dtype=w.dtype)
        is_dtype, dtype = _dtype_of(node.kwargs["dtype"], inputs)
        if is_dtype:
            if dtype is None:
                return ValueInfo()  # known only at run time: the readers' casts are guarded
            return ValueInfo(True, True, dtype) if dtype.is_floating_point else ValueInfo(None, False, dtype=dtype)
    if decision == "fp32" and node.meta.get(meta.FUSED) and first_info is not None:
        return ValueInfo(True, True, first_info.float_dtype)  # a fused norm returns its input's (low) dtype
    reads_float64 = any(i.float_dtype == torch.float64 for i in inputs.values() if may_be_float_tensor(i))
    if decision in ("low", "fp32") and target is not None and not reads_float64:
        if op in _FLOAT_RESULT:
            return ValueInfo(True, True, target)
        if node.op == "call_module":
            return ValueInfo(None, None, target)
    if op in _KEEPS_FIRST_DTYPE and first_info is not None and first_info.is_tensor is not False and not first_info.container:
        return ValueInfo(first_info.is_tensor, first_info.is_float, first_info.float_dtype, first_info.dtype)
    if op == "embedding" and len(node.args) > 1 and isinstance(node.args[1], fx.Node):
        weight = inputs[node.args[1]]
        return ValueInfo(True if weight.is_float else None, weight.is_float, weight.float_dtype)
    floats = [i for n, i in inputs.items() if may_be_float_tensor(i)]
    dimensioned = [i for i in floats if i.shape != ()]
    deciding = dimensioned or floats
    if not deciding:
        if inputs and any(i.container for i in inputs.values()):
            return ValueInfo(None, None, widest([i.float_dtype for i in inputs.values() if i.container]))
        # Factories (torch.zeros(x.size())) make the default dtype when they make floats.
        if all(i.is_tensor is False for i in inputs.values()):
            return ValueInfo(None, None, torch.get_default_dtype())
        return ValueInfo()
    is_float = True if (first_info is not None and first_info.is_float is True and op in tables.FOLLOW) or \
        (op in _FLOAT_RESULT) else None
    return ValueInfo(True if is_float else None, is_float, widest([i.float_dtype for i in deciding]))
