"""Errors amp_fx raises for bad input; each message names the problem and the fix."""

from __future__ import annotations

__all__ = ["AmpError", "BannedOpError", "UnknownOpError", "AlreadyConvertedError"]


class AmpError(Exception):
    """Base class of the errors amp_fx raises on purpose."""


class BannedOpError(AmpError, ValueError):
    """The model calls an op that is unsafe in low precision."""


class UnknownOpError(AmpError, ValueError):
    """``on_unknown_op="error"`` and the graph calls an op no table lists."""


class AlreadyConvertedError(AmpError, ValueError):
    """A converted module was converted again with a different configuration."""
