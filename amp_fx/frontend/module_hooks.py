"""Module hooks keep their meaning in a converted module: hook boundaries in the graph, only where hooks exist.

Symbolic tracing calls each module through ``Module.__call__``, which runs
the module's hooks once, on proxies: an observing hook would never fire
again, a hook that replaces an output would be baked into the graph, a full
backward hook would never run, and removing a hook afterwards would change
nothing.  Where a module has a hook when it is traced (or is named by a
rebuild, :mod:`amp_fx.converter.live_hooks`), :func:`trace_hooked_call` (called by
``AmpTracer.call_module``) runs no hook; it traces the module's ``forward``
alone, or keeps the leaf's ``call_module`` node, between two boundaries::

    token = module_hook_enter(*inputs)             # forward pre-hooks; BackwardHook on the inputs
    x_i   = module_hook_value(input_i, token, i)   # what the body reads (one per distinct value)
    ...                                            # the module's ops, as without hooks
    done  = module_hook_exit(token, *outputs)      # forward hooks; BackwardHook on the output
    y_j   = module_hook_value(output_j, done, j)   # what the caller reads

Only tensors and other traced values pass through the nodes, each once: a
value at several positions (``blk(x, x)``) is one ``module_hook_value``, so
``a is b`` holds in the body as in eager (:mod:`amp_fx.frontend.hook_structure`,
which also checks what hooks return at run time).  Constants stay on the
:class:`HookSite` (one per call of a hooked module), with the pytree
structures of the inputs ``(args, kwargs)`` and of the output.  At run time
the boundaries do what ``Module._call_impl`` does
(:mod:`amp_fx.graph_ops.hook_dispatch`), reading the hooks live from the
original model's module at that path (a weak reference taken at conversion)
and, for a module the graph inlines, from the converted module's module at
that path too (a leaf runs its own ``__call__``, which runs its own hooks).
A hook registered on the converted module does not reach the original model
(except inside a leaf: a leaf's submodules, which it calls itself, share the
original's hook dicts, amp_fx/converter/graph_module.py).  Not seen: hooks written
into a module's hook dicts directly, without ``register_*_hook``.

This module holds the boundaries whole: their node targets and the
:class:`HookSite` each pair runs the hooks of, tracing them into a graph
(:func:`trace_hooked_call`), and finding and binding the sites of a
converted module's graphs (:func:`sites_of`, :func:`bind_sites`).  Every
target names this module as its own: fx writes that import line for a node
target when a converted module is pickled or its code generated, and the
module's ``__getattr__`` resolves the name (:func:`boundary_named`).  What
crosses a boundary and the checks on what hooks return are
:mod:`amp_fx.frontend.hook_structure`; running the hooks as
``Module._call_impl`` does is :mod:`amp_fx.graph_ops.hook_dispatch`; hooks
registered after conversion are :mod:`amp_fx.converter.live_hooks`.

Precision is not touched: the three ops follow their inputs (reason "module
hook boundary"), are identities in the dtype analysis's fake runs and rules,
and no cast moves across them.  A hook may hand on another floating dtype
than traced (``out.float()``), which autocast takes: the analysis leaves the
dtype of what leaves a boundary unknown (``opened_by_hooks`` in
:mod:`amp_fx.ir.dtype_rules`), so the readers' casts are guarded
(``amp_cast``).  Pre-hooks that compute a weight
(``weight_norm``, ``spectral_norm``, pruning) are part of the module's
computation: traced into the graph as before, never dispatched (a later change
to them is refused: :mod:`amp_fx.converter.weight_computations`).
"""

from __future__ import annotations

import contextlib
import contextvars
import pickle
import uuid
import warnings
import weakref
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake
from torch.fx.node import _side_effectful_functions
from torch.utils import _pytree as pytree

from amp_fx.errors import UnsupportedConstructError
from amp_fx.frontend.hook_structure import check_replacement, join, per_slot, slots_of
from amp_fx.graph_ops import hook_dispatch
from amp_fx.graph_ops.hook_dispatch import COMPUTATION_HOOKS, has_user_hooks, refuse_non_full_backward_hooks
from amp_fx.ir.op_properties import HOOK_BOUNDARY_OPS, HOOK_VALUE_OP

__all__ = ["HookSite", "HookBoundary", "module_hook_value", "boundary_named", "trace_hooked_call", "bind_sites",
           "sites_of", "is_boundary", "graph_modules", "forcing_boundaries", "forced_boundaries", "BOUNDARY_OPS",
           "VALUE_OP", "ORIGINALS_ATTR", "CALLED_ATTR"]

BOUNDARY_OPS = HOOK_BOUNDARY_OPS  # the boundaries' op names, as the op registry knows them (enter, exit)
VALUE_OP = HOOK_VALUE_OP
# On a traced graph: path -> weak reference to the original model's module there (the tracer's map).
ORIGINALS_ATTR = "_amp_fx_hook_originals"
CALLED_ATTR = "_amp_fx_called_paths"  # on a traced graph: the paths of every module forward called
_FORCED: contextvars.ContextVar[frozenset] = contextvars.ContextVar("amp_fx_forced_boundaries", default=frozenset())
_PREFIX = "hook_"
_SITES: "weakref.WeakValueDictionary[str, HookSite]" = weakref.WeakValueDictionary()


# -- node targets and sites --------------------------------------------------------------------
class _Impure:
    """Stands for a boundary in torch.fx's set of side-effectful functions (dead-code elimination keeps it) without keeping it alive."""

    __slots__ = ("uid",)

    def __init__(self, uid: str):
        self.uid = uid

    def __hash__(self) -> int:
        return hash((_PREFIX, self.uid))

    def __eq__(self, other: Any) -> bool:
        return getattr(other, "_amp_fx_uid", None) == self.uid


class HookBoundary:
    """Node target ``module_hook_enter`` / ``module_hook_exit`` of one :class:`HookSite`.

    ``__reduce__`` names an attribute of this module that rebuilds it (fx
    writes an import line for each node target when a converted module is
    pickled); ``__deepcopy__`` keeps the object (a copy of a converted
    module rebinds its boundaries on its first call, :func:`bind_sites`).
    """

    _amp_fx_hook_boundary = True

    def __init__(self, site: "HookSite", kind: str):
        self.site, self.kind = site, kind
        self.__name__ = f"module_hook_{kind}"
        self.__module__ = __name__
        self.__qualname__ = f"{_PREFIX}{kind}__{site.uid}"
        self._amp_fx_uid = f"{kind}{site.uid}"
        stand_in = _Impure(self._amp_fx_uid)
        _side_effectful_functions.add(stand_in)
        weakref.finalize(self, _side_effectful_functions.discard, stand_in)

    def __hash__(self) -> int:
        return hash((_PREFIX, self._amp_fx_uid))

    def __call__(self, *args: Any) -> Any:
        proxy = next((a for a in args if isinstance(a, fx.Proxy)), None)
        if proxy is not None:  # fx re-traces a converted module when it is unpickled: stay one node
            return proxy.tracer.create_proxy("call_function", self, args, {})
        return self.site.run_enter(args) if self.kind == "enter" else self.site.run_exit(args[0], args[1:])

    def __reduce__(self) -> str:
        return f"{self.__qualname__}__{self.site.payload()}"

    def __deepcopy__(self, memo: dict) -> "HookBoundary":
        return self

    def __repr__(self) -> str:
        return f"HookBoundary({self.kind}, {self.site.path!r})"


class _Values:
    """What a boundary hands on: the traced values as it got them, and as the hooks left them."""

    __slots__ = ("given", "values")

    def __init__(self, given: Sequence[Any], values: Optional[Sequence[Any]] = None):
        self.given = given
        self.values = given if values is None else values


class _HookValue:
    """``module_hook_value(value, token, i)``: the i-th traced value out of a boundary (``value`` itself in fake runs)."""

    def __init__(self) -> None:
        self.__name__ = self.__qualname__ = VALUE_OP
        self.__module__ = __name__

    def __call__(self, value: Any, token: Any, index: int) -> Any:
        if isinstance(value, fx.Proxy) or isinstance(token, fx.Proxy):
            proxy = value if isinstance(value, fx.Proxy) else token
            return proxy.tracer.create_proxy("call_function", self, (value, token, index), {})
        if token is None:
            return value  # a fake run
        new = token.values[index]
        if new is token.given[index]:
            return value  # no hook replaced it: the value as the graph made it (a cast a pass wrote here included)
        if (value is not token.given[index] and isinstance(value, torch.Tensor) and isinstance(new, torch.Tensor)
                and value.is_floating_point() and new.is_floating_point() and new.dtype != value.dtype):
            new = new.to(value.dtype)  # the graph casts this value here: the hook's replacement too
        return new

    def __reduce__(self) -> str:
        return VALUE_OP


module_hook_value = _HookValue()


def _is_fake(values: Sequence[Any]) -> bool:
    """True in the dtype analysis's fake runs: the boundary is an identity and runs no hook."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if tensors:
        return any(t.is_meta or is_fake(t) for t in tensors)
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


class HookSite:
    """One call of one hooked module in a graph: its path, its inputs' and output's structure, where its hooks live."""

    def __init__(self, path: str, leaf: bool, in_spec: pytree.TreeSpec, in_leaves: Sequence[Any],
                 original: Optional[nn.Module] = None, uid: Optional[str] = None):
        self.path, self.leaf = path, leaf
        # per flat position: its slot (one per distinct traced value, hook_structure.py) or its constant
        self.in_spec, (self.in_slots, self.in_constants, _) = in_spec, slots_of(in_leaves)
        self.out_spec: Optional[pytree.TreeSpec] = None
        self.out_slots: tuple = ()
        self.out_constants: list = []
        self.original = weakref.ref(original) if original is not None else None
        self.owner: Optional[weakref.ref] = None  # the converted module whose graph holds this site
        self.uid = uid or uuid.uuid4().hex[:16]
        self.enter, self.exit = HookBoundary(self, "enter"), HookBoundary(self, "exit")
        _SITES[self.uid] = self

    def set_output(self, spec: pytree.TreeSpec, leaves: Sequence[Any]) -> list[fx.Proxy]:
        """Record the output's structure; return one proxy per slot (what the exit boundary takes)."""
        self.out_spec = spec
        self.out_slots, self.out_constants, unique = slots_of(leaves)
        return unique

    def modules(self) -> list[nn.Module]:
        """The modules whose hooks run here, live: the original model's, then the converted module's (inlined modules only)."""
        found = []
        original = self.original() if self.original is not None else None
        if original is not None:
            found.append(original)
        owner = self.owner() if self.owner is not None and not self.leaf else None
        if owner is not None:
            try:
                converted = owner.get_submodule(self.path)
            except AttributeError:
                converted = None
            if converted is not None and converted is not original:
                found.append(converted)
        return found

    # -- run time -------------------------------------------------------------------------
    def run_enter(self, traced: tuple) -> Optional[_Values]:
        if _is_fake(traced):
            return None
        modules = self.modules()
        if not modules or not any(has_user_hooks(m) for m in modules):
            return _Values(traced)
        leaves = join(self.in_slots, self.in_constants, traced)
        frame, args, kwargs, changed = hook_dispatch.enter(modules, self.path, *pytree.tree_unflatten(leaves, self.in_spec))
        if not changed:
            return _Frame(frame, traced, list(traced))
        leaves = check_replacement((args, kwargs), self.in_spec, leaves, self.in_slots, "input", self.path,
                                   wrapped=frame.bw_hook is not None)
        return _Frame(frame, traced, per_slot(leaves, self.in_slots))

    def run_exit(self, token: Any, traced: tuple) -> Optional[_Values]:
        if token is None:
            return None
        if not isinstance(token, _Frame):  # no hooks when the module was entered
            return _Values(traced)
        leaves = join(self.out_slots, self.out_constants, traced)
        result, changed = hook_dispatch.leave(token.frame, pytree.tree_unflatten(leaves, self.out_spec))
        if not changed:
            return _Values(traced)
        leaves = check_replacement(result, self.out_spec, leaves, self.out_slots, "output", self.path,
                                   wrapped=token.frame.bw_hook is not None)
        return _Values(traced, per_slot(leaves, self.out_slots))

    # -- copies ---------------------------------------------------------------------------
    def rebound(self, owner: nn.Module) -> "HookSite":
        """This site for another converted module (a deepcopy, an unpickled copy): same structure and original."""
        site = HookSite.__new__(HookSite)
        site.__dict__.update({k: v for k, v in self.__dict__.items() if k not in ("enter", "exit", "uid", "owner")})
        site.uid, site.owner = uuid.uuid4().hex[:16], weakref.ref(owner)
        site.enter, site.exit = HookBoundary(site, "enter"), HookBoundary(site, "exit")
        _SITES[site.uid] = site
        return site

    def payload(self) -> str:
        state = (self.path, self.leaf, self.in_spec, self.in_slots, self.in_constants, self.out_spec,
                 self.out_slots, self.out_constants)
        return pickle.dumps(state, protocol=4).hex()


class _Frame(_Values):
    __slots__ = ("frame",)

    def __init__(self, frame: hook_dispatch.Frame, given: Sequence[Any], values: list):
        super().__init__(given, values)
        self.frame = frame


def boundary_named(name: str) -> Any:
    """Resolve ``hook_<kind>__<uid>[__<payload>]``, the import name fx writes for a pickled boundary."""
    if not name.startswith(_PREFIX):
        raise AttributeError(name)
    kind, _, rest = name[len(_PREFIX):].partition("__")
    uid, _, payload = rest.partition("__")
    site = _SITES.get(uid)
    if site is None and payload:
        with warnings.catch_warnings():  # torch's pytree warns about its own old spec classes while unpickling
            warnings.simplefilter("ignore", FutureWarning)
            state = pickle.loads(bytes.fromhex(payload))
        path, leaf, in_spec, in_slots, in_constants, out_spec, out_slots, out_constants = state
        site = HookSite(path, leaf, in_spec, (), uid=uid)
        site.in_slots, site.in_constants = in_slots, in_constants
        site.out_spec, site.out_slots, site.out_constants = out_spec, out_slots, out_constants
    if site is None or kind not in ("enter", "exit"):
        raise AttributeError(f"{name}: a module hook boundary of a converted module that is gone (pickled without "
                             "its structure); convert the model again")
    return getattr(site, kind)


def __getattr__(name: str) -> Any:
    """Resolve ``hook_<kind>__<uid>[__<payload>]``, the import name fx writes for a pickled boundary."""
    return boundary_named(name)


# -- tracing ---------------------------------------------------------------------------------
@contextlib.contextmanager
def forcing_boundaries(paths: frozenset) -> Iterator[None]:
    """Trace the modules at ``paths`` with hook boundaries whether they have hooks or not (a rebuild)."""
    token = _FORCED.set(frozenset(paths))
    try:
        yield
    finally:
        _FORCED.reset(token)


def forced_boundaries() -> frozenset:
    """The paths :func:`forcing_boundaries` names now."""
    return _FORCED.get()


@contextlib.contextmanager
def _no_proxies_left(module: nn.Module) -> Iterator[None]:
    """A computation hook (weight_norm's) sets an attribute to a traced value: put the model's value back after the call."""
    before = dict(module.__dict__)
    try:
        yield
    finally:
        for key, value in list(module.__dict__.items()):
            if isinstance(value, fx.Proxy) and before.get(key) is not value:
                if key in before:
                    module.__dict__[key] = before[key]
                else:
                    del module.__dict__[key]


def _create(tracer: fx.Tracer, target: Callable, args: tuple, scope: dict) -> fx.Proxy:
    proxy = tracer.create_proxy("call_function", target, args, {})
    proxy.node.meta["nn_module_stack"] = dict(scope)  # the report names the hooked module
    return proxy


def _computation_pre_hooks(module: nn.Module) -> list[Callable]:
    return [h for h in module._forward_pre_hooks.values() if isinstance(h, COMPUTATION_HOOKS)]


def trace_hooked_call(tracer: fx.Tracer, module: nn.Module, path: str, forward: Callable, args: tuple, kwargs: dict,
                      call_module: Callable, original: Optional[nn.Module], forced: bool) -> Any:
    """``Tracer.call_module`` for a module with hooks: its hooks kept for run time (see module docstring)."""
    refuse_non_full_backward_hooks(module, path, UnsupportedConstructError)
    if not (forced or has_user_hooks(module)):
        with _no_proxies_left(module):  # only computation hooks: traced into the graph as before
            return call_module(module, forward, args, kwargs)
    flat, in_spec = pytree.tree_flatten((args, kwargs))
    site = HookSite(path, tracer.is_leaf_module(module, path), in_spec, flat, original)
    scope = {**tracer.module_stack, path: (path, type(module))}
    unique = slots_of(flat)[2]  # the same value at several positions passes once: `a is b` holds in the body
    token = _create(tracer, site.enter, tuple(unique), scope)
    values = [_create(tracer, module_hook_value, (value, token, i), scope) for i, value in enumerate(unique)]
    new_args, new_kwargs = pytree.tree_unflatten(join(site.in_slots, site.in_constants, values), in_spec)

    def body(*a: Any, **k: Any) -> Any:
        for hook in _computation_pre_hooks(module):
            result = hook(module, a)
            if result is not None:
                a = result if isinstance(result, tuple) else (result,)
        return module.forward(*a, **k)

    with _no_proxies_left(module):
        out = call_module(module, body, new_args, new_kwargs)
    out_flat, out_spec = pytree.tree_flatten(out)
    unique = site.set_output(out_spec, out_flat)
    done = _create(tracer, site.exit, (token, *unique), scope)
    values = [_create(tracer, module_hook_value, (value, done, j), scope) for j, value in enumerate(unique)]
    return pytree.tree_unflatten(join(site.out_slots, site.out_constants, values), out_spec)


# -- the sites of a converted module's graphs -----------------------------------------------
def is_boundary(node: fx.Node) -> bool:
    """True for the enter/exit nodes of a hook boundary."""
    return node.op == "call_function" and getattr(node.target, "_amp_fx_hook_boundary", False) is True


def graph_modules(gm: nn.Module) -> Iterator[fx.GraphModule]:
    """``gm`` and the graph modules it holds (checkpointed regions), not other converted modules inside it."""
    yield gm
    todo = list(gm.children())
    while todo:
        module = todo.pop()
        if "amp_config" in module.__dict__:
            continue
        if isinstance(module, fx.GraphModule):
            yield module
        todo.extend(module.children())
        # a checkpointed region keeps its body out of _modules (amp_fx/frontend/checkpoint_regions.py)
        todo.extend(v for k, v in module.__dict__.items() if isinstance(v, fx.GraphModule) and k != "_modules")


def sites_of(gm: nn.Module) -> list[HookSite]:
    """The hook sites in ``gm``'s graphs."""
    found: dict[str, HookSite] = {}
    for graph_module in graph_modules(gm):
        for node in graph_module.graph.nodes:
            if is_boundary(node):
                found.setdefault(node.target.site.uid, node.target.site)
    return list(found.values())


def bind_sites(gm: nn.Module) -> None:
    """Make each hook site in ``gm``'s graphs read ``gm``'s modules (after construction, deepcopy, unpickling)."""
    for graph_module in graph_modules(gm):
        replaced: dict[str, HookSite] = {}
        for node in graph_module.graph.nodes:
            if not is_boundary(node):
                continue
            site = node.target.site
            owner = site.owner() if site.owner is not None else None
            if owner is gm:
                continue
            if owner is None:
                site.owner = weakref.ref(gm)
                continue
            new = replaced.get(site.uid) or replaced.setdefault(site.uid, site.rebound(gm))
            node.target = getattr(new, node.target.kind)
        if replaced:
            graph_module.recompile()
