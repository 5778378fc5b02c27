"""Warn when Dynamo stops recompiling a frame of a model compiled with the amp_fx backend: it then runs eagerly.

Past ``torch._dynamo.config.recompile_limit`` compiles of one frame (8 by
default; a new input shape, dtype or Python constant each costs one), Dynamo
runs that frame eagerly, without calling any backend, and says so only in one
log line of its own.  Under the amp_fx backend that means the frame is no
longer converted: it computes in fp32.  Dynamo checks the limit before its
compile callbacks run (so :mod:`amp_fx.dynamo.watch` never sees that compile);
the one place it surfaces is that log line, so this module listens for it on
Dynamo's logger and, when the frame's backend is an amp_fx one, warns once
per compiled model and frame (:class:`RecompileLimitWarning`) naming the fixes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from typing import Any, Callable, Optional

import torch

from amp_fx.errors import AmpWarning

__all__ = ["RecompileLimitWarning", "install", "message"]

_LOGGER = "torch._dynamo.convert_frame"  # the logger of the line "torch._dynamo hit config.recompile_limit (8)"
_PREFIX = "torch._dynamo hit config."
# Frames that are not the user's: the warning points past torch, amp_fx, logging and contextlib at the model's call.
_INTERNAL = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.path.dirname(__file__)) + os.sep,
             os.path.dirname(logging.__file__) + os.sep, contextlib.__file__)

# What a located compile gives: the seen-set of its compiled model (one warning per frame) and whether Dynamo
# raises instead of running the frame eagerly (fullgraph=True, export): then the user sees the error, no warning.
Locate = Callable[[], Optional[tuple[set, bool]]]


class RecompileLimitWarning(AmpWarning):
    """Dynamo hit its recompile limit on a frame compiled with the amp_fx backend: that frame now runs eagerly, uncompiled."""


def message(limit_type: str, limit: Any, function: str, reason: Any) -> str:
    """The warning's text: the limit hit, the frame, Dynamo's last recompile reason, and the three fixes."""
    aliases = {"recompile_limit": "cache_size_limit", "accumulated_recompile_limit": "accumulated_cache_size_limit"}
    alias = aliases.get(limit_type)
    named = f"torch._dynamo.config.{limit_type}" + (f" (torch._dynamo.config.{alias} in older torch)" if alias else "")
    if os.path.dirname(torch.__file__) in function:  # torch.compile(module)'s own wrapper around forward
        function = f"the compiled module's forward (Dynamo's frame {function})"
    return (
        f"amp_fx: Dynamo hit {named} = {limit} compiling {function}, so it stops compiling that frame: from now on "
        "it runs eagerly, uncompiled: amp_fx's eager mode gives its ops the op tables' precisions as it does between "
        "graphs (fp32 where amp_fx warned BetweenGraphsWarning), but no graph of it is converted, compiled or fused. "
        f"Dynamo recompiled it because: {reason}. Fixes: raise torch._dynamo.config.{limit_type} above the number of "
        "variants you run; or compile with torch.compile(model, backend=..., dynamic=True) so a changing size does "
        "not recompile; or mark the sizes that vary with torch._dynamo.mark_dynamic(tensor, dim) before the first "
        "call; or keep one input shape (pad to a few buckets). TORCH_LOGS=recompiles lists every recompile.")


class _LimitHandler(logging.Handler):
    """Listens for Dynamo's recompile-limit line and turns it into a warning when the backend is amp_fx's."""

    def __init__(self, locate: Locate) -> None:
        super().__init__(level=logging.WARNING)
        self.locate = locate

    def emit(self, record: logging.LogRecord) -> None:
        # Reading the record must never break Dynamo's logging; a warning the user's filter made an error does raise.
        try:
            text = _warning_text(record, self.locate)
        except Exception:  # noqa: BLE001 - never break Dynamo's logging
            return
        if text is not None:
            warnings.warn(text, RecompileLimitWarning, stacklevel=_user_stacklevel())


def _warning_text(record: logging.LogRecord, locate: Locate) -> Optional[str]:
    if not (isinstance(record.msg, str) and record.msg.startswith(_PREFIX)) or len(record.args or ()) < 4:
        return None
    limit_type, limit, function, reason = tuple(record.args)[:4]
    located = locate()
    if located is None:
        return None  # not an amp_fx backend's frame
    seen, raises = located
    import torch._dynamo.config as dynamo_config

    if raises or dynamo_config.fail_on_recompile_limit_hit or function in seen:
        return None
    seen.add(function)
    return message(str(limit_type), limit, str(function), reason)


def install(locate: Locate) -> None:
    """Listen on Dynamo's logger (once; ``locate`` says whether the compile in flight is an amp_fx one)."""
    logger = logging.getLogger(_LOGGER)
    for handler in logger.handlers:
        if isinstance(handler, _LimitHandler):
            handler.locate = locate
            return
    logger.addHandler(_LimitHandler(locate))


def _user_stacklevel() -> int:
    frame, level = sys._getframe(2), 2  # stacklevel 1 is emit(), which calls warnings.warn; 2 its caller
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    return level
