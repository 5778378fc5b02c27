"""Find the user's source line that is running now (the innermost frame outside torch and amp_fx)."""

from __future__ import annotations

import functools
import linecache
import os
import sys
from typing import Optional

import torch

from amp_fx.errors import PACKAGE

__all__ = ["current_user_line", "is_library_file", "innermost_user_frame", "is_user_file"]

_STDLIB_DIR = os.path.dirname(os.__file__)


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    """torch's folder and amp_fx's own: the package and its passes (installed from ``passes/`` in a checkout)."""
    import importlib.util

    # Located, not imported: the frontend sits below the passes (docs/design.md's layers).
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    passes = os.path.dirname(importlib.util.find_spec(f"{PACKAGE}.passes").origin)
    return (os.path.dirname(torch.__file__), package, passes)


def is_library_file(filename: str) -> bool:
    """True for torch's and amp_fx's own source files (never the model's)."""
    return filename.startswith(_library_dirs())


def _skipped(filename: str, skip_stdlib: bool) -> bool:
    if is_library_file(filename):
        return True
    # contextlib and functools frames sit between a model's line and amp_fx's hooks;
    # installed packages (transformers) live under the stdlib folder too and are user code.
    return skip_stdlib and filename.startswith(_STDLIB_DIR) and "-packages" not in filename


def is_user_file(filename: str) -> bool:
    """True for the model's own code: not torch, not amp_fx, not the standard library (installed packages count as user code)."""
    return not _skipped(filename, True)


def innermost_user_frame(skip_stdlib: bool = True):
    """The innermost frame of the model's own code that is running now (None when there is none)."""
    frame = sys._getframe(1)
    while frame is not None and _skipped(frame.f_code.co_filename, skip_stdlib):
        frame = frame.f_back
    return frame


def current_user_line(skip_stdlib: bool = True) -> Optional[str]:
    """Return ``"file:line in fn: code"`` of the innermost caller outside torch, amp_fx (and the stdlib).

    Used in error messages raised while tracing, so they point at the line
    of the model that did the thing being refused.
    """
    frame = innermost_user_frame(skip_stdlib)
    if frame is None:
        return None
    filename, lineno = frame.f_code.co_filename, frame.f_lineno
    code = linecache.getline(filename, lineno).strip()
    where = f"{filename}:{lineno} in {frame.f_code.co_name}"
    return f"{where}: {code}" if code else where
