"""Keep custom ``torch.autograd.Function`` calls whole while tracing: one node, forward and backward intact.

``torch.fx.symbolic_trace`` runs ``MyFn.apply(proxy)`` like any Python
call: the forward is traced op by op and the backward is lost (a
straight-through estimator then has a zero gradient).  While amp_fx traces,
:func:`record_function_calls` replaces ``Function.apply`` so that a call with
traced arguments becomes one ``call_function`` node whose target is a
:class:`FunctionCall`, which calls the real ``apply`` at run time.

The node's canonical op name is the Function's class name (``"op:MyFn"`` in a
policy); the class object itself is a policy key too.  How its precision is
decided lives in :mod:`amp_fx.frontend.declared_precision`.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
import weakref
from typing import Any, Iterator, Optional

import torch.fx as fx
import torch.nn as nn
from torch.autograd.function import Function, _is_setup_context_defined
from torch.utils._pytree import tree_leaves

from amp_fx.errors import UnsupportedConstructError
from amp_fx.frontend.source_lines import current_user_line

__all__ = ["FunctionCall", "function_call", "record_function_calls", "ScratchCtx"]

_CALLS: "weakref.WeakKeyDictionary[type, FunctionCall]" = weakref.WeakKeyDictionary()
_ACTIVE = threading.local()
_PREFIX = "apply__"


def _encode(text: str) -> str:
    # Reversible and free of "__", so the import name splits back into module and qualname.
    return text.replace("_", "_0").replace(".", "_1")


def _decode(text: str) -> str:
    return text.replace("_1", ".").replace("_0", "_")


class FunctionCall:
    """Callable node target: ``FunctionCall(MyFn)(*args)`` is ``MyFn.apply(*args)``.

    One instance per Function class (see :func:`function_call`), so that
    nodes calling the same Function share a target.  ``__name__`` is the
    class name (the canonical op name); ``__module__``/``__qualname__`` name
    an attribute of this module that resolves back to the instance, so fx
    can write an import line for it when a converted module is pickled.
    """

    def __init__(self, function: type):
        self.function = function
        self.amp_fx_function = function  # policy and op_keys read this
        self.__name__ = function.__name__
        self.__module__ = __name__
        self.__qualname__ = f"{_PREFIX}{_encode(function.__module__)}__{_encode(function.__qualname__)}"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        proxy = _first_proxy(args, kwargs)
        if proxy is not None:
            # fx re-traces a converted module when it is unpickled: stay one node.
            return proxy.tracer.create_proxy("call_function", self, args, kwargs)
        return self.function.apply(*args, **kwargs)

    def __reduce__(self) -> str:
        return self.__qualname__

    def __deepcopy__(self, memo: dict) -> "FunctionCall":
        return self

    def __repr__(self) -> str:
        return f"FunctionCall({self.function.__module__}.{self.function.__qualname__})"


def function_call(function: type) -> FunctionCall:
    """The shared :class:`FunctionCall` target of ``function`` (a ``torch.autograd.Function`` subclass)."""
    call = _CALLS.get(function)
    if call is None:
        call = _CALLS[function] = FunctionCall(function)
    return call


def __getattr__(name: str) -> Any:
    """Resolve ``apply__<module>__<qualname>`` (the import name fx writes for a pickled node target)."""
    if not name.startswith(_PREFIX) or "__" not in name[len(_PREFIX):]:
        raise AttributeError(name)
    module_name, _, qualname = name[len(_PREFIX):].partition("__")
    owner: Any = importlib.import_module(_decode(module_name))
    for atom in _decode(qualname).split("."):
        owner = getattr(owner, atom)
    return function_call(owner)


def _first_proxy(args: tuple, kwargs: dict) -> Optional[fx.Proxy]:
    return next((a for a in tree_leaves((args, kwargs)) if isinstance(a, fx.Proxy)), None)


class ScratchCtx:
    """A stand-in ``ctx`` for running a forward once to learn the shape of its result (``dirty``: it called mark_dirty)."""

    saved_tensors: tuple = ()

    def __init__(self, n_inputs: int):
        self.needs_input_grad = (True,) * n_inputs
        self.dirty = False

    def save_for_backward(self, *tensors: Any) -> None: ...
    def save_for_forward(self, *tensors: Any) -> None: ...
    def mark_dirty(self, *tensors: Any) -> None:
        self.dirty = True
    def mark_non_differentiable(self, *tensors: Any) -> None: ...
    def set_materialize_grads(self, value: bool) -> None: ...


def _result_structure(function: type, args: tuple, kwargs: dict, graph: fx.Graph) -> Any:
    """Run the forward on the proxies once and return its result, or None if it cannot run.

    Only the structure is used (a tuple of how many values, which are
    constants); the nodes this run records are erased again.
    """
    marker = graph._root.prev  # the last node before the scratch run
    try:
        if _is_setup_context_defined(function.setup_context):
            result = function.forward(*args, **kwargs)
        else:
            result = function.forward(ScratchCtx(len(args)), *args, **kwargs)
    except Exception:  # any failure: fall back to one opaque result
        result = None
    scratch = []
    node = marker.next
    while node is not graph._root:
        scratch.append(node)
        node = node.next
    for node in reversed(scratch):
        # get_attr nodes may be cached by the tracer for later reuse: leave them.
        if not node.users and node.op != "get_attr":
            graph.erase_node(node)
    return result


def _record(function: type, args: tuple, kwargs: dict, proxy: fx.Proxy) -> Any:
    tracer = proxy.tracer
    if any(isinstance(leaf, nn.Module) for leaf in tree_leaves((args, kwargs))):
        # Its forward runs those modules' parameters where no graph node sees them: O1 could not cast them (a low
        # input would meet fp32 weights) and O2 could not hand them their low copies.
        where = current_user_line() or "unknown source line"
        raise UnsupportedConstructError(
            f"custom autograd Function {function.__qualname__} is called with modules as arguments (Reformer's "
            f"reversible layers): their parameters run inside it, out of the graph's sight.\n  at {where}",
            construct="torch.autograd.Function.apply", where=where)
    structure = _result_structure(function, args, kwargs, tracer.graph)
    try:
        out = tracer.create_proxy("call_function", function_call(function), args, kwargs)
    except NotImplementedError as error:
        where = current_user_line() or "unknown source line"
        raise UnsupportedConstructError(
            f"custom autograd Function {function.__qualname__} is called with an argument amp_fx cannot "
            f"record in a graph ({error}).\n  at {where}\n"
            "Routes that keep it: torch.compile(model, backend='amp_fx') (Dynamo captures the Function), "
            "or leaf_modules=[the module that calls it] to keep that module whole.",
            construct="torch.autograd.Function.apply", where=where,
        ) from error
    if isinstance(structure, (tuple, list)):
        return type(structure)(out[i] if isinstance(v, fx.Proxy) else v for i, v in enumerate(structure))
    return out


@contextlib.contextmanager
def record_function_calls(tracer: fx.Tracer) -> Iterator[None]:
    """While tracing with ``tracer``, record ``SomeFunction.apply`` calls on its proxies as single nodes."""
    original = Function.__dict__["apply"]
    previous = getattr(_ACTIVE, "tracer", None)

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        proxy = _first_proxy(args, kwargs)
        if proxy is not None and proxy.tracer is getattr(_ACTIVE, "tracer", None):
            return _record(cls, args, kwargs, proxy)
        return original.__get__(None, cls)(*args, **kwargs)

    _ACTIVE.tracer = tracer
    Function.apply = classmethod(apply)
    try:
        yield
    finally:
        Function.apply = original
        _ACTIVE.tracer = previous
