"""Apex-style API: ``amp_fx.initialize``, ``amp_fx.scale_loss`` and the loss scalers' checkpoint.

Code written for NVIDIA Apex amp runs with ``amp`` replaced by ``amp_fx``::

    model, optimizer = amp_fx.initialize(model, optimizer, opt_level="O2")
    for x, y in data:
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        with amp_fx.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()                     # skipped once if the gradients overflowed

Differences from Apex: the model is converted by :func:`amp_fx.convert` (a
graph rewrite, no function patching); at O2 the optimizer comes back wrapped
in :class:`~amp_fx.runtime.MasterWeightOptimizer` (the original model's fp32
parameters are the masters); a step whose gradients hold inf/NaN is skipped
at every level, including static scales and bf16 (where scaling is off).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import weakref
from collections import OrderedDict
from typing import Any, Iterator, Optional

import torch
from torch import nn

from amp_fx.converter.api import convert
from amp_fx.apex.optimizers import OptimizerRecord, check_ownership, fit_optimizer
from amp_fx.apex.properties import AmpProperties, build_scalers, reported_loss_scale, resolve_properties
from amp_fx.errors import PACKAGE, AmpError, AmpIndexError, AmpRuntimeError, AmpTypeError, AmpValueError
from amp_fx.converter.graph_module import AmpGraphModule
from amp_fx.runtime import LossScaler
from amp_fx.frontend.compiled_modules import compiled_like, is_compiled, unwrap_compiled

__all__ = [
    "initialize", "scale_loss", "state_dict", "load_state_dict",
    "loss_scalers", "master_params", "AlreadyInitializedError",
]

logger = logging.getLogger(f"{PACKAGE}.apex.amp")

_STASH = "_amp_fx_stash"  # attribute holding an optimizer's OptimizerRecord (Apex: _amp_stash)
# Every model and optimizer initialize() saw or returned: a second call on any is refused.
_SEEN: "weakref.WeakSet[Any]" = weakref.WeakSet()


class AlreadyInitializedError(AmpError, RuntimeError):
    """``initialize`` was called on a model or optimizer it already handled (or on a wrapped model)."""


@dataclasses.dataclass(eq=False)
class _Session:
    """What one ``initialize`` call set up: its properties and one loss scaler per loss."""

    properties: AmpProperties
    scalers: list[LossScaler]


_current: Optional[_Session] = None


# ------------------------------------------------------------------ helpers
def _listify(value: Any, kind: type, what: str) -> tuple[list[Any], Optional[type]]:
    """Return (items, container type or None when a single object was given)."""
    if isinstance(value, kind):
        return [value], None
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, kind) for v in value):
        return list(value), type(value)
    raise AmpTypeError(
        f"{PACKAGE}.initialize: {what} must be a {kind.__module__}.{kind.__qualname__} or a non-empty "
        f"list of them, got {type(value).__name__}"
    )


def _restructure(items: list[Any], container: Optional[type]) -> Any:
    return items[0] if container is None else container(items)


def _per_model(value: Any, count: int, listed: bool, what: str) -> list[Any]:
    """Spread ``example_inputs`` over the models: one entry per model when models came as a list."""
    if value is None:
        return [None] * count
    if not listed:
        return [value]
    if not isinstance(value, (list, tuple)) or len(value) != count:
        raise AmpValueError(
            f"{what}: models were passed as a list of {count}, so give one entry per model "
            "(None for models that need none), e.g. [(x1,), None]"
        )
    return list(value)


def _seen(obj: Any) -> bool:
    try:
        return obj in _SEEN
    except TypeError:  # unhashable (a class with __eq__ and no __hash__): never weakly tracked
        return False


def _check_fresh_model(model: nn.Module) -> None:
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        raise AlreadyInitializedError(
            f"{PACKAGE}.initialize got a model already wrapped in {type(model).__name__}. Initialize the "
            "bare model first, then wrap what it returns: model, optimizer = amp_fx.initialize(model, "
            f"optimizer, opt_level=...); model = {type(model).__name__}(model, ...)."
        )
    if any(type(m).__name__.startswith("FSDP") and hasattr(m, "_get_fsdp_state") for m in model.modules()):
        raise AlreadyInitializedError(  # FSDP2 (fully_shard); see amp_fx.runtime.distributed
            f"{PACKAGE}.initialize got a model sharded by fully_shard. initialize does not support FSDP2, in "
            "either order: it converts the model into one graph that never calls the blocks FSDP2 gathers, "
            "and fits an optimizer that fully_shard's new parameters would bypass. Use the GradScaler-style "
            "API in this order: gm = amp_fx.runtime.convert_for_sharding(model, level, blocks=Block); "
            "fully_shard each block, then gm; build the optimizer over gm.parameters() (O2: "
            "MasterWeightOptimizer(torch.optim.X(model.parameters()), gm)); amp_fx.LossScaler()."
        )
    if _seen(model) or (isinstance(model, AmpGraphModule) and hasattr(model, "amp_config")):
        raise AlreadyInitializedError(
            f"{PACKAGE}.initialize was already called on this model (or it is the module initialize/convert "
            "returned). Call initialize once, with all models and optimizers, and keep using what it "
            "returned; to change the level, start again from a fresh fp32 model and optimizer."
        )


def _check_fresh_optimizer(optimizer: torch.optim.Optimizer) -> None:
    if _seen(optimizer) or hasattr(optimizer, _STASH):
        raise AlreadyInitializedError(
            f"{PACKAGE}.initialize was already called on this optimizer (or it is one initialize returned). "
            "Call initialize once, with all models and optimizers, and keep using what it returned."
        )


def _record_of(optimizer: Any) -> OptimizerRecord:
    record = optimizer.__dict__.get(_STASH) if hasattr(optimizer, "__dict__") else None
    if record is None:
        raise AmpRuntimeError(
            f"{PACKAGE}.scale_loss got an optimizer that {PACKAGE}.initialize did not return. Pass the "
            "optimizer(s) returned by model, optimizer = amp_fx.initialize(model, optimizer, ...) "
            "(at O2 that is a MasterWeightOptimizer wrapping yours)."
        )
    return record


# --------------------------------------------------------------- initialize
def initialize(
    models: Any,
    optimizers: Any = None,
    opt_level: str = "O1",
    *,
    example_inputs: Any = None,
    example_kwarg_inputs: Any = None,
    **properties: Any,
) -> Any:
    """Convert models for mixed precision and fit their optimizers, as ``apex.amp.initialize`` did.

    Args:
        models: a module or a list/tuple of modules (not yet wrapped in DDP/DataParallel).
            A ``torch.compile``d module is accepted: the module inside it is
            converted, and the result comes back compiled with the same settings.
        optimizers: None, an optimizer or a list/tuple of them, built over the
            models' (fp32) parameters.
        opt_level: ``"O0"``-``"O3"`` (see :func:`amp_fx.convert`).
        example_inputs, example_kwarg_inputs: forwarded to :func:`amp_fx.convert`
            (one entry per model when ``models`` is a list).
        **properties: Apex's ``cast_model_type``, ``keep_batchnorm_fp32``,
            ``master_weights``, ``loss_scale`` (a number or ``"dynamic"``),
            ``cast_model_outputs``, ``num_losses``, ``min_loss_scale``,
            ``max_loss_scale``, ``verbosity``; ``dtype=`` (the low dtype);
            ``fp32_grad_accumulation=True`` (O2: micro-batch gradients summed in the
            fp32 masters, :class:`~amp_fx.runtime.MasterWeightOptimizer`);
            ``compiled_update=`` (O2: that wrapper's option; left None, it is on
            where the model given was ``torch.compile``d); and any other keyword
            of :func:`amp_fx.convert` (``policy=``, ...).

    Returns:
        The converted model(s), and when ``optimizers`` was given the fitted
        optimizer(s), each in the structure it was passed in. O0/O1 return the
        optimizer unchanged; O2 a :class:`~amp_fx.runtime.MasterWeightOptimizer`
        stepping the original fp32 parameters; O3 the optimizer re-pointed at the
        converted module's low-precision parameters.
    """
    global _current
    model_list, model_box = _listify(models, nn.Module, "models")
    # torch.compile(model): convert the module inside, and compile the result the same way.
    recompile = [m if is_compiled(m) else None for m in model_list]
    given_models = list(model_list)
    model_list = [unwrap_compiled(m) for m in model_list]
    opt_list, opt_box = ([], None) if optimizers is None else _listify(
        optimizers, torch.optim.Optimizer, "optimizers")
    if len({id(m) for m in model_list}) != len(model_list) or len({id(o) for o in opt_list}) != len(opt_list):
        raise AmpValueError(f"{PACKAGE}.initialize: the same model or optimizer appears twice in the lists")
    for model in model_list:
        _check_fresh_model(model)
    for optimizer in opt_list:
        _check_fresh_optimizer(optimizer)
    props = resolve_properties(opt_level, properties)
    examples = _per_model(example_inputs, len(model_list), model_box is not None, "example_inputs")
    kw_examples = _per_model(example_kwarg_inputs, len(model_list), model_box is not None, "example_kwarg_inputs")

    owners: dict[int, tuple[int, str]] = {}
    for index, model in enumerate(model_list):
        for name, param in model.named_parameters():
            owners.setdefault(id(param), (index, name))
    for optimizer in opt_list:  # before anything is converted or changed
        check_ownership(optimizer, owners)

    converted = [
        convert(m, props.level, example_inputs=ex, example_kwarg_inputs=kx, **props.convert_kwargs)
        for m, ex, kx in zip(model_list, examples, kw_examples)
    ]
    dtype = torch.float32 if props.level == "O0" else converted[0].amp_config.low_dtype
    for gm in converted:  # the config reports what initialize really set up (bf16: no loss scaling)
        gm.amp_config = dataclasses.replace(
            gm.amp_config, master_weights=props.master_weights, loss_scale=reported_loss_scale(props, dtype))
    session = _Session(props, build_scalers(props, dtype))

    fitted = []
    for optimizer in opt_list:
        result, record = fit_optimizer(
            optimizer, owners, converted, cast_params=props.cast_params, master_weights=props.master_weights,
            fp32_grad_accumulation=props.fp32_grad_accumulation, compiled_update=props.compiled_update,
            compiled_model=any(ctx is not None for ctx in recompile))
        record.session = session
        setattr(result, _STASH, record)
        fitted.append(result)
    returned = [gm if compiled is None else compiled_like(compiled, gm) for gm, compiled in zip(converted, recompile)]
    for obj in (*given_models, *model_list, *converted, *returned, *opt_list, *fitted):
        try:
            _SEEN.add(obj)
        except TypeError:
            pass  # unhashable: the stash attribute / amp_config still mark what can be marked
    _current = session
    if props.verbosity:
        logger.info("%s; loss scaler(s): %s", props.describe(), session.scalers)

    out_models = _restructure(returned, model_box)
    if optimizers is None:
        return out_models
    return out_models, _restructure(fitted, opt_box)


# --------------------------------------------------------------- scale_loss
@contextlib.contextmanager
def scale_loss(
    loss: Any,
    optimizers: Any,
    loss_id: int = 0,
    model: Any = None,
    delay_unscale: bool = False,
) -> Iterator[Any]:
    """Yield ``loss`` times loss ``loss_id``'s scale, in fp32; on exit unscale, check and update the scale.

    After the block the gradients of ``optimizers`` are unscaled (at O2: the
    fp32 master gradients, readable right away, e.g. to clip them). If they
    hold inf/NaN, the next ``optimizer.step()`` of every optimizer passed
    does nothing and returns False (once), and the scale backs off (Apex: an
    optimizer steps only if no loss scaled into it this iteration overflowed). Gradients
    already there from an earlier block (another loss) are set aside during the
    backward and added back after unscaling, so each loss is unscaled by its
    own scale.

    ``delay_unscale=True`` leaves the gradients scaled (no check, no update)
    so that more blocks can accumulate into them with the same scale; the last
    block of the accumulation must use ``delay_unscale=False``. ``model`` is
    accepted for Apex compatibility and ignored.
    """
    del model  # Apex accepted it; nothing here needs it
    opts = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    if not opts:
        raise AmpValueError(f"{PACKAGE}.scale_loss needs at least one optimizer")
    records = [_record_of(o) for o in opts]
    session = records[0].session
    if any(r.session is not session for r in records):
        raise AmpRuntimeError(f"{PACKAGE}.scale_loss: the optimizers come from different {PACKAGE}.initialize calls")
    if not 0 <= loss_id < len(session.scalers):
        raise AmpIndexError(
            f"loss_id={loss_id}, but amp_fx.initialize set up {len(session.scalers)} loss scaler(s); "
            f"pass num_losses={loss_id + 1} (or more) to initialize to give each loss its own scaler."
        )
    scaler = session.scalers[loss_id]
    for record in records:
        record.stash_grads()
    if isinstance(loss, torch.Tensor) and loss.dtype in (torch.float16, torch.bfloat16):
        loss = loss.float()  # as Apex (loss.float() * scale): an fp16 loss times 2**16 overflows
    try:
        yield scaler.scale(loss)
    except BaseException:
        for record in records:  # leave the earlier losses' gradients where they were
            if not record.scaled:
                record.restore_grads()
        raise
    if delay_unscale:
        for record in records:
            record.scaled = True
        return
    active = [r for r in records if r.has_new_grads()]
    if not active:
        for record in records:
            record.restore_grads()
            record.scaled = False
        raise AmpRuntimeError(
            f"{PACKAGE}.scale_loss: the backward pass inside the block gave no gradient to any parameter of "
            "the optimizer(s) passed; call scaled_loss.backward() inside the block, and pass the "
            "optimizers whose parameters the loss depends on."
        )
    overflow = False
    for record in active:
        # Unscale (at O2 into the fp32 master grads) and check, one host sync per optimizer.
        overflow |= not scaler._begin_step(record.optimizer)
    if overflow:
        # As Apex: an overflowing loss skips the next step of every optimizer it was scaled
        # into, also those whose own gradients from it were finite (a half-applied update
        # of a shared loss would be one no precision computes).
        for record in records:
            record.skip_next_step()
    for record in records:
        record.restore_grads()
        record.scaled = False
    scaler.update()


# ------------------------------------------------------------- checkpoints
def _session() -> _Session:
    if _current is None:
        raise AmpRuntimeError(f"{PACKAGE}.initialize has not been called: there are no loss scalers yet")
    return _current


def loss_scalers() -> list[LossScaler]:
    """The :class:`LossScaler` of each loss (``loss_id`` order) from the latest ``initialize``."""
    return list(_session().scalers)


def state_dict(destination: Optional[dict] = None) -> dict:
    """Return every loss scaler's state, keyed ``"loss_scaler<i>"`` as Apex did."""
    out = OrderedDict() if destination is None else destination
    for index, scaler in enumerate(_session().scalers):
        out[f"loss_scaler{index}"] = scaler.state_dict()
    return out


def load_state_dict(state: dict) -> None:
    """Restore the loss scalers' states saved by :func:`state_dict` (same ``num_losses``)."""
    scalers = _session().scalers
    keys = sorted((k for k in state if k.startswith("loss_scaler")), key=lambda k: int(k[len("loss_scaler"):]))
    if len(keys) != len(scalers) or len(keys) != len(state):
        raise AmpValueError(
            f"the amp_fx state holds {len(keys)} loss scaler(s) ({sorted(state)}), but initialize set up "
            f"{len(scalers)}; call initialize with num_losses={len(keys)} as when it was saved."
        )
    for index, scaler in enumerate(scalers):
        scaler.load_state_dict(state[f"loss_scaler{index}"])


def master_params(optimizer: Any) -> list[torch.Tensor]:
    """The tensors ``optimizer`` steps (fp32 masters at O2), as a list: a script may keep it and clip it every step.

    Apex returned a generator, which a script that stores it once exhausts at the first clip. Clipping
    ``model.parameters()`` after ``scale_loss`` works as well (at O2 the clip reaches the masters).
    """
    return [p for group in optimizer.param_groups for p in group["params"]]
