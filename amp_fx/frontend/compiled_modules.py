"""Recognise a ``torch.compile``d module, reach the module inside it, and compile another one the same way."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["unwrap_compiled", "is_compiled", "compiled_like"]


def is_compiled(module: Any) -> bool:
    """Whether ``module`` is the ``OptimizedModule`` that ``torch.compile(module)`` returns."""
    # Checked by name so that nothing here imports torch._dynamo (seconds) just to ask.
    return (
        isinstance(module, nn.Module)
        and isinstance(getattr(module, "_orig_mod", None), nn.Module)
        and type(module).__module__.startswith("torch._dynamo")
    )


def unwrap_compiled(module: Any) -> Any:
    """Return the module ``torch.compile`` wrapped (its parameters are the same tensors), else ``module``.

    An ``OptimizedModule`` names its parameters ``_orig_mod.<name>``; the inner
    module names them as the model and the converter did.
    """
    while is_compiled(module):
        module = module._orig_mod
    return module


def compiled_like(compiled: nn.Module, module: nn.Module) -> nn.Module:
    """``module`` compiled with the settings (backend, mode, ...) ``compiled`` was compiled with."""
    dynamo_ctx = getattr(compiled, "dynamo_ctx", None)
    return dynamo_ctx(module) if callable(dynamo_ctx) else torch.compile(module)
