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

This module traces the boundaries into a graph (:func:`trace_hooked_call`);
the boundary targets and sites are :mod:`amp_fx.frontend.hook_sites`, and
finding and binding the sites of a converted module's graphs is
:mod:`amp_fx.frontend.hook_graphs` (all importable from here too).

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
from typing import Any, Callable, Iterator, Optional

import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from amp_fx.errors import UnsupportedConstructError
from amp_fx.frontend.hook_graphs import bind_sites, graph_modules, is_boundary, sites_of
from amp_fx.frontend.hook_sites import BOUNDARY_OPS, VALUE_OP, HookBoundary, HookSite, boundary_named, module_hook_value
from amp_fx.frontend.hook_structure import join, slots_of
from amp_fx.graph_ops.hook_dispatch import COMPUTATION_HOOKS, has_user_hooks, refuse_non_full_backward_hooks

__all__ = ["HookSite", "HookBoundary", "module_hook_value", "trace_hooked_call", "bind_sites", "sites_of",
           "is_boundary", "graph_modules", "forcing_boundaries", "forced_boundaries", "BOUNDARY_OPS", "VALUE_OP", "ORIGINALS_ATTR", "CALLED_ATTR"]

# On a traced graph: path -> weak reference to the original model's module there (the tracer's map).
ORIGINALS_ATTR = "_amp_fx_hook_originals"
CALLED_ATTR = "_amp_fx_called_paths"  # on a traced graph: the paths of every module forward called
_FORCED: contextvars.ContextVar[frozenset] = contextvars.ContextVar("amp_fx_forced_boundaries", default=frozenset())


def __getattr__(name: str) -> Any:
    """Resolve ``hook_<kind>__<uid>[__<payload>]``, the import name fx writes for a pickled boundary (HOME)."""
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
