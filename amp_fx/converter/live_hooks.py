"""Hooks registered after conversion: found at call time, cheaply, and kept by rebuilding the graph with boundaries.

A converted graph inlines most modules.  Those hooked at conversion have hook
boundaries (:mod:`amp_fx.frontend.module_hooks`), which read the hooks live.
A hook registered later on a module the graph inlines without a boundary --
on the original model's module, or on the converted module's module at the
same path -- would never fire.  ``AmpGraphModule.__call__`` asks
:func:`check_hooks` before a call whose :class:`HookState` is stale:

- Fast path: ``torch.utils.hooks.RemovableHandle.next_id`` (every hook
  registration anywhere in torch makes a handle and moves it) still has the
  value it had at the last scan, and the graph is the one scanned: nothing
  to do (a dict lookup and two comparisons per call).
- Otherwise the watched hook dicts are scanned: the modules the graph
  inlines without a boundary, on both sides (a leaf module runs its own
  hooks; one of the model's leaves is watched for a boundary), and the
  global module hooks, which are refused.  A new hook makes ``convert()``
  run again from the original model with the same arguments and boundaries
  at the hooked paths (plus the old ones), and the new graph is swapped in.
  The converted module keeps its own modules, parameters and buffers, so an
  optimizer built over them stays valid.  Where that cannot be done (the
  torch.export route; a module whose model is not known, e.g. unpickled; a
  model changed since), an AmpRuntimeError names the module, the hook and
  the ways out.

The original model's own (root) hooks run around the converted module's
call (:func:`amp_fx.graph_ops.hook_dispatch.call_with_hooks`); the converted
module's own hooks run as any module's do, inside them.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from amp_fx.errors import AmpRuntimeError
from amp_fx.graph_ops import hook_dispatch
from amp_fx.converter import weight_computations
from amp_fx.frontend.tracing import FX_FAILED_IN_ATTR, export_hook_advice
from amp_fx.frontend.module_hooks import bind_sites, forcing_boundaries, graph_modules, sites_of

__all__ = ["ConversionRecipe", "HookState", "check_hooks", "lookup_target", "own_attribute", "RECIPE_ATTR", "STATE_ATTR"]

RECIPE_ATTR = "amp_fx_recipe"  # carried by deepcopy (shared) and pickle (emptied): AMP_ATTRIBUTES
STATE_ATTR = "_amp_fx_hook_state"  # per module object; rebuilt after a copy
_ROUTE_ATTR = "amp_fx_route"
_OWN_PREFIXES = ("amp_fx_checkpoint_",)  # modules amp_fx adds to a converted module


class ConversionRecipe:
    """How a module was converted -- the original model, convert()'s arguments and convert itself -- for a rebuild.

    ``build`` is the function that converted it (``amp_fx.convert``, handed down by
    :mod:`amp_fx.converter.api`): a rebuild for new hooks (here) or for another mode or
    set of inputs (:mod:`amp_fx.converter.specialisations`) calls ``build(model,
    **options)``, so neither imports the api module above them (no import circle).
    Shared by deepcopies of the converted module; a pickled one forgets the model
    and the builder (neither is saved with the module).
    """

    def __init__(self, model: Optional[nn.Module], options: dict, called: frozenset = frozenset(),
                 build: Optional[Callable[..., fx.GraphModule]] = None):
        self.model, self.options, self.build = model, options, build
        self.called = called  # paths of the modules forward calls (others' hooks never fire, in eager too)
        self.unplaced: set[str] = set()  # called paths a rebuild could not give a boundary (inside a custom Function)
        # pruning, weight_norm, spectral_norm, parametrizations as traced in: a later change is refused
        self.computations = weight_computations.signatures(model) if model is not None else {}
        self.computing = [(path, model.get_submodule(path), sig) for path, sig in self.computations.items()]

    def __deepcopy__(self, memo: dict) -> "ConversionRecipe":
        return self

    def __reduce__(self) -> tuple:
        return (ConversionRecipe, (None, {}))


class HookState:
    """What one converted module watches for new hooks (see module docstring)."""

    __slots__ = ("graph", "stamp", "watched", "root", "root_hooked", "has_sites", "exported", "computing",
                 "computations", "model_modules", "converted_modules")

    def __init__(self, gm: fx.GraphModule):
        bind_sites(gm)  # a deepcopy's boundaries still read the module it was copied from
        recipe = gm.__dict__.get(RECIPE_ATTR)
        model = recipe.model if recipe is not None else None
        self.graph = gm.__dict__.get("_graph")
        self.stamp = -1
        self.exported = gm.__dict__.get(_ROUTE_ATTR) == "torch.export"
        self.root = model
        self.root_hooked = False
        sites = {site.path for site in sites_of(gm)}
        self.has_sites = bool(sites)
        leaves = {str(n.target) for g in graph_modules(gm) for n in g.graph.nodes if n.op == "call_module"}
        originals = dict(model.named_modules()) if model is not None else {}
        converted = dict(gm.named_modules())
        # weight computations traced in (amp_fx/converter/weight_computations.py): checked at every call
        self.computing = recipe.computing if model is not None else []
        self.computations = recipe.computations if model is not None else {}
        self.model_modules = list(originals.items())
        self.converted_modules = list(converted.items()) if model is not None else []
        called = recipe.called - recipe.unplaced if model is not None and not self.exported else None
        self.watched: list[tuple[str, nn.Module, str]] = []
        for path in dict.fromkeys([*originals, *converted]):
            if not path or path in sites or path.startswith(_OWN_PREFIXES) or (called is not None and path not in called):
                continue
            if any(path.startswith(leaf + ".") for leaf in leaves):
                continue  # a leaf calls its submodules itself: they share the original's hook dicts
            if path in originals:
                self.watched.append((path, originals[path], "the model's"))
            if path in converted and path not in leaves:
                self.watched.append((path, converted[path], "the converted module's"))
        if self.exported and model is not None:
            self.watched.append(("", model, "the model's"))

    def __reduce__(self) -> tuple:
        return (_nothing, ())  # not saved with the module: a copy builds its own

    def __deepcopy__(self, memo: dict) -> None:
        return None

    def stale(self, gm: nn.Module) -> bool:
        # A removal (prune.remove, remove_weight_norm) registers no hook: the traced-in computations are compared too.
        return (self.stamp != RemovableHandle.next_id or self.graph is not gm.__dict__.get("_graph")
                or (bool(self.computing) and weight_computations.stale_computation(self.computing)))

    def scan(self) -> list[tuple[str, str, str, Callable]]:
        """(path, whose, hook dict, hook) of every watched module with a hook now."""
        found = []
        for path, module, whose in self.watched:
            held = module.__dict__
            if not (held.get("_forward_pre_hooks") or held.get("_forward_hooks") or held.get("_backward_hooks")
                    or held.get("_backward_pre_hooks")):
                continue
            for attr in hook_dispatch.HOOK_DICTS:
                hooks = hook_dispatch.user_hooks(module, attr)
                if hooks:
                    found.append((path, whose, attr, hooks[0][1]))
                    break
        if self.root is not None and not self.exported:
            self.root_hooked = hook_dispatch.has_user_hooks(self.root)
        return found

    @property
    def active(self) -> bool:
        """Boundaries in the graph, or hooks on the original model itself: calls go through :meth:`run`."""
        return self.has_sites or self.root_hooked

    def run(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``call(*args, **kwargs)``: the original model's own hooks around it; pending ``always_call`` hooks on an error."""
        if self.root_hooked:
            return hook_dispatch.call_with_hooks([self.root], "", call, args, kwargs)
        depth = hook_dispatch.open_depth()
        try:
            return call(*args, **kwargs)
        except Exception:
            hook_dispatch.unwind(depth)
            raise


def _nothing() -> None:
    return None


def check_hooks(gm: fx.GraphModule) -> HookState:
    """Scan for hooks registered since the last call; rebuild ``gm``'s graph with boundaries for them, or refuse."""
    state = gm.__dict__.get(STATE_ATTR)
    if state is None or state.graph is not gm.__dict__.get("_graph"):
        state = HookState(gm)
    hook_dispatch.refuse_global_hooks("while a converted module runs", AmpRuntimeError)
    # a hook registered anywhere may be a new pruning: every module's computation is compared, before any rebuild
    weight_computations.refuse_changed(state.computations, state.model_modules, state.converted_modules)
    found = state.scan()
    if found:
        _rebuild(gm, state, found)
        state = HookState(gm)
        state.scan()
    state.stamp = RemovableHandle.next_id
    gm.__dict__[STATE_ATTR] = state
    return state


def _kind(attr: str) -> str:
    return {"_forward_pre_hooks": "forward pre-hook", "_forward_hooks": "forward hook",
            "_backward_hooks": "full backward hook", "_backward_pre_hooks": "backward pre-hook"}[attr]


def _refusal(found: list, why: str, exported: bool = False, failed_in: Optional[str] = None) -> AmpRuntimeError:
    path, whose, attr, hook = found[0]
    name = f"module {path!r}" if path else "module '' (the model itself)"
    ways = (export_hook_advice(failed_in) if exported else
            "register the hook before amp_fx.convert (a module hooked at conversion keeps its hooks live, removal "
            "included), convert the model again after registering it, or use torch.compile(model, backend='amp_fx'), "
            "which keeps hooks")
    return AmpRuntimeError(
        f"amp_fx: a {_kind(attr)} ({hook_dispatch.hook_name(hook)}) is registered on {whose} {name}, which the converted "
        f"graph inlines without a hook boundary, so it would never fire; the graph cannot be rebuilt with one: {why}. "
        f"Ways out: {ways}.")


def _rebuild(gm: fx.GraphModule, state: HookState, found: list) -> None:
    """Convert the original model again, with boundaries at the hooked paths, and take its graph (see module docstring)."""
    recipe = gm.__dict__.get(RECIPE_ATTR)
    if state.exported:
        raise _refusal(found, "it was traced with torch.export, which runs hooks once while tracing", exported=True,
                       failed_in=gm.__dict__.get(FX_FAILED_IN_ATTR))
    if recipe is None or recipe.model is None or recipe.build is None:
        raise _refusal(found, "the model it was converted from is not known to it (an unpickled converted module)")
    from amp_fx.graph_ops.outer_autocast import call_without_outer_autocast

    paths = frozenset(path for path, *_ in found) | frozenset(site.path for site in sites_of(gm))
    # as convert() would run at top level: not under the caller's no_grad, inference_mode or autocast
    with forcing_boundaries(paths), torch.inference_mode(False), torch.enable_grad():
        new = call_without_outer_autocast(recipe.build, recipe.model, **recipe.options)
    if new.__dict__.get(_ROUTE_ATTR) != "symbolic_trace":
        raise _refusal(found, "the model now converts by the torch.export route")
    placed = {site.path for site in sites_of(new)}
    recipe.unplaced.update(paths - placed)  # called only where no graph can hold a boundary: never rebuilt again
    _swap(gm, new)
    gm.amp_report = new.amp_report
    gm.amp_report.notes.append(
        f"rebuilt at a call after hooks were registered on {', '.join(sorted({repr(p) for p, *_ in found}))}: "
        "the graph has hook boundaries there now (the module's own parameters, buffers and hooks kept)")


def own_attribute(owner: Any, atom: str) -> Any:
    """``owner.atom`` from what a module holds itself (parameters, buffers, submodules, attributes), else None.

    Not ``getattr``: a converted module answers some names it lacks from the original model
    (converter/model_attributes.py), which a graph target must never resolve to.
    """
    if isinstance(owner, nn.Module):
        for store in (owner._parameters, owner._buffers, owner._modules, owner.__dict__):
            if atom in store:
                return store[atom]
        return None
    return getattr(owner, atom, None)


def lookup_target(owner: nn.Module, target: str) -> Any:
    """The object a graph's dotted ``get_attr`` / ``call_module`` target names in ``owner``, or None."""
    value: Any = owner
    for atom in target.split("."):
        value = own_attribute(value, atom)
        if value is None:
            return None
    return value


def _assign(owner: nn.Module, target: str, value: Any) -> None:
    *prefix, leaf = target.split(".")
    for atom in prefix:
        owner = own_attribute(owner, atom)
    if isinstance(value, nn.Module):
        owner._modules[leaf] = value
    elif isinstance(value, nn.Parameter):
        owner.register_parameter(leaf, value)
    elif isinstance(value, torch.Tensor) and leaf in owner._buffers:
        owner._buffers[leaf] = value
    else:
        setattr(owner, leaf, value)


def _fresh(target: str) -> bool:
    """Attributes made by the conversion itself: the new graph's own are taken."""
    return target.startswith(("_tensor_constant", *_OWN_PREFIXES))


def _swap(gm: fx.GraphModule, new: fx.GraphModule) -> None:
    """Give ``gm`` ``new``'s graph; every module, parameter and buffer it reads stays ``gm``'s own."""
    bodies = [g for g in graph_modules(new) if g is not new]
    for body in bodies:  # checkpointed regions call gm's leaf modules, not new's
        for node in body.graph.nodes:
            mine = lookup_target(gm, str(node.target)) if node.op == "call_module" else None
            if mine is not None:
                _assign(body, str(node.target), mine)
    for node in new.graph.nodes:
        if node.op not in ("get_attr", "call_module"):
            continue
        target = str(node.target)
        mine, theirs = lookup_target(gm, target), lookup_target(new, target)
        if mine is None or _fresh(target):
            _assign(gm, target, theirs)
        elif isinstance(theirs, torch.Tensor) and (not isinstance(mine, torch.Tensor) or mine.shape != theirs.shape
                                                   or mine.dtype != theirs.dtype):
            raise AmpRuntimeError(
                f"amp_fx: could not rebuild the converted module for a new hook: the model changed since conversion "
                f"({target!r} is {tuple(theirs.shape)} {theirs.dtype} in the model's conversion, "
                f"{getattr(mine, 'shape', None)} {getattr(mine, 'dtype', type(mine).__name__)} in this module). "
                "Convert the model again.")
    gm.graph = new.graph
