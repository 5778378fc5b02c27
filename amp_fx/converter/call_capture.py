"""Capture from the real call: the route ``convert()`` takes where no whole graph of the model exists.

Symbolic tracing and ``torch.export`` capture forward once, ahead of time, as
one graph.  A forward with data-dependent control flow (``nonzero()``), Python
state (an attribute set in forward), a device branch (``if x.is_cuda``), a
shape ``assert`` or an opaque ``autograd.Function`` has no such graph, yet runs
eagerly, and ``torch.autocast`` runs it.  Here the model's own forward runs at
each call through Dynamo with amp_fx's own backend (``inner="eager"``: no
compiler): Dynamo splits the program into graphs at what it cannot capture,
guards each graph and captures again for new shapes, Python numbers and
keyword arguments, and every graph gets the decisions ``convert()`` would give
it.  So calls keep their Python meaning.

The result is a shallow copy of the model (its class, its own module objects
and flags, the model's parameter and buffer tensors) whose instance ``forward``
is the captured call: the library that holds the model keeps working on it
(``config``, ``generate()``, ``save_pretrained``, a diffusers pipeline), and
where that library calls ``self(...)`` the call runs mixed precision.

* O0 captures nothing: the copy runs the model's forward unchanged.
* O1 shares the model's parameters; each graph casts them once per forward.
* O2/O3 give the copy low-precision copies of the floating parameters (at O2
  those of normalisation modules stay fp32, ``keep_batchnorm_fp32``), with the
  model's fp32 parameters as masters (O2) as on the fx route; floating inputs
  are cast low at entry and floating outputs back to fp32.  The model's
  buffers are shared and stay fp32: the graphs cast them where they are read.

The Dynamo backend comes from the layer above (:mod:`amp_fx.dynamo`, installed
by ``amp_fx/__init__.py`` through :func:`provide_backend`): the converter layer
cannot import it.
"""

from __future__ import annotations

import copy
import functools
import inspect
import types
import weakref
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from amp_fx.converter.graph_module import (ROUTE_ATTR, _load_sources, _restore_source_dtypes, _shallow_clone,
                                           attach_masters)
from amp_fx.converter.live_hooks import RECIPE_ATTR
from amp_fx.converter.model_attributes import captured_routes
from amp_fx.graph_ops.master_sync import sync_masters
from amp_fx.ir.config import AmpConfig
from amp_fx.ir.policy import Policy
from amp_fx.errors import PACKAGE, AmpRuntimeError

__all__ = ["CALL_ROUTE", "CapturedReport", "capture_from_call", "call_route", "method_of", "provide_backend", "is_captured"]

CALL_ROUTE = "dynamo"  # the route name reports and ``amp_fx_route`` give this route
_CAPTURED_ATTR = "_amp_fx_captured_call"  # on the copy: its CapturedCall (None at O0)

_backend_factory: Optional[Callable[..., Any]] = None


def provide_backend(factory: Callable[..., Any]) -> None:
    """Install the factory that builds amp_fx's Dynamo backend (``amp_fx.backend``); called once by ``amp_fx``."""
    global _backend_factory
    _backend_factory = factory


class CapturedReport:
    """The report of a module captured from its calls: the route, why, and every Dynamo graph and break so far.

    ``graphs`` and ``breaks`` grow as calls bring new shapes and types; ``compiled``
    is the backend's :class:`~amp_fx.dynamo.report.CompiledReport` (None at O0).
    ``count``, ``nodes`` and ``totals()`` add every graph up, as on that report.
    """

    def __init__(self, level: str, dtype: str, why: str, compiled: Any = None, notes: Optional[list[str]] = None):
        self.level, self.dtype, self.route = level, dtype, CALL_ROUTE
        self.trace_failure = why  # the whole-graph capture's error, verbatim
        self.compiled = compiled
        self.notes = list(notes or ())

    @property
    def graphs(self) -> list:
        return list(self.compiled.graphs) if self.compiled is not None else []

    @property
    def breaks(self) -> list:
        return list(self.compiled.breaks) if self.compiled is not None else []

    @property
    def nodes(self) -> list:
        return self.compiled.nodes if self.compiled is not None else []

    def count(self, decision: str) -> int:
        return self.compiled.count(decision) if self.compiled is not None else 0

    def totals(self) -> dict[str, Any]:
        return self.compiled.totals() if self.compiled is not None else {"graphs": 0}

    def __str__(self) -> str:
        lines = [f"amp_fx conversion: level {self.level}, dtype {self.dtype}, captured from the call with Dynamo "
                 f"({len(self.graphs)} graphs, {len(self.breaks)} breaks so far)",
                 "  whole-graph capture failed: " + self.trace_failure.replace("\n", "\n    ")]
        lines.extend(f"  note: {note}" for note in self.notes)
        if self.compiled is not None:
            lines.append("  " + str(self.compiled).replace("\n", "\n  "))
        return "\n".join(lines)

    __repr__ = __str__


def _is_norm(module: nn.Module) -> bool:
    # torch's and the libraries' normalisation modules (BatchNorm2d, LayerNorm, GroupNorm, LlamaRMSNorm, ...)
    return any("Norm" in cls.__name__ for cls in type(module).__mro__ if cls not in (nn.Module, object))


def _own_low_parameters(clone: nn.Module, config: AmpConfig) -> dict[str, torch.dtype]:
    """Replace the clone's floating parameters by low copies (not a norm's under keep_batchnorm_fp32); their old dtypes."""
    low: dict[int, nn.Parameter] = {}
    source_dtypes: dict[str, torch.dtype] = {}
    for path, module in clone.named_modules(remove_duplicate=False):
        if config.keep_batchnorm_fp32 and _is_norm(module):
            continue
        for name, param in list(module._parameters.items()):
            if param is None or not param.is_floating_point() or param.dtype in (torch.float64, config.low_dtype):
                continue
            if id(param) not in low:  # a tied weight keeps one low copy
                low[id(param)] = nn.Parameter(param.detach().to(config.low_dtype), requires_grad=param.requires_grad)
            module._parameters[name] = low[id(param)]
            source_dtypes[f"{path}.{name}" if path else name] = param.dtype
    return source_dtypes


def _cast_floats(tree: Any, dtype: Optional[torch.dtype], only: Optional[torch.dtype] = None) -> Any:
    """``tree`` with each floating tensor cast to ``dtype`` (only those of dtype ``only`` when given)."""
    if dtype is None:
        return tree

    def cast(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype and value.dtype != torch.float64:
            if only is None or value.dtype == only:
                return value.to(dtype)
        return value

    return pytree.tree_map(cast, tree)


def _between_graphs(args: Any, kwargs: Any, dtype: torch.dtype) -> Any:
    """At O1, what Dynamo leaves eager between its graphs runs under ``torch.autocast``: as the graphs, ops decided.

    Each graph disables this outer autocast while it runs (it holds its own casts), so only the code between
    graphs (a graph break's own op, a Function Dynamo does not capture) is decided by autocast's tables; without
    it that code would run fp32, or fail on a low value meeting an fp32 weight.
    """
    devices = {leaf.device.type for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)}
    device = "cuda" if "cuda" in devices else next(iter(devices), "cpu")
    return torch.autocast(device, dtype=dtype)


class CapturedCall:
    """The copy's ``forward``: the model's own forward run through Dynamo with amp_fx's backend."""

    def __init__(self, module: nn.Module, forward: Callable, backend: Any, config: AmpConfig):
        self.module_ref = module  # (the copy holds this object: a plain reference keeps the pair together)
        self.backend = backend
        self.compiled = torch.compile(forward, backend=backend)
        self.entry_dtype = config.low_dtype if config.cast_params else None
        self.low_dtype, self.exit_dtype = config.low_dtype, config.cast_model_outputs
        self.between_graphs = config.level == "O1"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        sync_masters(self.module_ref)  # O2: masters written in place since the last call
        args, kwargs = _cast_floats((args, kwargs), self.entry_dtype)
        if self.between_graphs:
            with _between_graphs(args, kwargs, self.low_dtype):
                result = self.compiled(*args, **kwargs)
        else:
            result = self.compiled(*args, **kwargs)
        # The graphs keep their outputs as computed (low where autocast has them low); the call's own outputs
        # leave as the level says (fp32), as convert()'s graph does.
        return _cast_floats(result, self.exit_dtype, only=self.low_dtype)


def _own_code(function: Callable) -> Callable:
    """``function`` with a code object of its own (same body, globals, defaults and closure).

    Dynamo keeps its compiled graphs, and counts its recompile limit, per code object: with the class's own
    ``forward`` every conversion of one class would share them, and from the limit on (8 conversions) each new one
    would run eagerly, graphless.  Its own code object gives each conversion its own cache.
    """
    if not isinstance(function, types.FunctionType):
        return function
    own = types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                             function.__defaults__, function.__closure__)
    own.__kwdefaults__ = function.__kwdefaults__
    own.__qualname__, own.__module__, own.__doc__ = function.__qualname__, function.__module__, function.__doc__
    own.__dict__.update(function.__dict__)
    return own


def _save_pretrained(clone: nn.Module, model: nn.Module, save_directory: Any, **kwargs: Any) -> Any:
    """The copy's ``save_pretrained``: the model's own, writing the copy's weights in the model's dtypes.

    Saved by the copy itself, a library reads the dtype of the low parameters (O2/O3): Hugging Face writes
    ``"dtype": "bfloat16"`` into config.json, so ``from_pretrained`` loads a bf16 model, and into the config
    object the copy shares with the model, which ``convert`` must not change.  The copy's ``state_dict`` holds
    the model's dtypes (fp32 masters at O2), so the model writes it.
    """
    if "state_dict" in inspect.signature(model.save_pretrained).parameters:
        kwargs.setdefault("state_dict", clone.state_dict())
        return model.save_pretrained(save_directory, **kwargs)
    if clone.amp_config.cast_params and not clone.amp_config.master_weights:  # O3: only the copy holds the weights
        holder = copy.deepcopy(model)
        holder.load_state_dict(clone.state_dict())
        return holder.save_pretrained(save_directory, **kwargs)
    return model.save_pretrained(save_directory, **kwargs)  # O0-O2: the model's parameters are the weights


def _backend_for(config: AmpConfig, policy: Policy) -> Any:
    """amp_fx's Dynamo backend deciding each graph as ``config``'s level does, compiling nothing (inner eager)."""
    if _backend_factory is None:
        raise AmpRuntimeError(f"{PACKAGE}: the Dynamo backend was not installed; import amp_fx, not its submodules alone")
    # Each graph's outputs stay as computed (cast_model_outputs=False): a value passed from one graph to the next
    # keeps the dtype it has under autocast; the call casts its own outputs (CapturedCall).  At O2/O3 the graphs
    # run all low (norms and losses fp32 as the level keeps them) on the copy's low parameters.
    return _backend_factory(level="O1", dtype=config.low_dtype, policy=policy, inner="eager", op_mode=config.op_mode,
                            keep_batchnorm_fp32=config.keep_batchnorm_fp32, keep_losses_fp32=config.keep_losses_fp32,
                            cast_model_outputs=False, minimize_casts=config.minimize_casts, pad_gemm=config.pad_gemm,
                            on_unknown_op=config.on_unknown_op, allow_banned=config.allow_banned)


def capture_from_call(model: nn.Module, config: AmpConfig, policy: Policy, why: str,
                      parameters_from: Optional[nn.Module] = None) -> nn.Module:
    """A copy of ``model`` whose forward runs captured from the call at ``config``'s level (see the module docstring).

    ``why``: the whole-graph capture's error, kept in the report.  ``parameters_from``: a converted
    module whose parameters the copy shares (an fx-route module handing a call it cannot serve here).
    """
    clone = _shallow_clone(model, {})
    dtype = str(config.low_dtype).replace("torch.", "") if config.level != "O0" else "float32"
    notes = []
    if parameters_from is not None:
        owned = dict(parameters_from.named_parameters(remove_duplicate=False))
        for path, module in clone.named_modules(remove_duplicate=False):
            for name in list(module._parameters):
                key = f"{path}.{name}" if path else name
                if key in owned:
                    module._parameters[name] = owned[key]
        source_dtypes = dict(getattr(parameters_from, "amp_fx_source_dtypes", {}) or {})
    elif config.cast_params:
        source_dtypes = _own_low_parameters(clone, config)
    else:
        source_dtypes = {}
    compiled_report = None
    if config.level == "O0":
        notes.append("O0: the model's own forward runs unchanged; nothing is captured")
        clone.__dict__[_CAPTURED_ATTR] = None
    else:
        backend = _backend_for(config, policy)
        own_forward = model.__dict__.get("forward") or _own_code(type(model).forward).__get__(clone)
        call = CapturedCall(clone, own_forward, backend, config)
        clone.__dict__["forward"] = call
        clone.__dict__[_CAPTURED_ATTR] = call
        compiled_report = backend.report
        if config.cast_params:
            notes.append("the model's buffers are shared and stay in their dtype; each graph casts them where read")
    if callable(getattr(type(model), "save_pretrained", None)):  # a Hugging Face or diffusers model
        clone.__dict__["save_pretrained"] = functools.partial(_save_pretrained, clone, model)
    clone.amp_report = CapturedReport(config.level, dtype, why, compiled_report, notes)
    clone.amp_config = config
    clone.__dict__[ROUTE_ATTR] = CALL_ROUTE
    clone.amp_fx_source_dtypes = source_dtypes
    if source_dtypes:
        if config.master_weights:
            attach_masters(clone, dict(model.named_parameters(remove_duplicate=False)))
        clone._register_state_dict_hook(_restore_source_dtypes)
        clone._register_load_state_dict_pre_hook(_load_sources, with_module=True)
    return clone


# converted GraphModule -> the captured copy that serves the calls its graph cannot (out of its __dict__: a
# deepcopy or pickle of the module does not take the copy's compiled code along; a copy builds its own)
_CALL_ROUTES: "weakref.WeakKeyDictionary[nn.Module, nn.Module]" = weakref.WeakKeyDictionary()


def call_route(gm: nn.Module, why: str) -> nn.Module:
    """The captured copy of ``gm``'s model that serves the calls ``gm``'s graph cannot, on ``gm``'s own parameters.

    Built at the first such call (``why`` says which) and kept: a Python number where the graph traced a tensor,
    arguments the graph's signature does not take, a method of the model (``generate()``) that calls ``self``.
    """
    route = _CALL_ROUTES.get(gm)
    if route is None:
        recipe = gm.__dict__.get(RECIPE_ATTR)
        model = getattr(recipe, "model", None)
        if model is None:
            raise AmpRuntimeError(f"{PACKAGE}: {why}, and this converted module no longer knows its model "
                                  "(unpickled): convert the model again")
        policy = Policy.coerce((getattr(recipe, "options", None) or {}).get("policy"))
        route = capture_from_call(model, gm.amp_config, policy, why, parameters_from=gm)
        route.train(gm.training)
        _CALL_ROUTES[gm] = route
    elif route.training != gm.training:
        route.train(gm.training)
    return route


def method_of(gm: nn.Module, name: str) -> Callable:
    """The model's method ``name`` on ``gm``'s captured copy, run as the code between its graphs runs.

    Where it calls ``self(...)`` (``generate()``) that call runs the captured graphs; its own ops (an ``encode()``
    that calls a layer directly) get autocast's decisions at O1, and run on the low parameters at O2/O3.
    """
    route = call_route(gm, f"{type(gm).__name__}.{name} is a method the graph does not hold")
    method = getattr(route, name)
    call = route.__dict__.get(_CAPTURED_ATTR)
    if call is None or not call.between_graphs:
        return method

    @functools.wraps(method)
    def decided(*args: Any, **kwargs: Any) -> Any:
        with _between_graphs(args, kwargs, call.low_dtype):
            return method(*args, **kwargs)

    return decided


def is_captured(module: Any) -> bool:
    """True for a module :func:`capture_from_call` made."""
    return isinstance(module, nn.Module) and _CAPTURED_ATTR in module.__dict__


captured_routes.update(call_route=call_route, method_of=method_of)  # (model_attributes.py says why)
