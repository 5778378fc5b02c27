"""The precision an opaque call declares for itself: ``custom_fwd(cast_inputs=)`` and ``register_autocast`` rules.

autocast lets the author of an opaque op state its precision: a custom
``torch.autograd.Function`` whose forward is decorated with
``torch.amp.custom_fwd(device_type=..., cast_inputs=X)`` has its floating
inputs cast to X and runs with autocast off; a ``torch.library`` custom op
with a ``torch.library.register_autocast(op, device_type, X)`` rule does the
same.  :func:`declared_precision` reads those declarations from a node so
that ``assign_precision`` decides the node as autocast would:

- a declaration for the graph's device with X = float32 -> ``"fp32"``;
  X = the conversion's low dtype -> ``"low"``; another dtype is refused;
- a custom Function without one -> ``"follow"`` at O1: its inputs arrive as
  they are (the forward and backward run as written, with autocast off);
- at O2 a declaration is honoured as at O1, an undeclared Function takes the
  level's decision (low); at O3 everything is low and nothing here applies.

Precedence (in ``assign_precision``): a user policy beats a declaration, a
declaration beats the tables.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch
import torch.fx as fx

from amp_fx.errors import UnsupportedConstructError
from amp_fx.ir import meta
from amp_fx.frontend.opaque_calls import FunctionCall

__all__ = ["declared_precision", "policy_target", "custom_fwd_cast", "autocast_rule_dtype"]

# Namespaces of PyTorch's own ops: the tables decide those.
_BUILTIN_NAMESPACES = frozenset({"aten", "prims", "prim", "quantized", "_quant", "mkldnn", "higher_order", "inductor"})
Decision = tuple[str, str, str]


def policy_target(node: fx.Node) -> Any:
    """The object a policy keyed by a callable matches for ``node``: a custom Function's class, else the target."""
    return getattr(node.target, "amp_fx_function", node.target)


def custom_fwd_cast(forward: Any) -> Optional[tuple[str, Optional[torch.dtype]]]:
    """(device_type, cast_inputs) of a forward decorated with ``torch.amp.custom_fwd``, or None if it is not."""
    if getattr(getattr(forward, "__code__", None), "co_name", None) != "decorate_fwd":
        return None
    try:
        names = inspect.getclosurevars(forward).nonlocals
    except (TypeError, ValueError):
        return None
    if "device_type" not in names or "cast_inputs" not in names:
        return None
    return names["device_type"], names["cast_inputs"]


def _overload(target: Any) -> Optional[torch._ops.OpOverload]:
    if isinstance(target, torch._ops.OpOverload):
        return target
    if isinstance(target, torch._ops.OpOverloadPacket):
        names = target.overloads()
        return getattr(target, "default" if "default" in names else names[0], None) if names else None
    return None


def autocast_rule_dtype(op: torch._ops.OpOverload, device_type: str) -> tuple[bool, Optional[torch.dtype]]:
    """(has an autocast kernel for ``device_type``, the dtype it casts to when amp_fx can read it)."""
    key = "Autocast" + torch._C._dispatch_key_for_device(device_type)
    if not torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key):
        return False, None
    from torch._library.custom_ops import OPDEFS

    opdef = OPDEFS.get(op.name().split(".")[0]) or OPDEFS.get(op._schema.name)
    if opdef is not None and opdef._autocast_dtype.get(device_type) is not None:
        return True, opdef._autocast_dtype[device_type]
    # torch.library.register_autocast on a Library op keeps its rule as a Python kernel.
    kernel = op.py_kernels.get(getattr(torch._C.DispatchKey, key))
    if kernel is not None:
        try:
            dtype = inspect.getclosurevars(kernel).nonlocals.get("cast_inputs")
        except (TypeError, ValueError):
            dtype = None
        if isinstance(dtype, torch.dtype):
            return True, dtype
    return True, None


def _cast_decision(what: str, dtype: torch.dtype, ctx: Any, node: fx.Node) -> Decision:
    name = str(dtype).replace("torch.", "")
    if dtype == torch.float32:
        return "fp32", f"{what}: inputs cast to float32, as under torch.autocast", "declared"
    if dtype == ctx.low:
        return "low", f"{what}: inputs cast to {name}, as under torch.autocast", "declared"
    low = str(ctx.low).replace("torch.", "")
    raise UnsupportedConstructError(
        f"{what} asks for {name} inputs, but this conversion's low dtype is {low} and amp_fx runs one low "
        f"dtype per graph (node {node.name!r}, at {meta.SOURCE.get(node) or 'unknown source line'}).\n"
        f"Convert with dtype=torch.{name}, or decide the op yourself with policy={{'op:{meta.OP.get(node)}': "
        "'fp32' | 'low' | 'follow'}.",
        construct=what,
    )


def declared_precision(node: fx.Node, ctx: Any) -> Optional[Decision]:
    """(decision, reason, rule) that ``node`` declares for itself, or None when it declares nothing."""
    config = ctx.config
    if node.op != "call_function" or config.op_mode == "none" or config.level == "O3":
        return None
    device = ctx.device_for(node.graph.owning_module)
    if isinstance(node.target, FunctionCall):
        function = node.target.function
        declared = custom_fwd_cast(getattr(function, "forward", None))
        name = function.__qualname__
        if declared is not None and declared[1] is not None and declared[0] == device:
            return _cast_decision(f"custom_fwd(cast_inputs=...) on {name}.forward", declared[1], ctx, node)
        if config.op_mode != "tables":
            return None
        note = ""
        if declared is not None and declared[1] is not None:
            note = f" (its custom_fwd is for device_type={declared[0]!r}, which does nothing on {device})"
        return ("follow", f"custom autograd Function {name}: kept whole, forward and backward; "
                f"its inputs arrive in the dtype they have{note}", "declared")
    op = _overload(node.target)
    if op is None or op.namespace in _BUILTIN_NAMESPACES:
        return None
    has_rule, dtype = autocast_rule_dtype(op, device)
    if not has_rule:
        return None
    if dtype is None:
        return ("follow", f"custom op {op.name()} has an autocast kernel whose dtype amp_fx cannot read: "
                "it follows its input (a policy 'op:' entry decides it)", "declared")
    return _cast_decision(f"the registered autocast rule of custom op {op.name()}", dtype, ctx, node)
