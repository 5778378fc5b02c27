"""Weights computed by hooks or parametrizations: refuse a stale computation, and legacy weight_norm where the model is copied.

These compute a module's weight from other tensors at each call: a forward
pre-hook (``torch.nn.utils.prune``, ``weight_norm``, ``spectral_norm``) or a
parametrization (``torch.nn.utils.parametrize``).  The converted graph traces
that computation in, reading the tensors the module had at conversion.  When
it changes afterwards -- pruned again (a new ``PruningContainer`` hook and a
new ``weight_mask`` buffer), ``prune.remove`` / ``remove_weight_norm`` /
``remove_parametrizations``, a buffer the computation reads replaced
(``model.to(...)`` replaces buffers) -- the graph would go on computing the
old weight, silently.  A rebuild cannot simply take the new tensors: the
converted module keeps its own parameters and buffers (at O2 low copies an
optimizer may hold), so the call is refused, naming the module and the fix
(convert again).

:func:`signatures` records, per module path, the objects that make up the
computation (its module class, its computation hooks, its own parameters and
buffers, its parametrization modules); :func:`changed` compares them by
identity.  ``live_hooks`` checks the modules that had a computation at every
call (a removal registers no hook, so nothing else would tell), and every
module whenever a hook was registered anywhere (a new pruning registers one).

Legacy ``torch.nn.utils.weight_norm`` keeps ``weight`` as a plain tensor
attribute that its forward pre-hook recomputes from ``weight_g`` and
``weight_v`` on every call: after a forward it is a non-leaf tensor, which
``copy.deepcopy`` refuses (torch's own error), and a copy made before one
would hold a stale ``weight`` whose gradient reaches neither ``weight_g`` nor
``weight_v`` in low precision.  O1 converts it as it is (the graph computes
``_weight_norm(v, g)`` from the parameters each forward and casts the
result), so only the levels that copy the model's parameters to hold their
low copies refuse it (:func:`refuse_legacy_weight_norm`).
``torch.nn.utils.parametrizations.weight_norm`` keeps ``original0`` /
``original1`` as parameters and ``weight`` as a computed property, which
O2's masters and low copies handle like any other parameters.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch.nn as nn
from torch.nn.utils.weight_norm import WeightNorm

from amp_fx.errors import AmpRuntimeError, UnsupportedConstructError
from amp_fx.graph_ops.hook_dispatch import COMPUTATION_HOOKS

__all__ = ["Signature", "signature", "signatures", "changed", "refuse_changed", "stale_computation", "legacy_weight_norms",
           "refuse_legacy_weight_norm"]

# (kind, name, object) triples, compared by name and object identity
Signature = tuple


def _computation_hooks(module: nn.Module) -> list[Any]:
    hooks = module.__dict__.get("_forward_pre_hooks")
    return [h for h in hooks.values() if isinstance(h, COMPUTATION_HOOKS)] if hooks else []


def _computed(hook: Any) -> str:
    """The tensor a computation hook computes (prune's ``_tensor_name``, weight_norm's and spectral_norm's ``name``)."""
    return str(getattr(hook, "_tensor_name", None) or getattr(hook, "name", ""))


def signature(module: nn.Module) -> Optional[Signature]:
    """What ``module``'s weight computation is made of now, or None when it has none."""
    hooks = _computation_hooks(module)
    plists = module.__dict__.get("_modules", {}).get("parametrizations")
    if not isinstance(plists, nn.ModuleDict):  # (fx's plain container of that name in a converted module)
        plists = None
    if not hooks and plists is None:
        return None
    parts: list[tuple[str, str, Any]] = [("class", type(module).__name__, type(module))]
    parts += [("hook", f"{type(h).__name__}({_computed(h)})", h) for h in hooks]
    parts += [("parameter", name, p) for name, p in module._parameters.items()]
    parts += [("buffer", name, b) for name, b in module._buffers.items()]
    for name, plist in (plists.items() if plists is not None else ()):
        parts.append(("parametrization", name, plist))
        parts += [("parametrization", f"{name}[{i}]", p) for i, p in plist._modules.items()]
        parts += [("parameter", f"parametrizations.{name}.{n}", t) for n, t in plist._parameters.items()]
    return tuple(parts)


def signatures(model: nn.Module) -> dict[str, Signature]:
    """``signature`` of every module of ``model`` that has a weight computation, by path."""
    found = {}
    for path, module in model.named_modules():
        sig = signature(module)
        if sig is not None:
            found[path] = sig
    return found


def changed(before: Optional[Signature], now: Optional[Signature]) -> Optional[str]:
    """What differs between two signatures, in words (None: the same computation)."""
    if before is None and now is None:
        return None
    if before is None:
        return "a weight computation was added (" + _named(now) + ")"
    if now is None:
        return "its weight computation was removed (" + _named(before) + ")"
    old = {(k, n): o for k, n, o in before}
    new = {(k, n): o for k, n, o in now}
    differences = []
    for key in dict.fromkeys([*old, *new]):
        kind, name = key
        if key not in new:
            differences.append(f"{kind} {name} removed")
        elif key not in old:
            differences.append(f"{kind} {name} added")
        elif old[key] is not new[key]:
            differences.append(f"{kind} {name} replaced")
    return ", ".join(differences) or None


def _named(sig: Signature) -> str:
    return ", ".join(f"{k} {n}" for k, n, _ in sig if k in ("hook", "parametrization") and "[" not in n)


def _may_compute(module: nn.Module) -> bool:
    """A quick test before :func:`signature` (run on every module when a hook was registered anywhere)."""
    held = module.__dict__
    return bool(held.get("_forward_pre_hooks")) or "parametrizations" in held.get("_modules", ())


def _current(recorded: dict[str, Signature], model_modules: list, converted_modules: list) -> Iterator[tuple]:
    """(path, module, whose, signature now, signature at conversion) of the model's modules, then the converted module's hooks."""
    for path, module in model_modules:
        if path in recorded or _may_compute(module):
            yield path, module, "the model's", signature(module), recorded.get(path)
    for path, module in converted_modules:
        if path and module.__dict__.get("_forward_pre_hooks"):  # (the converted module itself is the graph)
            # Its modules are clones (of the model, or of its copy at O2/O3) or fx's containers, with none or the
            # model's computation hooks: only another kind of hook counts.
            known = {part[1] for part in recorded.get(path) or () if part[0] == "hook"}
            new = tuple(part for part in signature(module) or () if part[0] == "hook" and part[1] not in known)
            if new:
                yield path, module, "the converted module's", new, ()


def stale_computation(recorded: list[tuple[str, nn.Module, Signature]]) -> bool:
    """True when one of the ``(path, module, signature)`` recorded no longer matches its module (cheap: per call)."""
    for _, module, sig in recorded:
        now = signature(module)
        if now is None or len(now) != len(sig) or any(a[2] is not b[2] or a[1] != b[1] for a, b in zip(now, sig)):
            return True
    return False


def refuse_changed(recorded: dict[str, Signature], model_modules: list[tuple[str, nn.Module]],
                   converted_modules: list[tuple[str, nn.Module]] = ()) -> None:
    """Raise if one of the model's modules (path, module) computes its weight otherwise than at conversion.

    ``converted_modules``: the converted module's, which carry the same
    computation hooks (pruning one of them is refused the same way).
    """
    for path, module, whose, now, before in _current(recorded, model_modules, converted_modules):
        what = changed(before, now)
        if what is None:
            continue
        name = f"{whose} module {path!r}" if path else f"{whose} module '' (the model itself)"
        raise AmpRuntimeError(
            f"amp_fx: the weight computation of {name} ({type(module).__name__}) changed since conversion: {what}. "
            "The converted graph traced in the computation the module had then (pruning, weight_norm, spectral_norm "
            "and parametrizations compute a weight at each call from the tensors they read), so it would go on "
            "computing the old weight. Convert the model again after such a change: gm = amp_fx.convert(model, ...) "
            "(an optimizer over the model's parameters stays valid at O1; at O2 wrap it for the new module).")
    present = {path for path, _ in model_modules} if recorded else set()
    for path in recorded:
        if path not in present:
            raise AmpRuntimeError(
                f"amp_fx: module {path!r}, whose weight computation the converted graph traced in, is no longer in "
                "the model. Convert the model again: gm = amp_fx.convert(model, ...).")


# -- legacy weight_norm, where the model is copied -------------------------------------------
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
