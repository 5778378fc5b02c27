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

__all__ = ["amp_cast", "amp_promote", "call_with_params", "HELPERS"]


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


HELPERS = (amp_cast, amp_promote, call_with_params)

# Generated code names the helpers as builtins with an import line, so that
# GraphModule.to_folder writes a module that imports them.
for _helper in HELPERS:
    _register_custom_builtin(_helper.__name__, f"from amp_fx.graph_ops.casts import {_helper.__name__}", _helper)
