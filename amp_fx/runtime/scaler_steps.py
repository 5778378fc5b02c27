"""One optimizer's iteration under :class:`~amp_fx.runtime.LossScaler`: ``unscale_``, ``step`` and ``step_scheduler``.

Each optimizer goes READY -> UNSCALED -> STEPPED within an iteration, and
``update()`` (:mod:`amp_fx.runtime.scale_updates`) starts the next one.
While scaling, the order is enforced as GradScaler enforces it (unscaling
twice would divide the gradients by the scale twice); with scaling off, the
gradients are only checked, and a second check adds to the first verdict.
"""

from __future__ import annotations

import math
import warnings
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist

from .dtensors import reduce_over_ranks
from .optimizer_checks import warn_if_eps_underflows
from .overflow import check_and_unscale_, combined_found_inf, grads_of
from .scaler_options import NO_GRADS_FIX
from .scaler_state import _fp32
from amp_fx.errors import AmpRuntimeError, AmpWarning

__all__ = ["ScalerStepsMixin", "NoGradientsWarning"]


class NoGradientsWarning(AmpWarning):
    """``scaler.step(optimizer)`` with scaling off found no gradient on the optimizer's parameters: nothing is updated."""



def master_wrapper(optimizer: Any) -> Any:
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

class _Stage(Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


class ScalerStepsMixin:
    """``unscale_``, ``step``, ``step_scheduler`` and the per-optimizer stages for LossScaler (which sets the fields)."""

    # Fields owned by LossScaler.__init__.
    _scaling: bool
    _checks: bool
    _loss_scale: float
    _per_optimizer: dict[int, dict[str, Any]]
    _scaled_since_update: bool
    _last_step_taken: dict[int, bool]
    _stepping: int | None
    _warned_no_grads: bool
    _unreported_skips: int
    skipped_steps: int

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

    def _unscale(self, optimizer: Any, before_user_code: bool) -> None:
        """:meth:`unscale_`; ``before_user_code`` False where the step follows at once (nobody can clip in between)."""
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
        masters = master_wrapper(optimizer)
        fused = getattr(masters, "_sync_check_and_unscale_", None)
        found = fused(inv_scale) if callable(fused) else None
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
            mirror(write=inv_scale != 1.0)
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
            self._unscale(optimizer, before_user_code=False)
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
                    "nothing is updated. " + NO_GRADS_FIX, NoGradientsWarning, stacklevel=3,
                )
            found = False
        else:
            found = bool(total.item())  # the one host sync of this step
        state.update(stage=_Stage.STEPPED, found=found)
        if found:
            self.skipped_steps += 1
            self._unreported_skips += 1
            discard = getattr(master_wrapper(optimizer), "_discard_synced_grads", None)
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
