"""``amp_fx.convert``: trace a model, decide every node's precision, insert casts.

``convert`` never mutates the model it is given.  At O0 and O1 the
converted module shares the model's parameters (training it trains the
model); at O2 and O3 it owns low-precision copies, and the model's own fp32
parameters become the master weights (``converted.amp_fx_masters``).  Its
buffers are the model's own tensors wherever they keep their dtype, and the
low copies of the others are written back after a forward that changes them
(:mod:`amp_fx.converter.buffer_state`), so the model is trained too.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
import torch.fx as fx
import torch.nn as nn

from amp_fx.ir import tables
from amp_fx.converter.buffer_state import attach_buffer_sources, copy_sharing_buffers
from amp_fx.ir.config import AmpConfig, make_config
from amp_fx.ir.devices import device_type_of
from amp_fx.errors import PACKAGE, UnsupportedConstructError, AlreadyConvertedError, AmpTypeError, AmpValueError, checks_keywords, did_you_mean
from amp_fx.converter.graph_module import ROUTE_ATTR, AmpGraphModule, attach_masters, switching_modes
from amp_fx.ir.op_keys import CAST_OPS, canonical_op
from amp_fx.converter.live_hooks import RECIPE_ATTR, ConversionRecipe
from amp_fx.ir.pass_manager import PassContext
from amp_fx.converter.pipeline import rewrite_graph
from amp_fx.converter.specialisations import attach_specialisations
from amp_fx.ir.policy import Policy
from amp_fx.frontend.compiled_modules import compiled_like, is_compiled, unwrap_compiled
from amp_fx.frontend.module_hooks import CALLED_ATTR
from amp_fx.frontend.tracing import _TRACE_LOCK, DEFAULTS_ATTR, AmpTraceError, building_a_graph, trace_model
from amp_fx.converter.call_capture import capture_from_call, is_captured

__all__ = ["convert"]


# Refusals that capture from the call would not lift: the model's meaning itself is at stake, not the capture.
_KEPT_REFUSALS = frozenset({"legacy torch.nn.utils.weight_norm", "global module hooks", "register_backward_hook"})


def _check_model(model: Any) -> None:
    if not isinstance(model, nn.Module) and callable(getattr(model, "_torchdynamo_orig_callable", None)):
        raise AmpTypeError(
            f"{PACKAGE}.convert got a function torch.compile returned ({type(model).__name__}), not a module: "
            "torch.compile of an already compiled module gives a function. Compile once, "
            f"{PACKAGE}.convert(torch.compile(model)) or torch.compile({PACKAGE}.convert(model)), or pass the module "
            "inside (compiled._orig_mod).")
    if not isinstance(model, nn.Module):
        raise AmpTypeError(
            f"{PACKAGE}.convert expects a torch.nn.Module, got {type(model).__name__}. "
            "Wrap a function in an nn.Module whose forward calls it."
        )
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if tensor.device.type == "meta":
            raise AmpValueError(
                f"the model has parameters on the meta device ({name!r} is one: no data to cast). "
                "Materialise it first (model.to_empty(device=...) and load its weights), then convert."
            )


def _check_inputs(example_inputs: Any, example_kwarg_inputs: Any) -> None:
    """Refuse example inputs in a shape convert() would misread, before any work is done."""
    if isinstance(example_inputs, (torch.Tensor, Mapping)):
        what = "a tensor" if isinstance(example_inputs, torch.Tensor) else "a dict"
        fix = "example_inputs=(x,)" if isinstance(example_inputs, torch.Tensor) else "example_kwarg_inputs={...}"
        raise AmpTypeError(f"example_inputs takes a tuple of the positional inputs, got {what}: write {fix}")
    if example_kwarg_inputs is not None and not isinstance(example_kwarg_inputs, Mapping):
        raise AmpTypeError(f"example_kwarg_inputs takes a dict of keyword inputs, got {type(example_kwarg_inputs).__name__}")


def _check_leaf_names(leaf_modules: Sequence[Any], module_names: Sequence[str]) -> None:
    """A leaf module named by a string must exist in the model (a typo would silently trace through it)."""
    if isinstance(leaf_modules, str):
        raise AmpTypeError(f"leaf_modules takes a list of module names or types: write leaf_modules=[{leaf_modules!r}]")
    for leaf in leaf_modules:
        if isinstance(leaf, str) and leaf not in module_names:
            hint = did_you_mean(leaf, [n for n in module_names if n], cutoff=0.5)
            raise AmpValueError(f"leaf_modules names {leaf!r}, which the model does not have.{hint} "
                             "Names are those of model.named_modules(); module types are accepted too.")


def _tensor_notes(model: nn.Module) -> list[str]:
    """Report notes on parameters and buffers that amp_fx leaves as they are."""
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    notes = []
    kept = [f"{name} ({str(t.dtype).replace('torch.', '')})" for name, t in tensors if t.dtype == torch.float64 or t.is_complex()]
    if kept:
        notes.append(f"never cast, as under autocast (float64 and complex tensors): {', '.join(kept)}")
    if tensors and not any(t.is_floating_point() for _, t in tensors):
        notes.append("the model has no floating-point parameters or buffers: only activations are converted")
    return notes


def _copy_missing_state(gm: fx.GraphModule, model: nn.Module) -> None:
    """Give ``gm`` every parameter and buffer of ``model`` (unused ones too) so state_dict keys match."""
    present = set(gm.state_dict().keys())
    for name, tensor in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)):
        if name in present:
            continue
        owner_path, _, leaf = name.rpartition(".")
        owner = gm
        for atom in owner_path.split(".") if owner_path else ():
            if not hasattr(owner, atom):
                owner.add_module(atom, nn.Module())
            owner = getattr(owner, atom)
        if isinstance(tensor, nn.Parameter):
            owner.register_parameter(leaf, tensor)
        else:
            source = model.get_submodule(owner_path) if owner_path else model
            owner.register_buffer(leaf, tensor, persistent=leaf not in source._non_persistent_buffers_set)
    for module_name, module in model.named_modules():
        for leaf in module._non_persistent_buffers_set:
            try:
                target = gm.get_submodule(module_name) if module_name else gm
            except AttributeError:
                continue
            target._non_persistent_buffers_set.add(leaf)


def _keep_state_dict_keys(gm: fx.GraphModule, model: nn.Module) -> None:
    """Make buffers the trace added (torch.export's ``lifted_tensor_0``) non-persistent: state_dict keys stay the model's.

    A checkpoint then loads strictly in both directions, between the model and
    its converted form.
    """
    keys = set(model.state_dict().keys())
    for name, _ in list(gm.named_buffers(remove_duplicate=False)):
        if name in keys:
            continue
        owner_path, _, leaf = name.rpartition(".")
        owner = gm.get_submodule(owner_path) if owner_path else gm
        owner._non_persistent_buffers_set.add(leaf)


def _reconvert(model: AmpGraphModule, config: AmpConfig) -> AmpGraphModule:
    """Converting a converted module: same config changes nothing; another config is refused."""
    previous: AmpConfig = model.amp_config
    if previous != config:
        raise AlreadyConvertedError(
            f"this module was already converted at {previous.level} ({previous.low_dtype}); converting it again "
            f"at {config.level} ({config.low_dtype}) would stack casts. Convert the original model instead."
        )
    if is_captured(model):  # captured from the call: it is its own conversion
        return model
    result = copy.copy(model)
    report = copy.deepcopy(model.amp_report)
    report.notes.append("already converted with this configuration: nothing changed")
    result.amp_report = report
    return result


def _one_at_a_time(fn: Callable) -> Callable:
    """Run ``fn`` under the tracing lock: while one thread traces, no other may run a module (see tracing.py)."""

    @functools.wraps(fn)
    def locked(*args: Any, **kwargs: Any) -> Any:
        with _TRACE_LOCK:
            return fn(*args, **kwargs)

    return locked


@_one_at_a_time
@checks_keywords("convert", kind="conversion option")
def convert(
    model: nn.Module,
    level: str = "O1",
    *,
    dtype: Union[None, str, torch.dtype] = None,
    example_inputs: Optional[Sequence[Any]] = None,
    example_kwarg_inputs: Optional[Mapping[str, Any]] = None,
    policy: Union[None, Policy, Mapping] = None,
    keep_batchnorm_fp32: Optional[bool] = None,
    keep_losses_fp32: Optional[bool] = None,
    cast_model_outputs: Optional[torch.dtype] = None,
    leaf_modules: Sequence[Union[type, str]] = (),
    on_unknown_op: str = "follow",
    allow_banned: bool = False,
    minimize_casts: Optional[bool] = None,
    pad_gemm: Union[None, str, bool] = None,
    fuse_precision: Optional[bool] = None,
    cache_casts: Optional[Union[bool, str]] = None,
    dynamic_shapes: Any = None,
    fp8: Any = None,
) -> "AmpGraphModule | nn.Module":
    """Return ``model`` rewritten for mixed precision at Apex level ``level`` (O0-O3).

    Args:
        model: the module to convert; it is never mutated. A ``torch.compile``d
            module: the module inside is converted, and the result is compiled
            with the same settings (``torch.compile(amp_fx.convert(model))``).
        level: ``"O0"`` (unchanged, fp32), ``"O1"`` (op tables decide; fp32
            parameters cast once per forward), ``"O2"`` (low parameters and
            graph, norms fp32, fp32 master weights), ``"O3"`` (everything low).
        dtype: the low dtype; None picks float16 for a CUDA model and
            bfloat16 otherwise.
        example_inputs / example_kwarg_inputs: optional; give every node an
            exact dtype and shape (FakeTensor propagation) and enable the
            ``torch.export`` route for models fx cannot trace.
        policy: overrides (an :class:`amp_fx.Policy` or a dict such as
            ``{"module:decoder.head": "fp32", "op:softmax": "low"}``).
        keep_batchnorm_fp32, cast_model_outputs, minimize_casts, pad_gemm:
            override the level's preset.
        keep_losses_fp32: O2 keeps losses computed inside the model
            (``cross_entropy``, ``nll_loss``, ``log_softmax``, ...) fp32 (default
            True at O2, False at O3); False runs them low, as Apex's O2 did.
        fuse_precision: run fp32 norms fed and read in low precision as one
            mixed-dtype kernel where that keeps fp32's precision (default True;
            :mod:`amp_fx.passes.fuse_precision`).
        cache_casts: reuse each parameter's low-precision cast across
            forwards where autograd does not record it (``no_grad``,
            ``inference_mode``, frozen parameters), until the parameter
            changes (default False). ``"training"`` reuses it in training
            too, so under gradient accumulation each weight is cast once per
            optimizer step; each use stays its own autograd node. Hazard: a write through ``p.data``
            (``p.data.mul_(0.5)``) bumps no version counter and is not
            detected (only reading the whole weight could tell), so the old
            cast is served; after one call ``gm.clear_cast_cache()``, or write
            under ``torch.no_grad()`` without ``.data`` (:mod:`amp_fx.graph_ops.cast_cache`).
        fp8: run eligible GEMMs as scaled fp8 GEMMs: ``True`` (tensorwise), a recipe name
            (``"tensorwise"``, ``"rowwise"``, ``"delayed"``), a dict of :class:`amp_fx.Fp8Config`
            fields or an ``Fp8Config`` (default None: only where a policy says ``"fp8"``;
            :mod:`amp_fx.passes.fp8_gemms`, docs/fp8.md).
        leaf_modules: module types or names to keep whole (not traced into).
        on_unknown_op: ``"follow"`` (default), ``"fp32"`` or ``"error"`` for
            ops in no table.
        allow_banned: run banned ops (``binary_cross_entropy``) in fp32
            instead of raising.
        dynamic_shapes: for the torch.export route, torch.export's own
            argument for the tensor inputs; None makes batch and sequence
            dimensions dynamic, False keeps every shape static
            (:mod:`amp_fx.frontend.export_route`).

    The result is an :class:`AmpGraphModule` with ``amp_report`` (every
    decision and why) and ``amp_config``.

    Module hooks keep their meaning (:mod:`amp_fx.frontend.module_hooks`):
    forward pre-hooks, forward hooks (``with_kwargs``, ``always_call``, results
    that replace inputs or outputs), full backward hooks and backward
    pre-hooks registered on the model's modules fire at run time as in eager,
    with the same arguments (what arrives under autocast: a Linear's output
    low) and order, each given the module it was registered on.  They are read
    live: removing one from the model removes its effect.  A hook registered
    on ``result.get_submodule(path)`` fires too and does not reach the model;
    one registered after conversion on a module the graph inlines makes the
    first call after it rebuild the graph (:mod:`amp_fx.converter.live_hooks`).
    Global module hooks, deprecated ``register_backward_hook`` hooks and hooks
    on the torch.export route are refused, naming the route that works.
    """
    options = {k: v for k, v in locals().items() if k != "model"}  # convert's arguments, for a rebuild
    _check_model(model)
    if is_compiled(model):
        # torch.compile(model): what runs is the module inside; convert it and compile the result the same way
        # (converting the wrapper would trace Dynamo's frame, and the result's parameters would not be those its
        # forward reads).
        return compiled_like(model, convert(unwrap_compiled(model), **options))
    _check_inputs(example_inputs, example_kwarg_inputs)
    config, device = _config_for(model, options)
    policy = _policy_for(policy, config)
    if isinstance(model, AmpGraphModule) and hasattr(model, "amp_config") or is_captured(model):
        return _reconvert(model, config)
    _check_names(model, policy, leaf_modules)
    try:
        gm, route, source = _trace(model, config, options)
    except (AmpTraceError, UnsupportedConstructError) as error:  # no whole graph: capture from the real call
        # Kept: a refusal the call route would not lift, a graph for one more key of a converted module, and a
        # torch.export failure under the user's own dynamic_shapes= (their declaration is what the error names).
        if getattr(error, "construct", "") in _KEPT_REFUSALS or building_a_graph() or dynamic_shapes is not None:
            raise
        return capture_from_call(model, config, policy, str(error))  # (converter/call_capture.py)
    traced_defaults = dict(getattr(gm, DEFAULTS_ATTR, None) or {})  # optional inputs traced at their default (symbolic)
    _match_model_state(gm, source, policy)
    ctx = _pass_context(config, policy, options, route, device)
    gm, report = rewrite_graph(gm, ctx, own_params=config.cast_params, notes=_conversion_notes(model, gm, route))
    _restore_train_flags(gm, model, route)
    _attach_results(gm, report, config, route, ctx, options)
    _attach_rebuilds(gm, model, config, route, options, traced_defaults)
    return gm


# -- the steps of convert(), in the order it runs them ----------------------------------------------------------

def _config_for(model: nn.Module, options: dict) -> tuple[AmpConfig, str]:
    """The level's configuration with convert's overrides, and the device type the model (or its inputs) is on."""
    examples = list(options["example_inputs"] or ()) + list((options["example_kwarg_inputs"] or {}).values())
    device = device_type_of(model, examples)
    config = make_config(
        options["level"], **{name: options[name] for name in (
            "dtype", "keep_batchnorm_fp32", "keep_losses_fp32", "cast_model_outputs", "on_unknown_op", "allow_banned",
            "minimize_casts", "pad_gemm", "fuse_precision", "cache_casts", "fp8")},
    )
    return config.for_device(device), device


def _policy_for(policy: Union[None, Policy, Mapping], config: AmpConfig) -> Policy:
    """``policy=`` as a :class:`Policy`, refused where it asks for what the level cannot do (a low rule at O0)."""
    policy = Policy.coerce(policy)
    policy.check_level(config.level)
    return policy


def _check_names(model: nn.Module, policy: Policy, leaf_modules: Sequence[Any]) -> None:
    """Refuse a policy or ``leaf_modules`` entry naming a module the model does not have (with close matches)."""
    module_names = [name for name, _ in model.named_modules()]
    policy.validate_against(module_names)
    _check_leaf_names(leaf_modules, module_names)


def _trace(model: nn.Module, config: AmpConfig, options: dict) -> tuple[AmpGraphModule, str, nn.Module]:
    """Trace the model (fx, or torch.export with example inputs); return the graph, its route and what was traced.

    At O2/O3 the traced module is a copy whose parameters the passes cast; its buffers stay the
    model's tensors (:mod:`amp_fx.converter.buffer_state`).  At O0/O1 it is the model itself.
    """
    source = copy_sharing_buffers(model) if config.cast_params else model
    example_inputs, example_kwarg_inputs = options["example_inputs"], options["example_kwarg_inputs"]
    gm, route = trace_model(
        source, leaf_modules=options["leaf_modules"],
        example_inputs=tuple(example_inputs) if example_inputs is not None else None,
        example_kwarg_inputs=dict(example_kwarg_inputs) if example_kwarg_inputs else None,
        module_class=AmpGraphModule, dynamic_shapes=options["dynamic_shapes"], hook_originals=model,
    )
    return gm, route, source


def _match_model_state(gm: fx.GraphModule, source: nn.Module, policy: Policy) -> None:
    """Give the graph the model's whole state under the model's keys, and check the policy's op names against it."""
    _copy_missing_state(gm, source)
    _keep_state_dict_keys(gm, source)
    known_ops = set().union(*tables.all_tables().values(), CAST_OPS)
    policy.check_op_names((canonical_op(n, gm) for n in gm.graph.nodes if n.op.startswith("call")), known_ops)


def _pass_context(config: AmpConfig, policy: Policy, options: dict, route: str, device: str) -> PassContext:
    """What every pass reads: the configuration, the policy, the example inputs, the route and the device."""
    example_inputs, example_kwarg_inputs = options["example_inputs"], options["example_kwarg_inputs"]
    return PassContext(config=config, policy=policy,
                       example_inputs=tuple(example_inputs) if example_inputs is not None else None,
                       example_kwarg_inputs=dict(example_kwarg_inputs) if example_kwarg_inputs else None,
                       route=route, device_type=device)


def _conversion_notes(model: nn.Module, gm: fx.GraphModule, route: str) -> list[str]:
    """The report's notes on the conversion as a whole: tensors left as they are, what the route fixed."""
    notes = _tensor_notes(model)
    notes.extend(getattr(gm, "amp_fx_trace_notes", ()))  # what the export route fixed or kept dynamic
    if route == "torch.export":
        notes.append("traced with torch.export in the model's train/eval mode; .train()/.eval() switch to a graph "
                     "specialised to the other mode, built at its first call, on the same weights")
    return notes


def _restore_train_flags(result: nn.Module, model: nn.Module, route: str) -> None:
    """Off the symbolic route: each module's flag as traced; one the graph holds no state of follows the root."""
    if route == "symbolic_trace":
        return
    with switching_modes():  # the mode it was traced in: no frozen-mode warning
        flags = {path: m.training for path, m in model.named_modules()}
        for path, module in result.named_modules():
            module.training = flags.get(path, model.training)


def _attach_results(result: AmpGraphModule, report: Any, config: AmpConfig, route: str, ctx: PassContext,
                    options: dict) -> None:
    """Put the report, the configuration, the route and the input dtypes the casts were placed for on ``result``."""
    result.amp_report = report
    result.amp_config = config
    setattr(result, ROUTE_ATTR, route)
    # The casts were placed for the example inputs' floating dtypes: calls with other dtypes are refused.
    examples = {**dict(enumerate(options["example_inputs"] or ())), **dict(options["example_kwarg_inputs"] or {})}
    result.amp_fx_input_dtypes = {key: value.dtype for key, value in examples.items()
                                  if isinstance(value, torch.Tensor) and value.is_floating_point()}
    result.amp_fx_source_dtypes = dict(ctx.source_dtypes)


def _attach_rebuilds(result: AmpGraphModule, model: nn.Module, config: AmpConfig, route: str, options: dict,
                     traced_defaults: dict) -> None:
    """Tie ``result`` to the model: O2's masters, the buffers it writes back, and what rebuilds its graph later.

    Hooks registered later on a module forward calls rebuild the graph (:mod:`amp_fx.converter.live_hooks`);
    the other train/eval mode (torch.export route) and the optional inputs a call gives or leaves out (both
    routes) get graphs built at their first call (:mod:`amp_fx.converter.specialisations`).  Both rebuild
    through the recipe's ``build``: this very function, handed down so they need not import it.
    """
    called = getattr(result.graph, CALLED_ATTR, frozenset())
    setattr(result, RECIPE_ATTR, ConversionRecipe(model, options, called, build=convert))
    if config.master_weights and config.cast_params:
        attach_masters(result, dict(model.named_parameters(remove_duplicate=False)))
    if config.cast_params:
        attach_buffer_sources(result, model)
    example_inputs = options["example_inputs"]
    attach_specialisations(result, model, route, tuple(example_inputs) if example_inputs is not None else None,
                           options["example_kwarg_inputs"], traced_defaults)
