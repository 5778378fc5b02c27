"""Keep custom ``torch.autograd.Function`` calls whole through ``torch.export``: one node, forward and backward intact.

torch.export (strict or not) traces *through* ``MyFn.apply``: the forward's
ATen ops stay and the Function's backward is lost (a straight-through
estimator's gradient becomes round's, zero).  Export keeps a
``torch.library`` custom op as one node, so while it traces,
:func:`keeping_function_calls` routes ``apply`` of every Function outside
``torch.*`` through one generic custom op, ``amp_fx::autograd_function(key,
tensors, sizes)``: ``key`` names the call's Function and its constant
arguments, ``tensors`` and ``sizes`` (symbolic ints) are its graph inputs.
The op's fake kernel runs the Function's forward on export's fake tensors
(for the output's shapes and structure; nothing it runs is recorded).
:meth:`KeptCalls.restore` then turns each op node of the unlifted module
into the node the symbolic route makes: a
:class:`~amp_fx.frontend.opaque_calls.FunctionCall`, which calls the real
``apply`` at run time, so autograd runs the Function's own backward.

The op exists only between export and :meth:`KeptCalls.restore`; it has no
kernel of its own.  Refused, naming the construct: a Function that writes to
its inputs in place (the rewrite may hand it a cast copy), one given or
returning a value a graph cannot hold, and one whose forward cannot run on
fake tensors.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
import torch.fx as fx
from torch.autograd.function import Function, _is_setup_context_defined
from torch.utils._pytree import tree_flatten, tree_unflatten

from amp_fx.errors import UnsupportedConstructError
from amp_fx.frontend.opaque_calls import ScratchCtx, function_call
from amp_fx.frontend.source_lines import current_user_line

__all__ = ["keeping_function_calls", "KeptCalls"]

# What a graph node can hold as a constant argument (fx writes it into code with repr()).
_CONSTANTS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)
_ACTIVE = threading.local()
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
    call = _ACTIVE.kept.calls[key]
    inputs = {"tensor": iter(tensors), "size": iter(sizes)}
    leaves = [next(inputs[kind]) if kind != "constant" else value for kind, value in zip(call.kinds, call.constants)]
    args, kwargs = tree_unflatten(leaves, call.spec)
    versions = [t._version for t in tensors]
    ctx = ScratchCtx(len(args))
    previous, _ACTIVE.inside = getattr(_ACTIVE, "inside", False), True
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
        _ACTIVE.inside = previous
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


def _record(kept: KeptCalls, cls: type, args: tuple, kwargs: dict) -> Any:
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
    previous = getattr(_ACTIVE, "kept", None)

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        recording = (threading.get_ident() == me and not getattr(_ACTIVE, "inside", False)
                     and not cls.__module__.startswith("torch."))
        if recording and any(isinstance(v, torch.Tensor) for v in tree_flatten((args, kwargs))[0]):
            return _record(kept, cls, args, kwargs)
        return original.__get__(None, cls)(*args, **kwargs)

    _ACTIVE.kept = kept
    Function.apply = classmethod(apply)
    try:
        yield kept
    finally:
        Function.apply = original
        _ACTIVE.kept = previous
