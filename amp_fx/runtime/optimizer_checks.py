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

__all__ = ["EpsUnderflowWarning", "MomentUnderflowWarning", "warn_if_eps_underflows"]

_CHECKED: "weakref.WeakSet[Any]" = weakref.WeakSet()

# MasterWeightOptimizer and LowPrecisionOptimizer are the two ways to train O2's low parameters.
register_wrapper_type(WrappedOptimizer)


class EpsUnderflowWarning(AmpWarning):
    """An optimizer's ``eps`` rounds to zero in the dtype of parameters it steps in place."""


class MomentUnderflowWarning(EpsUnderflowWarning):
    """An Adam-family optimizer keeps its second moment in fp16: it underflows to 0 for small gradients, and ``eps``
    then sets the step size (``lr * m / eps``), whatever ``eps`` is."""


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
        if _warn_if_fp16_second_moment(optimizer, group, eps):
            return


def _warn_if_fp16_second_moment(optimizer: Any, group: dict, eps: float) -> bool:
    """Warn (and say so) when an Adam-family group (``betas`` and ``eps``) steps fp16 parameters in place.

    Its state is allocated like the parameters: ``exp_avg_sq`` gains ``(1 - beta2) * g**2`` per step, which is 0 in
    fp16 below ``|g| ~ sqrt(2**-25 / (1 - beta2))`` (5.5e-3 at beta2 0.999); the update ``lr * m / (sqrt(v) + eps)``
    is then ``lr * m / eps``, far larger than fp32's (a tester measured 10x the fp32 update at eps 1e-4).
    """
    betas = group.get("betas")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        return False
    if not any(p.dtype == torch.float16 for p in group["params"]):
        return False
    threshold = (2.0**-25 / max(1.0 - float(betas[1]), 1e-12)) ** 0.5
    warnings.warn(
        f"{type(optimizer).__name__} steps fp16 parameters in place and keeps its moments in fp16: the second moment "
        f"(1 - beta2) * grad**2 is 0 for gradients below {threshold:.2g}, and the step then is lr * exp_avg / eps "
        f"(eps={eps:g}), many times fp32's. Use {PACKAGE}.LowPrecisionOptimizer (fp32 update math) or O2 with "
        "MasterWeightOptimizer (fp32 masters), or bf16.",
        MomentUnderflowWarning,
        stacklevel=4,
    )
    return True
