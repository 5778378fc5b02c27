"""The frozen conversion config: Apex's levels O0-O3 and their overrides.

A level is a preset of properties; every property can be overridden by
keyword.  Precedence: explicit keyword > level preset.  ``dtype=None`` is
resolved by :meth:`AmpConfig.for_device` from the model's device type
(float16 on CUDA, bfloat16 elsewhere, as autocast does).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from amp_fx.ir.devices import device_type_of, low_dtype_for
from amp_fx.ir.fp8_rules import Fp8Config, fp8_for_level, parse_fp8
from amp_fx.errors import PACKAGE, AmpTypeError, AmpValueError, unknown_options_error

__all__ = ["AmpConfig", "LEVELS", "make_config", "parse_dtype"]

LEVELS = ("O0", "O1", "O2", "O3")

# How ops get their precision at each level.
#   "none":   graph unchanged
#   "tables": allow / deny / promote tables decide (O1)
#   "all_low": everything low except norms (O2, O3)
_PRESETS: dict[str, dict[str, Any]] = {
    "O0": dict(op_mode="none", cast_params=False, keep_batchnorm_fp32=True,
               master_weights=False, loss_scale=1.0, cast_model_outputs=None),
    # O1 leaves most ops FOLLOW, so where the casts go is a real choice:
    # minimize_casts places them by min-cut. Floating outputs come back fp32, as
    # at O2/O3: the loss is computed outside the module, and autocast would have
    # run it (cross_entropy, mse_loss, ...) in fp32 from these same low logits.
    "O1": dict(op_mode="tables", cast_params=False, keep_batchnorm_fp32=True,
               master_weights=False, loss_scale="dynamic", cast_model_outputs=torch.float32,
               minimize_casts=True),
    "O2": dict(op_mode="all_low", cast_params=True, keep_batchnorm_fp32=True, keep_losses_fp32=True,
               master_weights=True, loss_scale="dynamic", cast_model_outputs=torch.float32),
    "O3": dict(op_mode="all_low", cast_params=True, keep_batchnorm_fp32=False, keep_losses_fp32=False,
               master_weights=False, loss_scale=1.0, cast_model_outputs=torch.float32),
}

_DTYPE_NAMES = {
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}
_UNKNOWN_OP_MODES = ("follow", "fp32", "error")
_PAD_MODES = ("auto", True, False)


def parse_dtype(dtype: Union[None, str, torch.dtype], *, what: str = "dtype") -> Optional[torch.dtype]:
    """Return the low-precision dtype named by ``dtype`` (None stays None); reject anything else."""
    if dtype is None:
        return None
    if isinstance(dtype, str) and dtype.lower() in _DTYPE_NAMES:
        return _DTYPE_NAMES[dtype.lower()]
    if dtype in (torch.float16, torch.bfloat16):
        return dtype
    raise AmpValueError(
        f"{what}={dtype!r} is not a low-precision dtype. "
        "Use torch.float16 or torch.bfloat16 (or the strings 'fp16' / 'bf16'); "
        "leave it None to pick float16 on CUDA and bfloat16 on CPU."
    )


@dataclass(frozen=True)
class AmpConfig:
    """Every property of a conversion, resolved from a level and overrides."""

    level: str = "O1"
    dtype: Optional[torch.dtype] = None
    op_mode: str = "tables"
    cast_params: bool = False
    keep_batchnorm_fp32: bool = True
    # O2: losses (cross_entropy, nll_loss, log_softmax, ...) computed inside the model stay fp32, as norms do;
    # False restores Apex's O2, which ran them low.  (At O1 the tables already keep them fp32.)
    keep_losses_fp32: bool = False
    master_weights: bool = False
    loss_scale: Union[float, str] = "dynamic"
    cast_model_outputs: Optional[torch.dtype] = None
    on_unknown_op: str = "follow"
    allow_banned: bool = False
    minimize_casts: bool = False
    pad_gemm: Union[str, bool] = "auto"
    fuse_precision: bool = True  # fp32 norms as fused mixed-dtype kernels where precision is kept (passes/fuse_precision)
    # Weight casts reused across forwards (amp_fx/graph_ops/cast_cache.py), keyed to each parameter's version:
    # True where autograd does not record them (inference); "training" in training too, so gradient accumulation
    # casts each weight once per optimizer step.  Opt-in: an in-place write through ``p.data`` (a hand-written
    # ``p.data -= lr * p.grad``) bypasses the version counter the cache is keyed to.
    cache_casts: Union[bool, str] = False
    # fp8 GEMMs (amp_fx/ir/fp8_rules.py, passes/fp8_gemms.py): None, or how eligible GEMMs run in fp8.
    fp8: Optional[Fp8Config] = None

    @property
    def low_dtype(self) -> torch.dtype:
        """The resolved low dtype (bfloat16 when no model told otherwise)."""
        return self.dtype or torch.bfloat16

    def for_device(self, device_type: str) -> "AmpConfig":
        """Return a copy whose unset ``dtype`` is autocast's for ``device_type`` (float16 on CUDA, else bfloat16)."""
        return self if self.dtype is not None else dataclasses.replace(self, dtype=low_dtype_for(device_type))

    def with_dtype_for(self, module: Optional[torch.nn.Module]) -> "AmpConfig":
        """Return a copy with ``dtype`` resolved from ``module``'s device type (:func:`amp_fx.ir.devices.device_type_of`)."""
        return self.for_device(device_type_of(module))

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-serialisable dict (dtypes as their names)."""
        out = dataclasses.asdict(self)
        for key in ("dtype", "cast_model_outputs"):
            if out[key] is not None:
                out[key] = str(out[key]).replace("torch.", "")
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "AmpConfig":
        """Rebuild a config written by :meth:`to_dict`."""
        data = dict(data)
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            keys = [f.name for f in dataclasses.fields(cls)]  # (a ValueError, as before: the data is wrong, not a call)
            raise AmpValueError(str(unknown_options_error(unknown, keys, "AmpConfig.from_dict", kind="key")))
        for key in ("dtype", "cast_model_outputs"):
            if isinstance(data.get(key), str):
                data[key] = getattr(torch, data[key])
        data["fp8"] = parse_fp8(data.get("fp8"))
        return cls(**data)


def make_config(level: str = "O1", **overrides: Any) -> AmpConfig:
    """Build an :class:`AmpConfig` from a level and keyword overrides (None means "level default")."""
    if not isinstance(level, str) or level.upper() not in LEVELS:
        raise AmpValueError(
            f"unknown level {level!r}: amp_fx knows Apex's levels {', '.join(LEVELS)} "
            "(O0 = fp32, O1 = op tables, O2 = low params with fp32 masters, O3 = everything low)."
        )
    level = level.upper()
    fields = {f.name for f in dataclasses.fields(AmpConfig)}
    bad = sorted(set(overrides) - fields)
    if bad:
        raise unknown_options_error(bad, fields - {"level", "op_mode"}, f"{PACKAGE}.make_config", kind="conversion option")
    defaults = {f.name: f.default for f in dataclasses.fields(AmpConfig)}
    settings = dict(defaults, **_PRESETS[level], level=level)
    settings.update({k: v for k, v in overrides.items() if v is not None})
    settings["dtype"] = parse_dtype(settings.get("dtype"))
    settings["fp8"] = fp8_for_level(level, settings.get("fp8"))
    if settings.get("cast_model_outputs") is False:  # "keep the outputs as the graph computes them"
        settings["cast_model_outputs"] = None
    if settings.get("cast_model_outputs") is not None and not isinstance(settings["cast_model_outputs"], torch.dtype):
        raise AmpValueError(
            f"cast_model_outputs must be a torch.dtype, False (keep the graph's dtypes) or None (the level's "
            f"default), got {settings['cast_model_outputs']!r}")
    for flag in ("keep_batchnorm_fp32", "keep_losses_fp32", "master_weights", "allow_banned", "minimize_casts", "cast_params", "fuse_precision"):
        if not isinstance(settings[flag], bool):
            raise AmpTypeError(f"{flag} must be True or False, got {settings[flag]!r}")
    if not (isinstance(settings["cache_casts"], bool) or settings["cache_casts"] == "training"):
        raise AmpTypeError(f"cache_casts must be False, True (inference: where autograd does not record the cast) or "
                           f"'training' (training too: one cast per optimizer step), got {settings['cache_casts']!r}")
    if settings["on_unknown_op"] not in _UNKNOWN_OP_MODES:
        raise AmpValueError(f"on_unknown_op must be one of {_UNKNOWN_OP_MODES}, got {settings['on_unknown_op']!r}")
    if settings["pad_gemm"] not in _PAD_MODES:
        raise AmpValueError(f"pad_gemm must be 'auto', True or False, got {settings['pad_gemm']!r}")
    loss_scale = settings["loss_scale"]
    if not (loss_scale == "dynamic" or isinstance(loss_scale, (int, float))):
        raise AmpValueError(f"loss_scale must be a number or 'dynamic', got {loss_scale!r}")
    return AmpConfig(**settings)
