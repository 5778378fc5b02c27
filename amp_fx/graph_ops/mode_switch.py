"""Mark train/eval switches as amp_fx's own, so a converted module frozen in one mode does not warn about them."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

__all__ = ["switching_modes", "amp_fx_is_switching"]

# Set while amp_fx itself switches a module's train/eval mode (an analysis running briefly in eval,
# convert() restoring the traced mode): those switches are not the user's and do not warn.
_SWITCHING: contextvars.ContextVar[bool] = contextvars.ContextVar("amp_fx_switching_modes", default=False)


@contextlib.contextmanager
def switching_modes() -> Iterator[None]:
    """Mark the ``.train()`` / ``.eval()`` calls inside the block as amp_fx's own: no FrozenTrainingWarning."""
    token = _SWITCHING.set(True)
    try:
        yield
    finally:
        _SWITCHING.reset(token)


def amp_fx_is_switching() -> bool:
    """True inside :func:`switching_modes`."""
    return _SWITCHING.get()
