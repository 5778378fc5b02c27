"""Errors amp_fx raises for bad input, each naming the problem and the fix, and the AmpWarning base.

Every error derives from :class:`AmpError`.  The ``Amp*Error`` classes below
also derive from the built-in that the same mistake raises in Python
(``ValueError`` for a bad value, ``TypeError`` for a bad kind of argument or
an unknown keyword, ...), so ``except ValueError`` keeps catching them.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from typing import Any, Callable, Iterable, Sequence, TypeVar

__all__ = [
    "AmpError", "AmpValueError", "AmpTypeError", "AmpRuntimeError", "AmpKeyError", "AmpIndexError",
    "AmpNotImplementedError", "AmpAttributeError", "AmpWarning",
    "BannedOpError", "UnknownOpError", "AlreadyConvertedError", "UnsupportedConstructError",
    "did_you_mean", "unknown_options_error", "checks_keywords", "PACKAGE",
]

PACKAGE = __name__.split(".")[0]  # "amp_fx": user-facing names and logger names are built from it, never spelt

_F = TypeVar("_F", bound=Callable[..., Any])


class AmpError(Exception):
    """Base class of the errors amp_fx raises on purpose."""


class AmpWarning(UserWarning):
    """Base class of every warning amp_fx emits: one ``warnings.filterwarnings("error", category=amp_fx.AmpWarning)``
    raises them all, one ``"ignore"`` silences them all (a UserWarning too, so existing filters keep working)."""


class AmpValueError(AmpError, ValueError):
    """An argument has the right kind but a value amp_fx cannot use (a ValueError too)."""


class AmpTypeError(AmpError, TypeError):
    """An argument of the wrong kind, or a keyword the function does not take (a TypeError too)."""


class AmpRuntimeError(AmpError, RuntimeError):
    """A call made in the wrong order or state, e.g. a LossScaler step before scale() (a RuntimeError too)."""


class AmpKeyError(AmpError, KeyError):
    """A name looked up that does not exist (a KeyError too); the message lists close names."""

    def __str__(self) -> str:
        # KeyError's own __str__ shows repr(message): quotes and escaped newlines around the advice.
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()


class AmpIndexError(AmpError, IndexError):
    """An index out of range, e.g. a ``loss_id`` beyond ``num_losses`` (an IndexError too)."""


class AmpAttributeError(AmpError, AttributeError):
    """An attribute of the original model a converted module does not carry, e.g. a method other than forward
    (an AttributeError too, so ``hasattr`` answers False)."""


class AmpNotImplementedError(AmpError, NotImplementedError):
    """Input amp_fx refuses rather than guesses about, e.g. sparse gradients (a NotImplementedError too)."""


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


def did_you_mean(names: str | Iterable[str], candidates: Sequence[str], *, n: int = 3, cutoff: float = 0.6) -> str:
    """Return ``" Did you mean 'a', 'b'?"`` for the candidates close to ``names``, or ``""`` when none is."""
    wanted = [names] if isinstance(names, str) else list(names)
    close: list[str] = []
    for name in wanted:
        for match in difflib.get_close_matches(name, list(candidates), n=n, cutoff=cutoff):
            if match not in close:
                close.append(match)
    return f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""


def unknown_options_error(bad: Iterable[str], valid: Iterable[str], where: str, *, kind: str = "option") -> AmpTypeError:
    """The error for keywords ``where`` does not take: the close matches, then every valid option."""
    bad, valid = sorted(bad), sorted(valid)
    return AmpTypeError(f"unknown {kind}(s) {bad} for {where}.{did_you_mean(bad, valid, n=1)} Valid options are {valid}.")


def checks_keywords(where: str, *, kind: str = "option") -> Callable[[_F], _F]:
    """Decorate a function so an unknown keyword raises :func:`unknown_options_error` instead of Python's bare TypeError.

    ``where`` is the public name without the package (``"LossScaler"``: the
    message says ``amp_fx.LossScaler``).  The signature (``help()``,
    ``inspect.signature``) stays the function's own.
    """
    where = f"{PACKAGE}.{where}"

    def decorate(function: _F) -> _F:
        parameters = inspect.signature(function).parameters.values()
        if any(p.kind is p.VAR_KEYWORD for p in parameters):
            raise AmpTypeError(f"checks_keywords: {function.__qualname__} takes **kwargs, so no keyword is unknown; drop the decorator")
        names = frozenset(p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
        valid = sorted(names - {"self", "model"})

        @functools.wraps(function)
        def checked(*args: Any, **kwargs: Any) -> Any:
            if not names.issuperset(kwargs):
                raise unknown_options_error(set(kwargs) - names, valid, where, kind=kind)
            return function(*args, **kwargs)

        return checked  # type: ignore[return-value]

    return decorate
