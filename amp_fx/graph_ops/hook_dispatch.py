"""Run a module's hooks at run time as ``torch.nn.Module._call_impl`` does, split at a graph's hook boundary.

A converted graph inlines a hooked module's ``forward`` between two nodes
(:mod:`amp_fx.frontend.module_hooks`): :func:`enter` runs where eager would
run the forward pre-hooks, :func:`leave` where it would run the forward
hooks.  Between them a :class:`Frame` carries what ``_call_impl`` keeps in
local variables: the arguments the forward got (after pre-hooks replaced
them and ``BackwardHook`` wrapped them), the ``BackwardHook`` itself, and
which ``always_call`` hooks already ran.

The rules are ``_call_impl``'s (torch 2.13), in its order:

1. full backward hooks and backward pre-hooks are read first;
2. forward pre-hooks run in registration order; one registered
   ``with_kwargs=True`` gets ``(module, args, kwargs)`` and may return
   ``(new_args, new_kwargs)``; another gets ``(module, args)`` and may
   return new args (a non-tuple is wrapped in a 1-tuple);
3. if there are backward hooks, ``BackwardHook.setup_input_hook`` wraps the
   positional tensors;
4. after the forward, forward hooks run in registration order with
   ``(module, args, output)`` or ``(module, args, kwargs, output)``; a
   non-None result replaces the output;
5. ``BackwardHook.setup_output_hook`` wraps the output;
6. if the forward (or a hook) raises, ``always_call=True`` forward hooks
   that have not run yet run with the output so far, their own errors
   turned into warnings (:func:`unwind`, called by the converted module).

Hooks are read live from the modules at each call (removing a hook removes
its effect), from up to two modules per boundary -- the original model's
module and the converted module's module at the same path -- merged in
handle-id order (``RemovableHandle`` ids are global and increasing, so that
is registration order), and each hook is handed the module it was
registered on.  Deprecated non-full backward hooks are refused.
"""

from __future__ import annotations

import heapq
import threading
import warnings
from operator import itemgetter
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn as nn
from torch.utils.hooks import BackwardHook

from amp_fx.graph_ops.master_sync import sync_parameters_of
from amp_fx.errors import AmpRuntimeError, AmpWarning, UnsupportedConstructError

__all__ = ["Frame", "enter", "leave", "unwind", "open_depth", "call_with_hooks", "user_hooks", "has_user_hooks",
           "refuse_non_full_backward_hooks", "hook_name", "global_hooks", "refuse_global_hooks", "COMPUTATION_HOOKS",
           "HOOK_DICTS", "HookWarning"]


class HookWarning(AmpWarning):
    """A warning ``_call_impl`` gives about a module's hooks, given with torch's own text by the converted module."""

# The dicts that hold a module's hooks (the *_with_kwargs / always_called dicts only flag their ids).
HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks")


def _computation_hook_types() -> tuple[type, ...]:
    from torch.nn.utils.prune import BasePruningMethod
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    return (WeightNorm, SpectralNorm, BasePruningMethod)


# Pre-hooks that compute a module's weight from other parameters (weight_norm, spectral_norm,
# pruning): part of what the module computes, so they are traced into the graph (or run with a
# leaf module), never dispatched as hooks.
COMPUTATION_HOOKS = _computation_hook_types()
_LOCAL = threading.local()


def user_hooks(module: nn.Module, attr: str) -> list[tuple[int, Callable]]:
    """(handle id, hook) of ``module``'s hooks in dict ``attr``, in order, without computation hooks."""
    hooks = module.__dict__.get(attr)
    if not hooks:
        return []
    return [(key, hook) for key, hook in hooks.items() if not isinstance(hook, COMPUTATION_HOOKS)]


def has_user_hooks(module: nn.Module) -> bool:
    """True when ``module`` has a forward (pre-)hook, a backward hook or a backward pre-hook (computation hooks aside)."""
    return any(user_hooks(module, attr) for attr in HOOK_DICTS)


def refuse_non_full_backward_hooks(module: nn.Module, path: str, error: type = AmpRuntimeError) -> None:
    """Refuse the deprecated ``register_backward_hook`` (its gradients depend on the module's last autograd op)."""
    if module.__dict__.get("_backward_hooks") and module.__dict__.get("_is_full_backward_hook") is False:
        hooks = ", ".join(hook_name(h) for h in module._backward_hooks.values())
        name = f"module {path!r}" if path else "the root module"
        message = (f"{name} ({type(module).__name__}) has a backward hook registered with the deprecated "
                   f"register_backward_hook ({hooks}): its grad_input depends on which op the module ran last, and "
                   "amp_fx changes the ops around it (casts). Register it with module.register_full_backward_hook "
                   "(the same hook signature; torch recommends it), which amp_fx keeps on every route.")
        raise error(message, construct="register_backward_hook", where="") if error is UnsupportedConstructError \
            else error(message)


def hook_name(hook: Any) -> str:
    """The name an error gives a hook: its qualified name, or its class's."""
    return getattr(hook, "__qualname__", None) or getattr(type(hook), "__qualname__", repr(hook))


def _merged(modules: Sequence[nn.Module], attr: str) -> list[tuple[int, Callable, nn.Module]]:
    """The hooks of ``modules`` in dict ``attr`` as (id, hook, owner), merged by handle id."""
    lists = [[(key, hook, m) for key, hook in user_hooks(m, attr)] for m in modules]
    lists = [hooks for hooks in lists if hooks]
    if len(lists) <= 1:
        return lists[0] if lists else []
    return list(heapq.merge(*lists, key=itemgetter(0)))


class _Bound:
    """A backward hook called with the module it was registered on (BackwardHook passes one module for all)."""

    def __init__(self, hook: Callable, owner: nn.Module):
        self.hook, self.owner = hook, owner

    def __call__(self, module: nn.Module, *rest: Any) -> Any:
        return self.hook(self.owner, *rest)


class Frame:
    """What ``_call_impl`` keeps between a module's pre-hooks and its forward hooks."""

    __slots__ = ("modules", "args", "kwargs", "bw_hook", "called", "result")

    def __init__(self, modules: list[nn.Module]):
        self.modules = modules
        self.args: Any = ()
        self.kwargs: Any = {}
        self.bw_hook: Optional[BackwardHook] = None
        self.called: set[int] = set()
        self.result: Any = None


def _open_frames() -> list[Frame]:
    frames = getattr(_LOCAL, "frames", None)
    if frames is None:
        frames = _LOCAL.frames = []
    return frames


def open_depth() -> int:
    """How many boundaries are open on this thread (:func:`unwind` closes those opened after this count)."""
    return len(_open_frames())


def enter(modules: list[nn.Module], path: str, args: tuple, kwargs: dict) -> tuple[Frame, tuple, dict, bool]:
    """Steps 1-3 for ``modules``' hooks; returns the frame, the args and kwargs the forward gets, and whether any changed."""
    for module in modules:
        refuse_non_full_backward_hooks(module, path)
    frame = Frame(modules)
    frame.args, frame.kwargs = args, kwargs
    _open_frames().append(frame)  # open before the pre-hooks: an error in one runs the always_call hooks too
    changed = False
    backward_pre = _merged(modules, "_backward_pre_hooks")
    backward = _merged(modules, "_backward_hooks")
    for key, hook, owner in _merged(modules, "_forward_pre_hooks"):
        if key in owner._forward_pre_hooks_with_kwargs:
            result = hook(owner, args, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise AmpRuntimeError(  # torch's own message (a RuntimeError in eager too)
                        f"forward pre-hook must return None or a tuple of (new_args, new_kwargs), but got {result}.")
                args, kwargs = frame.args, frame.kwargs = result
                changed = True
        else:
            result = hook(owner, args)
            if result is not None:
                args = frame.args = result if isinstance(result, tuple) else (result,)
                changed = True
    sync_parameters_of(modules)  # O2: a pre-hook that wrote a master in place (amp_fx/graph_ops/master_sync.py)
    if backward or backward_pre:
        frame.bw_hook = BackwardHook(modules[0], [_Bound(h, o) for _, h, o in backward],
                                     [_Bound(h, o) for _, h, o in backward_pre])
        args = frame.args = frame.bw_hook.setup_input_hook(args)
        changed = True
    return frame, args, kwargs, changed


def leave(frame: Frame, result: Any) -> tuple[Any, bool]:
    """Steps 4-5: the forward hooks on ``result``; returns the output and whether it changed."""
    changed = False
    frame.result = result
    for key, hook, owner in _merged(frame.modules, "_forward_hooks"):
        if key in owner._forward_hooks_always_called:
            frame.called.add(key)
        if key in owner._forward_hooks_with_kwargs:
            replaced = hook(owner, frame.args, frame.kwargs, result)
        else:
            replaced = hook(owner, frame.args, result)
        if replaced is not None:
            result = frame.result = replaced
            changed = True
    if frame.bw_hook is not None:
        if not isinstance(result, (torch.Tensor, tuple)):
            warnings.warn("For backward hooks to be called, module output should be a Tensor or a tuple of Tensors"
                          f" but received {type(result)}", HookWarning, stacklevel=3)
        result = frame.bw_hook.setup_output_hook(result)
        changed = True
    _close(frame)
    return result, changed


def _close(frame: Frame) -> None:
    frames = _open_frames()
    if frames and frames[-1] is frame:
        frames.pop()
    elif frame in frames:
        frames.remove(frame)


def unwind(depth: int) -> None:
    """Step 6 after an error: run the pending ``always_call`` hooks of the boundaries opened since ``depth``, innermost first."""
    frames = _open_frames()
    pending, frames[depth:] = frames[depth:], []
    for frame in reversed(pending):
        for key, hook, owner in _merged(frame.modules, "_forward_hooks"):
            if key not in owner._forward_hooks_always_called or key in frame.called:
                continue
            try:
                if key in owner._forward_hooks_with_kwargs:
                    replaced = hook(owner, frame.args, frame.kwargs, frame.result)
                else:
                    replaced = hook(owner, frame.args, frame.result)
                if replaced is not None:
                    frame.result = replaced
            except Exception as error:  # as _call_impl: the forward's error is the one raised
                warnings.warn("module forward hook with ``always_call=True`` raised an exception that was silenced as "
                              f"another error was raised in forward: {error}", HookWarning, stacklevel=2)


def call_with_hooks(modules: list[nn.Module], path: str, call: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """Run ``call(*args, **kwargs)`` with ``modules``' hooks around it (the converted module's root)."""
    depth = open_depth()
    try:
        frame, args, kwargs, _ = enter(modules, path, args, kwargs)
        return leave(frame, call(*args, **kwargs))[0]
    except Exception:
        unwind(depth)
        raise


_GLOBAL_HOOKS = (
    ("_global_forward_pre_hooks", "register_module_forward_pre_hook"),
    ("_global_forward_hooks", "register_module_forward_hook"),
    ("_global_backward_hooks", "register_module_full_backward_hook"),
    ("_global_backward_pre_hooks", "register_module_full_backward_pre_hook"),
)


def global_hooks() -> list[str]:
    """The kinds of global module hooks registered now (``torch.nn.modules.module.register_module_*_hook``)."""
    from torch.nn.modules import module as nn_module

    return [f"torch.nn.modules.module.{register} ({len(getattr(nn_module, attr))})"
            for attr, register in _GLOBAL_HOOKS if getattr(nn_module, attr)]


def refuse_global_hooks(when: str, error: type = UnsupportedConstructError) -> None:
    """Refuse global module hooks: they run on every module call, and a converted graph calls few modules."""
    found = global_hooks()
    if not found:
        return
    message = (f"amp_fx: global module hooks are registered ({', '.join(found)}) {when}. They run on every module "
               "call, and a converted module inlines most of its modules into its graph, so they would fire for a "
               "few modules only. Remove them while the converted module runs (handle.remove()), register them on "
               "the modules instead (module.register_forward_hook and the like are kept by convert), or use "
               "torch.compile(model, backend='amp_fx'), which keeps global hooks.")
    if error is UnsupportedConstructError:
        raise error(message, construct="global module hooks", where="")
    raise error(message)
