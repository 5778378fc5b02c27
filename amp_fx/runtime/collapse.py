"""What happens when the loss scale collapses: the error, and optionally a diagnosis of which op overflowed.

The runtime path imports no fx inspection code: the error names
``amp_fx.find_overflow``, and :mod:`amp_fx.inspection` is loaded only when the
scaler was built with ``on_collapse="diagnose"``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from amp_fx.errors import AmpError

__all__ = ["LossScaleCollapseError", "collapse_error", "ON_COLLAPSE"]

ON_COLLAPSE = ("raise", "diagnose")


class LossScaleCollapseError(AmpError, RuntimeError):
    """Gradients still overflow at the minimum loss scale: fp16 cannot train this as is.

    ``diagnosis`` holds an :class:`amp_fx.inspection.find_overflow.OverflowReport` when the
    scaler was built with ``on_collapse="diagnose"`` and a way to reproduce
    the step; otherwise None.
    """

    def __init__(self, message: str, diagnosis: Any = None) -> None:
        super().__init__(message)
        self.diagnosis = diagnosis


def collapse_error(min_scale: float, streak: int, loss_scale: float, on_collapse: str,
                   reproduce: Optional[Callable[[], Any]]) -> LossScaleCollapseError:
    """Build the error raised when gradients overflow at ``min_scale``, with a diagnosis if asked."""
    message = (
        f"loss scale collapsed: gradients still hold inf/NaN at min_scale={min_scale} "
        f"({streak} overflowing iterations in a row), so float16 cannot represent this model's "
        "gradients. Try: train in bfloat16, which needs no loss scaling (convert with "
        "dtype=torch.bfloat16 and use LossScaler(dtype=torch.bfloat16)); or pin the overflowing ops "
        "to fp32 through the policy, e.g. amp_fx.convert(model, policy={\"module:<name>\": \"fp32\"}); "
        "or lower min_scale. If the loss itself is inf/NaN, no scale can help: check the data and "
        "the learning rate."
    )
    if on_collapse != "diagnose" or reproduce is None:
        # The runtime never loads the fx inspection code itself: it only names the tool.
        message += (
            f"\nTo find the op that overflows: amp_fx.find_overflow(converted, *inputs, target=target, "
            f"backward=True, loss_scale={loss_scale}), or build the scaler with on_collapse=\"diagnose\" "
            "and reproduce=."
        )
        return LossScaleCollapseError(message)
    diagnosis = None
    from amp_fx.inspection.find_overflow import diagnose_collapse  # lazy: only when the user asked for a diagnosis

    try:
        diagnosis = diagnose_collapse(lambda: _uncompiled(reproduce()), loss_scale=loss_scale)
        message += "\n" + (str(diagnosis) if diagnosis is not None else
                           "Reproducing the step found no node that overflows in low precision but not in fp32.")
    except Exception as error:  # a failed diagnosis must not hide the collapse itself
        message += f"\n(diagnosis failed: {type(error).__name__}: {error})"
    return LossScaleCollapseError(message, diagnosis)


def _uncompiled(step: Any) -> Any:
    """Let ``reproduce()`` return a ``torch.compile``d module: the diagnosis reads the graph inside it."""
    from amp_fx.frontend.compiled_modules import unwrap_compiled

    if isinstance(step, tuple) and step:
        return (unwrap_compiled(step[0]), *step[1:])
    if hasattr(step, "module"):
        import dataclasses

        return dataclasses.replace(step, module=unwrap_compiled(step.module))
    return step
