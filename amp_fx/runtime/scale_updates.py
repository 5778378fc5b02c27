"""The loss scale's state machine: ``LossScaler.update()`` grows, backs off or collapses the scale, and logs skips.

The scale is a host float rounded to fp32 after every change (:func:`_fp32`),
so the sequence of scales is bit-identical to GradScaler's for any growth or
backoff factor; ``hysteresis``, ``max_scale`` and ``min_scale`` (DeepSpeed's
bounds) add to GradScaler's growth/backoff rule.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable

import torch

from .collapse import collapse_error
from .overflow import combined_found_inf
from .scaler_state import ScalerStateMixin, _fp32
from amp_fx.errors import AmpRuntimeError, AmpValueError

__all__ = ["ScaleUpdatesMixin"]

logger = logging.getLogger(__package__)  # amp_fx.runtime: one logger for the loss scaler family


class ScaleUpdatesMixin(ScalerStateMixin):
    """``update()`` and the growth/backoff/hysteresis rule for LossScaler (which sets the fields).

    On the state mixin: the scale's settings and trackers are the fields it
    declares and checkpoints, and the skip log reads :meth:`get_scale`.
    """

    # Fields owned by LossScaler.__init__ (besides ScalerStateMixin's).
    _checks: bool
    _on_collapse: str
    _reproduce: Callable[[], Any] | None
    _log_every: int
    _unreported_skips: int
    _reported: bool
    _per_optimizer: dict[int, dict[str, Any]]
    _scaled_since_update: bool
    skipped_steps: int

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """End the iteration: adapt the scale (or set ``new_scale``) and forget per-optimizer state.

        Backs off if any optimizer saw inf/NaN this iteration (after ``hysteresis``
        consecutive such iterations); grows after ``growth_interval`` clean ones.
        """
        if not self._checks:
            return
        states, self._per_optimizer = self._per_optimizer, {}
        scaled, self._scaled_since_update = self._scaled_since_update, False
        if not self._scaling:
            self._report_skips()
            return
        if new_scale is not None:
            if isinstance(new_scale, torch.Tensor):
                if new_scale.numel() != 1 or new_scale.requires_grad:
                    raise AmpValueError("new_scale must be a float or a 1-element tensor without grad")
                new_scale = new_scale.item()
            self._loss_scale = _fp32(float(new_scale))
            self._report_skips()
            return
        verdicts = []
        for state in states.values():
            if state["found"] is not None:
                verdicts.append(state["found"])
            elif state["found_inf"]:  # unscaled but never stepped: read it now
                verdicts.append(bool(combined_found_inf(state["found_inf"]).item()))
        if not verdicts:
            raise AmpRuntimeError(
                "No inf checks were recorded prior to update(): call scaler.step(optimizer) "
                "(or scaler.unscale_(optimizer)) for each optimizer before scaler.update()"
                + ("." if scaled else ", and scale the loss with scaler.scale(loss).")
            )
        if self._dynamic:
            self._adapt(any(verdicts))
        self._report_skips()

    def _adapt(self, overflow: bool) -> None:
        if not overflow:
            self._overflow_streak = 0
            self._growth_tracker += 1
            if self._growth_tracker >= self._growth_interval:
                grown = _fp32(self._loss_scale * self._growth_factor)
                if math.isfinite(grown):
                    self._loss_scale = min(grown, self._max_scale)
                self._growth_tracker = 0
            return
        self._growth_tracker = 0
        self._overflow_streak += 1
        if self._overflow_streak < self._hysteresis:
            return
        if self._min_scale is not None and self._loss_scale <= self._min_scale:
            raise collapse_error(self._min_scale, self._overflow_streak, self._loss_scale,
                                 self._on_collapse, self._reproduce)
        backed_off = _fp32(self._loss_scale * self._backoff_factor)
        if self._min_scale is not None:
            backed_off = max(backed_off, self._min_scale)
        self._loss_scale = backed_off

    def _report_skips(self) -> None:
        n = self._unreported_skips
        if n == 0 or (self._reported and n < self._log_every):
            return
        # Early overflows are how a dynamic scale calibrates; anywhere else they mean
        # the model itself produced inf/NaN.
        level = logging.INFO if (self._scaling and self._dynamic) else logging.WARNING
        logger.log(
            level,
            "skipped %d optimizer step(s) with inf/NaN gradients since the last report "
            "(%d in total); loss scale is now %s",
            n, self.skipped_steps, self.get_scale(),
        )
        self._unreported_skips = 0
        self._reported = True
