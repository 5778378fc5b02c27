"""Where the frame Dynamo is compiling sits in the compiled model, so module paths are full ones after a graph break.

A graph break inside a submodule makes Dynamo compile that submodule's
``forward`` (and its resume functions) as frames of their own.  Their
graphs name modules from the frame's own locals: ``L['self'].fc1`` in
``Layer.forward`` is ``fc1``, not ``encoder.layers.0.fc1``, and a resume
function may hold a module as a stack value (``L['___stack0']``, the
``head`` that was loaded before the call that broke).  A module policy
written with ``model.named_modules()``'s names would silently miss them.

The modules are real objects, though, and the Python stack at compile time
says whose call this frame runs inside: every ``nn.Module.__call__`` between
``torch.compile``'s entry (``compile_wrapper``) and the frame leaves a
``_call_impl`` frame whose ``self`` is that module.  The outermost one is the
model the compiled callable called (the module given to ``torch.compile``,
or the one a compiled function called); the innermost one is the module
whose ``forward`` this frame runs.  :func:`locate` finds each module a graph
names in that model by identity and returns its full path, so
:mod:`amp_fx.dynamo.graph` can write full paths and weight names.

The compiled callable's own frame (``forward(self)``, ``step(m, x)``, a
trainer method, a closure over the model) and its resume functions keep
:mod:`amp_fx.dynamo.graph`'s relative names, which are the model's names for
every calling style.  A nested frame whose modules cannot be found in the
model is :attr:`FramePlace.unknown`: the backend refuses module policies for
it rather than let them miss.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import weakref
from types import CodeType, FrameType
from typing import Any, Iterable, Optional

import torch.nn as nn

from amp_fx.dynamo.graph import ROOT_VARIABLE, STEP

__all__ = ["FramePlace", "Held", "locate", "guard_instance", "enclosing_modules"]

_RESUME = re.compile(r"^torch_dynamo_resume_in_(.+)_at_(\d+)$")
_LOCAL = re.compile(r"L\[\s*'([^']*)'\s*\]")  # a frame local: the one kind of expression guard_instance guards
_MODULE_FILE = nn.Module._call_impl.__code__.co_filename


@dataclasses.dataclass
class Held:
    """A module a nested frame's graph belongs to, and the model's other modules of its class.

    Dynamo guards a module by its class, not its identity (its weights are
    graph inputs), so it runs this frame's compiled graph for any of
    ``siblings`` too: ``encoder.layers.1`` reuses the graph compiled for
    ``encoder.layers.0``.
    """

    expression: Optional[str]  # the frame's local that holds it (L['self']); None when no local does
    path: str
    type: type
    siblings: tuple[str, ...]


@dataclasses.dataclass
class FramePlace:
    """The compiled frame's place in the model: full paths for the module expressions its graph uses."""

    frame: str  # "forward (model.py:12)"
    nested: bool  # not the compiled callable's own frame (or one of its resume functions)
    prefixes: dict[str, str]  # module expression (L['self'], L['___stack0']) -> its path in the model ('' = the model)
    frame_module: Optional[tuple[str, type]] = None  # the module whose forward this frame runs, when nested
    unknown: list[str] = dataclasses.field(default_factory=list)  # expressions naming modules the model does not hold
    model: Optional[type] = None  # the model's class
    held: list[Held] = dataclasses.field(default_factory=list)  # nested frames: the modules above, with their siblings


def _dynamo_frame() -> Optional[tuple[CodeType, dict, dict]]:
    """The code, locals and globals of the frame Dynamo is compiling now, or None outside a Dynamo compile."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
    except (ImportError, AttributeError):
        return None
    tx = getattr(getattr(tx, "output", None), "root_tx", None) or tx
    code, f_locals, f_globals = getattr(tx, "f_code", None), getattr(tx, "f_locals", None), getattr(tx, "f_globals", None)
    if not isinstance(code, CodeType) or not isinstance(f_locals, dict):
        return None
    return code, f_locals, f_globals if isinstance(f_globals, dict) else {}


def _is_entry(frame: FrameType) -> bool:
    """``torch.compile``'s wrapper of the compiled callable (torch/_dynamo/eval_frame.py ``compile_wrapper``)."""
    code = frame.f_code
    return code.co_name == "compile_wrapper" and code.co_filename.endswith(("_dynamo/eval_frame.py", "_dynamo\\eval_frame.py"))


def _calls_on_stack() -> tuple[list[nn.Module], Optional[FrameType]]:
    """The modules whose ``__call__`` runs between the innermost ``compile_wrapper`` and here (innermost first), and that wrapper."""
    calls: list[nn.Module] = []
    frame = sys._getframe(1)
    while frame is not None and not _is_entry(frame):
        code = frame.f_code
        # By name, not identity: a frame running code Dynamo compiled (model.compile()) has a new code object.
        if code.co_name == "_call_impl" and code.co_filename == _MODULE_FILE:
            module = frame.f_locals.get("self")
            if isinstance(module, nn.Module):
                calls.append(module)
        frame = frame.f_back
    return calls, frame


def _entry_callable(entry: Optional[FrameType]) -> tuple[Optional[list[CodeType]], list[nn.Module]]:
    """The code of the callable ``torch.compile`` wrapped (a module's: its ``forward`` too), and the modules it was called on or with."""
    if entry is None:
        return None, []
    f_locals = entry.f_locals
    fn = f_locals.get("fn")
    owner = getattr(fn, "__self__", None)
    codes = [getattr(getattr(fn, "__func__", fn), "__code__", None)]
    if isinstance(owner, nn.Module):  # torch.compile(model) wraps model.__call__: Dynamo compiles its forward
        codes.append(getattr(type(owner).forward, "__code__", None))
    values: Iterable[Any] = (owner, *(f_locals.get("args") or ()), *(f_locals.get("kwargs") or {}).values())
    return [c for c in codes if isinstance(c, CodeType)], [v for v in values if isinstance(v, nn.Module)]


def _evaluate(expression: str, f_locals: dict, f_globals: dict) -> Any:
    """The object a Dynamo source names (``L['self']._modules['fc1']``, ``G['model'].head``); None when unsure."""
    root = ROOT_VARIABLE.match(expression)
    if root is None:
        return None
    head = root.group(0)
    match = re.fullmatch(r"([LG])\[\s*'([^']*)'\s*\]", head)
    if match is None:
        return None
    scope = f_locals if match.group(1) == "L" else f_globals
    if match.group(2) not in scope:
        return None
    value = scope[match.group(2)]
    rest = expression[root.end():]
    position = 0
    for step in STEP.finditer(rest):
        if step.start() != position:  # something the steps do not cover (a call, an operator): unsure
            return None
        position = step.end()
        attr, key, key2, index = step.groups()
        try:
            value = getattr(value, attr) if attr is not None else value[int(index)] if index is not None else value[key if key is not None else key2]
        except (AttributeError, KeyError, IndexError, TypeError):
            return None
    return value if position == len(rest) else None


def _is_top(code: CodeType, entry_codes: Optional[list[CodeType]]) -> bool:
    """Whether ``code`` is the compiled callable's own frame or one of its resume functions."""
    if entry_codes is None:
        return True  # no torch.compile entry on the stack (the backend called directly): nothing to place
    resumed = _RESUME.match(code.co_name)
    return any(code is entry or (resumed is not None and resumed.group(1) == entry.co_name
                                 and code.co_filename == entry.co_filename and _holds_line(entry, int(resumed.group(2))))
               for entry in entry_codes)


def _holds_line(code: CodeType, line: int) -> bool:
    """Whether ``line`` is in ``code``: a resume function names its function and the line it resumes at,
    and two classes in one file both have a ``forward``."""
    lines = [start for _, _, start in code.co_lines() if start is not None]
    return bool(lines) and min(lines + [code.co_firstlineno]) <= line <= max(lines)


def locate(expressions: Iterable[str]) -> Optional[FramePlace]:
    """Place the frame Dynamo is compiling: the full path of each module ``expressions`` name (root expressions).

    None outside a Dynamo compile.  For a frame of a module called inside
    the compiled model, ``prefixes`` maps each expression to its module's
    path and ``frame_module`` is the module whose forward the frame runs.
    """
    found = _dynamo_frame()
    if found is None:
        return None
    code, f_locals, f_globals = found
    calls, entry = _calls_on_stack()
    entry_codes, entry_modules = _entry_callable(entry)
    where = f"{code.co_name} ({code.co_filename.rsplit('/', 1)[-1]}:{code.co_firstlineno})"
    # The model: the outermost module called under the entry; else one the compiled callable was called with.
    models = ([calls[-1]] if calls else []) + [m for m in entry_modules if not calls or m is not calls[-1]]
    names: dict[int, tuple[nn.Module, dict[int, str]]] = {}

    def path_of(module: Any) -> Optional[str]:
        return located(module)[0]

    def located(module: Any) -> tuple[Optional[str], tuple[str, ...]]:
        """The module's path in the first model that holds it, and that model's other modules of its class."""
        for model in models:
            if id(model) not in names:
                names[id(model)] = (model, {id(m): name for name, m in model.named_modules()})
            path = names[id(model)][1].get(id(module))
            if path is not None:
                siblings = tuple(name for name, m in model.named_modules() if type(m) is type(module) and m is not module)
                return path, siblings
        return None, ()

    def hold(expression: Optional[str], module: nn.Module) -> None:
        path, siblings = located(module)
        if path and all(h.path != path or h.expression != expression for h in place.held):
            place.held.append(Held(expression, path, type(module), siblings))

    place = FramePlace(where, nested=not _is_top(code, entry_codes), prefixes={},
                       model=type(models[0]) if models else None)
    for expression in dict.fromkeys(expressions):
        module = _evaluate(expression, f_locals, f_globals)
        path = path_of(module) if isinstance(module, nn.Module) else None
        if path is not None:
            place.prefixes[expression] = path
            if place.nested and _LOCAL.fullmatch(expression):
                hold(expression, module)
        elif place.nested:
            place.unknown.append(expression)
    if place.nested and calls:
        # The module whose forward (or a resume function of it, or a function it called) this frame runs.
        path = path_of(calls[0])
        if path is None:
            place.unknown.append(f"the module whose forward is {where} ({type(calls[0]).__name__})")
        elif path:
            place.frame_module = (path, type(calls[0]))
            holder = next((name for name, value in f_locals.items() if value is calls[0]), None)
            hold(f"L['{holder}']" if holder is not None else None, calls[0])
    # A nested frame with no module call on the stack is a function the compiled callable called: its own ops
    # are the model's top level, as they are in the callable's frame.
    return place


def guard_instance(expression: str) -> bool:
    """Make Dynamo reuse the graph being compiled only while the local ``expression`` holds the very same object.

    An ``ID_MATCH`` guard on the frame local (``L['self']``): Dynamo compiles
    the frame again for another instance.  False when ``expression`` is not
    a plain local or this torch cannot add the guard.
    """
    local = _LOCAL.fullmatch(expression)
    if local is None:
        return False
    try:
        from torch._dynamo.guards import GuardBuilder, install_guard
        from torch._dynamo.source import LocalSource

        install_guard(LocalSource(local.group(1)).make_guard(GuardBuilder.ID_MATCH))
    except (ImportError, AttributeError, TypeError, AssertionError, RuntimeError):
        return False
    return True


def enclosing_modules() -> Optional[list[tuple[str, type]]]:
    """``(path, type)`` of the modules whose ``forward`` runs at this point of a compiled call, innermost first.

    For an op that Dynamo runs eagerly (between graphs): the ``_call_impl``
    frames on the Python stack name its modules, and the compiled model (the
    outermost of them, or the module the compiled callable was called with)
    gives their ``model.named_modules()`` paths.  None when a module is not in
    that model or no compiled call is on the stack.
    """
    calls, entry = _calls_on_stack()
    if entry is None:
        return None
    _, entry_modules = _entry_callable(entry)
    models = ([calls[-1]] if calls else []) + [m for m in entry_modules if not calls or m is not calls[-1]]
    for model in models:
        names = _names_of(model)
        if all(id(module) in names for module in calls):
            return [(names[id(module)], type(module)) for module in calls]
    return None


_NAMES: "weakref.WeakKeyDictionary[nn.Module, dict[int, str]]" = weakref.WeakKeyDictionary()


def _names_of(model: nn.Module) -> dict[int, str]:
    """``id(module) -> path`` for every module of ``model`` (cached: module trees rarely change between calls)."""
    names = _NAMES.get(model)
    if names is None:
        names = {id(module): name for name, module in model.named_modules()}
        _NAMES[model] = names
    return names
