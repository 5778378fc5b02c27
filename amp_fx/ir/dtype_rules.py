"""Dtype-only mode of the analysis: each op's result rule, derived from the op tables.

Used where a node cannot be fake-run: no example inputs (graph inputs' dtypes
unknown, no shapes), an input whose value is unknown, or an op with no fake
kernel.  Every rule reads the op registry (:mod:`amp_fx.ir.op_properties`,
which derives from the tables and says each op's *result kind*: not a
tensor, not floating, a tuple, ...); none keeps an op list of its own.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
import torch.fx as fx

from amp_fx.ir import meta, op_properties
from amp_fx.graph_ops.casts import amp_cast, amp_promote
from amp_fx.graph_ops.dtype_info import finfo_of
from amp_fx.ir.meta import ValueInfo, may_be_float_tensor

__all__ = ["rule_value", "widest", "explicit_dtype", "opened_by_hooks"]

# Tensor attributes whose value is never a tensor (``x.shape``: attribute names, not ops).
_NON_TENSOR_ATTRS = frozenset({"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "is_sparse", "layout"})


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
    named = op_properties.of(node.meta.get(meta.OP)).cast_dtype
    if named is not None:
        return True, named
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
    hooked = op_properties.of(node.meta.get(meta.OP)).hook == "value"
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
        if op_properties.of(node.meta.get(meta.OP)).cast or node.target in (amp_cast, amp_promote):
            is_float_cast, dtype = _cast_target(node, inputs)
            if is_float_cast is False or dtype is not None:
                return info, None  # a cast to a fixed dtype
    if info.is_float is False and not info.container:
        return info, None
    return ValueInfo(info.is_tensor, None, None, None, info.shape, info.container, reason, info.fake, info.has_value), reason


def _reads_finfo(node: fx.Node) -> bool:
    """``node`` is ``finfo.min`` (or another member) of a :func:`finfo_of` node."""
    owner = node.args[0] if node.target is getattr and node.args else None
    return isinstance(owner, fx.Node) and owner.op == "call_function" and owner.target is finfo_of


def rule_value(node: fx.Node, decision: str, inputs: Mapping[fx.Node, ValueInfo], target: Optional[torch.dtype],
                gm: fx.GraphModule) -> ValueInfo:
    """Dtype-only mode: the op's result rule (see the module docstring, step 4)."""
    op = node.meta.get(meta.OP)
    props = op_properties.of(op)
    method = op_properties.of(node.target) if node.op == "call_method" else op_properties.of(None)
    if props.non_tensor_result or method.non_tensor_result or props.hook == "boundary":
        return ValueInfo.non_tensor()
    if props.hook == "value" and node.args and isinstance(node.args[0], fx.Node) and node.args[0] in inputs:
        passed = inputs[node.args[0]]
        return ValueInfo(passed.is_tensor, passed.is_float, passed.float_dtype, passed.dtype, passed.shape, passed.container)
    if node.op == "call_function" and (node.target is finfo_of or _reads_finfo(node)):
        return ValueInfo.non_tensor()  # torch.finfo(h.dtype) and its .min: Python numbers read at run time
    if node.op == "call_function" and node.target is getattr and len(node.args) > 1:
        return _attribute_value(node.args[1], inputs.get(node.args[0]) if isinstance(node.args[0], fx.Node) else None)
    if method.non_float_cast:
        return ValueInfo(True, False)
    first = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    first_info = inputs.get(first) if first is not None else None
    if op == "getitem" and first_info is not None and (first_info.container or first_info.is_tensor is None):
        # An item of a tuple of tensors (chunk, LSTM outputs): its dtype flows through.
        if first_info.container:
            return ValueInfo(None, None, first_info.float_dtype)
        return ValueInfo()
    if props.tuple_result and first_info is not None and first_info.is_float is not False and first_info.float_dtype:
        return ValueInfo(False, False, first_info.float_dtype if target is None else target, container=True)
    if props.non_float_result:
        return ValueInfo(None, False)
    if decision == "cast" or props.cast:
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
    if props.real_of_complex and complex_first:
        real = first_info.dtype.to_real()
        return ValueInfo(True, True, real, real)
    if op == "view_as_complex" and first_info is not None and first_info.float_dtype is not None:
        return ValueInfo(True, False, None, first_info.float_dtype.to_complex())
    complex_in = next((i.dtype for i in inputs.values() if i.dtype is not None and i.dtype.is_complex), None)
    if complex_in is not None or props.complex_result:
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
        if props.float_result:
            return ValueInfo(True, True, target)
        if node.op == "call_module":
            return ValueInfo(None, None, target)
    if props.keeps_first_dtype and first_info is not None and first_info.is_tensor is not False and not first_info.container:
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
    is_float = True if (first_info is not None and first_info.is_float is True and props.table == "follow") or \
        props.float_result else None
    return ValueInfo(True if is_float else None, is_float, widest([i.float_dtype for i in deciding]))
