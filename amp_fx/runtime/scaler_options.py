"""What :class:`~amp_fx.runtime.LossScaler` accepts and says: keyword markers, dtype names, advice."""

from __future__ import annotations

from typing import Any

import torch

from amp_fx.ir.config import parse_dtype
from amp_fx.errors import PACKAGE, AmpValueError

__all__ = ["Default", "parse_scaler_dtype", "NO_SCALING_DTYPES", "PROMOTED_TO_FP32", "NO_GRADS_FIX"]


class Default:
    """Marks a keyword the caller did not pass (so bf16 can tell "asked" from "default")."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return repr(self.value)


# dtypes that have fp32's exponent range, so loss scaling buys nothing.
NO_SCALING_DTYPES = (torch.bfloat16, torch.float32)
# 0-dim losses of these dtypes come out of scale() in fp32, as from GradScaler.
PROMOTED_TO_FP32 = (torch.float16, torch.bfloat16)
NO_GRADS_FIX = (
    "A common cause: the optimizer was built over the original model's parameters, but "
    f"{PACKAGE}.convert(model, 'O2'/'O3') trains low-precision copies of them. At O2 wrap it: "
    f"{PACKAGE}.MasterWeightOptimizer(optimizer, converted) (the original parameters are the fp32 masters); "
    "at O3 build it over converted.parameters()."
)
_DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32}


def parse_scaler_dtype(dtype: Any) -> torch.dtype | None:
    """Accept what :func:`amp_fx.convert` accepts (``"fp16"``, ``"half"``, ``"bf16"``, ...) and fp32."""
    if isinstance(dtype, str) and dtype.lower() in _DTYPE_NAMES:
        return _DTYPE_NAMES[dtype.lower()]
    if dtype is None or dtype == torch.float32:
        return dtype
    try:
        return parse_dtype(dtype)
    except ValueError:
        raise AmpValueError(
            f"dtype must be torch.float16, torch.bfloat16, torch.float32 or None (or one of the strings "
            f"'fp16', 'half', 'float16', 'bf16', 'bfloat16', 'fp32', 'float32'), got {dtype!r}"
        ) from None
