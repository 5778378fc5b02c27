"""Recognise the modules the runtime is handed: ``torch.compile`` wrappers and converted modules."""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["unwrap_compiled", "is_compiled"]


def is_compiled(module: Any) -> bool:
    """Whether ``module`` is the ``OptimizedModule`` that ``torch.compile(module)`` returns."""
    # Checked by name so that the runtime never imports torch._dynamo (seconds) just to ask.
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
