"""Refuse legacy ``torch.nn.utils.weight_norm`` where amp_fx must copy the model (O2/O3), naming the form that works.

The legacy form keeps ``weight`` as a plain tensor attribute that a forward
pre-hook recomputes from ``weight_g`` and ``weight_v`` on every call: after a
forward it is a non-leaf tensor, which ``copy.deepcopy`` refuses (torch's own
error), and a copy made before one would hold a stale ``weight`` whose
gradient reaches neither ``weight_g`` nor ``weight_v`` in low precision.  O1
converts it as it is (the graph computes ``_weight_norm(v, g)`` from the
parameters each forward and casts the result), so only the levels that copy
the model's parameters to hold their low copies refuse it.
``torch.nn.utils.parametrizations.weight_norm`` keeps ``original0`` /
``original1`` as parameters and ``weight`` as a computed property, which
O2's masters and low copies handle like any other parameters.
"""

from __future__ import annotations

import torch.nn as nn
from torch.nn.utils.weight_norm import WeightNorm

from amp_fx.errors import UnsupportedConstructError

__all__ = ["legacy_weight_norms", "refuse_legacy_weight_norm"]


def legacy_weight_norms(model: nn.Module) -> list[str]:
    """``"path.weight"`` for every weight that legacy ``torch.nn.utils.weight_norm`` computes in ``model``."""
    found = []
    for path, module in model.named_modules():
        for hook in module._forward_pre_hooks.values():
            if isinstance(hook, WeightNorm):
                found.append(f"{path}.{hook.name}" if path else hook.name)
    return found


def refuse_legacy_weight_norm(model: nn.Module, level: str = "O2/O3") -> None:
    """Raise :class:`~amp_fx.errors.UnsupportedConstructError` when ``model`` uses legacy weight norm."""
    found = legacy_weight_norms(model)
    if not found:
        return
    raise UnsupportedConstructError(
        f"{', '.join(found)} {'is' if len(found) == 1 else 'are'} computed by legacy torch.nn.utils.weight_norm, "
        f"which {level} cannot convert: it copies the model's parameters to hold their low-precision copies, and the "
        "legacy form's weight is a tensor its forward pre-hook recomputes (not a parameter; copy.deepcopy refuses it "
        "after a forward). Apply torch.nn.utils.parametrizations.weight_norm instead (the same weight, its g and v "
        "are parametrizations.weight.original0 / original1), or convert at O1, which keeps the legacy form.",
        construct="legacy torch.nn.utils.weight_norm", where=found[0])
