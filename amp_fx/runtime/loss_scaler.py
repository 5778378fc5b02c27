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
* The scale lives on the host as a float, rounded to fp32 after every change
  (:func:`_fp32`), so the sequence of scales is bit-identical to GradScaler's
  for any growth or backoff factor. ``step()`` must read the inf verdict anyway
  to return its bool, so keeping the scale there costs nothing more, and
  ``update()``/``get_scale()`` then need no device sync at all: one ``.item()``
  per optimizer step, none per parameter.
* Optimizers exposing ``_sync_grads_to_masters()`` (:class:`MasterWeightOptimizer`)
  get it called before their gradients are checked and unscaled.
* Gradients that are DTensor shards (FSDP2) are checked shard by shard and the
  verdict is summed over the ranks (one all-reduce per step), so an inf on one
  rank skips the step on all of them and the scale stays the same everywhere.

Each optimizer goes READY -> UNSCALED -> STEPPED within an iteration, and
``update()`` starts the next one. While scaling, the order is enforced as
GradScaler enforces it (unscaling twice would divide the gradients by the scale
twice); with scaling off, the gradients are only checked, and a second check
adds to the first verdict. The checkpoint format is :mod:`~amp_fx.runtime.scaler_state`.
"""

from __future__ import annotations

import logging
import math
import struct
import warnings
from collections import abc
from enum import Enum
from typing import Any, Callable

import torch
import torch.distributed as dist

from .collapse import ON_COLLAPSE, LossScaleCollapseError, collapse_error
from .dtensors import reduce_over_ranks
from .optimizer_checks import warn_if_eps_underflows
from .overflow import check_and_unscale_, combined_found_inf, grads_of
from .scaler_state import LossScalerStateError, check_loadable
from amp_fx.errors import PACKAGE, AmpRuntimeError, AmpValueError, AmpWarning, checks_keywords
from amp_fx.ir.config import parse_dtype

__all__ = ["LossScaler", "LossScaleCollapseError", "LossScalerStateError", "NoGradientsWarning"]

logger = logging.getLogger(__package__)  # amp_fx.runtime: one logger for the runtime's reports

# dtypes that have fp32's exponent range, so loss scaling buys nothing.
_NO_SCALING_DTYPES = (torch.bfloat16, torch.float32)
# 0-dim losses of these dtypes come out of scale() in fp32, as from GradScaler.
_PROMOTED_TO_FP32 = (torch.float16, torch.bfloat16)
_NO_GRADS_FIX = (
    "A common cause: the optimizer was built over the original model's parameters, but "
    f"{PACKAGE}.convert(model, 'O2'/'O3') trains low-precision copies of them. At O2 wrap it: "
    f"{PACKAGE}.MasterWeightOptimizer(optimizer, converted) (the original parameters are the fp32 masters); "
    "at O3 build it over converted.parameters()."
)
_FP32_NAMES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32}


class NoGradientsWarning(AmpWarning):
    """``scaler.step(optimizer)`` with scaling off found no gradient on the optimizer's parameters: nothing is updated."""


class _Default:
    """Marks a keyword the caller did not pass (so bf16 can tell "asked" from "default")."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return repr(self.value)


class _Stage(Enum):
    """Where one optimizer is in the current iteration."""

    READY = 0
    UNSCALED = 1
    STEPPED = 2


def _parse_dtype(dtype: Any) -> torch.dtype | None:
    """Accept what :func:`amp_fx.convert` accepts (``"fp16"``, ``"half"``, ``"bf16"``, ...) and fp32."""
    if isinstance(dtype, str) and dtype.lower() in _FP32_NAMES:
        return _FP32_NAMES[dtype.lower()]
    if dtype is None or dtype == torch.float32:
        return dtype
    try:
        return parse_dtype(dtype)
    except ValueError:
        raise AmpValueError(
            f"dtype must be torch.float16, torch.bfloat16, torch.float32 or None (or one of the strings "
            f"'fp16', 'half', 'float16', 'bf16', 'bfloat16', 'fp32', 'float32'), got {dtype!r}"
        ) from None


def _fp32(x: float) -> float:
    # GradScaler keeps its scale in a float32 tensor; rounding the same way keeps
    # our scale sequence bit-identical to it for any growth/backoff factor.
    return struct.unpack("f", struct.pack("f", x))[0]


def _master_wrapper(optimizer: Any) -> Any:
    """The optimizer that keeps fp32 masters (``_sync_grads_to_masters``), looking through wrappers' ``.optimizer``.

    A framework may wrap a :class:`~amp_fx.runtime.MasterWeightOptimizer` again (Accelerate's
    ``AcceleratedOptimizer``): the scaler must still copy and check the masters' gradients, not the
    low ones the wrapper's ``param_groups`` would show it.  Returns ``optimizer`` when none is found.
    """
    found, seen = optimizer, set()
    while found is not None and id(found) not in seen:
        if callable(getattr(found, "_sync_grads_to_masters", None)):
            return found
        seen.add(id(found))
        found = getattr(found, "optimizer", None)
    return optimizer


class LossScaler:
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
        dtype = _parse_dtype(dtype)
        asked = not isinstance(init_scale, _Default) or (
            not isinstance(dynamic, _Default) and bool(dynamic)
        )
        init_scale = init_scale.value if isinstance(init_scale, _Default) else init_scale
        dynamic = dynamic.value if isinstance(dynamic, _Default) else dynamic

        self._scaling = bool(enabled) and (dtype not in _NO_SCALING_DTYPES or asked)
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
            if val.dim() == 0 and val.dtype in _PROMOTED_TO_FP32:
                val = val.float()
            return val * self._loss_scale
        if isinstance(val, abc.Mapping):
            return type(val)((k, self._apply_scale(v)) for k, v in val.items())
        if isinstance(val, abc.Iterable) and not isinstance(val, (str, bytes)):
            scaled = map(self._apply_scale, val)
            return type(val)(scaled) if isinstance(val, (list, tuple)) else scaled
        raise AmpValueError(f"scale() takes a Tensor or an iterable of Tensors, got {type(val).__name__}")

    # ------------------------------------------------------ per-optimizer stage
    def _state(self, optimizer: Any) -> dict[str, Any]:
        return self._per_optimizer.setdefault(
            id(optimizer), {"stage": _Stage.READY, "found_inf": {}, "found": None}
        )

    # ---------------------------------------------------------------- unscale
    def unscale_(self, optimizer: Any) -> None:
        """Divide ``optimizer``'s gradients by the scale in place and check them for inf/NaN.

        Optional before :meth:`step` (e.g. to clip). At most once per optimizer
        per iteration while scaling; with scaling off it only checks.
        """
        self._unscale(optimizer, before_user_code=True)

    def _unscale(self, optimizer: Any, before_user_code: bool, step_follows: bool = False) -> None:
        """:meth:`unscale_`; ``before_user_code`` False where no user code runs before the gradients are mirrored
        or stepped (nobody can clip in between); ``step_follows``: the optimizer's step itself comes next."""
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
        # Reciprocal in double then fp32, as GradScaler: the same bits for any scale
        # (a scale decayed to 0 without a floor gives inf, as GradScaler's does).
        inv_scale = 1.0
        if self._scaling:
            inv_scale = _fp32(1.0 / self._loss_scale) if self._loss_scale else math.inf
        # A MasterWeightOptimizer copies its gradients into the masters' and checks each while it is in cache.
        masters = _master_wrapper(optimizer)
        fused = getattr(masters, "_sync_check_and_unscale_", None)
        found = fused(inv_scale, step_follows=step_follows) if callable(fused) else None
        if found is None:
            sync = getattr(masters, "_sync_grads_to_masters", None)
            if callable(sync):
                sync()
            grads = grads_of(optimizer.param_groups)
            found = check_and_unscale_(grads, inv_scale)
            if dist.is_available() and dist.is_initialized():  # only sharded (DTensor) grads need other ranks
                found = reduce_over_ranks(found, grads)  # FSDP2: every rank agrees
        mirror = getattr(masters, "_mirror_master_grads", None)
        if callable(mirror) and before_user_code:  # O2: the low gradients read true values too (clip model.parameters())
            mirror(write=inv_scale != 1.0, by_unscale=True)
        if not self._scaling and state["stage"] is _Stage.UNSCALED:
            for dev, flag in state["found_inf"].items():  # a re-check keeps earlier verdicts
                found[dev] = found[dev] + flag if dev in found else flag
        state.update(stage=_Stage.UNSCALED, found_inf=found, found=None)

    def is_unscaled(self, optimizer: Any) -> bool:
        """Whether :meth:`unscale_` ran on ``optimizer`` since the last :meth:`update` (a framework that may
        clip before the step, as Lightning's manual optimization does, asks before unscaling itself)."""
        return self._state(optimizer)["stage"] is _Stage.UNSCALED

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
        if not self._begin_step(optimizer, step_follows=True):
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

    def _begin_step(self, optimizer: Any, step_follows: bool = False) -> bool:
        """Check ``optimizer``'s gradients (one host sync) and record the verdict; True = step.

        ``step_follows``: the caller steps ``optimizer`` right after a True (a master-weight optimizer may then
        leave its gradient copy to the step; ``amp_fx.scale_loss`` checks at the end of its block instead)."""
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
            self._unscale(optimizer, before_user_code=False, step_follows=step_follows)
        total = combined_found_inf(state["found_inf"])
        if total is None:
            if self._scaling:
                raise AmpRuntimeError(
                    "No inf checks were recorded for this optimizer: none of its parameters "
                    "has a gradient this iteration. Make sure the loss passed to "
                    "scaler.scale(loss).backward() depends on this optimizer's parameters "
                    "(with requires_grad=True), or do not call scaler.step() for an "
                    "optimizer whose parameters got no gradients. " + _NO_GRADS_FIX
                )
            if not self._warned_no_grads:
                # GradScaler would raise here; without scaling we only warn (a frozen
                # optimizer is legal), once, because the usual cause trains nothing.
                self._warned_no_grads = True
                warnings.warn(
                    "scaler.step(optimizer): none of the optimizer's parameters has a gradient, so "
                    "nothing is updated. " + _NO_GRADS_FIX, NoGradientsWarning, stacklevel=3,
                )
            found = False
        else:
            found = bool(total.item())  # the one host sync of this step
        state.update(stage=_Stage.STEPPED, found=found)
        if found:
            self.skipped_steps += 1
            self._unreported_skips += 1
            discard = getattr(_master_wrapper(optimizer), "_discard_synced_grads", None)
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
        if self._scaling and new_scale is not None:
            if isinstance(new_scale, torch.Tensor):
                if new_scale.numel() != 1 or new_scale.requires_grad:
                    raise AmpValueError("new_scale must be a float or a 1-element tensor without grad")
                new_scale = new_scale.item()
            self._loss_scale = _fp32(float(new_scale))
        elif self._scaling:
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

    # -------------------------------------------------------------- accessors
    def get_scale(self) -> float:
        """Return the current scale as a Python float (1.0 when scaling is off); never syncs."""
        return self._loss_scale if self._scaling else 1.0

    def get_init_scale(self) -> float:
        """Return the initial scale (1.0 when scaling is off)."""
        return self._init_scale if self._scaling else 1.0

    def is_enabled(self) -> bool:
        """Return whether losses are scaled (False when disabled or off because of bf16)."""
        return self._scaling

    def get_growth_factor(self) -> float:
        """Return the scale growth factor."""
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the scale growth factor."""
        self._growth_factor = float(new_factor)

    def get_backoff_factor(self) -> float:
        """Return the scale backoff factor."""
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the scale backoff factor."""
        self._backoff_factor = float(new_factor)

    def get_growth_interval(self) -> int:
        """Return the number of clean iterations before the scale grows."""
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the number of clean iterations before the scale grows."""
        self._growth_interval = int(new_interval)

    def __repr__(self) -> str:
        mode = ("dynamic" if self._dynamic else "static") if self._scaling else "off"
        return (
            f"LossScaler({mode}, scale={self.get_scale()}, dtype={self._dtype}, "
            f"level={self._level!r}, skipped_steps={self.skipped_steps})"
        )

    # ------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Return the scaler's state; call it after :meth:`update`.

        GradScaler's five keys come first, so a GradScaler can load it too.
        """
        return {
            "scale": self.get_scale(),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._growth_tracker,
            "_hysteresis_tracker": self._overflow_streak,
            "hysteresis": self._hysteresis,
            "max_scale": self._max_scale,
            "min_scale": self._min_scale,
            "skipped_steps": self.skipped_steps,
            "dynamic": self._dynamic,
            "enabled": self._scaling,
            "level": self._level,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state from :meth:`state_dict` (or from a GradScaler).

        Raises :class:`LossScalerStateError` when the state was saved by a scaler
        for another level, with scaling on/off where this one differs, or
        dynamic where this one is static (or the reverse).
        """
        check_loadable(state_dict, scaling=self._scaling, dynamic=self._dynamic, level=self._level)
        if len(state_dict) == 0:  # a disabled GradScaler's state, loaded by a scaler that does not scale
            return
        if self._scaling:
            self._loss_scale = _fp32(float(state_dict["scale"]))
        self._growth_factor = float(state_dict.get("growth_factor", self._growth_factor))
        self._backoff_factor = float(state_dict.get("backoff_factor", self._backoff_factor))
        self._growth_interval = int(state_dict.get("growth_interval", self._growth_interval))
        self._growth_tracker = int(state_dict.get("_growth_tracker", 0))
        self._overflow_streak = int(state_dict.get("_hysteresis_tracker", 0))
        self._hysteresis = int(state_dict.get("hysteresis", self._hysteresis))
        self._max_scale = float(state_dict.get("max_scale", self._max_scale))
        self._min_scale = state_dict.get("min_scale", self._min_scale)
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
