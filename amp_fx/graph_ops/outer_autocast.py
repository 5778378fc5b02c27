"""Run amp_fx's graphs with any outer ``torch.autocast`` turned off: the graph already holds its casts.

A converted module, a graph compiled by the backend, and the backend's own
conversion all run under the user's autocast if nothing stops it; autocast
would then cast the ops a second time (and differently from the report).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

__all__ = ["AUTOCAST_DEVICES", "no_outer_autocast", "call_without_outer_autocast"]

# The device types whose autocast state is checked (and switched off while amp_fx's graphs run).
AUTOCAST_DEVICES = ("cpu", "cuda")


def _active() -> list[str]:
    return [device for device in AUTOCAST_DEVICES if torch.is_autocast_enabled(device)]


@contextlib.contextmanager
def no_outer_autocast() -> Iterator[None]:
    """Disable every active autocast for the duration of the block (no-op when none is active)."""
    active = _active()
    if not active:
        yield
        return
    with contextlib.ExitStack() as stack:
        for device in active:
            stack.enter_context(torch.autocast(device, enabled=False))
        yield


def call_without_outer_autocast(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with any outer autocast disabled; no context manager when none is on (the hot path)."""
    if not _active():
        return fn(*args, **kwargs)
    with no_outer_autocast():
        return fn(*args, **kwargs)
