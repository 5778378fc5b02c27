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
  has no input for is refused, naming it; so is a constant bound into the
  graph that a call leaves out where forward's default differs.  Positional
  inputs past the conversion's ``example_inputs`` are matched to forward's
  names first (``gm(x, None)`` is ``gm(x, labels=None)``).

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
the graph in use).  Switching back recompiles the kept graph and traces
nothing; a build costs one conversion, once per key.

On the symbolic route the graph reads ``self.training`` at run time (the
flags are no part of the key), and the key is which of forward's optional
parameters (a ``None`` or scalar default) are graph inputs: those the
example inputs leave out are traced at their default
(:mod:`amp_fx.frontend.traced_defaults`), since fx alone traces each as a
Proxy, which is never ``None``.  A call that gives one at another value
(by name or position) runs a graph traced with it as an input; one that
leaves out an input the graph has runs a graph traced with it at its
default.  Where fx cannot trace such a graph (Python control flow on the
input), the call is refused with an :class:`AmpTypeError` naming the
input and the fix (give it in ``example_kwarg_inputs`` at conversion);
the refusal is remembered.  A build on this route traces only with fx
and takes the call's own inputs as its example inputs where the
conversion had examples.  Hook boundaries of the current graph are kept
in every graph built.

What makes a built graph one of the module's own (:func:`adopt_graph` and
its helpers, at the end of this module): it reads the module's parameters,
buffers and modules, its constants move over under names of their own, it
is traced from the flag-only copy of the model (:func:`flag_copy`) with the
call's inputs as example inputs (:func:`example_copies`), and the modules
torch.export leaves out get stand-ins (:func:`add_stand_ins`).
"""

from __future__ import annotations

import copy
import inspect
import weakref
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from amp_fx.errors import AmpRuntimeError, AmpTypeError
from amp_fx.converter.live_hooks import RECIPE_ATTR, lookup_target, own_attribute
from amp_fx.graph_ops.fp8_ops import Fp8GemmState
from amp_fx.frontend.export_route import split_constants
from amp_fx.frontend.module_hooks import forcing_boundaries, sites_of
from amp_fx.frontend.traced_defaults import is_default, optional_parameters, positional_names
from amp_fx.frontend.tracing import FX_FAILED_IN_ATTR, AmpTraceError, tracing_for
from amp_fx.frontend.train_flags import FROZEN_ATTR

__all__ = ["Specialisations", "attach_specialisations", "SPECS_ATTR", "UntraceableCallError", "adopt_graph", "add_stand_ins",
           "example_copies", "flag_copy", "module_at", "persistent_buffers"]


class UntraceableCallError(AmpTypeError):
    """fx cannot build a graph for the inputs this call gives: the converted module hands the call to the call route."""

SPECS_ATTR = "amp_fx_specialisations"  # in AMP_ATTRIBUTES: a deepcopy gets a fresh cache (see __deepcopy__)
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

    def __init__(self, gm: fx.GraphModule, model: nn.Module, example_inputs: tuple, example_kwarg_inputs: dict,
                 route: str, traced_defaults: dict):
        self.exported = route == "torch.export"
        frozen = gm.__dict__.get(FROZEN_ATTR) or {}
        # torch.export fixed every module's flag; the symbolic route reads them at run time (its branches warn)
        self.paths = tuple(frozen) if self.exported else ()
        self.positional = positional_names(model)
        self.defaults = optional_parameters(model)  # forward's parameters with a None or scalar default
        self.model_type = type(model).__name__
        if self.exported:
            tensors, constants = split_constants(model, example_kwarg_inputs)
            self.keywords = tuple(tensors)
            self.constants = constants  # bound into every graph: a call may repeat them
            self.optional, self.named, self.var_kw = _optional_keywords(model, self.keywords)
            self.n_args = len(example_inputs)  # the graph takes these by position, the rest by name
            present = self.keywords
        else:  # fx placeholders take what forward takes: the key is which optional parameters are graph inputs
            self.keywords = tuple(self.defaults)
            self.constants, self.optional, self.named, self.var_kw = {}, frozenset(self.keywords), frozenset(), True
            self.n_args = 0
            present = tuple(k for k in self.keywords if k not in traced_defaults)
        self.failed_in = str(gm.__dict__.get(FX_FAILED_IN_ATTR) or "")  # the torch.export route's hook advice
        # what every graph reads as the module's own: the model's parameters, buffers and modules, persistent state
        self.own = frozenset(n for n, _ in model.named_parameters(remove_duplicate=False)) | frozenset(
            n for n, _ in model.named_buffers(remove_duplicate=False)) | persistent_buffers(gm)
        self.modules = frozenset(p for p, _ in model.named_modules())
        self.current: _Key = (tuple(frozen[p][0] for p in self.paths), present)
        self.converted_key = self.current
        self.graphs: dict[_Key, _Graph] = {}
        self.failures: dict[_Key, str] = {}  # keys whose graph could not be built: refused again without a rebuild
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
    def select(self, gm: fx.GraphModule, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Install the graph this call needs; return the positional and keyword inputs to pass it."""
        if self.exported:
            args, kwargs = self._by_name(args, kwargs)
            positional = frozenset(self.positional[:len(args)])  # keyword inputs given by position (torch.export binds them)
            kwargs = self._keywords(kwargs, positional)
            present = tuple(k for k in self.keywords if k in kwargs or k in positional)
        else:
            present = self._given(args, kwargs)
        watched = self._watched(gm)
        root = gm.training
        key = (tuple(root if m is None else m.training for m in watched), present)
        if self.graph is not gm.__dict__.get("_graph"):  # first call, a deepcopy's first, or a rebuild for new hooks
            if self.graph is not None:  # live_hooks rebuilt the graph from the conversion's inputs: the others are stale
                self.graphs, self.current = {}, self.converted_key
            self.graph = gm.__dict__.get("_graph")
            self.graphs[self.current] = _Graph(self.graph, gm.__dict__.get("amp_report"), gm.__dict__.get(FROZEN_ATTR))
        if key != self.current:
            self._switch(gm, key, args, kwargs)
        return args, kwargs

    def _given(self, args: tuple, kwargs: dict) -> tuple[str, ...]:
        """Symbolic route: forward's optional parameters this call gives at a value other than their default."""
        given = set()
        for name, value in zip(self.positional, args):
            if name in self.defaults and not is_default(value, self.defaults[name]):
                given.add(name)
        for name, value in kwargs.items():
            if name in self.defaults and not is_default(value, self.defaults[name]):
                given.add(name)
        return tuple(k for k in self.keywords if k in given) if given else ()

    def _by_name(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """torch.export route: positional inputs past those the conversion gave by position, passed by name."""
        if len(args) <= self.n_args:
            return args, kwargs
        names = self.positional[self.n_args:len(args)]
        if len(names) < len(args) - self.n_args or any(name in kwargs for name in names):
            return args, kwargs  # more than forward names, or given twice: the call fails as the model's would
        return args[:self.n_args], {**dict(zip(names, args[self.n_args:])), **kwargs}

    def _keywords(self, kwargs: dict, positional: frozenset = frozenset()) -> dict:
        """torch.export route: the call's keyword inputs with omitted ones (``None``, defaults) and repeated constants dropped; refuse the others."""
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
            elif name in self.defaults and is_default(value, self.defaults[name]):
                continue  # forward's default: what torch.export traced with, leaving it out
            elif name not in self.named and not self.var_kw:
                raise AmpTypeError(
                    f"amp_fx: {self.model_type}.forward takes no keyword input {name!r} (it takes "
                    f"{', '.join(sorted(self.named)) or 'none'}).")
            elif value is not None:
                raise AmpTypeError(
                    f"amp_fx: keyword input {name!r} was not among example_kwarg_inputs at conversion "
                    f"({', '.join(self.keywords) or 'none'}), so the converted graph has no input for it. "
                    f"Convert with example_kwarg_inputs={{..., {name!r}: <an example>}}.")
        for name, bound in self.constants.items():  # a constant left out: the graph runs it, the model its default
            default = self.defaults.get(name)
            if name not in kwargs and name not in positional and default is not None and not is_default(bound, default):
                raise AmpTypeError(
                    f"amp_fx: {name}={bound!r} was given at conversion and is bound into the converted graph; this "
                    f"call leaves {name!r} out, where {self.model_type}.forward runs its default {name}={default!r}. "
                    f"Pass {name}={bound!r}, or convert without {name!r} in example_kwarg_inputs for such calls.")
        missing = [k for k in self.keywords if k not in kept and k not in positional and k not in self.optional]
        if missing:
            raise AmpTypeError(
                f"amp_fx: the converted {self.model_type} needs keyword input {missing[0]!r}: the model's forward "
                "has no default for it.")
        return kept

    def _watched(self, gm: fx.GraphModule) -> list:
        """The module at each path (None where the graph holds no state of one: it follows the root), found once."""
        if self._modules_of is None or self._modules_of[0]() is not gm:
            self._modules_of = (weakref.ref(gm), [module_at(gm, path) for path in self.paths])
        return self._modules_of[1]

    # -- switching ------------------------------------------------------------------------------
    def _switch(self, gm: fx.GraphModule, key: _Key, args: tuple, kwargs: dict) -> None:
        entry = self.graphs.get(key)
        built = entry is None
        if built:
            if key in self.failures:  # refused before: no second conversion to find that out
                raise UntraceableCallError(self.failures[key])
            entry = _build_eagerly(self, gm, key, args, kwargs)
            self.graphs[key] = entry
        gm.graph = entry.graph  # recompiles forward from the kept graph
        if built:
            entry.graph.lint()  # every attribute it reads is this module's
        gm.amp_report = entry.report
        gm.__dict__[FROZEN_ATTR] = entry.frozen
        self.current, self.graph = key, entry.graph

    def _build(self, gm: fx.GraphModule, key: _Key, args: tuple, kwargs: dict) -> _Graph:
        """Convert the model again for ``key``'s flags and keyword inputs; keep its graph, on ``gm``'s own state."""
        recipe = gm.__dict__.get(RECIPE_ATTR)
        model = recipe.model if recipe is not None and recipe.build is not None else None
        flags, present = key
        want = _describe(self.exported, self.paths, flags, present, self.keywords)
        if model is None:
            raise AmpRuntimeError(
                f"amp_fx: this module needs a graph for {want}, and the model it was converted from is not known "
                "to it (an unpickled copy). Convert the model in that mode / with those inputs.")
        from amp_fx.graph_ops.outer_autocast import call_without_outer_autocast

        source = flag_copy(model, {}) if self.paths else model  # symbolic: the model itself, whose hooks stay live
        for path, flag in zip(self.paths, flags):
            try:
                (source.get_submodule(path) if path else source).training = flag
            except AttributeError:
                continue
        options = dict(recipe.options)
        if self.exported:  # the conversion's examples, less the keyword inputs this call leaves out
            examples = dict(options.get("example_kwarg_inputs") or {})
            options["example_kwarg_inputs"] = {k: v for k, v in examples.items() if k in present or k not in self.keywords}
            route = tracing_for("torch.export", failed_in=self.failed_in)
        else:
            if options.get("example_inputs") is not None or options.get("example_kwarg_inputs"):
                # this call's inputs are the examples (dtypes as the conversion's: checked): they hold each input it gives
                options["example_inputs"], options["example_kwarg_inputs"] = example_copies(args), example_copies(kwargs) or None
            route = tracing_for("symbolic_trace", inputs=present)
        sites = frozenset(site.path for site in sites_of(gm))  # hook boundaries the current graph has, kept
        # as convert() runs at top level: not under the caller's no_grad, inference_mode or autocast
        with torch.inference_mode(False), torch.enable_grad(), route, forcing_boundaries(sites):
            try:
                new = call_without_outer_autocast(recipe.build, source, **options)
            except AmpTraceError as error:
                if self.exported:
                    raise AmpRuntimeError(f"amp_fx: could not build this module's graph for {want}: {error}") from error
                self.failures[key] = self._untraceable(present, error)
                raise UntraceableCallError(self.failures[key]) from error
            except Exception as error:
                raise AmpRuntimeError(f"amp_fx: could not build this module's graph for {want}: "
                                      f"{type(error).__name__}: {error}") from error
        self.renamed = adopt_graph(gm, new, self.own, self.modules, self.renamed)
        report = new.amp_report
        report.notes.append(f"graph for {want}, built at its first call (amp_fx/converter/specialisations.py)")
        return _Graph(new.graph, report, new.__dict__.get(FROZEN_ATTR))

    def _untraceable(self, present: tuple[str, ...], error: BaseException) -> str:
        """The refusal of a call whose inputs fx cannot trace as graph inputs (symbolic route)."""
        reason = str(error).splitlines()[0].replace("symbolic_trace failed: ", "")
        new = [k for k in present if k not in self.converted_key[1]]
        if not new:  # the call leaves out an input the conversion traced as one, because fx could not do without it
            left_out = [k for k in self.converted_key[1] if k not in present] or list(self.keywords)
            return (f"amp_fx: this call leaves out {', '.join(repr(k) for k in left_out)}, and fx cannot trace "
                    f"{self.model_type} with {'it' if len(left_out) == 1 else 'them'} at the default ({reason}); the "
                    f"converted graph takes {'it' if len(left_out) == 1 else 'them'} as an input: pass "
                    f"{', '.join(f'{k}=...' for k in left_out)}.")
        name = new[0]
        return (f"amp_fx: {self.model_type} was converted with {name!r} traced at its default "
                f"({name}={self.defaults.get(name)!r}: not in the example inputs), and this call gives it; fx cannot "
                f"trace {name!r} as a graph input ({reason}). "
                f"Give it at conversion: amp_fx.convert(model, ..., example_kwarg_inputs={{..., {name!r}: <a value "
                "like this call's>}), which traces the model with torch.export, specialised to that value where "
                "forward branches on it.")



def _same(value: Any, constant: Any) -> bool:
    try:
        return bool(value == constant)
    except Exception:  # an object without a plain ==
        return value is constant


def _describe(exported: bool, paths: tuple[str, ...], flags: tuple[bool, ...], present: tuple[str, ...],
              keywords: tuple[str, ...]) -> str:
    if not exported:  # symbolic route: flags are read at run time; the key is which optional inputs are given
        if present:
            return f"the calls giving {', '.join(present)} (its other optional inputs at their defaults)"
        return "the calls leaving every optional input at its default"
    modes = set(flags)
    if not modes:
        mode = "the calls"
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


def attach_specialisations(gm: fx.GraphModule, model: nn.Module, route: str, example_inputs: Optional[tuple],
                           example_kwarg_inputs: Optional[dict], traced_defaults: Optional[dict] = None) -> None:
    """Give a converted module its keys (see module docstring), where it has any."""
    if route == "torch.export":
        add_stand_ins(gm, model)
    specs = Specialisations(gm, model, tuple(example_inputs or ()), dict(example_kwarg_inputs or {}), route,
                            dict(traced_defaults or {}))
    if specs.exported or specs.keywords:
        gm.__dict__[SPECS_ATTR] = specs


# -- a built graph made the module's own ------------------------------------------------
@torch.compiler.disable
def _build_eagerly(specs: "Specialisations", gm: fx.GraphModule, key: Any, args: tuple, kwargs: dict) -> "_Graph":
    """``specs._build``, run eagerly under ``torch.compile(gm)``: Dynamo would otherwise trace the conversion op
    by op (several graphs and graph breaks, tens of seconds for GPT-2) at the first call in a new mode."""
    return specs._build(gm, key, args, kwargs)


def adopt_graph(gm: fx.GraphModule, new: fx.GraphModule, own: frozenset, modules: frozenset, renamed: int) -> int:
    """Point ``new``'s graph at ``gm``'s own parameters, buffers and modules; move its constants over.

    ``own`` names the state every graph shares (the model's parameters and buffers, persistent
    buffers), ``modules`` the model's module paths; a constant of ``new`` whose name another graph
    already uses gets a name of its own, counted on from ``renamed``.  Returns the new count.
    """
    for node in list(new.graph.nodes):
        if node.op not in ("get_attr", "call_module"):
            continue
        target = str(node.target)
        mine, theirs = lookup_target(gm, target), lookup_target(new, target)
        if target in own or (node.op == "call_module" and target in modules):
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
        if isinstance(mine, Fp8GemmState) and isinstance(theirs, Fp8GemmState):
            continue  # an fp8 GEMM's scales and amax history are the conversion's: one per GEMM, every graph's
        if mine is theirs or (mine is not None and not isinstance(mine, (torch.Tensor, nn.Module))):
            continue  # the same object, or a plain attribute (a flag)
        if mine is not None:  # a constant of the same name in another graph: this one gets its own name
            renamed += 1
            target = f"_amp_fx_mode{renamed}_{target.replace('.', '_')}"
            node.target = target
        _assign(gm, target, theirs)
    return renamed


def persistent_buffers(module: nn.Module) -> frozenset:
    """Names of ``module``'s persistent buffers (state a pass added, such as fp8 scales, is shared by every graph)."""
    return frozenset(f"{path}.{name}" if path else name for path, m in module.named_modules()
                     for name in m._buffers if name not in m._non_persistent_buffers_set)


def module_at(gm: nn.Module, path: str) -> Optional[nn.Module]:
    """``gm``'s module at ``path``, or None where it has none (torch.export keeps only modules holding state)."""
    module: Optional[nn.Module] = gm
    for atom in path.split(".") if path else ():
        module = module._modules.get(atom) if module is not None else None
    return module


def flag_copy(module: nn.Module, memo: dict[int, nn.Module]) -> nn.Module:
    """A copy of ``module``'s tree with its own flags and containers, the same parameter and buffer tensors."""
    if id(module) in memo:
        return memo[id(module)]
    clone = copy.copy(module)
    memo[id(module)] = clone
    for key, value in module.__dict__.items():
        if isinstance(value, (dict, list, set)):  # _parameters, _buffers, hook dicts: new containers, same tensors
            clone.__dict__[key] = copy.copy(value)
    clone.__dict__["_modules"] = type(module._modules)(
        (name, None if child is None else flag_copy(child, memo)) for name, child in module._modules.items())
    return clone


def example_copies(values: Any) -> Any:
    """A call's inputs as example inputs for a build: detached; inference tensors cloned (fake tensors refuse them)."""
    def detach(t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone() if t.is_inference() else t.detach()

    return pytree.tree_map_only(torch.Tensor, detach, values)


def _assign(owner: nn.Module, target: str, value: Any) -> None:
    *prefix, leaf = target.split(".")
    for atom in prefix:
        child = own_attribute(owner, atom)
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


def add_stand_ins(gm: nn.Module, model: nn.Module) -> None:
    """Give ``gm`` a module at every path of ``model`` that torch.export left out (those holding no state).

    torch.export keeps only the modules that hold parameters or buffers, so
    ``gm.apply(lambda m: m.eval() if isinstance(m, nn.Dropout) else None)``
    would find no Dropout and change nothing, silently.  Each stand-in is a
    copy of the model's module (its type, attributes and flag) with empty
    containers: it holds no state and no hooks of the model's, and the
    graph never calls it; its flag is part of the key.
    """
    for path, module in model.named_modules():
        if not path or module_at(gm, path) is not None:
            continue
        parent_path, _, name = path.rpartition(".")
        parent = module_at(gm, parent_path)
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
