"""The loss scaler's checkpoint format: the keys :meth:`LossScaler.state_dict` writes, and which saved states load.

A checkpoint outlives the process that wrote it, and GradScaler's checkpoints load
into a LossScaler (and ours into a GradScaler). So the format is a contract apart
from the scaling rule: its keys, and the refusals that stop a state saved for
another level or scaling mode from resuming silently with the wrong scale.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from amp_fx.errors import AmpError, AmpTypeError, AmpValueError

__all__ = ["LossScalerStateError", "STATE_KEYS", "check_loadable"]

# The keys LossScaler.state_dict() writes, in order; GradScaler writes the first five.
STATE_KEYS = (
    "scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker", "_hysteresis_tracker",
    "hysteresis", "max_scale", "min_scale", "skipped_steps", "dynamic", "enabled", "level",
)


class LossScalerStateError(AmpError, RuntimeError):
    """A saved scaler state does not fit this scaler's configuration.

    An :class:`~amp_fx.errors.AmpError`; still a RuntimeError, so existing ``except RuntimeError`` keeps catching it.
    """


def check_loadable(state_dict: Any, *, scaling: bool, dynamic: bool, level: str | None) -> None:
    """Refuse a state no loss scaler wrote, or one saved by a scaler configured unlike this one.

    ``scaling``, ``dynamic`` and ``level`` describe the loading scaler. An empty
    dict (a disabled GradScaler's state) passes only when it does not scale.
    """
    if not isinstance(state_dict, Mapping):
        raise AmpTypeError(
            f"LossScaler.load_state_dict takes the dict LossScaler.state_dict() (or GradScaler.state_dict()) "
            f"returned, got {type(state_dict).__name__}"
        )
    unknown = sorted(map(str, set(state_dict) - set(STATE_KEYS)))
    # An empty dict is a disabled GradScaler's state; the check below deals with it.
    missing = ["scale"] if scaling and state_dict and "scale" not in state_dict else []
    if unknown or missing:
        raise AmpValueError(
            f"this is not a loss scaler state: missing keys {missing}, unknown keys {unknown}. Load the dict "
            "that LossScaler.state_dict() (or torch.amp.GradScaler.state_dict()) returned, e.g. "
            "checkpoint['scaler'] saved as scaler.state_dict(), not the whole checkpoint or another object's state."
        )
    if len(state_dict) == 0:
        if scaling:
            raise LossScalerStateError(
                "the state dict is empty: it was saved by a disabled GradScaler, but "
                "this scaler scales; create LossScaler(enabled=False) to load it."
            )
        return
    saved_level = state_dict.get("level")
    if saved_level is not None and level is not None and saved_level != level:
        raise LossScalerStateError(
            f"the state was saved by a scaler for level {saved_level!r}, but this scaler "
            f"is for level {level!r}; resume with the level the checkpoint was "
            "trained with."
        )
    saved_on = bool(state_dict.get("enabled", True))  # GradScaler: non-empty = enabled
    if saved_on != scaling:
        on = {True: "on", False: "off"}
        raise LossScalerStateError(
            f"enabled mismatch: the state was saved with loss scaling {on[saved_on]}, but "
            f"this scaler has it {on[scaling]} (enabled= / dtype= decide it; "
            "bfloat16 turns scaling off). Build the scaler as the checkpoint's was."
        )
    saved_dynamic = bool(state_dict.get("dynamic", True))
    if scaling and saved_dynamic != dynamic:
        kind = {True: "dynamic", False: "static"}
        raise LossScalerStateError(
            f"dynamic mismatch: the state was saved by a {kind[saved_dynamic]} scaler, "
            f"but this one is {kind[dynamic]}; pass dynamic={saved_dynamic}."
        )
