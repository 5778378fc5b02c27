"""Keep custom ``torch.autograd.Function`` calls whole on both tracing routes: one node, forward and backward intact.

``torch.fx.symbolic_trace`` runs ``MyFn.apply(proxy)`` like any Python
call: the forward is traced op by op and the backward is lost (a
straight-through estimator then has a zero gradient).  While amp_fx traces,
:func:`record_function_calls` replaces ``Function.apply`` so that a call with
traced arguments becomes one ``call_function`` node whose target is a
:class:`FunctionCall`, which calls the real ``apply`` at run time.

torch.export (strict or not) traces *through* ``MyFn.apply`` too.  Export
keeps a ``torch.library`` custom op as one node, so while it traces,
:func:`keeping_function_calls` routes ``apply`` of every Function outside
``torch.*`` through one generic custom op, ``amp_fx::autograd_function(key,
tensors, sizes)``: ``key`` names the call's Function and its constant
arguments, ``tensors`` and ``sizes`` (symbolic ints) are its graph inputs.
The op's fake kernel runs the Function's forward on export's fake tensors
(for the output's shapes and structure; nothing it runs is recorded).
:meth:`KeptCalls.restore` then turns each op node of the unlifted module
into the node the symbolic route makes, a :class:`FunctionCall`.  The op
exists only between export and :meth:`KeptCalls.restore`; it has no kernel
of its own.  Refused on that route, naming the construct: a Function that
writes to its inputs in place (the rewrite may hand it a cast copy), one
given or returning a value a graph cannot hold, and one whose forward cannot
run on fake tensors.

The node's canonical op name is the Function's class name (``"op:MyFn"`` in a
policy); the class object itself is a policy key too.  How its precision is
decided lives in :mod:`amp_fx.frontend.declared_precision`.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import operator
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
import torch.fx as fx
import torch.nn as nn
from torch.autograd.function import Function, _is_setup_context_defined
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from amp_fx.errors import UnsupportedConstructError
from amp_fx.frontend.source_lines import current_user_line

__all__ = ["FunctionCall", "function_call", "record_function_calls", "ScratchCtx", "keeping_function_calls", "KeptCalls",
           "AUTOGRAD_FUNCTION"]

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


# -- the torch.export route ---------------------------------------------------------------
# What a graph node can hold as a constant argument (fx writes it into code with repr()).
_CONSTANTS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)
_EXPORTING = threading.local()  # the calls kept while torch.export traces on this thread
_ROUTE = "The route that keeps it: torch.compile(model, backend='amp_fx') (Dynamo captures the Function)."


@torch.library.custom_op("amp_fx::autograd_function", mutates_args=())
def _autograd_function(key: str, tensors: list[torch.Tensor], sizes: list[int]) -> list[torch.Tensor]:
    """Stands for one ``Function.apply`` call while torch.export traces; never run (restore() replaces it)."""
    raise UnsupportedConstructError(
        f"amp_fx::autograd_function ({key}) ran outside a conversion: it stands for a custom autograd Function "
        "only while torch.export traces for amp_fx.convert. Export the model through amp_fx.convert.",
        construct="torch.autograd.Function.apply")


AUTOGRAD_FUNCTION = torch.ops.amp_fx.autograd_function.default


@dataclass
class _Call:
    """One recorded ``apply``: the Function, its arguments' structure and constants, what the fake run learned."""

    function: type
    spec: Any
    kinds: list[str]             # per argument leaf: "tensor", "size" or "constant"
    constants: list[Any]         # per leaf: the constant, None for a graph input
    where: str
    out_spec: Any = None
    out_constants: Optional[list[Any]] = None  # per output leaf: the constant, None for a tensor
    refusal: Optional[UnsupportedConstructError] = None

    def refuse(self, problem: str) -> UnsupportedConstructError:
        self.refusal = UnsupportedConstructError(
            f"custom autograd Function {self.function.__qualname__} {problem}\n  at {self.where}\n"
            f"amp_fx keeps Functions whole on the torch.export route and cannot keep this one.\n{_ROUTE}",
            construct="torch.autograd.Function.apply", where=self.where)
        return self.refusal


@dataclass
class KeptCalls:
    """The ``apply`` calls recorded during one export, by key; :meth:`restore` puts them in the graph."""

    calls: dict[str, _Call] = field(default_factory=dict)
    counter: Any = field(default_factory=itertools.count)

    def restore(self, gm: fx.GraphModule) -> int:
        """Replace each ``amp_fx::autograd_function`` node in ``gm`` (and its submodules) by a FunctionCall node; return how many."""
        restored = 0
        for module in gm.modules():
            if not isinstance(module, fx.GraphModule):
                continue
            nodes = [n for n in module.graph.nodes if n.op == "call_function" and n.target is AUTOGRAD_FUNCTION]
            for node in nodes:
                _restore_one(module.graph, node, self.calls[node.args[0]])
            if nodes:
                module.graph.lint()
                module.recompile()
                restored += len(nodes)
        return restored


def _restore_one(graph: fx.Graph, node: fx.Node, call: _Call) -> None:
    _, tensors, sizes = node.args
    inputs = {"tensor": iter(tensors), "size": iter(sizes)}
    leaves = [next(inputs[kind]) if kind != "constant" else value for kind, value in zip(call.kinds, call.constants)]
    args, kwargs = tree_unflatten(leaves, call.spec)
    with graph.inserting_before(node):
        kept = graph.call_function(function_call(call.function), tuple(args), dict(kwargs))
    kept.meta.update(node.meta)
    # the op returns the tensor outputs as a list; the Function returns one tensor or a tuple with constants in it
    positions = [i for i, c in enumerate(call.out_constants) if c is None]
    single = call.out_spec.is_leaf()
    values = node.meta.get("val")
    if isinstance(values, (list, tuple)):
        structure = list(call.out_constants)
        for position, value in zip(positions, values):
            structure[position] = value
        kept.meta["val"] = structure[0] if single else tree_unflatten(structure, call.out_spec)
    for user in list(node.users):
        if user.op == "call_function" and user.target is operator.getitem:
            if single:
                user.replace_all_uses_with(kept)
                graph.erase_node(user)
            else:
                user.args = (kept, positions[user.args[1]])
    if node.users:  # the list used whole (not made by export): fail loudly rather than hand over the wrong structure
        raise UnsupportedConstructError(f"the torch.export graph uses the outputs of {call.function.__qualname__} "
                                        f"as a list (node {node.name!r}); amp_fx cannot keep it whole.\n{_ROUTE}",
                                        construct="torch.autograd.Function.apply", where=call.where)
    graph.erase_node(node)


def _fake_forward(key: str, tensors: list[torch.Tensor], sizes: list[Any]) -> list[torch.Tensor]:
    """The op's fake kernel: run the Function's forward on export's fake tensors, learn its outputs."""
    call = _EXPORTING.kept.calls[key]
    inputs = {"tensor": iter(tensors), "size": iter(sizes)}
    leaves = [next(inputs[kind]) if kind != "constant" else value for kind, value in zip(call.kinds, call.constants)]
    args, kwargs = tree_unflatten(leaves, call.spec)
    versions = [t._version for t in tensors]
    ctx = ScratchCtx(len(args))
    previous, _EXPORTING.inside = getattr(_EXPORTING, "inside", False), True
    try:
        if _is_setup_context_defined(call.function.setup_context):
            result = call.function.forward(*args, **kwargs)
        else:
            result = call.function.forward(ctx, *args, **kwargs)
    except UnsupportedConstructError:
        raise
    except Exception as error:  # any failure: the forward is not something export's fake tensors can run
        raise call.refuse(f"cannot run its forward on torch.export's fake tensors ({type(error).__name__}: "
                          f"{str(error).splitlines()[0] if str(error) else ''}).") from error
    finally:
        _EXPORTING.inside = previous
    if ctx.dirty or [t._version for t in tensors] != versions:
        raise call.refuse("writes to its input in place (ctx.mark_dirty or an in-place op): after conversion it may "
                          "be given a cast copy, and the write would not reach the model's tensor.")
    flat, call.out_spec = tree_flatten(result)
    if not call.out_spec.is_leaf() and any(not child.is_leaf() for child in call.out_spec.children()):
        raise call.refuse("returns a nested structure; amp_fx keeps one tensor or a flat tuple of them.")
    bad = [v for v in flat if not isinstance(v, (torch.Tensor,) + _CONSTANTS)]
    if bad:
        raise call.refuse(f"returns {type(bad[0]).__name__} values, which a graph cannot hold as constants.")
    call.out_constants = [None if isinstance(v, torch.Tensor) else v for v in flat]
    return [v.clone() for v in flat if isinstance(v, torch.Tensor)]  # an op's outputs never alias its inputs


_autograd_function.register_fake(_fake_forward)


def _record_on_export(kept: KeptCalls, cls: type, args: tuple, kwargs: dict) -> Any:
    flat, spec = tree_flatten((args, kwargs))
    kinds = ["tensor" if isinstance(v, torch.Tensor) else "size" if isinstance(v, torch.SymInt) else "constant"
             for v in flat]
    call = _Call(cls, spec, kinds, [v if k == "constant" else None for v, k in zip(flat, kinds)],
                 current_user_line() or "unknown source line")
    bad = [v for v, k in zip(flat, kinds) if k == "constant" and not isinstance(v, _CONSTANTS)]
    if bad:
        raise call.refuse(f"is called with a {type(bad[0]).__name__} argument, which a graph cannot hold.")
    key = f"{cls.__qualname__}#{next(kept.counter)}"
    kept.calls[key] = call
    tensors = [v for v, k in zip(flat, kinds) if k == "tensor"]
    sizes = [v for v, k in zip(flat, kinds) if k == "size"]
    try:
        outputs = _autograd_function(key, tensors, sizes)
    except Exception:
        if call.refusal is not None:  # raised in the fake kernel, perhaps wrapped by torch on the way out
            raise call.refusal from None
        raise
    if call.out_constants is None:
        raise call.refuse("was not run by torch.export's fake kernel (amp_fx cannot learn what it returns).")
    produced = iter(outputs)
    return tree_unflatten([next(produced) if c is None else c for c in call.out_constants], call.out_spec)


@contextlib.contextmanager
def keeping_function_calls() -> Iterator[KeptCalls]:
    """While torch.export traces on this thread, record custom Functions' ``apply`` as single op nodes."""
    original = Function.__dict__["apply"]
    kept = KeptCalls()
    me = threading.get_ident()
    previous = getattr(_EXPORTING, "kept", None)

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        recording = (threading.get_ident() == me and not getattr(_EXPORTING, "inside", False)
                     and not cls.__module__.startswith("torch."))
        if recording and any(isinstance(v, torch.Tensor) for v in tree_flatten((args, kwargs))[0]):
            return _record_on_export(kept, cls, args, kwargs)
        return original.__get__(None, cls)(*args, **kwargs)

    _EXPORTING.kept = kept
    Function.apply = classmethod(apply)
    try:
        yield kept
    finally:
        Function.apply = original
        _EXPORTING.kept = previous
