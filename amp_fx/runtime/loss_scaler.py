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
"""

from __future__ import annotations

import logging
import math
import warnings
from collections import abc
from enum import Enum
from typing import Any, Callable

import torch
import torch.distributed as dist

from .collapse import ON_COLLAPSE, LossScaleCollapseError, collapse_error
from .distributed import reduce_over_ranks
from .optimizer_checks import warn_if_eps_underflows
from .overflow import check_and_unscale_, combined_found_inf, grads_of
from .scaler_options import NO_GRADS_FIX, NO_SCALING_DTYPES, PROMOTED_TO_FP32
from .scaler_options import Default as _Default
from .scaler_options import parse_scaler_dtype
from .scaler_state import LossScalerStateError, ScalerStateMixin, _fp32
from amp_fx.errors import AmpRuntimeError, AmpValueError, checks_keywords

__all__ = ["LossScaler", "LossScaleCollapseError", "LossScalerStateError"]

logger = logging.getLogger("amp_fx.runtime")


class _Stage(Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


class LossScaler(ScalerStateMixin):
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

    @checks_keywords("amp_fx.LossScaler")
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

    # ---------------------------------------------------------------- unscale
    def _state(self, optimizer: Any) -> dict[str, Any]:
        return self._per_optimizer.setdefault(
            id(optimizer), {"stage": _Stage.READY, "found_inf": {}, "found": None}
        )

    def unscale_(self, optimizer: Any) -> None:
        """Divide ``optimizer``'s gradients by the scale in place and check them for inf/NaN.

        Optional before :meth:`step` (e.g. to clip). At most once per optimizer
        per iteration while scaling; with scaling off it only checks.
        """
        if not self._checks:
            return
        state = self._state(optimizer)
        if self._scaling:
            if state["stage"] is _Stage.UNSCALED:
                raise AmpRuntimeError(
                    "unscale_() has already been called on this optimizer since the last "
                    "update(); unscaling again would divide its gradients by the scale twice. "
                    "Call scaler.unscale_(optimizer) at most once per iteration, after all "
                    "backward passes (scaler.step() does not unscale again)."
                )
            if state["stage"] is _Stage.STEPPED:
                raise AmpRuntimeError(
                    "unscale_() was called after step() on this optimizer; call "
                    "scaler.update() to end the iteration first."
                )
            self._require_scaled("unscale_")
        sync = getattr(optimizer, "_sync_grads_to_masters", None)
        if callable(sync):
            sync()
        # Reciprocal in double then fp32, as GradScaler: the same bits for any scale
        # (a scale decayed to 0 without a floor gives inf, as GradScaler's does).
        inv_scale = 1.0
        if self._scaling:
            inv_scale = _fp32(1.0 / self._loss_scale) if self._loss_scale else math.inf
        grads = grads_of(optimizer.param_groups)
        found = check_and_unscale_(grads, inv_scale)
        if dist.is_available() and dist.is_initialized():  # only sharded (DTensor) grads need other ranks
            found = reduce_over_ranks(found, grads)  # FSDP2: every rank agrees
        if not self._scaling and state["stage"] is _Stage.UNSCALED:
            for dev, flag in state["found_inf"].items():  # a re-check keeps earlier verdicts
                found[dev] = found[dev] + flag if dev in found else flag
        state.update(stage=_Stage.UNSCALED, found_inf=found, found=None)

    def _require_scaled(self, what: str) -> None:
        if not self._scaled_since_update:
            raise AmpRuntimeError(
                f"scaler.{what}(optimizer) was called, but scaler.scale(loss) was not called "
                "since the last update(): the gradients are not scaled, and unscaling them "
                f"would shrink them by {self._loss_scale}. Use scaler.scale(loss).backward() "
                "instead of loss.backward() in every iteration."
            )

    # ------------------------------------------------------------------- step
    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> bool:
        """Unscale (unless done), then ``optimizer.step(*args, **kwargs)`` if the gradients are finite.

        Returns True when the optimizer stepped, False when the step was skipped.
        """
        if self._scaling and "closure" in kwargs:
            raise AmpRuntimeError(
                "closures are not supported while scaling: the closure's backward would "
                "produce scaled gradients after they were checked. Compute the loss and "
                "call scaler.scale(loss).backward() before scaler.step(optimizer)."
            )
        warn_if_eps_underflows(optimizer)
        if not self._begin_step(optimizer):
            return False
        self._stepping = id(optimizer)
        try:
            optimizer.step(*args, **kwargs)
        finally:
            self._stepping = None
        return True

    def _is_stepping(self, optimizer: Any) -> bool:
        """True while :meth:`step` is inside ``optimizer.step()`` (lets wrappers not re-check)."""
        return self._stepping == id(optimizer)

    def _begin_step(self, optimizer: Any) -> bool:
        """Check ``optimizer``'s gradients (one host sync) and record the verdict; True = step."""
        if not self._checks:
            self._record_step(optimizer, True)
            return True
        state = self._state(optimizer)
        if state["stage"] is _Stage.STEPPED:
            if self._scaling:
                raise AmpRuntimeError(
                    "step() has already been called on this optimizer since the last "
                    "update(). Call scaler.update() once per iteration, after "
                    "scaler.step() for every optimizer."
                )
            state.update(stage=_Stage.READY, found_inf={})  # nothing scaled: just re-check
        if state["stage"] is _Stage.READY:
            if self._scaling:
                self._require_scaled("step")
            self.unscale_(optimizer)
        total = combined_found_inf(state["found_inf"])
        if total is None:
            if self._scaling:
                raise AmpRuntimeError(
                    "No inf checks were recorded for this optimizer: none of its parameters "
                    "has a gradient this iteration. Make sure the loss passed to "
                    "scaler.scale(loss).backward() depends on this optimizer's parameters "
                    "(with requires_grad=True), or do not call scaler.step() for an "
                    "optimizer whose parameters got no gradients. " + NO_GRADS_FIX
                )
            if not self._warned_no_grads:
                # GradScaler would raise here; without scaling we only warn (a frozen
                # optimizer is legal), once, because the usual cause trains nothing.
                self._warned_no_grads = True
                warnings.warn(
                    "scaler.step(optimizer): none of the optimizer's parameters has a gradient, so "
                    "nothing is updated. " + NO_GRADS_FIX, UserWarning, stacklevel=3,
                )
            found = False
        else:
            found = bool(total.item())  # the one host sync of this step
        state.update(stage=_Stage.STEPPED, found=found)
        if found:
            self.skipped_steps += 1
            self._unreported_skips += 1
            discard = getattr(optimizer, "_discard_synced_grads", None)
            if callable(discard):
                discard()
        self._record_step(optimizer, not found)
        return not found

    def _record_step(self, optimizer: Any, taken: bool) -> None:
        self._last_step_taken[id(optimizer)] = taken
        # Wrappers (MasterWeightOptimizer) expose the inner optimizer as .optimizer; a
        # scheduler may have been built over either one.
        inner = getattr(optimizer, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            self._last_step_taken[id(inner)] = taken

    def step_scheduler(self, scheduler: Any, *args: Any, **kwargs: Any) -> bool:
        """Call ``scheduler.step(*args, **kwargs)`` only if its optimizer's last ``step()`` was real.

        Use it in place of ``scheduler.step()`` right after ``scaler.step(opt)``
        (before or after ``update()``), once per iteration. Skipped steps then do
        not advance the schedule, and torch's "lr_scheduler.step() before
        optimizer.step()" warning is not triggered by a skipped first step.
        Returns whether the scheduler stepped.
        """
        optimizer = getattr(scheduler, "optimizer", None)
        taken = self._last_step_taken.get(id(optimizer))
        if taken is None:
            raise AmpRuntimeError(
                "step_scheduler(): scaler.step() was never called for this scheduler's "
                "optimizer; call scaler.step(optimizer) first (build the scheduler over "
                "the optimizer you pass to scaler.step)."
            )
        if taken:
            scheduler.step(*args, **kwargs)
        return taken

    # ----------------------------------------------------------------- update
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
