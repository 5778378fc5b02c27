"""Warn about optimizer settings that break on low-precision parameters (once per optimizer).

Also registers amp_fx's optimizer wrappers with :mod:`amp_fx.converter.step_guard`,
which refuses a plain optimizer's step over O2's low parameters: the wrappers
(and the optimizers they wrap) step masters or compensated updates themselves.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

from amp_fx.errors import PACKAGE, AmpWarning
import torch

from amp_fx.converter.step_guard import register_wrapper_type

from .wrapped_optimizer import WrappedOptimizer

__all__ = ["EpsUnderflowWarning", "warn_if_eps_underflows"]

_CHECKED: "weakref.WeakSet[Any]" = weakref.WeakSet()

# MasterWeightOptimizer and LowPrecisionOptimizer are the two ways to train O2's low parameters.
register_wrapper_type(WrappedOptimizer)


class EpsUnderflowWarning(AmpWarning):
    """An optimizer's ``eps`` rounds to zero in the dtype of parameters it steps in place."""


def warn_if_eps_underflows(optimizer: Any) -> None:
    """Warn once when a group's ``eps`` is 0 in the dtype of the low-precision parameters it updates.

    Adam-style updates divide by ``sqrt(v) + eps`` in the parameter's dtype; a
    parameter whose gradient is 0 then gets 0/0 and becomes NaN for good (fp16's
    smallest value is 6e-8, Adam's default eps 1e-8): no loss scaler can skip
    that, since the NaN is made by the step itself.
    """
    if isinstance(optimizer, WrappedOptimizer):
        return  # MasterWeightOptimizer and LowPrecisionOptimizer do the update math in fp32
    try:
        if optimizer in _CHECKED:
            return
        _CHECKED.add(optimizer)
    except TypeError:  # not weak-referenceable: check every time (cheap)
        pass
    for group in getattr(optimizer, "param_groups", ()):
        eps = group.get("eps")
        if not isinstance(eps, float) or eps <= 0:
            continue
        for dtype in {p.dtype for p in group["params"] if p.is_floating_point() and p.dtype in (torch.float16, torch.bfloat16)}:
            if torch.tensor(eps, dtype=dtype).item() == 0.0:
                warnings.warn(
                    f"{type(optimizer).__name__} has eps={eps:g}, which is 0 in {dtype}, the dtype of parameters it "
                    "updates in place: a parameter with a zero gradient becomes NaN at the first step. Use "
                    f"{PACKAGE}.LowPrecisionOptimizer (fp32 update math), or O2 with MasterWeightOptimizer, "
                    f"or eps >= {torch.finfo(dtype).tiny:g}.",
                    EpsUnderflowWarning,
                    stacklevel=3,
                )
                return
