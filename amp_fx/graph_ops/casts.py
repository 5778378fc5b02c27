"""The small runtime helpers that rewritten graphs call.

Where the converter knows a value's dtype it writes a plain ``x.to(dtype)``.
Where it cannot know (a graph input with no example inputs), it writes
:func:`amp_cast`, which does what autocast checks at every dispatch -- cast
only floating tensors, only when the dtype differs -- but only at the few
places the graph needs it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Proxy
from torch.fx.graph import _register_custom_builtin

__all__ = ["amp_cast", "amp_promote", "call_with_params", "shared_cast_read", "HELPERS"]


def amp_cast(value: Any, dtype: torch.dtype) -> Any:
    """Cast ``value`` to ``dtype`` if it is a floating tensor of another dtype; return anything else as is.

    Tuples and lists (an LSTM's ``(h0, c0)``, a ``PackedSequence``) have their
    floating tensors cast the same way.

    float64 tensors are returned as they are: autocast does not cast them
    either (an op reading float64 is not eligible for a lower precision).
    """
    if isinstance(value, torch.Tensor):
        eligible = value.is_floating_point() and value.dtype not in (dtype, torch.float64)
        return value.to(dtype) if eligible else value
    if isinstance(value, Proxy):
        return _record(amp_cast, (value, dtype), {})
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple (PackedSequence, ...)
        return type(value)(*(amp_cast(item, dtype) for item in value))
    if isinstance(value, (tuple, list)):  # an LSTM's (h0, c0) and other containers of tensors
        return type(value)(amp_cast(item, dtype) for item in value)
    return value


amp_cast._amp_fx_cast = True  # op_keys reads this: the node is a cast, not an op


def amp_promote(*values: Any) -> tuple:
    """Cast every floating tensor among ``values`` to the widest floating dtype among them."""
    if any(isinstance(value, Proxy) for value in values):
        return _record(amp_promote, values, {})
    widest = None
    for value in values:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            widest = value.dtype if widest is None else torch.promote_types(widest, value.dtype)
    if widest is None:
        return values
    return tuple(amp_cast(value, widest) for value in values)


amp_promote._amp_fx_cast = True


class _SharedCastRead(torch.autograd.Function):
    """A view of a shared cast whose gradient goes to the cast's source, upcast there, not summed in the cast's dtype."""

    generate_vmap_rule = True  # torch.func.vmap over a converted model

    @staticmethod
    def forward(cast: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        return cast.view_as(cast)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.source_dtype, ctx.cast_dtype = inputs[1].dtype, inputs[0].dtype

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        # What autocast's per-reader cast does in backward: this reader's low gradient, upcast alone.
        return None, grad.to(ctx.source_dtype)

    @staticmethod
    def jvp(ctx: Any, cast_tangent: Any, source_tangent: Any) -> Any:
        return source_tangent.to(ctx.cast_dtype)


class _SharedCastReadTraced(_SharedCastRead):
    """:class:`_SharedCastRead` as Dynamo traces it, with torch's default jvp: Dynamo breaks the graph at a
    Function that defines one, which would cut a compiled model at every shared cast."""

    jvp = torch.autograd.Function.jvp


def shared_cast_read(cast: Any, source: Any) -> Any:
    """One reader's read of ``cast`` (``source`` cast once, read by several ops): ``cast`` itself in forward.

    In backward this reader's gradient goes to ``source`` in ``source``'s
    dtype, so the readers' gradients are summed there, in fp32, as under
    autocast (which casts once per reader), instead of in the low dtype at the
    one shared cast.  The forward casts nothing: ``cast`` is a view here.
    Without a gradient to route (no grad mode, ``source`` needs none, the
    guarded cast returned ``source`` itself) it returns ``cast`` as is.
    """
    if isinstance(cast, Proxy) or isinstance(source, Proxy):
        return _record(shared_cast_read, (cast, source), {})
    routed = (isinstance(cast, torch.Tensor) and isinstance(source, torch.Tensor) and torch.is_grad_enabled()
              and source.requires_grad and source.is_floating_point() and cast is not source and cast.dtype != source.dtype)
    if not routed:
        return cast
    function = _SharedCastReadTraced if torch.compiler.is_compiling() else _SharedCastRead
    return function.apply(cast.detach(), source)


shared_cast_read._amp_fx_op = "alias"  # op_keys reads this: a view of its first argument, no arithmetic


def call_with_params(module: torch.nn.Module, params: dict, *args: Any, **kwargs: Any) -> Any:
    """Run ``module`` with some parameters replaced (their low-precision casts) for this call only."""
    if any(isinstance(a, Proxy) for a in (*args, *kwargs.values(), *params.values())):
        return _record(call_with_params, (module, params, *args), kwargs)
    # A copy: fx.Interpreter (torch.export, FakeTensorProp) passes the node's immutable dict,
    # which functional_call updates.
    return torch.func.functional_call(module, dict(params), args, kwargs)


def _record(fn: Any, args: tuple, kwargs: dict) -> Proxy:
    """Record a call of ``fn`` as one node when fx re-traces a rewritten graph.

    A GraphModule is re-traced when it is unpickled or converted again; the
    helpers must then stay single nodes instead of being traced into (where
    ``isinstance(proxy, torch.Tensor)`` would be False and the cast lost).
    """
    proxy = next(a for a in (*args, *kwargs.values(), *(args[1].values() if fn is call_with_params else ())) if isinstance(a, Proxy))
    return proxy.tracer.create_proxy("call_function", fn, args, kwargs)


HELPERS = (amp_cast, amp_promote, call_with_params, shared_cast_read)

# Generated code names the helpers as builtins with an import line, so that
# GraphModule.to_folder writes a module that imports them.
for _helper in HELPERS:
    _register_custom_builtin(_helper.__name__, f"from amp_fx.graph_ops.casts import {_helper.__name__}", _helper)
