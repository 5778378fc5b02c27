"""Accessors and checkpointing of :class:`~amp_fx.runtime.LossScaler`'s settings and state."""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

from amp_fx.errors import AmpError, AmpTypeError, AmpValueError

__all__ = ["LossScalerStateError", "ScalerStateMixin"]

# The keys :meth:`ScalerStateMixin.state_dict` writes; GradScaler writes the first five.
STATE_KEYS = (
    "scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker", "_hysteresis_tracker",
    "hysteresis", "max_scale", "min_scale", "skipped_steps", "dynamic", "enabled", "level",
)


class LossScalerStateError(AmpError, RuntimeError):
    """A saved scaler state does not fit this scaler's configuration.

    An :class:`~amp_fx.errors.AmpError`; still a RuntimeError, so existing ``except RuntimeError`` keeps catching it.
    """


def _fp32(x: float) -> float:
    # GradScaler keeps its scale in a float32 tensor; rounding the same way keeps
    # our scale sequence bit-identical to it for any growth/backoff factor.
    return struct.unpack("f", struct.pack("f", x))[0]


def _check_state_keys(state_dict: Any, *, scaling: bool) -> None:
    """Refuse a state that no LossScaler or GradScaler wrote, naming the missing and unknown keys."""
    if not isinstance(state_dict, Mapping):
        raise AmpTypeError(
            f"LossScaler.load_state_dict takes the dict LossScaler.state_dict() (or GradScaler.state_dict()) "
            f"returned, got {type(state_dict).__name__}"
        )
    unknown = sorted(map(str, set(state_dict) - set(STATE_KEYS)))
    # An empty dict is a disabled GradScaler's state; the enabled check below deals with it.
    missing = ["scale"] if scaling and state_dict and "scale" not in state_dict else []
    if unknown or missing:
        raise AmpValueError(
            f"this is not a loss scaler state: missing keys {missing}, unknown keys {unknown}. Load the dict "
            "that LossScaler.state_dict() (or torch.amp.GradScaler.state_dict()) returned, e.g. "
            "checkpoint['scaler'] saved as scaler.state_dict(), not the whole checkpoint or another object's state."
        )


class ScalerStateMixin:
    """Getters/setters, ``state_dict`` and ``load_state_dict`` for LossScaler (which sets the fields)."""

    # Fields owned by LossScaler.__init__.
    _scaling: bool
    _dynamic: bool
    _loss_scale: float
    _init_scale: float
    _growth_factor: float
    _backoff_factor: float
    _growth_interval: int
    _growth_tracker: int
    _overflow_streak: int
    _hysteresis: int
    _max_scale: float
    _min_scale: float | None
    _level: str | None
    _dtype: Any
    skipped_steps: int

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
        _check_state_keys(state_dict, scaling=self._scaling)
        if len(state_dict) == 0:
            if self._scaling:
                raise LossScalerStateError(
                    "the state dict is empty: it was saved by a disabled GradScaler, but "
                    "this scaler scales; create LossScaler(enabled=False) to load it."
                )
            return
        saved_level = state_dict.get("level")
        if saved_level is not None and self._level is not None and saved_level != self._level:
            raise LossScalerStateError(
                f"the state was saved by a scaler for level {saved_level!r}, but this scaler "
                f"is for level {self._level!r}; resume with the level the checkpoint was "
                "trained with."
            )
        saved_on = bool(state_dict.get("enabled", True))  # GradScaler: non-empty = enabled
        if saved_on != self._scaling:
            on = {True: "on", False: "off"}
            raise LossScalerStateError(
                f"enabled mismatch: the state was saved with loss scaling {on[saved_on]}, but "
                f"this scaler has it {on[self._scaling]} (enabled= / dtype= decide it; "
                "bfloat16 turns scaling off). Build the scaler as the checkpoint's was."
            )
        saved_dynamic = bool(state_dict.get("dynamic", True))
        if self._scaling and saved_dynamic != self._dynamic:
            kind = {True: "dynamic", False: "static"}
            raise LossScalerStateError(
                f"dynamic mismatch: the state was saved by a {kind[saved_dynamic]} scaler, "
                f"but this one is {kind[self._dynamic]}; pass dynamic={saved_dynamic}."
            )
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
