"""Keep O2's low-precision copies equal to their fp32 masters after a master is written in place outside amp_fx.

At O2 the model's own fp32 parameters are the master weights and the
converted module runs on bf16/fp16 copies of them. The masters are the truth:
``MasterWeightOptimizer`` steps them, ``gm.state_dict()`` saves them. A user
may also write them directly: ``model.load_state_dict(ckpt)`` after the
convert (a resume), ``model[2].weight.mul_(0.5)``, or a forward pre-hook that
clamps ``module.weight`` in place (hooks get the model's module, whose weight
is the master). Without a sync the converted module would keep running on
the old low copies, and nothing would say so.

So each converted module keeps a :class:`MasterSync`: its (low copy, master)
pairs and the master's ``_version`` when the low copy was last written from
it (at conversion, and by ``MasterWeightOptimizer`` after each step's copy,
so its steps never copy twice). Before each call, before ``state_dict()`` reads the values, and after a
module's forward pre-hooks ran, a low copy whose master's version moved is
copied again from it. In-place writes bump the version; a write through
``p.data`` does not and is not seen (as with every version-based cache), nor
does a step of torch's fused Adam/AdamW (``fused=True``: its kernels bump no
version; train the model itself with another implementation, or convert again).

Cost: one ``_version`` read per master per call, a Python list compare (measured:
docs/performance.md, "O2 update"; ``benchmarks/bench_master_sync.py``). Only pairs of plain tensors of the
same shape are tracked (not FSDP2's DTensor shards, whose masters
``MasterWeightOptimizer`` owns).
"""

from __future__ import annotations

import weakref
from operator import attrgetter
from typing import Any, Iterable, Optional

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["MasterSync", "SYNC_ATTR", "track_masters", "sync_masters", "sync_parameters_of", "writers", "record",
           "low_with_grad"]

SYNC_ATTR = "_amp_fx_master_sync"  # on a converted O2 module: its MasterSync
_PLAIN = (torch.Tensor, nn.Parameter)
_VERSION = attrgetter("_version")
# master -> [(weak reference to a MasterSync, index)]: the low copies made of it, in every live converted module.
_BY_MASTER: WeakIdKeyDictionary = WeakIdKeyDictionary()


class MasterSync:
    """A converted module's (low copy, master) pairs and each master's version when its low copy was written."""

    __slots__ = ("source", "names", "lows", "masters", "versions", "grad_flags", "level", "recopies", "__weakref__")

    def __init__(self, module: nn.Module, masters: dict) -> None:
        self.source = masters  # the module's amp_fx_masters dict: another one (FSDP2's shards) means rebuild
        self.level = getattr(getattr(module, "amp_config", None), "level", None) or "O2"
        pairs = [(name, low, masters[name]) for name, low in module.named_parameters() if name in masters]
        pairs = [(n, low, m) for n, low, m in pairs
                 if m is not low and type(m) in _PLAIN and type(low) in _PLAIN and m.shape == low.shape]
        self.names = [n for n, _, _ in pairs]
        self.lows = [low for _, low, _ in pairs]
        self.masters = [m for _, _, m in pairs]
        self.versions = [m._version for m in self.masters]
        self.grad_flags = [m.requires_grad for m in self.masters]
        self.recopies = 0  # how many low copies were written again (tests count them)
        ref = weakref.ref(self)
        for index, master in enumerate(self.masters):
            entries = _BY_MASTER.get(master)
            if entries is None:
                entries = _BY_MASTER[master] = []
            entries[:] = [e for e in entries if e[0]() is not None]  # converted modules since freed
            entries.append((ref, index))

    def sync(self) -> None:
        """Copy again every master whose version moved since its low copy was written."""
        versions = list(map(_VERSION, self.masters))
        if versions != self.versions:
            self.copy(i for i, (now, then) in enumerate(zip(versions, self.versions)) if now != then)
        flags = [m.requires_grad for m in self.masters]
        if flags != self.grad_flags:
            # The model's parameter was frozen or unfrozen (requires_grad_, Lightning's toggle_optimizer): its low
            # copy follows, or it would keep collecting gradients its optimizer then steps. Only a change is
            # passed on, so freezing the converted module's own copy directly still holds.
            for index, (now, then) in enumerate(zip(flags, self.grad_flags)):
                if now != then and self.lows[index].is_leaf:
                    self.lows[index].requires_grad_(now)
            self.grad_flags = flags

    def copy(self, indices: Iterable[int]) -> None:
        """Write the masters at ``indices`` into their low copies (rounded), and record their versions."""
        with torch.no_grad():
            for i in indices:
                master = self.masters[i]
                self.lows[i].copy_(master)
                self.versions[i] = master._version
                self.recopies += 1


def track_masters(module: nn.Module) -> Optional[MasterSync]:
    """Start tracking ``module``'s masters (``amp_fx_masters``) as its low copies now are; None without masters."""
    masters = module.__dict__.get("amp_fx_masters")
    sync = MasterSync(module, masters) if masters else None
    module.__dict__[SYNC_ATTR] = sync
    return sync


def sync_masters(module: nn.Module) -> None:
    """Re-copy ``module``'s low copies whose master was written in place since (a no-op without masters)."""
    masters = module.__dict__.get("amp_fx_masters")
    if not masters:
        return
    sync = module.__dict__.get(SYNC_ATTR)
    if sync is None or sync.source is not masters:  # unpickled, or the masters replaced: in sync as they are now
        sync = track_masters(module)
    sync.sync()


def sync_parameters_of(modules: Iterable[nn.Module]) -> None:
    """Re-copy the low copies of the masters among ``modules``' parameters that moved (after their pre-hooks ran)."""
    if not _BY_MASTER:  # no O2 module was built
        return
    for module in modules:
        if not module.__dict__.get("_forward_pre_hooks"):
            continue
        for param in module.parameters():
            for ref, index in _BY_MASTER.get(param, ()):
                sync = ref()
                if sync is not None and sync.versions[index] != param._version:
                    sync.copy((index,))


def writers(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[MasterSync, int, torch.Tensor]]:
    """For (low copy, master) pairs that an optimizer copies master -> low: the sync entries those copies refresh."""
    found = []
    for low, master in pairs:
        for ref, index in _BY_MASTER.get(master, ()):
            sync = ref()
            if sync is not None and sync.lows[index] is low:  # another module's copy of the same master is not written
                found.append((sync, index, master))
    return found


def record(entries: list[tuple[MasterSync, int, torch.Tensor]]) -> None:
    """After the copies :func:`writers` named: their low copies are their masters' current values."""
    for sync, index, master in entries:
        sync.versions[index] = master._version


def low_with_grad(master: Any) -> Optional[tuple[MasterSync, int]]:
    """The (sync, index) of a live low copy of ``master`` that holds a gradient, if any."""
    for ref, index in _BY_MASTER.get(master, ()):
        sync = ref()
        if sync is not None and sync.lows[index].grad is not None:
            return sync, index
    return None
