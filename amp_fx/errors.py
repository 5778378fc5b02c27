"""Errors amp_fx raises for bad input; each message names the problem and the fix."""

from __future__ import annotations

__all__ = ["AmpError", "BannedOpError", "UnknownOpError", "AlreadyConvertedError", "UnsupportedConstructError"]


class AmpError(Exception):
    """Base class of the errors amp_fx raises on purpose."""


class BannedOpError(AmpError, ValueError):
    """The model calls an op that is unsafe in low precision."""


class UnknownOpError(AmpError, ValueError):
    """``on_unknown_op="error"`` and the graph calls an op no table lists."""


class AlreadyConvertedError(AmpError, ValueError):
    """A converted module was converted again with a different configuration."""


class UnsupportedConstructError(AmpError, RuntimeError):
    """The model's forward does something this route cannot keep (the message names it, its line and the route that works).

    Raised while tracing, instead of letting symbolic tracing freeze or drop
    the construct silently.  ``construct`` is a short name of what was met
    (``"module attribute assignment"``, ``"torch.random.fork_rng"``, ...),
    ``where`` the user source line.
    """

    def __init__(self, message: str, *, construct: str = "", where: str = ""):
        super().__init__(message)
        self.construct = construct
        self.where = where
