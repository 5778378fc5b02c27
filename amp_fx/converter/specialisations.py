"""One converted module, several graphs: one per train/eval mode and per set of keyword inputs a call gives.

torch.export (the route transformers models take) specialises a graph to
the train/eval flag of every module (dropout on or off, batch norm's
statistics updated or read) and to the keyword inputs of the example
(``labels`` present: the graph computes the loss).  A converted module
keeps one such graph per *key* -- (the flags of the model's modules, the
keyword inputs present) -- and ``AmpGraphModule.__call__`` picks the one
the call needs:

- ``.train()`` / ``.eval()`` (on the converted module or any submodule)
  change the flags; the next call runs the graph for the new flags.
- A keyword input given at conversion may be left out (or passed as
  ``None``) where the model's forward lets a caller omit it (it has a
  default, or forward takes ``**kwargs``): the call runs a graph traced
  without it, so a GPT-2 converted with ``labels`` returns logits and no
  loss when called without them, as the model does.  A keyword the graph
  has no input for is refused, naming it.

A key's graph is built at its first call (lazily: a module only ever
trained never pays for an eval trace): ``convert()`` runs again, from the
original model with the conversion's own arguments and example inputs (less
the omitted keywords), on a flag-only copy of the model (its modules'
``training`` set to the key's; parameters and buffers the model's own
tensors; the model's flags never change).  Only the new *graph* is kept:
every parameter and buffer it reads is the converted module's own (one set
of weights, masters, statistics and hook sites for all graphs; a batch
norm's running statistics updated by the train graph are read by the eval
graph); the constants torch.export made for it are added under names of
their own.  Each graph keeps its report (``amp_report`` is the report of
the graph in use).  Switching back is a recompile of the kept graph
(milliseconds); a build costs one conversion (about a second for a tiny
GPT-2, once per key).

On the symbolic route the graph reads ``self.training`` at run time (the
flags are no part of the key), and its placeholders take whatever forward
takes; a keyword input given at conversion whose default is None is the
only key there: a call that leaves it out runs a graph traced with it
``None`` (fx's ``concrete_args``), since fx alone would keep the branch
``labels is not None`` takes.  Hook boundaries of the current graph are
kept in every graph built.
"""

from __future__ import annotations

import copy
import inspect
import weakref
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn as nn

from amp_fx.errors import AmpRuntimeError, AmpTypeError
from amp_fx.frontend.export_route import split_constants
from amp_fx.frontend.module_hooks import forcing_boundaries, sites_of
from amp_fx.frontend.tracing import omitting_keywords
from amp_fx.frontend.train_flags import FROZEN_ATTR

__all__ = ["Specialisations", "attach_specialisations", "SPECS_ATTR"]

SPECS_ATTR = "amp_fx_specialisations"  # in AMP_ATTRIBUTES: a deepcopy gets a fresh cache (see __deepcopy__)
_RECIPE_ATTR = "amp_fx_recipe"  # amp_fx/converter/live_hooks.py
_Key = tuple[tuple[bool, ...], tuple[str, ...]]


class _Graph:
    """One specialisation: its graph, its report and the flags it was traced with."""

    __slots__ = ("graph", "report", "frozen")

    def __init__(self, graph: fx.Graph, report: Any, frozen: Optional[dict]):
        self.graph, self.report, self.frozen = graph, report, frozen


def _optional_keywords(model: nn.Module, keywords: tuple[str, ...]) -> tuple[frozenset, frozenset, bool]:
    """(keywords a caller may omit, keywords forward names, whether it takes ``**kwargs``)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return frozenset(), frozenset(), True
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    named = frozenset(name for name, p in params.items()
                      if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL))
    optional = frozenset(k for k in keywords if (k in params and params[k].default is not inspect.Parameter.empty)
                         or (k not in params and var_kw))
    return optional, named, var_kw


class Specialisations:
    """The keys of one converted module (see module docstring) and the graphs built for them."""

    def __init__(self, gm: fx.GraphModule, model: nn.Module, example_kwarg_inputs: dict, route: str):
        self.exported = route == "torch.export"
        frozen = gm.__dict__.get(FROZEN_ATTR) or {}
        # torch.export fixed every module's flag; the symbolic route reads them at run time (its branches warn)
        self.paths = tuple(frozen) if self.exported else ()
        tensors, constants = split_constants(model, example_kwarg_inputs)
        self.keywords = tuple(tensors)
        self.constants = constants if self.exported else {}  # bound into every graph: a call may repeat them
        self.optional, self.named, self.var_kw = _optional_keywords(model, self.keywords)
        self.positional = _positional_names(model)
        if not self.exported:  # fx placeholders take any keyword forward names; only a None default can be traced as None
            self.keywords = tuple(k for k in self.keywords if k in self.optional and _default(model, k) is None)
            self.optional = frozenset(self.keywords)
        self.model_type = type(model).__name__
        # what every graph reads as the module's own: the model's parameters, buffers and modules, persistent state
        self.own = frozenset(n for n, _ in model.named_parameters(remove_duplicate=False)) | frozenset(
            n for n, _ in model.named_buffers(remove_duplicate=False)) | _persistent_buffers(gm)
        self.modules = frozenset(p for p, _ in model.named_modules())
        self.current: _Key = (tuple(frozen[p][0] for p in self.paths), self.keywords)
        self.converted_key = self.current
        self.graphs: dict[_Key, _Graph] = {}
        self.graph: Optional[fx.Graph] = None  # the graph installed for ``current``
        self.renamed = 0
        self._modules_of: Optional[tuple[weakref.ref, list]] = None

    def __deepcopy__(self, memo: dict) -> "Specialisations":
        fresh = copy.copy(self)  # the copy's graph is its own: it builds its other graphs itself
        fresh.graphs, fresh.graph, fresh._modules_of = {}, None, None
        return fresh

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)  # pickled (symbolic route): the graphs are rebuilt, the module looked up again
        state.update(graphs={}, graph=None, _modules_of=None)
        return state

    # -- per call ---------------------------------------------------------------------------
    def select(self, gm: fx.GraphModule, args: tuple, kwargs: dict) -> dict:
        """Install the graph this call needs; return the keyword inputs to pass it."""
        positional = frozenset(self.positional[:len(args)])  # keyword inputs given by position (torch.export binds them)
        kwargs = self._keywords(kwargs, positional)
        present = tuple(k for k in self.keywords if k in kwargs or k in positional)
        watched = self._watched(gm)
        root = gm.training
        key = (tuple(root if m is None else m.training for m in watched), present)
        if self.graph is not gm.__dict__.get("_graph"):  # first call, a deepcopy's first, or a rebuild for new hooks
            if self.graph is not None:  # live_hooks rebuilt the graph from the conversion's inputs: the others are stale
                self.graphs, self.current = {}, self.converted_key
            self.graph = gm.__dict__.get("_graph")
            self.graphs[self.current] = _Graph(self.graph, gm.__dict__.get("amp_report"), gm.__dict__.get(FROZEN_ATTR))
        if key != self.current:
            self._switch(gm, key)
        return kwargs

    def _keywords(self, kwargs: dict, positional: frozenset = frozenset()) -> dict:
        """The call's keyword inputs with omitted ones (``None``) and repeated constants dropped; refuse the others."""
        if not self.exported:  # the graph's placeholders take what forward takes: only omissions matter
            return {k: v for k, v in kwargs.items() if not (v is None and k in self.optional)}
        kept = {}
        for name, value in kwargs.items():
            if name in self.keywords:
                if value is None and name in self.optional:
                    continue
                kept[name] = value
            elif name in self.constants and _same(value, self.constants[name]):
                continue  # bound into the graph already
            elif name in self.constants:
                raise AmpTypeError(
                    f"amp_fx: {name}={value!r} differs from the value the module was converted with "
                    f"({name}={self.constants[name]!r}), which is bound into its graph. Convert with "
                    f"example_kwarg_inputs={{..., {name!r}: {value!r}}} for calls with that value.")
            elif name not in self.named and not self.var_kw:
                raise AmpTypeError(
                    f"amp_fx: {self.model_type}.forward takes no keyword input {name!r} (it takes "
                    f"{', '.join(sorted(self.named)) or 'none'}).")
            elif value is not None:
                raise AmpTypeError(
                    f"amp_fx: keyword input {name!r} was not among example_kwarg_inputs at conversion "
                    f"({', '.join(self.keywords) or 'none'}), so the converted graph has no input for it. "
                    f"Convert with example_kwarg_inputs={{..., {name!r}: <an example>}}.")
        missing = [k for k in self.keywords if k not in kept and k not in positional and k not in self.optional]
        if missing:
            raise AmpTypeError(
                f"amp_fx: the converted {self.model_type} needs keyword input {missing[0]!r}: the model's forward "
                "has no default for it.")
        return kept

    def _watched(self, gm: fx.GraphModule) -> list:
        """The module at each path (None where the graph holds no state of one: it follows the root), found once."""
        if self._modules_of is None or self._modules_of[0]() is not gm:
            self._modules_of = (weakref.ref(gm), [_module_at(gm, path) for path in self.paths])
        return self._modules_of[1]

    # -- switching ------------------------------------------------------------------------------
    def _switch(self, gm: fx.GraphModule, key: _Key) -> None:
        entry = self.graphs.get(key)
        built = entry is None
        if built:
            entry = self._build(gm, key)
            self.graphs[key] = entry
        gm.graph = entry.graph  # recompiles forward from the kept graph
        if built:
            entry.graph.lint()  # every attribute it reads is this module's
        gm.amp_report = entry.report
        gm.__dict__[FROZEN_ATTR] = entry.frozen
        self.current, self.graph = key, entry.graph

    def _build(self, gm: fx.GraphModule, key: _Key) -> _Graph:
        """Convert the model again for ``key``'s flags and keyword inputs; keep its graph, on ``gm``'s own state."""
        recipe = gm.__dict__.get(_RECIPE_ATTR)
        model = recipe.model if recipe is not None else None
        flags, present = key
        want = _describe(self.paths, flags, present, self.keywords)
        if model is None:
            raise AmpRuntimeError(
                f"amp_fx: this module needs a graph for {want}, and the model it was converted from is not known "
                "to it (an unpickled copy). Convert the model in that mode / with those inputs.")
        from amp_fx.converter.api import convert
        from amp_fx.graph_ops.outer_autocast import call_without_outer_autocast

        source = _flag_copy(model, {}) if self.paths else model  # symbolic: the model itself, whose hooks stay live
        for path, flag in zip(self.paths, flags):
            try:
                (source.get_submodule(path) if path else source).training = flag
            except AttributeError:
                continue
        options = dict(recipe.options)
        examples = dict(options.get("example_kwarg_inputs") or {})
        options["example_kwarg_inputs"] = {k: v for k, v in examples.items() if k in present or k not in self.keywords}
        omitted = [k for k in self.keywords if k not in present]
        sites = frozenset(site.path for site in sites_of(gm))  # hook boundaries the current graph has, kept
        # as convert() runs at top level: not under the caller's no_grad, inference_mode or autocast
        with torch.inference_mode(False), torch.enable_grad(), omitting_keywords(omitted), forcing_boundaries(sites):
            try:
                new = call_without_outer_autocast(convert, source, **options)
            except Exception as error:
                raise AmpRuntimeError(f"amp_fx: could not build this module's graph for {want}: "
                                      f"{type(error).__name__}: {error}") from error
        self._adopt(gm, new)
        report = new.amp_report
        report.notes.append(f"graph for {want}, built at its first call (amp_fx/converter/specialisations.py)")
        return _Graph(new.graph, report, new.__dict__.get(FROZEN_ATTR))

    def _adopt(self, gm: fx.GraphModule, new: fx.GraphModule) -> None:
        """Point ``new``'s graph at ``gm``'s own parameters, buffers and modules; move its constants over."""
        for node in list(new.graph.nodes):
            if node.op not in ("get_attr", "call_module"):
                continue
            target = str(node.target)
            mine, theirs = _lookup(gm, target), _lookup(new, target)
            if target in self.own or (node.op == "call_module" and target in self.modules):
                if mine is None:
                    _assign(gm, target, theirs)
                elif isinstance(theirs, torch.Tensor) and (not isinstance(mine, torch.Tensor) or mine.shape != theirs.shape
                                                           or mine.dtype != theirs.dtype):
                    raise AmpRuntimeError(
                        f"amp_fx: the graph built for another mode reads {target!r} as {tuple(theirs.shape)} "
                        f"{theirs.dtype}, but this module holds {getattr(mine, 'shape', None)} "
                        f"{getattr(mine, 'dtype', type(mine).__name__)} there: the model changed since conversion. "
                        "Convert the model again.")
                continue
            if mine is theirs or (mine is not None and not isinstance(mine, (torch.Tensor, nn.Module))):
                continue  # the same object, or a plain attribute (a flag)
            if mine is not None:  # a constant of the same name in another graph: this one gets its own name
                self.renamed += 1
                target = f"_amp_fx_mode{self.renamed}_{target.replace('.', '_')}"
                node.target = target
            _assign(gm, target, theirs)


def _positional_names(model: nn.Module) -> tuple[str, ...]:
    """forward's parameters a caller may give by position, in order."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return ()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(name for name, p in params.items() if p.kind in kinds)


def _default(model: nn.Module, name: str) -> Any:
    try:
        return inspect.signature(model.forward).parameters[name].default
    except (TypeError, ValueError, KeyError):
        return inspect.Parameter.empty


def _same(value: Any, constant: Any) -> bool:
    try:
        return bool(value == constant)
    except Exception:  # an object without a plain ==
        return value is constant


def _persistent_buffers(module: nn.Module) -> frozenset:
    """Names of ``module``'s persistent buffers (state a pass added, such as fp8 scales, is shared by every graph)."""
    return frozenset(f"{path}.{name}" if path else name for path, m in module.named_modules()
                     for name in m._buffers if name not in m._non_persistent_buffers_set)


def _module_at(gm: nn.Module, path: str) -> Optional[nn.Module]:
    """``gm``'s module at ``path``, or None where it has none (torch.export keeps only modules holding state)."""
    module: Optional[nn.Module] = gm
    for atom in path.split(".") if path else ():
        module = module._modules.get(atom) if module is not None else None
    return module


def _flag_copy(module: nn.Module, memo: dict[int, nn.Module]) -> nn.Module:
    """A copy of ``module``'s tree with its own flags and containers, the same parameter and buffer tensors."""
    if id(module) in memo:
        return memo[id(module)]
    clone = copy.copy(module)
    memo[id(module)] = clone
    for key, value in module.__dict__.items():
        if isinstance(value, (dict, list, set)):  # _parameters, _buffers, hook dicts: new containers, same tensors
            clone.__dict__[key] = copy.copy(value)
    clone.__dict__["_modules"] = type(module._modules)(
        (name, None if child is None else _flag_copy(child, memo)) for name, child in module._modules.items())
    return clone


def _describe(paths: tuple[str, ...], flags: tuple[bool, ...], present: tuple[str, ...], keywords: tuple[str, ...]) -> str:
    modes = set(flags)
    if not modes:
        mode = "the calls"  # symbolic route: flags are read at run time
    elif len(modes) == 1:
        mode = "train mode" if True in modes else "eval mode"
    else:  # name the modules whose flag differs from the root's
        root = dict(zip(paths, flags)).get("", flags[0])
        others = [p for p, f in zip(paths, flags) if f != root]
        shown = ", ".join(others[:4]) + (f" and {len(others) - 4} more" if len(others) > 4 else "")
        mode = f"{'train' if root else 'eval'} mode with {shown} in {'eval' if root else 'train'} mode"
    omitted = [k for k in keywords if k not in present]
    given = [k for k in keywords if k in present]
    if omitted:
        return f"{mode} without {', '.join(omitted)}"
    return mode if modes else f"the calls with {', '.join(given)}"


def _lookup(owner: nn.Module, target: str) -> Any:
    value: Any = owner
    for atom in target.split("."):
        value = getattr(value, atom, None)
        if value is None:
            return None
    return value


def _assign(owner: nn.Module, target: str, value: Any) -> None:
    *prefix, leaf = target.split(".")
    for atom in prefix:
        child = getattr(owner, atom, None)
        if child is None:
            child = nn.Module()
            owner.add_module(atom, child)
        owner = child
    if isinstance(value, nn.Module):
        owner._modules[leaf] = value
    elif isinstance(value, nn.Parameter):
        owner.register_parameter(leaf, value)
    elif isinstance(value, torch.Tensor):
        owner.register_buffer(leaf, value, persistent=False)  # a constant of one graph: not the model's state
    else:
        setattr(owner, leaf, value)


def _add_stand_ins(gm: nn.Module, model: nn.Module) -> None:
    """Give ``gm`` a module at every path of ``model`` that torch.export left out (those holding no state).

    torch.export keeps only the modules that hold parameters or buffers, so
    ``gm.apply(lambda m: m.eval() if isinstance(m, nn.Dropout) else None)``
    would find no Dropout and change nothing, silently.  Each stand-in is a
    copy of the model's module (its type, attributes and flag) with empty
    containers: it holds no state and no hooks of the model's, and the
    graph never calls it; its flag is part of the key.
    """
    for path, module in model.named_modules():
        if not path or _module_at(gm, path) is not None:
            continue
        parent_path, _, name = path.rpartition(".")
        parent = _module_at(gm, parent_path)
        if parent is None:
            continue
        stand_in = copy.copy(module)
        for key, value in module.__dict__.items():
            if isinstance(value, (dict, set)):  # parameters, buffers, submodules, hook dicts: its own, empty
                stand_in.__dict__[key] = type(value)()
        parent._modules[name] = stand_in
        order = list(model.get_submodule(parent_path)._modules) if parent_path else list(model._modules)
        children = parent._modules  # the model's order, then whatever else the trace added (its guards)
        ordered = sorted(children.items(), key=lambda item: order.index(item[0]) if item[0] in order else len(order))
        children.clear()
        children.update(ordered)


def attach_specialisations(gm: fx.GraphModule, model: nn.Module, route: str, example_kwarg_inputs: Optional[dict]) -> None:
    """Give a converted module its keys (see module docstring), where it has any."""
    if route == "torch.export":
        _add_stand_ins(gm, model)
    specs = Specialisations(gm, model, dict(example_kwarg_inputs or {}), route)
    if specs.exported or specs.keywords:
        gm.__dict__[SPECS_ATTR] = specs
