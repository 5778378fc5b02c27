"""The O2 module's low-precision gradients between ``unscale_`` and ``step``: true values, and edits that reach the masters.

Every training script clips ``model.parameters()`` after ``scaler.unscale_(optimizer)`` (and Apex-style
scripts after the ``scale_loss`` block). At O2 those are the converted module's fp16/bf16 parameters,
while the step reads the fp32 masters' gradients, which the unscale already copied. So that such a line
means what it says:

* :func:`mirror` writes each master's unscaled fp32 gradient back into its low gradient (rounded), so
  norms, clipping and inspection read true values, and remembers each low gradient's identity, version
  counter, storage (``data_ptr``) and a fingerprint of its values: its fp32 norm and sum (no copy of its values);
* :func:`apply_edits`, at the step, finds the low gradients whose version moved (an in-place edit), whose
  storage or fingerprint changed (an edit through ``.data`` or ``.detach()``, which share the storage but
  not the version counter: the old hand-written clip ``p.grad.data.mul_(c)``, ``p.grad.data = x``), that
  were replaced or set to None, and carries the edit over to the master:

  - an edit that scales a gradient uniformly (``clip_grad_norm_``'s ``mul_``, a user's ``div_``) scales
    the fp32 master gradient by the same factor, so the master keeps its fp32 digits. The factor is
    estimated over all the edited gradients together (the ratio of the norms: one factor for the whole clip),
    else per gradient, and accepted where every element matches it within two roundings to the low
    dtype (what ``round(round(m) * c)`` can differ from ``m * c`` by);
  - any other edit (zeroing a slice, adding noise) replaces the master's gradient by the edited low one:
    the user touched it, and only its low-precision value exists;
  - a gradient nobody touched keeps its master's fp32 gradient as it is.

What is exact and what is rounding: an untouched gradient is exact (fp32). A uniformly scaled one is
``m * c`` in fp32 with ``c`` the clipped low gradients' fp32 norm over the masters': the update's norm is the
clipped low gradients'. torch computes the clip factor itself from the low gradients' norm, rounded to the
low dtype, and rounds what it clips, so a clipped update's norm is at most ``lr * max_norm * ((1+u)/(1-u))**3``,
``u`` the low dtype's unit roundoff (docs/training.md derives it), whatever is done here.

What is not seen: an edit through ``.data``/``.detach()`` that keeps both the fp32 norm and the sum of the
gradient bit for bit (swapping two elements, an edit undone before the step). Nothing fp32 is kept per
gradient: a mark is a weak reference, two ints and two floats, the fingerprints computed in two foreach
passes over the low gradients at the mirror and again at the step (no host sync at the mirror, one at the step).
"""

from __future__ import annotations

import math
import weakref
from typing import Iterable, NamedTuple, Optional

import torch

__all__ = ["Mark", "Marks", "mirror", "apply_edits"]

# (the low gradient, its version counter and data_ptr right after mirror()); None: the master had no gradient.
Mark = Optional[tuple["weakref.ReferenceType[torch.Tensor]", int, int]]


class Marks(NamedTuple):
    """Every low gradient's :data:`Mark`, and the fingerprints of the marked ones (:func:`_fingerprints`) per device."""

    marks: list[Mark]
    fingerprints: dict[torch.device, torch.Tensor]  # (2, n): column j is the device's j-th marked gradient
    columns: list[Optional[tuple[torch.device, int]]]  # each marked gradient's column there


def _fingerprints(grads: list[torch.Tensor]) -> dict[torch.device, torch.Tensor]:
    """Each gradient's fp32 norm and sum, a (2, n) tensor per device: two passes over the gradients, no host sync.

    Recomputed on the same values by the same kernels they are the same bits, so a change of either means the
    values changed. The norm sees a scale or a zeroing, the sum a sign flip or a shift.
    """
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for grad in grads:
        by_device.setdefault(grad.device, []).append(grad)
    return {
        device: torch.stack([torch.stack(torch._foreach_norm(group, 2, dtype=torch.float32)),
                             torch.stack([grad.sum(dtype=torch.float32) for grad in group])])
        for device, group in by_device.items()
    }


@torch.no_grad()
def mirror(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], write: bool) -> Marks:
    """Give each low parameter its master's gradient (rounded) where ``write``, and mark every low gradient.

    ``write=False`` only marks: the low gradients hold their masters' values already (copied, not scaled).
    A master without a gradient leaves its parameter's gradient None.
    """
    marked: list[Optional[torch.Tensor]] = []
    dst, src = [], []
    for param, master in pairs:
        if master.grad is None:
            if write:
                param.grad = None
            marked.append(None)
            continue
        if write:
            if param.grad is None:
                param.grad = torch.empty_like(param)
            dst.append(param.grad)
            src.append(master.grad)
        marked.append(param)  # (replaced by its gradient's mark below, after the copies)
    if dst:
        torch._foreach_copy_(dst, src)
    grads = [param.grad for param in marked if param is not None]
    marks = [None if p is None else (weakref.ref(p.grad), p.grad._version, p.grad.data_ptr()) for p in marked]
    counts: dict[torch.device, int] = {}
    columns: list[Optional[tuple[torch.device, int]]] = []
    for param in marked:
        if param is None:
            columns.append(None)
        else:
            columns.append((param.grad.device, counts.get(param.grad.device, 0)))
            counts[param.grad.device] = columns[-1][1] + 1
    return Marks(marks, _fingerprints(grads), columns)


def _edited(param: torch.Tensor, mark: Mark) -> bool:
    """Whether the gradient was set, replaced, set to None, edited through itself (its version moved) or given new storage."""
    grad = param.grad
    if mark is None:
        return grad is not None
    return grad is None or grad is not mark[0]() or grad._version != mark[1] or grad.data_ptr() != mark[2]


def _edited_through_data(params: list[torch.Tensor], marks: Marks) -> list[bool]:
    """Which of the marked, otherwise unchanged gradients have a new fingerprint (an edit through ``.data``).

    One host sync. Compared bit for bit: a NaN fingerprint that stayed NaN is unchanged.
    """
    where = marks.columns
    candidates = [i for i, (param, mark) in enumerate(zip(params, marks.marks))
                  if mark is not None and not _edited(param, mark)]
    if not candidates:
        return [False] * len(params)
    now = _fingerprints([params[i].grad for i in candidates])
    order: dict[torch.device, list[int]] = {}
    for i in candidates:
        order.setdefault(where[i][0], []).append(i)
    flags, indices = [], []
    for device, members in order.items():
        then = marks.fingerprints[device][:, [where[i][1] for i in members]]
        flags.append((now[device].view(torch.int32) != then.view(torch.int32)).any(0).cpu())
        indices += members
    changed = [False] * len(params)
    for index, flag in zip(indices, torch.cat(flags).tolist()):
        changed[index] = flag
    return changed


@torch.no_grad()
def apply_edits(pairs: list[tuple[torch.Tensor, torch.Tensor]], marks: Marks) -> int:
    """Carry every edit made to the low gradients since :func:`mirror` over to the masters (module docstring).

    Returns how many gradients were edited (one host sync for the fingerprints, one more when any was edited in place).
    """
    scaled = []  # (low grad, master grad): edited in place, maybe a uniform scale
    count = 0
    params = [param for param, _ in pairs]
    through_data = _edited_through_data(params, marks)
    for (param, master), mark, data_edit in zip(pairs, marks.marks, through_data):
        if not (data_edit or _edited(param, mark)):
            continue
        count += 1
        grad = param.grad
        if grad is None:
            master.grad = None
        elif mark is not None and grad is mark[0]() and master.grad is not None and grad.dtype != master.dtype:
            scaled.append((grad, master.grad))
        elif master.grad is None:  # (and a gradient as wide as its master's: copied, nothing is lost)
            master.grad = grad.detach().to(master.dtype)
        else:
            master.grad.copy_(grad)
    if scaled:
        _scale_or_copy(scaled)
    return count


def _matches(low: torch.Tensor, master: torch.Tensor, factor: float) -> bool:
    """Whether ``low`` is ``master * factor`` rounded twice to ``low``'s dtype, element by element.

    ``|low - c m| <= 2 eps |c m| + 2 s max(1, |c|)``, ``eps`` and the subnormal step ``s`` the low dtype's: each
    rounding errs by half a step, the first on ``m`` (then scaled by ``c``), the second on the product.
    In five passes over the gradient, two temporaries of its size (one at a time, not one per gradient).
    """
    if not math.isfinite(factor):
        return False
    info = torch.finfo(low.dtype)
    spacing = info.tiny * info.eps  # the smallest subnormal step of the low dtype
    excess = low.float().sub_(master, alpha=factor).abs_()
    excess.sub_(master.abs(), alpha=2 * info.eps * abs(factor))
    return bool(excess.max() <= 2 * spacing * max(1.0, abs(factor)))


def _scale_or_copy(scaled: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Scale each master by the factor its low gradient was scaled by, or copy the low gradient where none fits.

    The factor is the ratio of the norms (the low gradient held the master's values, rounded, before the edit):
    first one for all the edited gradients together (a clip scales them all alike), then each gradient's own.
    """
    lows = torch._foreach_norm([low for low, _ in scaled], 2, dtype=torch.float32)  # (not rounded to the low dtype)
    masters = torch._foreach_norm([master for _, master in scaled])
    norms = torch.stack([torch.stack(lows), torch.stack(masters)]).tolist()  # one host sync
    shared = math.hypot(*norms[0]) / math.hypot(*norms[1]) if any(norms[1]) else math.nan
    for (low, master), low_norm, master_norm in zip(scaled, *norms):
        if _matches(low, master, shared):
            master.mul_(shared)
            continue
        own = low_norm / master_norm if master_norm else math.nan  # a gradient scaled by itself
        if _matches(low, master, own):
            master.mul_(own)
        else:
            master.copy_(low)
