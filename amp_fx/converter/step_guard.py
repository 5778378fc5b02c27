"""Refuse a plain optimizer's first step over O2's low-precision parameters, which would silently not train.

At O2 the converted module holds bf16/fp16 copies of the model's fp32
parameters, and the fp32 originals are the master weights. A plain optimizer
over ``gm.parameters()`` (what HF Trainer, Lightning and most hand loops
build) updates the low copies in place: every update below half an ulp of the
weight (``|w| * 2**-9`` in bf16) rounds away, so the run trains a little or
not at all, and the masters, which ``gm.state_dict()`` saves and the next
``MasterWeightOptimizer`` step copies back, never change. Nothing fails: the
loss just stays where it was.

So the first ``step()`` of such an optimizer raises :class:`AmpRuntimeError`
naming the parameter, the level and both fixes. An error, not a warning: a
warning scrolls by in a framework's log while the run goes on not training,
which is the silent wrong result this guard exists to stop; an error costs one
edit to fix, and there is no run whose intent it breaks (one that really wants
to round updates into bf16 says so with ``LowPrecisionOptimizer(...,
update="nearest")``).

How it sees the step without the user calling amp_fx: one global
``torch.optim`` step pre-hook, registered the first time an O2 module is built
(:func:`guard_low_parameters`, called by ``attach_masters``). What is refused:
an optimizer whose param groups hold a float16/bfloat16 parameter that has an
fp32 master and requires grad (a frozen one is never changed by the step; O2's
fp32 norm parameters train as they are). What is not:

- amp_fx's own wrappers (``MasterWeightOptimizer``, ``LowPrecisionOptimizer``,
  registered by :mod:`amp_fx.runtime.optimizer_checks` through
  :func:`register_wrapper_type`) and the optimizer each wraps: the wrapper's
  step runs the hook first, which marks its inner optimizer as stepped on its
  behalf. (``MasterWeightOptimizer``'s inner groups hold the masters anyway.)
- O1 (its parameters are the model's fp32 ones) and O3 (no masters: low
  weights are what O3 trains; ``LowPrecisionOptimizer`` keeps its small updates).
- ``zero_grad``, LR schedulers and state dicts: only ``step()`` runs the hook.

Also refused: a plain optimizer over the model's own parameters (built before
the convert, the torch.amp habit) whose step finds an O2 master without a
gradient while its low copy in a live converted module has one: backward wrote
into gm, so the step would change nothing. A master with its own gradient (the
fp32 model trained itself) is not refused.

``copy.deepcopy(gm)`` marks its copies again (``AmpGraphModule.__deepcopy__``).
Not seen: the DTensors FSDP2's ``fully_shard`` puts in place of the marked
parameters. The guard lives in core, beside
``attach_masters`` that installs it, since core imports nothing above it; the
runtime registers its wrapper types here.

Cost: a passed optimizer is remembered (weakly) with the identities of its
groups' parameter lists, so each later step is one dictionary lookup; a new
group (``add_param_group``) or a replaced parameter list is checked again at
the next step. A refused optimizer is refused at every step. Nothing runs
before the first O2 module is built (its time: docs/performance.md, "Costs of
the run-time checks").
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from amp_fx.graph_ops.master_sync import low_with_grad
from amp_fx.errors import PACKAGE, AmpRuntimeError

__all__ = ["guard_low_parameters", "register_wrapper_type"]

# On each O2 low parameter that has an fp32 master: (its name in the converted module, the level).
ORIGIN_ATTR = "_amp_fx_low_origin"

_LOW = (torch.float16, torch.bfloat16)
_WRAPPER_TYPES: list[type] = []
# Optimizers that passed: -> the identities of their groups' "params" lists when they passed.
_PASSED: "weakref.WeakKeyDictionary[Any, tuple[int, ...]]" = weakref.WeakKeyDictionary()
# Inner optimizers of amp_fx wrappers: stepped on the wrapper's behalf, never refused.
_WRAPPED: "weakref.WeakSet[Any]" = weakref.WeakSet()
_HANDLE: Optional[Any] = None
_LOCK = threading.Lock()


def register_wrapper_type(cls: type) -> None:
    """Exempt ``cls`` (an amp_fx optimizer wrapper with an ``optimizer`` attribute) and what it wraps."""
    if cls not in _WRAPPER_TYPES:
        _WRAPPER_TYPES.append(cls)


def guard_low_parameters(module: nn.Module) -> None:
    """Mark ``module``'s low parameters that have fp32 masters, and install the step hook once.

    Reads ``module.amp_fx_masters`` (``{name: master}``) as ``attach_masters``
    left it, and the level from ``module.amp_config`` (a module without one,
    such as ``convert_for_sharding``'s root, keeps the level its blocks gave).
    """
    global _HANDLE
    masters = module.__dict__.get("amp_fx_masters") or {}
    level = getattr(getattr(module, "amp_config", None), "level", None)
    for name, param in module.named_parameters():
        master = masters.get(name)
        if master is not None and master is not param and param.dtype in _LOW:  # (fp32 norms train as they are)
            previous = getattr(param, ORIGIN_ATTR, None)
            setattr(param, ORIGIN_ATTR, (name, level or (previous[1] if previous else "O2")))
    with _LOCK:
        if _HANDLE is None:
            _HANDLE = register_optimizer_step_pre_hook(_refuse_plain_step)


def _signature(optimizer: Any) -> tuple[int, ...]:
    # .get: the hook runs for every optimizer in the process, amp_fx's or not; none may break on it
    return tuple(id(group.get("params")) for group in optimizer.param_groups)


def _remember(optimizer: Any) -> None:
    try:
        _PASSED[optimizer] = _signature(optimizer)
    except TypeError:  # not weak-referenceable: checked at every step (a loop over its parameters)
        pass


def _refuse_plain_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """The global step pre-hook: raise if ``optimizer`` would update O2 low parameters in place."""
    try:
        if _PASSED.get(optimizer) == _signature(optimizer):
            return None
    except TypeError:
        pass
    if _WRAPPER_TYPES and isinstance(optimizer, tuple(_WRAPPER_TYPES)):
        try:
            _WRAPPED.add(optimizer.optimizer)
        except (AttributeError, TypeError):  # none yet, or not weak-referenceable: checked on its own
            pass
        _remember(optimizer)
        return None
    try:
        wrapped = optimizer in _WRAPPED
    except TypeError:
        wrapped = False
    if wrapped:
        _remember(optimizer)
        return None
    low = [p for group in optimizer.param_groups for p in group.get("params", ())
           if isinstance(p, torch.Tensor) and p.requires_grad and p.dtype in _LOW and hasattr(p, ORIGIN_ATTR)]
    if low:
        raise _plain_step_error(optimizer, low)
    masters = [(p, found) for group in optimizer.param_groups for p in group.get("params", ())
               if isinstance(p, torch.Tensor) and p.grad is None and (found := low_with_grad(p)) is not None]
    if masters:
        raise _masters_step_error(optimizer, masters)
    _remember(optimizer)
    return None


def _plain_step_error(optimizer: Any, low: list[torch.Tensor]) -> AmpRuntimeError:
    name, level = getattr(low[0], ORIGIN_ATTR)
    kind = type(optimizer).__name__
    more = f" and {len(low) - 1} more" if len(low) > 1 else ""
    dtype = str(low[0].dtype).replace("torch.", "")
    return AmpRuntimeError(
        f"amp_fx: {kind}.step() would update {name!r}{more} in place, {dtype} copies that "
        f"{PACKAGE}.convert(model, {level!r}) made of the model's fp32 parameters (the fp32 originals are the "
        f"master weights). Updates below half a {dtype} ulp round away, so the model would silently stop "
        "training, and the masters, which gm.state_dict() saves, would never change. Wrap the optimizer: "
        "opt = amp_fx.MasterWeightOptimizer(opt, gm) (steps the fp32 masters and copies them into gm; opt may "
        "be built over gm.parameters() or model.parameters()), or opt = amp_fx.LowPrecisionOptimizer(opt, gm, "
        "update=\"kahan\") (no masters: Kahan-compensated low-precision updates); or convert at \"O1\" "
        "(fp32 parameters: any optimizer trains them). With a framework (HF Trainer, Lightning), hand it "
        "the wrapped optimizer.")


def _masters_step_error(optimizer: Any, masters: list) -> AmpRuntimeError:
    master, (sync, index) = masters[0]
    name, low = sync.names[index], sync.lows[index]
    kind = type(optimizer).__name__
    more = f" and {len(masters) - 1} more" if len(masters) > 1 else ""
    dtype = str(low.dtype).replace("torch.", "")
    return AmpRuntimeError(
        f"amp_fx: {kind}.step() steps the model's fp32 parameter {name!r}{more}, the master weight of a "
        f"{dtype} copy that amp_fx.convert(model, {sync.level!r}) made, and the backward pass wrote the gradient "
        f"into that copy (gm's parameter), not into the master: the master has none, so the step would change "
        "nothing and the model would silently not train. Wrap the optimizer: opt = amp_fx.MasterWeightOptimizer("
        "opt, gm) (it steps these masters with gm's gradients and copies them into gm; build it before the first "
        "step). To train the fp32 model itself, call the model, not gm.")
