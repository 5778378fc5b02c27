"""Dynamic/static loss scaling that speaks ``torch.amp.GradScaler``'s protocol.

``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()`` works
unchanged. What differs from GradScaler, and why:

* A step whose gradients hold inf/NaN is skipped in every mode (dynamic,
  static, bf16, disabled): one NaN update ruins the weights, whatever the dtype.
  ``skip_nonfinite=False`` restores GradScaler's behaviour.
* ``hysteresis`` (DeepSpeed): back off only after that many consecutive
  overflowing iterations; ``max_scale``/``min_scale`` bound the scale, and
  overflowing at ``min_scale`` raises :class:`LossScaleCollapseError`.
* ``step()`` returns whether the optimizer really stepped; ``skipped_steps``
  counts the skips and :meth:`LossScaler.step_scheduler` advances an LR
  scheduler only after real steps.
* The scale lives on the host as a float. ``step()`` must read the inf verdict
  anyway to return its bool, so keeping the scale there costs nothing more, and
  ``update()``/``get_scale()`` then need no device sync at all: one ``.item()``
  per optimizer step, none per parameter.
* Optimizers exposing ``_sync_grads_to_masters()`` (:class:`MasterWeightOptimizer`)
  get it called before their gradients are checked and unscaled.
* Gradients that are DTensor shards (FSDP2) are checked shard by shard and the
  verdict is summed over the ranks (one all-reduce per step), so an inf on one
  rank skips the step on all of them and the scale stays the same everywhere.

This module holds the settings and ``scale()``; ``unscale_``/``step``/``step_scheduler``
are in :mod:`~amp_fx.runtime.scaler_steps`, ``update()`` and the scale's growth and
backoff in :mod:`~amp_fx.runtime.scale_updates`, accessors and checkpoints in
:mod:`~amp_fx.runtime.scaler_state`.
"""

from __future__ import annotations

import math
from collections import abc
from typing import Any, Callable

import torch

from .collapse import ON_COLLAPSE, LossScaleCollapseError
from .scale_updates import ScaleUpdatesMixin
from .scaler_options import NO_SCALING_DTYPES, PROMOTED_TO_FP32
from .scaler_options import Default as _Default
from .scaler_options import parse_scaler_dtype
from .scaler_state import LossScalerStateError, ScalerStateMixin, _fp32
from .scaler_steps import ScalerStepsMixin
from amp_fx.errors import AmpValueError, checks_keywords

__all__ = ["LossScaler", "LossScaleCollapseError", "LossScalerStateError"]


class LossScaler(ScalerStepsMixin, ScaleUpdatesMixin, ScalerStateMixin):
    """Scale losses, skip non-finite steps and adapt the scale (GradScaler's protocol).

    Args:
        init_scale: initial scale (default ``2.**16``).
        growth_factor, backoff_factor, growth_interval: as in GradScaler.
        enabled: ``False`` turns scaling off; inf/NaN steps are still skipped
            unless ``skip_nonfinite=False``.
        dynamic: adapt the scale (default) or keep ``init_scale`` fixed.
        max_scale: growth never goes above it.
        min_scale: backoff never goes below it; overflowing while at it raises
            :class:`LossScaleCollapseError`. ``None``: no floor and no error.
        hysteresis: back off only after this many consecutive overflowing
            iterations (1 = every overflow, as GradScaler). Once reached, every
            further consecutive overflow backs off again; a clean step resets it.
        dtype: the low-precision dtype the model trains in (a dtype, or a name
            :func:`amp_fx.convert` accepts: ``"fp16"``, ``"half"``, ``"bf16"``). ``torch.float16`` or
            ``None`` scales like GradScaler. ``torch.bfloat16`` (and
            ``torch.float32``) turn scaling off by themselves (scale 1.0,
            ``is_enabled()`` False) unless the caller explicitly asks for
            scaling, which means passing ``init_scale`` (any value) or
            ``dynamic=True``. ``dynamic=False`` alone does not ask.
        skip_nonfinite: skip steps with inf/NaN gradients even when not scaling.
        log_every: log a summary of skipped steps (to ``amp_fx.runtime``) at the
            first skip and then at most once per ``log_every`` skips.
        on_collapse: ``"raise"`` (default) raises :class:`LossScaleCollapseError`
            when the scale collapses; ``"diagnose"`` also calls ``reproduce()``
            and runs :func:`amp_fx.find_overflow` on that step, putting the
            node that overflowed (and the policy that pins it) in the error.
        reproduce: for ``on_collapse="diagnose"``: a function with no
            arguments returning ``(converted_module, inputs[, target[,
            loss_fn]])`` (or an ``amp_fx.inspection.find_overflow.ReproStep``) for one step;
            keep the last batch and return it.
        level: the opt level this scaler serves (e.g. ``"O2"``); stored in
            :meth:`state_dict`, and a state saved for another level is refused.
    """

    @checks_keywords("LossScaler")
    def __init__(
        self,
        init_scale: float = _Default(2.0**16),  # type: ignore[assignment]
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        *,
        enabled: bool = True,
        dynamic: bool = _Default(True),  # type: ignore[assignment]
        max_scale: float = 2.0**24,
        min_scale: float | None = None,
        hysteresis: int = 1,
        dtype: torch.dtype | None = None,
        skip_nonfinite: bool = True,
        log_every: int = 100,
        level: str | None = None,
        on_collapse: str = "raise",
        reproduce: Callable[[], Any] | None = None,
    ) -> None:
        dtype = parse_scaler_dtype(dtype)
        asked = not isinstance(init_scale, _Default) or (
            not isinstance(dynamic, _Default) and bool(dynamic)
        )
        init_scale = init_scale.value if isinstance(init_scale, _Default) else init_scale
        dynamic = dynamic.value if isinstance(dynamic, _Default) else dynamic

        self._scaling = bool(enabled) and (dtype not in NO_SCALING_DTYPES or asked)
        # Whether gradients are checked at all: always while scaling (GradScaler),
        # otherwise only to skip non-finite steps.
        self._checks = self._scaling or skip_nonfinite
        self._dynamic = bool(dynamic)
        self._dtype = dtype
        self._level = level
        self._skip_nonfinite = skip_nonfinite
        if self._scaling:
            if not (init_scale > 0 and math.isfinite(init_scale)):
                raise AmpValueError(f"init_scale must be a positive finite number, got {init_scale}")
            if self._dynamic:
                if growth_factor <= 1.0:
                    raise AmpValueError(f"growth_factor must be > 1.0, got {growth_factor}")
                if not 0.0 < backoff_factor < 1.0:
                    raise AmpValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
                if int(growth_interval) < 1 or int(hysteresis) < 1:
                    raise AmpValueError("growth_interval and hysteresis must be >= 1")
                if init_scale > max_scale or (min_scale is not None and init_scale < min_scale):
                    raise AmpValueError(
                        f"init_scale {init_scale} is outside [min_scale, max_scale] = "
                        f"[{min_scale}, {max_scale}]"
                    )
        if on_collapse not in ON_COLLAPSE:
            raise AmpValueError(f"on_collapse must be one of {ON_COLLAPSE}, got {on_collapse!r}")
        if on_collapse == "diagnose" and reproduce is None:
            raise AmpValueError(
                "on_collapse='diagnose' needs reproduce=: a function with no arguments returning "
                "(converted_module, inputs[, target[, loss_fn]]) for a step that overflows"
            )
        self._on_collapse = on_collapse
        self._reproduce = reproduce
        if log_every < 1:
            raise AmpValueError(f"log_every must be >= 1, got {log_every}")
        self._init_scale = _fp32(float(init_scale))
        self._loss_scale = self._init_scale
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = int(growth_interval)
        self._hysteresis = int(hysteresis)
        self._max_scale = float(max_scale)
        self._min_scale = None if min_scale is None else float(min_scale)
        self._growth_tracker = 0  # consecutive clean iterations since the last change
        self._overflow_streak = 0  # consecutive overflowing iterations (hysteresis)
        self.skipped_steps = 0
        self._log_every = int(log_every)
        self._unreported_skips = 0
        self._reported = False
        self._per_optimizer: dict[int, dict[str, Any]] = {}
        self._scaled_since_update = False
        self._last_step_taken: dict[int, bool] = {}
        self._stepping: int | None = None
        self._warned_no_grads = False

    # ------------------------------------------------------------------ scale
    def scale(self, outputs: Any) -> Any:
        """Multiply a loss (or a nested list/tuple/dict/iterable of them) by the scale.

        As from GradScaler, a 0-dim fp16/bf16 loss comes back fp32 (its scaled
        value would overflow fp16); a tensor with dimensions keeps its dtype.
        When scaling is off the argument comes back as is (the same object).
        """
        if not self._scaling:
            return outputs
        self._scaled_since_update = True
        return self._apply_scale(outputs)

    def _apply_scale(self, val: Any) -> Any:
        if isinstance(val, torch.Tensor):
            # GradScaler multiplies by a 0-dim fp32 tensor, and type promotion makes a
            # 0-dim fp16/bf16 loss fp32 (6.3 * 65536 would overflow fp16); a loss with
            # dimensions keeps its dtype. A host float would not promote, so promote
            # first; the scale is fp32-exact and needs no host-to-device copy.
            if val.dim() == 0 and val.dtype in PROMOTED_TO_FP32:
                val = val.float()
            return val * self._loss_scale
        if isinstance(val, abc.Mapping):
            return type(val)((k, self._apply_scale(v)) for k, v in val.items())
        if isinstance(val, abc.Iterable) and not isinstance(val, (str, bytes)):
            scaled = map(self._apply_scale, val)
            return type(val)(scaled) if isinstance(val, (list, tuple)) else scaled
        raise AmpValueError(f"scale() takes a Tensor or an iterable of Tensors, got {type(val).__name__}")
