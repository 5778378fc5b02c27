"""Apex ``amp.initialize`` properties: resolve them against a level and build the loss scalers.

Apex named the knobs of a level ``cast_model_type``, ``keep_batchnorm_fp32``,
``master_weights``, ``loss_scale``, ... ; this module maps them onto
:func:`amp_fx.convert`'s keywords and :class:`~amp_fx.runtime.LossScaler`'s
settings, rejecting combinations that would silently do something else.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from amp_fx.converter.api import convert
from amp_fx.ir.config import LEVELS, AmpConfig, make_config, parse_dtype
from amp_fx.runtime import LossScaler
from amp_fx.runtime.compiled_update import check_compiled_update
from amp_fx.errors import PACKAGE, AmpTypeError, AmpValueError, did_you_mean

__all__ = ["AmpProperties", "resolve_properties", "build_scalers", "reported_loss_scale", "APEX_PROPERTIES",
           "OPTIMIZER_PROPERTIES"]

APEX_PROPERTIES = (
    "cast_model_type", "keep_batchnorm_fp32", "master_weights", "loss_scale", "cast_model_outputs",
    "num_losses", "min_loss_scale", "max_loss_scale", "verbosity", "dtype",
)
# amp_fx's own options of the optimizer initialize fits (not Apex's): MasterWeightOptimizer's keywords.
OPTIMIZER_PROPERTIES = ("fp32_grad_accumulation", "compiled_update")
# Every other keyword convert() takes is passed through (policy=, leaf_modules=, ...).
_CONVERT_KEYWORDS = tuple(
    name for name, p in inspect.signature(convert).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in ("example_inputs", "example_kwarg_inputs")
)
# convert() keywords that are AmpConfig fields: checked by make_config before anything is converted.
_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(AmpConfig)) - {"level", "op_mode"}
_DYNAMIC_INIT_SCALE = 2.0**16
_DEFAULT_MAX_SCALE = 2.0**24


@dataclass
class AmpProperties:
    """The resolved properties of one ``initialize`` call."""

    level: str
    convert_kwargs: dict[str, Any]
    master_weights: bool
    loss_scale: Union[float, str]
    loss_scale_explicit: bool
    num_losses: int = 1
    min_loss_scale: Optional[float] = None
    max_loss_scale: float = _DEFAULT_MAX_SCALE
    verbosity: int = 1
    cast_params: bool = False
    fp32_grad_accumulation: bool = False
    # MasterWeightOptimizer's compiled_update= (None: on where the model given was torch.compile'd).
    compiled_update: Union[bool, str, None] = None

    def describe(self) -> str:
        """One line naming every property, as Apex printed at initialize."""
        kw = ", ".join(f"{k}={v}" for k, v in self.convert_kwargs.items() if v is not None)
        return (
            f"{PACKAGE}.initialize: opt_level={self.level} master_weights={self.master_weights} "
            f"loss_scale={self.loss_scale} num_losses={self.num_losses}" + (f" {kw}" if kw else "")
        )


def _as_bool(name: str, value: Any) -> Optional[bool]:
    # Apex accepted the strings "True"/"False" (they came from argparse).
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str) and value in ("True", "False"):
        return value == "True"
    raise AmpValueError(f"{name} must be True, False or None, got {value!r}")


def _parse_loss_scale(value: Any) -> Union[float, str]:
    if value == "dynamic":
        return "dynamic"
    try:
        scale = float(value)
    except (TypeError, ValueError):
        raise AmpValueError(f"loss_scale must be a positive number or 'dynamic', got {value!r}") from None
    if not scale > 0 or scale == float("inf"):
        raise AmpValueError(f"loss_scale must be a positive finite number or 'dynamic', got {value!r}")
    return scale


def _model_dtype(level: str, cast_model_type: Any, dtype: Any) -> Optional[torch.dtype]:
    """Fold Apex's ``cast_model_type`` into ``dtype=`` (the two must agree)."""
    low = parse_dtype(dtype)
    if cast_model_type is None:
        return low
    if cast_model_type == torch.float32:
        if level in ("O2", "O3"):
            raise AmpValueError(
                f"cast_model_type=torch.float32 at {level} would keep fp32 parameters, which is what "
                "O1 does (fp32 parameters, op tables pick each op's precision). Use opt_level='O1', "
                "or a low dtype (torch.float16 / torch.bfloat16)."
            )
        return low
    cast = parse_dtype(cast_model_type, what="cast_model_type")
    if level in ("O0", "O1"):
        raise AmpValueError(
            f"cast_model_type={cast_model_type} at {level}: this level keeps fp32 parameters. "
            "Pass dtype= to choose the low dtype the ops run in, or use O2/O3 to cast the parameters."
        )
    if low is not None and low != cast:
        raise AmpValueError(f"cast_model_type={cast} and dtype={low} disagree; pass only one of them")
    return cast


def resolve_properties(opt_level: str, properties: dict[str, Any]) -> AmpProperties:
    """Check Apex properties (and convert() keywords) against ``opt_level`` and resolve them."""
    unknown = sorted(set(properties) - set(APEX_PROPERTIES) - set(OPTIMIZER_PROPERTIES) - set(_CONVERT_KEYWORDS))
    if unknown:
        raise AmpTypeError(
            f"unknown amp_fx.initialize propert{'y' if len(unknown) == 1 else 'ies'} {unknown}."
            f"{did_you_mean(unknown, [*APEX_PROPERTIES, *OPTIMIZER_PROPERTIES, *_CONVERT_KEYWORDS], n=1)} "
            f"Apex properties: {list(APEX_PROPERTIES)}; optimizer options: {list(OPTIMIZER_PROPERTIES)}; other "
            f"keywords of amp_fx.convert: {[k for k in _CONVERT_KEYWORDS if k not in APEX_PROPERTIES]}."
        )
    props = dict(properties)
    if not isinstance(opt_level, str) or opt_level.upper() not in LEVELS:
        make_config(opt_level)  # raises the level error with its explanation
    level = opt_level.upper()
    dtype = _model_dtype(level, props.pop("cast_model_type", None), props.pop("dtype", None))
    keep_bn = _as_bool("keep_batchnorm_fp32", props.pop("keep_batchnorm_fp32", None))
    if keep_bn is not None and level in ("O0", "O1"):
        # O0/O1 parameters are fp32 anyway; Apex refused this combination too.
        if keep_bn is False:
            raise AmpValueError(
                f"keep_batchnorm_fp32=False at {level}: parameters stay fp32 at this level, so there is "
                "nothing to cast. Use O2 or O3 to run batch norm in low precision."
            )
        keep_bn = None
    preset = make_config(level)
    master = _as_bool("master_weights", props.pop("master_weights", None))
    if master is None:
        master = preset.master_weights
    explicit_scale = "loss_scale" in props and props["loss_scale"] is not None
    loss_scale = _parse_loss_scale(props.pop("loss_scale")) if explicit_scale else preset.loss_scale
    props.pop("loss_scale", None)
    num_losses = int(props.pop("num_losses", 1) or 1)
    if num_losses < 1:
        raise AmpValueError(f"num_losses must be >= 1, got {num_losses}")
    min_s = props.pop("min_loss_scale", None)
    max_s = props.pop("max_loss_scale", None)
    max_s = _DEFAULT_MAX_SCALE if max_s is None else float(max_s)
    min_s = None if min_s is None else float(min_s)
    if min_s is not None and min_s > max_s:
        raise AmpValueError(f"min_loss_scale={min_s} is above max_loss_scale={max_s}")
    verbosity = int(props.pop("verbosity", 1) or 0)
    accumulate = _fp32_accumulation(level, bool(master) and preset.cast_params, props.pop("fp32_grad_accumulation", False))
    compiled_update = _compiled_update(level, bool(master) and preset.cast_params, props.pop("compiled_update", None))
    cast_outputs = props.pop("cast_model_outputs", None)
    convert_kwargs = dict(props, dtype=dtype, keep_batchnorm_fp32=keep_bn, cast_model_outputs=cast_outputs)
    make_config(level, **{k: v for k, v in convert_kwargs.items() if k in _CONFIG_FIELDS})  # validate early
    return AmpProperties(
        level=level, convert_kwargs=convert_kwargs, master_weights=bool(master) and preset.cast_params,
        loss_scale=loss_scale, loss_scale_explicit=explicit_scale, num_losses=num_losses,
        min_loss_scale=min_s, max_loss_scale=max_s, verbosity=verbosity, cast_params=preset.cast_params,
        fp32_grad_accumulation=accumulate, compiled_update=compiled_update,
    )


def _fp32_accumulation(level: str, masters: bool, value: Any) -> bool:
    """Check ``fp32_grad_accumulation``: it sums micro-batch gradients in O2's fp32 masters, so only there."""
    if not isinstance(value, bool):
        raise AmpValueError(f"fp32_grad_accumulation must be True or False, got {value!r}")
    if value and not masters:
        why = ("parameters and their gradients are fp32 already at this level" if level in ("O0", "O1") else
               "it adds each low-precision gradient into an fp32 master, and this setup has none")
        raise AmpValueError(
            f"fp32_grad_accumulation=True at opt_level={level}"
            f"{' with master_weights=False' if level == 'O2' else ''}: {why}. Use opt_level='O2' with master "
            "weights (the default) to accumulate gradients in fp32, or leave the option out.")
    return value


def _compiled_update(level: str, masters: bool, value: Any) -> Union[bool, str, None]:
    """Check ``compiled_update`` as MasterWeightOptimizer does; asking for it needs O2's masters (it steps them)."""
    check_compiled_update(value)
    if value is not None and value is not False and not masters:
        raise AmpValueError(
            f"compiled_update={value!r} at opt_level={level}"
            f"{' with master_weights=False' if level == 'O2' else ''}: the compiled update steps O2's fp32 master "
            "weights, and this setup has none (the optimizer steps the parameters itself). Use opt_level='O2' with "
            "master weights (the default), or leave the option out.")
    return value


def reported_loss_scale(props: AmpProperties, dtype: torch.dtype) -> Union[float, str]:
    """The loss scale the scalers of :func:`build_scalers` really use: 1.0 (off) where bf16 or fp32 needs none.

    ``"dynamic"`` is the level's default; without an explicit ``loss_scale`` it only scales fp16, so the
    config of a bf16 model must not say it scales.
    """
    if props.loss_scale == "dynamic" and not props.loss_scale_explicit and dtype != torch.float16:
        return 1.0
    return props.loss_scale


def build_scalers(props: AmpProperties, dtype: torch.dtype) -> list[LossScaler]:
    """One :class:`LossScaler` per loss, set up as Apex's were, knowing the model's ``dtype``.

    ``"dynamic"`` starts at ``min(2**16, max_loss_scale)``; with bf16 (or fp32 at
    O0) scaling stays off unless ``loss_scale`` was passed explicitly. A static
    scale of 1.0 is "scaling off": losses pass through, and steps whose
    gradients hold inf/NaN are still skipped.
    """
    common = dict(dtype=dtype, level=props.level, log_every=100 if props.verbosity else 10**9)
    kwargs: dict[str, Any]
    if props.loss_scale == "dynamic":
        init = min(_DYNAMIC_INIT_SCALE, props.max_loss_scale)
        if props.min_loss_scale is not None:
            init = max(init, props.min_loss_scale)
        kwargs = dict(common, min_scale=props.min_loss_scale, max_scale=props.max_loss_scale)
        if props.loss_scale_explicit or dtype == torch.float16:
            kwargs.update(init_scale=init, dynamic=True)
    elif props.loss_scale == 1.0:
        kwargs = dict(common, enabled=False)
    else:
        kwargs = dict(common, init_scale=float(props.loss_scale), dynamic=False)
    return [LossScaler(**kwargs) for _ in range(props.num_losses)]
