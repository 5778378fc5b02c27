"""The node targets of module hook boundaries, and the :class:`HookSite` each pair of boundaries runs the hooks of.

:mod:`amp_fx.frontend.module_hooks` (which traces them into graphs) says what
the boundaries do and why.  Every target here names ``module_hooks`` as its
module (``HOME``): fx writes that import line for a node target when a
converted module is pickled or its code generated, and ``module_hooks``
resolves the names (:func:`boundary_named`, its ``__getattr__``), so saved
modules and the generated code are the same as before these classes moved here.
"""

from __future__ import annotations

import pickle
import uuid
import warnings
import weakref
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake
from torch.fx.node import _side_effectful_functions
from torch.utils import _pytree as pytree

from amp_fx.graph_ops import hook_dispatch
from amp_fx.frontend.hook_structure import check_replacement, join, per_slot, slots_of
from amp_fx.graph_ops.hook_dispatch import has_user_hooks
from amp_fx.ir.op_properties import HOOK_BOUNDARY_OPS, HOOK_VALUE_OP

__all__ = ["HookSite", "HookBoundary", "module_hook_value", "boundary_named", "BOUNDARY_OPS", "VALUE_OP", "HOME"]

HOME = f"{__package__}.module_hooks"  # amp_fx.frontend.module_hooks: the module fx names for every target here (see the module doc)
BOUNDARY_OPS = HOOK_BOUNDARY_OPS  # the boundaries' op names, as the op registry knows them (enter, exit)
VALUE_OP = HOOK_VALUE_OP
_PREFIX = "hook_"
_SITES: "weakref.WeakValueDictionary[str, HookSite]" = weakref.WeakValueDictionary()


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

    ``__reduce__`` names an attribute of ``HOME`` that rebuilds it (fx
    writes an import line for each node target when a converted module is
    pickled); ``__deepcopy__`` keeps the object (a copy of a converted
    module rebinds its boundaries on its first call, :func:`bind_sites`).
    """

    _amp_fx_hook_boundary = True

    def __init__(self, site: "HookSite", kind: str):
        self.site, self.kind = site, kind
        self.__name__ = f"module_hook_{kind}"
        self.__module__ = HOME
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
        self.__module__ = HOME

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
