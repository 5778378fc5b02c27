"""What crosses a module hook boundary: the traced values by slot, the constants, and the checks on what hooks return.

A hooked module's call is flattened (``pytree``) into positions
(:mod:`amp_fx.frontend.module_hooks`).  A position the caller filled with a
traced value holds a *slot*: one per distinct traced value (fx node), so a
module called ``blk(x, x)`` gets one value at both positions and its
``forward`` sees ``a is b`` while tracing and at run time, as in eager.  Any
other position holds a constant fixed in the graph at conversion.

At run time a hook may replace what the module gets (forward pre-hooks, and
torch's ``BackwardHook``, which wraps each positional tensor) or returns
(forward hooks, ``BackwardHook`` on the output).  :func:`check_replacement`
takes the replacement only where the graph can: a traced value in each slot
(one object for all positions of a slot, distinct objects in distinct slots:
the identity the body was traced with), each constant equal to the traced
one.  Anything else is an :class:`~amp_fx.errors.AmpRuntimeError` saying
which position, what the graph fixed there and what to do.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from amp_fx.errors import AmpRuntimeError

__all__ = ["slots_of", "join", "per_slot", "check_replacement"]

# Python values whose identity means nothing (``is`` on them depends on interning): only their value is checked.
_SCALARS = (int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device)


def slots_of(leaves: Sequence[Any]) -> tuple[tuple[Optional[int], ...], list, list[fx.Proxy]]:
    """(slot per position, constant per position, one proxy per slot): positions with the same fx node share a slot."""
    slots: list[Optional[int]] = []
    constants: list = []
    unique: list[fx.Proxy] = []
    index: dict[fx.Node, int] = {}
    for value in leaves:
        if isinstance(value, fx.Proxy):
            if value.node not in index:
                index[value.node] = len(unique)
                unique.append(value)
            slots.append(index[value.node])
            constants.append(None)
        else:
            slots.append(None)
            constants.append(value)
    return tuple(slots), constants, unique


def join(slots: Sequence[Optional[int]], constants: Sequence[Any], values: Sequence[Any]) -> list:
    """The positions' values: each slot's value where traced, the constant elsewhere."""
    return [values[s] if s is not None else c for s, c in zip(slots, constants)]


def per_slot(leaves: Sequence[Any], slots: Sequence[Optional[int]]) -> list:
    """One value per slot (the first position's: :func:`check_replacement` made them one object)."""
    found: dict[int, Any] = {}
    for value, slot in zip(leaves, slots):
        if slot is not None and slot not in found:
            found[slot] = value
    return [found[s] for s in range(len(found))]


def check_replacement(value: Any, spec: pytree.TreeSpec, old: Sequence[Any], slots: Sequence[Optional[int]],
                      what: str, path: str, wrapped: bool) -> list[Any]:
    """Flatten ``value`` (what the hooks left) as ``spec``; refuse what the graph cannot take (see module docstring).

    ``old``: the positions' values before the hooks; ``wrapped``: torch's
    ``BackwardHook`` wrapped the tensors (a full backward hook is registered).
    """
    try:
        new = spec.flatten_up_to(value)
    except Exception as error:  # any mismatch pytree reports
        raise _error(what, path, f"a value of another structure ({error})", _KEEP) from error
    for i, (before, after) in enumerate(zip(old, new)):
        if slots[i] is not None:
            if isinstance(before, torch.Tensor) != isinstance(after, torch.Tensor):
                raise _error(what, path, f"{type(after).__name__} in place of {type(before).__name__} at "
                             f"{_position(spec, i, what)}", _KEEP)
        elif after is not before and not _equal(after, before):
            raise _constant_error(what, path, spec, i, before, after)
    _check_identity(new, old, slots, spec, what, path, wrapped)
    return list(new)


def _check_identity(new: Sequence[Any], old: Sequence[Any], slots: Sequence[Optional[int]], spec: pytree.TreeSpec,
                    what: str, path: str, wrapped: bool) -> None:
    """One object per slot, a different one per slot (and per constant object): the identity the body was traced with."""
    groups: dict[tuple, list[int]] = {}
    for i, slot in enumerate(slots):
        key = ("slot", slot) if slot is not None else ("constant", id(old[i]))
        if slot is not None or not isinstance(old[i], _SCALARS):
            groups.setdefault(key, []).append(i)
    owner: dict[int, tuple] = {}
    for key, positions in groups.items():
        first = new[positions[0]]
        for i in positions[1:]:
            other = new[i]
            same = other is first or (isinstance(first, _SCALARS) and type(other) is type(first) and other == first)
            if not same:
                raise _identity_error(what, path, spec, positions[0], i, wrapped, broken=True)
        if isinstance(first, _SCALARS):
            continue
        earlier = owner.setdefault(id(first), key)
        if earlier != key:
            raise _identity_error(what, path, spec, groups[earlier][0], positions[0], wrapped, broken=False)


def _equal(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # a comparison that does not give a bool (a tensor of several elements): not equal
        return False


def _position(spec: pytree.TreeSpec, index: int, what: str) -> str:
    """``positional argument 1``, ``keyword argument 'bias'``, ``output[0]``: where leaf ``index`` sits."""
    try:
        paths, _ = pytree.tree_flatten_with_path(pytree.tree_unflatten(list(range(spec.num_leaves)), spec))
        keys = paths[index][0]
    except Exception:  # a container pytree cannot describe: the flat index
        return f"position {index}"
    if what == "output":
        return f"output{pytree.keystr(keys)}" if keys else "the output"
    if len(keys) >= 2 and getattr(keys[0], "idx", None) == 0:
        return f"positional argument {keys[1].idx}{pytree.keystr(keys[2:])}"
    if len(keys) >= 2 and getattr(keys[0], "idx", None) == 1:
        return f"keyword argument {keys[1].key!r}{pytree.keystr(keys[2:])}"
    return f"position {index}"


_KEEP = "Keep the structure in the hook (the same containers, a tensor where there was one)"
_BACKEND = "or use torch.compile(model, backend='amp_fx'), which traces the hooks' results"


def _hooks(what: str) -> str:
    return "forward pre-hooks" if what == "input" else "forward hooks"


def _error(what: str, path: str, detail: str, fix: str) -> AmpRuntimeError:
    return AmpRuntimeError(
        f"amp_fx: the {_hooks(what)} of module {path!r} gave its {what} {detail}. The converted graph was traced with "
        f"the {what} the module had at conversion and can take only tensors in the same places. {fix}, {_BACKEND}.")


def _constant_error(what: str, path: str, spec: pytree.TreeSpec, i: int, before: Any, after: Any) -> AmpRuntimeError:
    where = _position(spec, i, what)
    if isinstance(before, torch.Tensor):
        shown = f"a tensor of shape {tuple(before.shape)}"
        why = ("that tensor was made without reading any input of the model (such as torch.ones(8) in the calling "
               "forward), so fx kept it in the graph as a constant: the graph has no input there to take another "
               "tensor")
        fix = (f"Make the {'caller' if what == 'input' else 'module'} compute it from an input (x.new_ones(8), "
               "torch.ones(8, device=x.device)) or register it as a buffer, so that it is a traced value the hook can "
               "replace; converting again with the hook registered does not help (hooks do not run while fx traces)")
    else:
        shown = f"the Python value {before!r}"
        why = "fx fixed that value in the graph (only tensors and values computed from the model's inputs pass through it)"
        fix = ("Return the value the module got from its caller there, pass it as a tensor computed from an input, or "
               "change it in the caller")
    return AmpRuntimeError(
        f"amp_fx: the {_hooks(what)} of module {path!r} replaced its {what} at {where}, which was a constant when the "
        f"model was converted ({shown}, not a graph value), by {_short(after)}: {why}. {fix}; {_BACKEND}.")


def _identity_error(what: str, path: str, spec: pytree.TreeSpec, i: int, j: int, wrapped: bool,
                    broken: bool) -> AmpRuntimeError:
    a, b = _position(spec, i, what), _position(spec, j, what)
    if broken:
        detail = (f"broke the identity of its {what}: different objects at {a} and {b}, which held one object "
                  "when traced (the same value twice, as in blk(x, x))")
    else:
        detail = f"made an identity in its {what}: one object at {a} and {b}, which held different objects when traced"
    fix = ("Keep the identity in the hook (return the same object where the module got one, distinct objects "
           "where it got distinct ones), or call the module with the arguments you mean it to compare")
    cause = ""
    if wrapped and broken:
        cause = (" (a full backward hook is registered and the tensors need gradients: torch's BackwardHook wraps "
                 f"each {'positional' if what == 'input' else 'output'} tensor separately, so eager's "
                 f"{'forward' if what == 'input' else 'caller'} gets distinct tensors)")
        fix = ("Register the full backward hook on a module that gets the tensor once (its parent, or the "
               "submodules it calls), or call the module with distinct tensors if that is what forward should see")
    return AmpRuntimeError(
        f"amp_fx: the {_hooks(what) if not wrapped else 'hooks'} of module {path!r} {detail}{cause}. "
        f"The converted graph was traced with the identity of the {what} at conversion (a forward that checks "
        f"`a is b` took that branch) and would compute another branch than eager. {fix}; {_BACKEND}.")


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
