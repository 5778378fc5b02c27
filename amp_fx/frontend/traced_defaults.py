"""Which of ``forward``'s optional parameters a trace fixes at their default, and whether a call's value is that default.

fx traces every parameter of ``forward`` as a Proxy, and a Proxy is never
``None``: ``if scale is not None:`` takes the branch that multiplies by
``scale``, ``if past is None:`` skips the work a call without ``past``
does.  So a parameter that has a default and that the example inputs
leave out (or give at its default) is traced *at* its default (fx's
``concrete_args``), as the model's own call without it runs: the graph
computes what ``model(x)`` computes.  A call that gives it runs a graph
traced with it as an input (:mod:`amp_fx.converter.specialisations`).

Only defaults fx can guard are fixed: ``None`` and the Python scalars
``bool``, ``int``, ``float``, ``str`` (fx adds a check to the graph that the
value is the default).  A parameter with any other default (a tensor, a
tuple, an object) stays a graph input, as before.
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping, Optional, Sequence

import torch.nn as nn

__all__ = ["optional_parameters", "positional_names", "is_default", "traced_at_default", "describe_defaults"]

_SCALARS = (bool, int, float, str)
_NAMED_KINDS = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
_POSITIONAL_KINDS = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _parameters(model: nn.Module) -> list[inspect.Parameter]:
    """``forward``'s parameters after ``self``, read from the function fx traces (the class's, unwrapped)."""
    try:
        fn = inspect.unwrap(type(model).forward)
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError, AttributeError):
        return []
    return params[1:]


def _fixable(default: Any) -> bool:
    return default is None or type(default) in _SCALARS


def optional_parameters(model: nn.Module) -> dict[str, Any]:
    """forward's parameters whose default a trace can fix, in signature order: {name: default}."""
    return {p.name: p.default for p in _parameters(model)
            if p.kind in _NAMED_KINDS and p.default is not inspect.Parameter.empty and _fixable(p.default)}


def positional_names(model: nn.Module) -> tuple[str, ...]:
    """forward's parameters a caller may give by position, in order."""
    return tuple(p.name for p in _parameters(model) if p.kind in _POSITIONAL_KINDS)


def is_default(value: Any, default: Any) -> bool:
    """Whether ``value`` is ``default`` for tracing: None is None; a scalar of the same type and value."""
    if value is default:
        return True
    if default is None or value is None:
        return False
    return type(value) is type(default) and type(value) in _SCALARS and value == default


def traced_at_default(model: nn.Module, example_inputs: Optional[Sequence[Any]], example_kwarg_inputs: Optional[Mapping[str, Any]],
                      inputs: Optional[frozenset] = None) -> dict[str, Any]:
    """The optional parameters to trace at their default: {name: default}.

    ``inputs`` (a specialisation's key) names exactly those traced as graph
    inputs; without it, a parameter is traced at its default where the
    example inputs leave it out or give it at its default.
    """
    optional = optional_parameters(model)
    if inputs is not None:
        return {name: default for name, default in optional.items() if name not in inputs}
    args = tuple(example_inputs or ())
    kwargs = dict(example_kwarg_inputs or {})
    given: dict[str, Any] = dict(zip(positional_names(model), args))
    given.update((k, v) for k, v in kwargs.items() if k in optional)
    return {name: default for name, default in optional.items() if name not in given or is_default(given[name], default)}


def describe_defaults(defaults: Mapping[str, Any]) -> str:
    """``scale=None, labels=None`` (at most eight named)."""
    items = [f"{name}={default!r}" for name, default in defaults.items()]
    return ", ".join(items[:8]) + (f" and {len(items) - 8} more" if len(items) > 8 else "")
