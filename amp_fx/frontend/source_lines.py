"""Find the user's source line that is running now (the innermost frame outside torch and amp_fx)."""

from __future__ import annotations

import linecache
import os
import sys
from typing import Optional

import torch

__all__ = ["current_user_line", "is_user_file"]

_TORCH_DIR = os.path.dirname(torch.__file__)
_AMP_FX_DIR = os.path.dirname(__file__)
_STDLIB_DIR = os.path.dirname(os.__file__)


def _skipped(filename: str, skip_stdlib: bool) -> bool:
    if filename.startswith((_TORCH_DIR, _AMP_FX_DIR)):
        return True
    # contextlib and functools frames sit between a model's line and amp_fx's hooks;
    # installed packages (transformers) live under the stdlib folder too and are user code.
    return skip_stdlib and filename.startswith(_STDLIB_DIR) and "-packages" not in filename


def is_user_file(filename: str) -> bool:
    """True for the model's own code: not torch, not amp_fx, not the standard library (installed packages count as user code)."""
    return not _skipped(filename, True)


def current_user_line(skip_stdlib: bool = True) -> Optional[str]:
    """Return ``"file:line in fn: code"`` of the innermost caller outside torch, amp_fx (and the stdlib).

    Used in error messages raised while tracing, so they point at the line
    of the model that did the thing being refused.
    """
    frame = sys._getframe(1)
    while frame is not None and _skipped(frame.f_code.co_filename, skip_stdlib):
        frame = frame.f_back
    if frame is None:
        return None
    filename, lineno = frame.f_code.co_filename, frame.f_lineno
    code = linecache.getline(filename, lineno).strip()
    where = f"{filename}:{lineno} in {frame.f_code.co_name}"
    return f"{where}: {code}" if code else where
