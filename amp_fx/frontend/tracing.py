"""Turn a model into a GraphModule: symbolic tracing first, torch.export second.

The tracer records, for every node, the qualified name and type of each
module it came from (``node.meta["nn_module_stack"]``) and the user source
line (``node.meta["stack_trace"]``).  It traces *through* torch.nn modules
that are pure functions of their parameters (Linear, Conv, LayerNorm, ...),
so their weights appear as ``get_attr`` nodes whose casts the passes can see
and share, and keeps as leaves the modules whose behaviour depends on
``self.training`` or that fx cannot trace (BatchNorm, Dropout, RNNs,
MultiheadAttention), plus any the user names.  forward's optional
parameters that the example inputs leave out are traced at their default,
as the model's own call without them runs (amp_fx/frontend/traced_defaults.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import linecache
import threading
import traceback
import weakref
from typing import Any, Iterable, Iterator, Optional, Sequence, Union

import torch
import torch.fx as fx
import torch.nn as nn

from amp_fx.frontend import module_hooks, regions
from amp_fx.graph_ops import hook_dispatch
from amp_fx.graph_ops.casts import HELPERS
from amp_fx.errors import AmpError, AmpTypeError, AmpWarning, UnsupportedConstructError
from amp_fx.frontend.checkpoint_regions import record_checkpoints
from amp_fx.frontend.dtype_reads import record_dtype_reads
from amp_fx.frontend.opaque_calls import record_function_calls
from amp_fx.frontend.source_lines import innermost_user_frame, is_library_file
from amp_fx.frontend.trace_guards import refuse_state_changes, watch_context_managers, watched_export
from amp_fx.frontend.traced_defaults import describe_defaults, traced_at_default
from amp_fx.frontend.train_flags import FROZEN_ATTR, TrainingReads

__all__ = ["AmpTracer", "AmpTraceError", "trace_model", "DEFAULT_LEAF_TYPES", "module_stack_of", "user_frame",
           "export_hook_advice", "FX_FAILED_IN_ATTR", "tracing_for", "building_a_graph", "DEFAULTS_ATTR"]
# On a module traced by torch.export: the module fx failed in ("" the model's own forward), for later advice.
FX_FAILED_IN_ATTR = "amp_fx_fx_failed_in"

# Modules kept whole: their forward reads self.training (tracing would freeze
# train or eval mode into the graph) or is not symbolically traceable.
DEFAULT_LEAF_TYPES: tuple[type, ...] = (
    nn.modules.batchnorm._BatchNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.modules.dropout._DropoutNd,
    nn.AlphaDropout,
    nn.RReLU,
    nn.RNNBase,
    nn.RNNCellBase,
    nn.MultiheadAttention,
)

# fx tracing patches torch.nn.Module.__call__/__getattr__ for every thread: convert() holds this
# lock throughout, so a conversion in one thread never runs a module while another traces.
_TRACE_LOCK = threading.RLock()


class AmpTraceError(AmpError, RuntimeError):
    """The model could not be turned into a graph; the message says where and what to do."""


class AmpTracer(fx.Tracer):
    """fx tracer that records module scope and source lines and honours user leaf modules."""

    # Buffers are graph values: an in-place update in forward (a step counter, an EMA) is
    # recorded and runs every call, instead of running once on the model during tracing.
    proxy_buffer_attributes = True

    def __init__(self, leaf_modules: Iterable[Union[type, str]] = (), hook_originals: Optional[dict[str, nn.Module]] = None):
        super().__init__(autowrap_functions=HELPERS)
        self._tensor_names: Optional[tuple[dict[int, str], dict[int, str]]] = None
        # path -> the original model's module: hooked modules get boundaries (amp_fx/frontend/module_hooks.py).
        # None when fx re-traces a converted module's own code (unpickling): its boundaries are already there.
        self._hook_originals = hook_originals
        self._forced_boundaries = module_hooks.forced_boundaries()
        self._called_paths: set[str] = set()
        leaves = tuple(leaf_modules)
        self.leaf_types = tuple(t for t in leaves if isinstance(t, type))
        self.leaf_names = frozenset(n for n in leaves if isinstance(n, str))
        bad = [leaf for leaf in leaves if not isinstance(leaf, (type, str))]
        if bad:
            raise AmpTypeError(f"leaf_modules takes module types or qualified module names, got {bad!r}")

    def trace(self, root: Any, concrete_args: Optional[dict] = None) -> fx.Graph:
        self._tensor_names = None
        self._training_reads = TrainingReads()
        graph = None
        try:
            # grad-mode / autocast regions become marker nodes (amp_fx/frontend/regions.py)
            with regions.recording(self), self._front_end_hooks():
                graph = super().trace(root, concrete_args)
        finally:
            self._training_reads.restore(graph)
        return graph

    @contextlib.contextmanager
    def _front_end_hooks(self) -> Iterator[None]:
        """Install, for this one trace, every interception of the symbolic front end.

        Symbolic tracing runs ``forward`` once with proxies and keeps the tensor
        ops it sees.  Constructs with a meaning of their own are kept (custom
        autograd Functions stay one node, amp_fx/frontend/opaque_calls.py;
        checkpoint calls stay checkpointed, amp_fx/frontend/checkpoint_regions.py;
        ``torch.finfo`` of a traced dtype is read at run time,
        amp_fx/frontend/dtype_reads.py) or refused with an error naming the
        construct, its line and the route that works (Python state changed
        during forward, context managers amp_fx does not know:
        amp_fx/frontend/trace_guards.py).
        """
        with contextlib.ExitStack() as stack:
            stack.enter_context(record_function_calls(self))
            stack.enter_context(record_checkpoints(self))
            stack.enter_context(refuse_state_changes(self))
            stack.enter_context(watch_context_managers(self))
            stack.enter_context(record_dtype_reads(self))
            yield

    def create_args_for_root(self, root_fn: Any, is_module: bool, concrete_args: Any = None) -> Any:
        """Make the placeholders, then the runtime reads of ``self.training`` (amp_fx/frontend/train_flags.py)."""
        result = super().create_args_for_root(root_fn, is_module, concrete_args)
        if is_module:
            self._training_reads.install(self, self.root)
        return result

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict) -> Any:
        """Proxy parameters and buffers through a name index.

        fx's own lookup scans every parameter of the model for each attribute
        access, which makes tracing quadratic in model size.
        """
        if not isinstance(attr_val, torch.Tensor):
            return attr_val
        if self._tensor_names is None:
            params: dict[int, str] = {}
            buffers: dict[int, str] = {}
            for name, p in self.root.named_parameters():
                params.setdefault(id(p), name)
            for name, b in self.root.named_buffers():
                buffers.setdefault(id(b), name)
            self._tensor_names = (params, buffers)
        params, buffers = self._tensor_names
        name = params.get(id(attr_val)) if isinstance(attr_val, nn.Parameter) else None
        if name is None and self.proxy_buffer_attributes:
            name = buffers.get(id(attr_val))
        if name is None:
            return attr_val
        if name not in parameter_proxy_cache:
            parameter_proxy_cache[name] = self.create_proxy("get_attr", name, (), {})
        return parameter_proxy_cache[name]

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        """Create a node and record the innermost user source line that made it.

        Cheaper than fx's ``record_stack_traces``, which formats the whole
        stack for every node.
        """
        node = super().create_node(*args, **kwargs)
        frame = innermost_user_frame(skip_stdlib=False)
        if frame is not None:
            filename, lineno = frame.f_code.co_filename, frame.f_lineno
            code = linecache.getline(filename, lineno).strip()
            node.meta["stack_trace"] = f'  File "{filename}", line {lineno}, in {frame.f_code.co_name}\n    {code}\n'
        return node

    def call_module(self, m: nn.Module, forward: Any, args: tuple, kwargs: dict) -> Any:
        """Trace a module call; a module with hooks keeps them for run time, between boundaries (amp_fx/frontend/module_hooks.py)."""
        if self._hook_originals is None:
            return super().call_module(m, forward, args, kwargs)
        path = self.path_of_module(m)
        self._called_paths.add(path)  # a hook registered on it later makes a rebuild (amp_fx/converter/live_hooks.py)
        hooked = m._forward_pre_hooks or m._forward_hooks or m._backward_hooks or m._backward_pre_hooks
        if not hooked and path not in self._forced_boundaries:
            return super().call_module(m, forward, args, kwargs)
        return module_hooks.trace_hooked_call(self, m, path, forward, args, kwargs, super().call_module,
                                              self._hook_originals.get(path), path in self._forced_boundaries)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.leaf_names or isinstance(m, self.leaf_types):
            return True
        return isinstance(m, DEFAULT_LEAF_TYPES)


def user_frame(stack_trace: Optional[str]) -> Optional[str]:
    """Return ``"file:line in fn: code"`` for the innermost frame outside torch and amp_fx."""
    if not stack_trace:
        return None
    lines = stack_trace.strip().splitlines()
    best = None
    for i, line in enumerate(lines):
        line = line.strip()
        if not line.startswith("File "):
            continue
        try:
            path = line.split('"')[1]
        except IndexError:
            continue
        if is_library_file(path):
            continue
        code = lines[i + 1].strip() if i + 1 < len(lines) and not lines[i + 1].strip().startswith("File ") else ""
        where = line.replace("File ", "").replace('"', "").replace(", line ", ":").replace(", in ", " in ")
        best = f"{where}: {code}" if code else where
    return best


def module_stack_of(node: fx.Node) -> list[tuple[str, Any]]:
    """Return (qualified name, type) of the modules enclosing ``node``, innermost first."""
    stack = node.meta.get("nn_module_stack") or {}
    out = []
    for key, value in stack.items():
        path, module_type = value if isinstance(value, tuple) else (key, None)
        out.append((_clean_path(str(path)), module_type))
    return out[::-1]


def _clean_path(path: str) -> str:
    # torch.export writes paths as "L['self'].layers[0].attn" or "layers.0.attn".
    for prefix in ("L['self'].", "L['self']"):
        if path.startswith(prefix):
            path = path[len(prefix):]
    return path.replace("[", ".").replace("]", "").replace("'", "")


# Set by amp_fx/converter/specialisations.py while it builds a graph for one key: the route the converted module
# took (a build never changes it) and, on the symbolic route, forward's optional parameters traced as inputs.
_BUILDING: contextvars.ContextVar[Optional["_Build"]] = contextvars.ContextVar("amp_fx_building", default=None)
# On a traced module: {name: default} of the optional parameters traced at their default (amp_fx/frontend/traced_defaults.py).
DEFAULTS_ATTR = "amp_fx_traced_defaults"


class _Build:
    __slots__ = ("route", "inputs", "failed_in")

    def __init__(self, route: str, inputs: Optional[frozenset], failed_in: str):
        self.route, self.inputs, self.failed_in = route, inputs, failed_in


def building_a_graph() -> bool:
    """True while a converted module builds its graph for another key (under :func:`tracing_for`): one route only."""
    return _BUILDING.get() is not None


@contextlib.contextmanager
def tracing_for(route: str, inputs: Optional[Iterable[str]] = None, failed_in: str = "") -> Iterator[None]:
    """Trace on ``route`` only; on the symbolic route, ``inputs`` (of forward's optional parameters) as graph inputs, the rest at their defaults.

    For a converted module's graph for another key: it must come from the
    route the module took (a torch.export model is not re-traced by fx, a
    symbolic one never falls back to torch.export), and take exactly the
    inputs the call gives.  ``failed_in`` is where fx failed at conversion
    (the hook advice of the torch.export route).
    """
    token = _BUILDING.set(_Build(route, frozenset(inputs) if inputs is not None else None, failed_in))
    try:
        yield
    finally:
        _BUILDING.reset(token)


def _settle_default_inputs(graph: fx.Graph, defaults: dict) -> None:
    """Give the placeholders fx made for ``concrete_args`` forward's names, and drop the checks fx put on them.

    fx names such a placeholder ``scale_1``: named ``scale`` again, the
    converted module's forward takes ``scale=None`` by name as the model's
    does (the node keeps fx's name).  fx checks its value in the graph
    (``_assert_is_none``, ``torch._assert(scale_1 == 2)``): ops the model
    never runs, which the precision passes would have to decide; the
    converted module checks instead, before the graph runs, and runs the
    graph traced with the input given where the call gives another value
    (amp_fx/converter/specialisations.py).
    """
    for node in list(graph.nodes):
        if node.op != "placeholder":
            continue
        base, _, count = str(node.target).rpartition("_")
        if count != "1" or base not in defaults:
            continue
        node.target = base
        for user in list(node.users):
            checks = [user] + [u for u in user.users if u.op == "call_function" and u.target is torch._assert]
            if user.op == "call_function" and len(checks) == len(user.users) + 1:
                for check in reversed(checks):
                    graph.erase_node(check)


def _symbolic_trace(model: nn.Module, tracer: AmpTracer, module_class: type, defaults: dict) -> fx.GraphModule:
    # forward's optional parameters the examples leave out are traced at their default (amp_fx/frontend/traced_defaults.py)
    graph = tracer.trace(model, dict(defaults) if defaults else None)
    _settle_default_inputs(graph, defaults)
    # where the converted module's clones find the original hooks (amp_fx/converter/graph_module.py _own_modules)
    setattr(graph, module_hooks.ORIGINALS_ATTR, {path: weakref.ref(m) for path, m in (tracer._hook_originals or {}).items()})
    setattr(graph, module_hooks.CALLED_ATTR, frozenset(tracer._called_paths))
    gm = module_class(tracer.root, graph, type(model).__name__)
    setattr(gm, DEFAULTS_ATTR, dict(defaults))
    if defaults:
        gm.amp_fx_trace_notes = [
            f"traced at their defaults, as the model runs without them (not given in example inputs, or given at "
            f"the default): {describe_defaults(defaults)}; a call that gives one runs a graph with it as an input, "
            "built at its first such call (amp_fx/frontend/traced_defaults.py)"]
    return gm


def _export_trace(model: nn.Module, args: tuple, kwargs: dict, module_class: type, dynamic_shapes: Any = None) -> fx.GraphModule:
    # constants bound, caches off, batch/sequence dynamic; Hugging Face interface kept (amp_fx/frontend/export_route.py, amp_fx/frontend/hf.py)
    from amp_fx.frontend import export_route, hf

    with regions.exporting() as notes:  # inference_mode kept as no_grad; regions export drops are noted
        unlifted, constants, export_notes = export_route.export_module(model, args, kwargs, dynamic_shapes)
    regions.inline_region_hops(unlifted)  # grad-mode / autocast bodies inline, between markers
    setattr(unlifted.graph, regions.NOTES_ATTR, list(dict.fromkeys(notes)))
    # torch.export specialises every train/eval branch: the converted module warns when .train()/.eval() differ
    setattr(unlifted.graph, FROZEN_ATTR, {path: (m.training, "traced with torch.export") for path, m in model.named_modules()})
    gm = unlifted if module_class is fx.GraphModule else module_class(unlifted, unlifted.graph, type(model).__name__)
    gm.amp_fx_trace_notes = export_notes  # constants bound, dynamic dimensions: for the report
    hf.attach_interface(gm, model, constants)
    return gm


def _describe_failure(error: BaseException, tracer: AmpTracer) -> str:
    frames = traceback.extract_tb(error.__traceback__)
    user = [f for f in frames if not is_library_file(f.filename)]
    where = f"{user[-1].filename}:{user[-1].lineno}: {user[-1].line}" if user else "unknown source line"
    scope = list(getattr(tracer, "module_stack", {}) or {})
    module = scope[-1] if scope and scope[-1] else "<root module>"
    return f"{type(error).__name__}: {error}\n  in module {module!r}\n  at {where}"


def _failing_module(tracer: AmpTracer) -> str:
    """The path of the module whose forward fx failed in ("" for the model's own forward)."""
    scope = list(getattr(tracer, "module_stack", {}) or {})
    return str(scope[-1]).split("@")[0] if scope and scope[-1] else ""


def export_hook_advice(failed_in: Optional[str]) -> str:
    """The routes that keep hooks when fx cannot trace a model: the backend, and a leaf only where it helps."""
    backend = "torch.compile(model, backend='amp_fx'), which keeps hooks"
    if failed_in is None:  # not known here
        return (f"{backend}; or, if fx failed inside a submodule rather than in the model's own forward (the "
                "conversion's error says where), amp_fx.convert's symbolic route with that submodule kept whole "
                "(leaf_modules=['its.path']), which keeps hooks live")
    if not failed_in:
        return (f"{backend} (fx fails in the model's own forward, which cannot be a leaf, so amp_fx.convert has only "
                "the torch.export route for it)")
    return (f"{backend}; or amp_fx.convert with the module fx fails in kept whole (leaf_modules=[{failed_in!r}]): "
            "the symbolic route keeps hooks live")


def _refuse_hooks_on_export(model: nn.Module, failure: str, failed_in: str) -> None:
    """torch.export runs module hooks once while it traces and keeps their effect: refuse a hooked model on that route."""
    for path, module in model.named_modules():
        for attr in hook_dispatch.HOOK_DICTS:
            hooks = hook_dispatch.user_hooks(module, attr)
            if hooks:
                name = f"module {path!r}" if path else "the model itself"
                kind = attr.strip("_").replace("_", " ")[:-1]
                raise UnsupportedConstructError(
                    f"{name} ({type(module).__name__}) has a {kind} ({hook_dispatch.hook_name(hooks[0][1])}), and amp_fx "
                    f"would have to trace {type(model).__name__} with torch.export: fx could not ({failure.splitlines()[0]}). "
                    "torch.export runs hooks once while it traces and keeps their effect in the graph (an observing "
                    f"hook would never fire again, a backward hook never). Routes that keep hooks: "
                    f"{export_hook_advice(failed_in)}.",
                    construct="module hooks on the torch.export route", where="")


def trace_model(
    model: nn.Module,
    *,
    leaf_modules: Sequence[Union[type, str]] = (),
    example_inputs: Optional[tuple] = None,
    example_kwarg_inputs: Optional[dict] = None,
    module_class: type = fx.GraphModule,
    dynamic_shapes: Any = None,
    hook_originals: Optional[nn.Module] = None,
) -> tuple[fx.GraphModule, str]:
    """Trace ``model``; return the GraphModule and the route taken ("symbolic_trace" or "torch.export").

    Symbolic tracing is tried first.  When it fails and example inputs were
    given, ``torch.export`` (non-strict) traces the model at the ATen level.
    When neither works, :class:`AmpTraceError` says what failed, where, and
    the ways out.  ``module_class`` is the GraphModule subclass to build;
    ``dynamic_shapes`` is torch.export's (see :mod:`amp_fx.frontend.export_route`).
    ``hook_originals`` is the model whose modules' hooks the converted module
    reads at run time (``model`` itself unless it is a copy of it).
    On the symbolic route forward's optional parameters the examples leave
    out are traced at their default; where fx cannot trace forward with a
    ``None`` default, those are traced as inputs instead (a report note says
    which).  Under :func:`tracing_for` only the route named is tried.
    """
    hook_dispatch.refuse_global_hooks("at conversion")
    originals = hook_originals if hook_originals is not None else model
    tracer = AmpTracer(leaf_modules, hook_originals=dict(originals.named_modules()))
    building = _BUILDING.get()  # a converted module's graph for another key: its own route only
    if building is not None and building.route == "torch.export":
        symbolic_error = None
        failure, failed_in = "it could not at conversion", building.failed_in
    else:
        defaults = traced_at_default(model, example_inputs, example_kwarg_inputs,
                                     building.inputs if building is not None else None)
        try:
            with _TRACE_LOCK:
                return _symbolic_trace(model, tracer, module_class, defaults), "symbolic_trace"
        except UnsupportedConstructError:
            raise  # a refusal already names the construct, its line and the routes that work
        except Exception as error:  # any tracing failure: report it with context below
            if building is not None:
                raise AmpTraceError(f"symbolic_trace failed: {_describe_failure(error, tracer)}") from error
            symbolic_error = error
            failure = _describe_failure(error, tracer)
            failed_in = _failing_module(tracer)
        # forward may not trace at all with a None default (`mask.unsqueeze(-1)`, `len(labels)`): those traced as inputs,
        # as calls that give them run (a call leaving one out is then refused, naming it)
        inputs = {name: None for name, default in defaults.items() if default is None}
        if inputs:
            retry = {name: default for name, default in defaults.items() if default is not None}
            tracer = AmpTracer(leaf_modules, hook_originals=dict(originals.named_modules()))
            try:
                with _TRACE_LOCK:
                    gm = _symbolic_trace(model, tracer, module_class, retry)
            except UnsupportedConstructError:
                raise
            except Exception as error:  # the failure closest to the model's calls with every input: the one reported
                symbolic_error = error
                failure = _describe_failure(error, tracer)
                failed_in = _failing_module(tracer)
            else:
                gm.amp_fx_trace_notes = list(getattr(gm, "amp_fx_trace_notes", ())) + [
                    f"traced as graph inputs although not given in example inputs: {', '.join(inputs)} (fx could not "
                    f"trace forward with them at their default None: {failure.splitlines()[0]}); a call that leaves "
                    "one out is refused, naming it"]
                return gm, "symbolic_trace"
    if example_inputs is not None or example_kwarg_inputs is not None:
        _refuse_hooks_on_export(originals, failure, failed_in)
        try:
            args, kwargs = tuple(example_inputs or ()), dict(example_kwarg_inputs or {})
            # refuse what torch.export would drop silently (amp_fx/frontend/trace_guards.py)
            exported = watched_export(model, lambda: _export_trace(model, args, kwargs, module_class, dynamic_shapes))
            setattr(exported, FX_FAILED_IN_ATTR, failed_in)  # where a hook's refusal says a leaf helps (core/live_hooks.py)
            return exported, "torch.export"
        except (UnsupportedConstructError, AmpWarning):
            raise  # a refusal names its fix; a warning the user's filter made an error is theirs to see as it is
        except Exception as error:
            raise AmpTraceError(
                f"amp_fx could not trace {type(model).__name__}.\n"
                f"symbolic_trace failed: {failure}\n"
                f"torch.export failed too: {type(error).__name__}: {error}\n"
                "Ways out: mark the module that fails as a leaf (leaf_modules=[...]), "
                "or compile the model with torch.compile(model, backend='amp_fx'), which handles "
                "data-dependent Python through graph breaks."
            ) from error
    from amp_fx.frontend import hf

    failure = failure.replace("'<root module>'", f"{type(model).__name__} (the model itself)")
    raise AmpTraceError(
        f"amp_fx could not trace {type(model).__name__} with torch.fx.symbolic_trace.\n"
        f"{failure}\n{hf.untraceable_hint(model)}"
        "Ways out: (1) leaf_modules=[TheModuleType or 'its.name'] keeps the failing module whole; "
        "(2) example_inputs=(x, ...) lets amp_fx trace with torch.export instead; "
        "(3) torch.compile(model, backend='amp_fx') converts whatever Dynamo captures."
    ) from symbolic_error
