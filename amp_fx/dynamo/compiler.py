"""AmpBackend: convert one graph Dynamo captured (the same passes as ``convert()``), then compile it with the inner backend.

:mod:`amp_fx.dynamo.backend` builds these objects (:func:`~amp_fx.dynamo.backend.backend`,
the registered name ``"amp_fx"``) and says what the backend does as a whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from typing import Any, Callable, Mapping, Sequence, Union

import torch
import torch.fx as fx

from amp_fx.dynamo.between_graphs import EagerDecisions, run_suspended, suspended
from amp_fx.dynamo.bodies import convert_bodies, describe_region_nodes
from amp_fx.dynamo import frames
from amp_fx.dynamo.transforms import refuse_autograd_transforms
from amp_fx.dynamo.graph import module_expressions, placeholder_params, relative_module_stacks
from amp_fx.dynamo import watch
from amp_fx.dynamo.report import CompiledReport, publish
from amp_fx.ir import meta
from amp_fx.ir.config import AmpConfig, make_config
from amp_fx.ir.devices import device_type_of
from amp_fx.ir.fake_calls import transform_levels_kept
from amp_fx.graph_ops.outer_autocast import call_without_outer_autocast, no_outer_autocast
from amp_fx.ir.pass_manager import PassContext
from amp_fx.converter.pipeline import rewrite_graph
from amp_fx.ir.policy import Policy
from amp_fx.errors import AmpTypeError, AmpValueError, unknown_options_error
from amp_fx.frontend.tracing import module_stack_of, user_frame

__all__ = ["AmpBackend"]

# The logger keeps the name it had when this code lived in amp_fx.dynamo.backend (logging settings name it).
logger = logging.getLogger(f"{__package__}.backend")  # amp_fx.dynamo.backend

_PARAM_LEVELS = ("O2", "O3")
# backend()'s own keywords; every other option is an AmpConfig field (make_config's overrides).
_BACKEND_OPTIONS = ("level", "dtype", "policy", "pad_gemm", "inner")
_CONFIG_OPTIONS = frozenset(f.name for f in dataclasses.fields(AmpConfig))


def _o2_error(level: str) -> AmpValueError:
    return AmpValueError(
        f"level {level!r} keeps the parameters themselves in low precision, and a torch.compile backend only "
        "sees graphs, never the model's parameters, so it cannot convert them. Convert first, then compile:\n"
        f"    compiled = torch.compile(amp_fx.convert(model, level={level!r}))\n"
        "(any inner backend, e.g. backend='inductor'). backend='amp_fx' supports O0 and O1."
    )


def _check_options(options: Mapping[str, Any]) -> None:
    """Refuse an option the backend does not know, naming the close ones and every valid one."""
    bad = sorted(set(options) - _CONFIG_OPTIONS)
    if not bad:
        return
    valid = set(_BACKEND_OPTIONS) | (_CONFIG_OPTIONS - {"op_mode"})
    raise unknown_options_error(bad, valid, "the amp_fx backend", kind="conversion option")


def _resolve_inner(inner: Union[str, Callable]) -> tuple[Callable, str]:
    """The inner backend callable and its name."""
    if callable(inner):
        return inner, getattr(inner, "__name__", type(inner).__name__)
    if not isinstance(inner, str):
        raise AmpTypeError(f"inner must be a backend name or a callable backend, got {inner!r}")
    if inner == "amp_fx":
        raise AmpValueError("inner='amp_fx' would convert every graph twice; name the backend that compiles the result")
    from torch._dynamo.backends.registry import lookup_backend

    return lookup_backend(inner), inner


def _without_outer_autocast(compiled: Callable) -> Callable:
    """Wrap a compiled graph so that it runs with any outer autocast, and amp_fx's eager decisions, off: it holds its casts."""

    # updated=(): attributes such as _boxed_call describe the inner callable's calling convention, not this one's
    @functools.wraps(compiled, updated=())
    def run(*args: Any) -> Any:
        return run_suspended(call_without_outer_autocast, compiled, *args)

    return run


def _fake_mode(gm: fx.GraphModule) -> Any:
    for node in gm.graph.nodes:
        mode = getattr(node.meta.get("example_value"), "fake_mode", None)
        if node.op == "placeholder" and mode is not None:
            return mode
    return None


def _no_new_guards(gm: fx.GraphModule) -> Any:
    """Keep the passes from adding shape guards to a dynamic-shape graph.

    A pass that reads a symbolic size as a number (``int(s0)`` for a byte
    estimate) would otherwise specialise the graph and force a recompile for
    every new shape.  Sizes feed only cost estimates (cast bytes, min-cut
    weights), which may use the hint; a pass whose *correctness* needs a size
    (GEMM padding) must skip symbolic sizes (``not isinstance(size, int)``).
    """
    shape_env = getattr(_fake_mode(gm), "shape_env", None)
    return shape_env.suppress_guards() if shape_env is not None else contextlib.nullcontext()


def _refresh_example_values(gm: fx.GraphModule) -> None:
    """Recompute Dynamo's ``example_value`` on every node after the rewrite.

    The casts amp_fx inserted have none, and the ops that now run low still
    carry fp32 ones; inner backends (inductor's pre-grad passes) read them.
    """
    fakes = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
    mode = _fake_mode(gm)
    if mode is None or any(v is None for v in fakes):
        return
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    try:
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fakes)
    except Exception as error:  # the inner backend re-traces anyway; stale metadata is only a hint
        logger.debug("could not refresh example values: %s", error)
        return
    for node in gm.graph.nodes:
        if node.op != "placeholder" and "val" in node.meta:
            node.meta["example_value"] = node.meta.pop("val")


def _graph_name(gm: fx.GraphModule) -> str:
    for node in gm.graph.nodes:
        if node.op.startswith("call") and not meta.INSERTED.get(node):
            where = user_frame(node.meta.get("stack_trace"))
            if where:
                return where
    return "graph"


class AmpBackend:
    """A Dynamo backend: rewrite each captured graph for mixed precision, then compile it with ``inner``.

    Build one with :func:`backend`.  ``report`` gathers every graph this
    object converted (a :class:`CompiledReport`); after ``torch._dynamo.reset()``
    (which discards the compiled code) new graphs go to a fresh report.
    """

    def __init__(self, level: str = "O1", dtype: Union[None, str, torch.dtype] = None,
                 policy: Union[None, Policy, Mapping] = None, pad_gemm: Union[None, str, bool] = None,
                 inner: Union[str, Callable] = "inductor", **options: Any):
        if isinstance(level, str) and level.upper() in _PARAM_LEVELS:
            raise _o2_error(level.upper())
        if "example_inputs" in options or "leaf_modules" in options:
            raise AmpTypeError("example_inputs / leaf_modules are convert() options: Dynamo supplies the graphs and their values")
        _check_options(options)
        self.config = make_config(level, dtype=dtype, pad_gemm=pad_gemm, **options)
        self.policy = Policy.coerce(policy)
        self.policy.check_level(self.config.level)
        self.inner_fn, self.inner_name = _resolve_inner(inner)
        self.report = self._new_report()
        self.watches = watch.Watches()  # per compiled model: did Dynamo leave anything to convert?
        self.__name__ = f"amp_fx[{self.config.level},{self.inner_name}]"
        # What the ops Dynamo runs eagerly between this backend's graphs get (amp_fx.dynamo.between_graphs).
        self.eager_decisions = EagerDecisions(self.config.dtype, self.policy, self.__name__)
        watch.ensure_watching()

    def _new_report(self) -> CompiledReport:
        dtype_name = str(self.config.dtype).replace("torch.", "") if self.config.dtype else "auto"
        report = CompiledReport(level=self.config.level, dtype=dtype_name, inner=self.inner_name)
        if self.policy.rules:
            report.notes.append("policy module names are not checked against the model: each graph holds only part of it")
        return report

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        """Convert ``gm`` (in place), record its report, and return the inner backend's compiled callable."""
        watch.ensure_watching()  # again after a torch._dynamo.reset(), for the model's next frames
        # Dynamo hands the backend its mode stack back: amp_fx's eager mode must not decide the inner backend's tracing.
        with no_outer_autocast(), suspended():
            device = device_type_of(gm, example_inputs)
            config = self.config
            if config.op_mode != "none":  # O0 writes no cast
                refuse_autograd_transforms(gm)
            if config.dtype is None:
                config = config.for_device(device)
                self.report.dtype = str(config.dtype).replace("torch.", "")
            # Module policies and the report name modules as model.named_modules() does, whatever
            # the compiled function called its module (self, m, s, a global, a closure), and in
            # the frames of a submodule that Dynamo compiles on their own after a graph break.
            place = frames.locate(module_expressions(gm))
            self._check_place(place)
            prefixes = place.prefixes if place is not None else None
            ctx = PassContext(config=config, policy=self.policy, route="dynamo", device_type=device,
                              placeholder_params=placeholder_params(gm, example_inputs, prefixes))
            compile_id = _compile_id()
            relative_module_stacks(gm, prefixes=prefixes, frame_module=place.frame_module if place is not None else None)
            notes = [f"Dynamo graph {compile_id}, converted by the torch.compile backend", *self._pin_instances(gm, place)]
            # A graph that traced torch.vmap pushes and pops functorch levels when its nodes are fake-run; the
            # stack must be as Dynamo left it, or Dynamo's guard on it fails on the frame that made it.
            with _no_new_guards(gm), transform_levels_kept():
                # Checkpointed regions and subgraphs first: each body is converted and sealed on its own.
                bodies = [] if config.op_mode == "none" else convert_bodies(
                    gm, ctx.placeholder_params, functools.partial(self._convert_body, config, device, compile_id))
                gm, report = rewrite_graph(gm, ctx, own_params=False, notes=notes)
                if config.op_mode != "none":
                    for _, _, body, _ in bodies:
                        _refresh_example_values(body)
                    _refresh_example_values(gm)
            describe_region_nodes(report)
            name = _graph_name(gm)
            before = len(self.report.graphs)
            self.report.add(compile_id, name, report)
            for body_name, op, _, body_report in bodies:
                self.report.add(compile_id, f"{name} / {op} body {body_name}", body_report, region=op)
            publish(self.report)
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug("converted Dynamo graph %s: %s", compile_id, report.totals())
            try:
                compiled = self.inner_fn(gm, example_inputs)
            except BaseException:
                # The graph never runs (with suppress_errors Dynamo runs the frame eagerly): the report keeps graphs that do.
                del self.report.graphs[before:]
                raise
            watch.graph_converted(compile_id, low=bool(report.count("low") or any(b[3].count("low") for b in bodies)))
        return _without_outer_autocast(compiled)

    def _check_place(self, place: Any) -> None:
        """Refuse module policies for a frame whose place in the model is unknown: they would silently miss."""
        if place is None or not place.unknown:
            return
        rules = [r.describe() for r in self._module_rules()]
        if not rules:
            return
        model = place.model.__name__ if place.model is not None else "the compiled model"
        raise AmpValueError(
            f"amp_fx cannot tell where Dynamo's frame {place.frame} sits in {model}: it reads "
            f"{', '.join(place.unknown)}, which is not a submodule of {model}, so module paths in this graph "
            f"are not model.named_modules() names and {', '.join(rules)} may not match them. Fix: remove the graph "
            "break that made Dynamo compile this frame on its own, decide these modules by type "
            "(policy={ModuleClass: 'fp32'}) or op instead of by name, or convert first: "
            "torch.compile(amp_fx.convert(model, ...)).")

    def _module_rules(self) -> list:
        return [r for r in self.policy.rules if r.kind in ("module", "module_glob", "module_re")]

    def _pin_instances(self, gm: fx.GraphModule, place: Any) -> list[str]:
        """Keep a nested frame's graph to the modules it was painted for, where module policies paint their siblings otherwise.

        Dynamo runs a frame compiled for ``encoder.layers.0`` for every
        module of its class; a rule naming ``encoder.layers.0`` must not
        reach ``encoder.layers.1`` that way (nor miss ``layers.0`` when
        ``layers.1`` compiled first).  Such a graph gets an identity guard on
        the frame local that holds the module, so Dynamo compiles the frame
        again for each of them; without such a local, the backend refuses.
        Returns the report notes.
        """
        rules = self._module_rules()
        if place is None or not place.nested or not rules:
            return []
        by_name = Policy(rules=rules)
        stacks = {tuple(module_stack_of(node)) for module in gm.modules() if isinstance(module, fx.GraphModule)
                  for node in module.graph.nodes if node.op not in ("placeholder", "output")}

        def decided(held: Any, path: str) -> list:
            def moved(name: str) -> str:
                return path + name[len(held.path):] if name == held.path or name.startswith(held.path + ".") else name

            return [by_name.decide(None, None, [(moved(name), kind) for name, kind in stack]) for stack in sorted(stacks, key=str)]

        notes = []
        for held in place.held:
            mine = decided(held, held.path)
            other = next((sibling for sibling in held.siblings if decided(held, sibling) != mine), None)
            if other is None:
                continue
            if held.expression is None or not frames.guard_instance(held.expression):
                raise AmpValueError(
                    f"Dynamo compiled {place.frame} as a frame of its own (a graph break), and it runs that graph for "
                    f"every {held.type.__name__} of the model: {held.path} and {other} among them. The module policy "
                    f"({', '.join(r.describe() for r in rules)}) decides them differently, and this frame holds no "
                    f"reference to its module that could tell them apart at run time. Fix: remove the graph break in "
                    f"{held.type.__name__}, decide these modules by type (policy={{{held.type.__name__}: ...}}) or op, "
                    "or convert first: torch.compile(amp_fx.convert(model, policy=...)).")
            notes.append(f"kept to module {held.path} ({held.expression} guarded by identity): the module policy "
                         f"decides other {held.type.__name__} modules ({other}, ...) differently, so Dynamo compiles "
                         "this frame for each of them")
        return notes

    def _convert_body(self, config: Any, device: str, compile_id: str, body: fx.GraphModule,
                      params: dict, name: str) -> tuple[fx.GraphModule, Any]:
        """Run the pipeline on one higher-order op's body (see :mod:`amp_fx.dynamo.bodies`)."""
        # A body's outputs are not the model's: they keep their traced dtypes (sealed afterwards).
        config = dataclasses.replace(config, cast_model_outputs=None)
        ctx = PassContext(config=config, policy=self.policy, route="dynamo", device_type=device, placeholder_params=params)
        return rewrite_graph(body, ctx, own_params=False,
                             notes=[f"body {name} of Dynamo graph {compile_id}, converted by the torch.compile backend"])

    def reset(self) -> None:
        """Called by ``torch._dynamo.reset()``: later graphs go to a fresh report (a held one stays intact)."""
        eager_decided = self.report.eager_decided  # the hooks stay on the compiled models' contexts
        self.report = self._new_report()
        self.report.eager_decided = eager_decided
        self.watches = watch.Watches()
        reset = getattr(self.inner_fn, "reset", None)
        if callable(reset):
            reset()


def _compile_id() -> str:
    from torch._guards import CompileContext

    compile_id = CompileContext.current_compile_id()
    return str(compile_id) if compile_id is not None else "?"
