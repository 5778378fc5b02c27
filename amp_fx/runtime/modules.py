"""Recognise the modules the runtime is handed: ``torch.compile`` wrappers (:mod:`amp_fx.frontend.compiled_modules`)."""

from __future__ import annotations

from amp_fx.frontend.compiled_modules import is_compiled, unwrap_compiled

__all__ = ["unwrap_compiled", "is_compiled"]
