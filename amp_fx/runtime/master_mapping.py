"""Which fp32 master stands for each parameter of a low-precision module, for :class:`MasterWeightOptimizer`.

A master is given (``masters=``, by default the converter's ``module.amp_fx_masters``: the model's own
fp32 parameters, so no third copy exists), made by copying a low parameter to fp32, the parameter itself
where it is fp32 already (norms kept fp32), or adopted by ``add_param_group``.  Under FSDP2 a given
full master is cut to this rank's shard.  The refusals of modules that need no masters live here too.
"""

from __future__ import annotations

import weakref
from typing import Mapping

import torch
import torch.distributed as dist
from torch import nn

from amp_fx.converter.graph_module import MASTER_ATTR
from amp_fx.errors import AmpValueError
from amp_fx.ir.config import AmpConfig

from .dtensors import is_dtensor, shard_like
from .master_copies import CopyGroup

__all__ = ["LOW", "MasterMapping", "check_fp32_accumulation", "check_module"]

LOW = (torch.float16, torch.bfloat16)

# module -> the MasterWeightOptimizers built over it (weakly held): torch's "several optimizers" recipe splits one
# module's parameters between them, and a step refuses a gradient that none of them would apply.
_MAPPINGS_OVER: "weakref.WeakKeyDictionary[nn.Module, weakref.WeakSet[MasterMapping]]" = weakref.WeakKeyDictionary()


def check_module(module: nn.Module) -> None:
    """Refuse modules whose parameters need no masters: they would train, but not as the user thinks."""
    config = getattr(module, "amp_config", None)
    if isinstance(config, AmpConfig):
        if not config.cast_params:
            raise AmpValueError(
                f"MasterWeightOptimizer got a module converted at {config.level}: at O0/O1 the converted "
                "module shares the model's fp32 parameters and casts them in the graph, so there are no "
                "low-precision parameters to keep masters of. Step a plain optimizer over "
                "converted.parameters() (or model.parameters(): the same tensors), or convert at O2."
            )
        return
    if not any(p.dtype in LOW for p in module.parameters()):
        raise AmpValueError(
            f"MasterWeightOptimizer got a {type(module).__name__} with no float16/bfloat16 parameters, "
            "so there is nothing to keep fp32 masters of. Pass the module amp_fx.convert(model, 'O2') "
            "returned (its parameters are low-precision copies): "
            "MasterWeightOptimizer(torch.optim.X(model.parameters()), converted)."
        )


def check_fp32_accumulation(module: nn.Module) -> None:
    """Refuse fp32_grad_accumulation where another tool reads the low gradients the hook frees."""
    sharded = any(is_dtensor(p) for p in module.parameters())
    if sharded or (dist.is_available() and dist.is_initialized()):
        raise AmpValueError(
            "MasterWeightOptimizer(fp32_grad_accumulation=True) frees each low-precision gradient as soon as "
            "backward makes it (after adding it into the fp32 master's), but DDP and FSDP reduce those gradients "
            "after that point, so they would reduce nothing" + (" (this module's parameters are DTensor shards)"
                                                                 if sharded else " (torch.distributed is initialized)")
            + ". Leave fp32_grad_accumulation off under torch.distributed; FSDP2's reduce_dtype=torch.float32 "
            "keeps the reduced gradients fp32.")


class MasterMapping:
    """The parameter-to-master half of :class:`~amp_fx.runtime.MasterWeightOptimizer` (a mixin: it sets and reads
    the wrapper's ``_params``, ``_names``, ``_given``, ``_masters``, ``_pairs`` and copy groups)."""

    def _map_parameters(self, module: nn.Module, masters: Mapping[str, torch.Tensor] | None) -> None:
        """Name the module's parameters and check the given masters; no master is chosen yet (``_master_for``)."""
        self._names = {id(p): n for n, p in module.named_parameters()}
        self._params = dict(module.named_parameters())
        if masters is None:
            masters = getattr(module, "amp_fx_masters", None)
        self._given = dict(masters or {})
        for name, master in self._given.items():
            param = self._params.get(name)
            if param is not None and (master.shape != param.shape or master.dtype in LOW):
                raise AmpValueError(
                    f"master for {name!r} must be a full-precision tensor of shape "
                    f"{tuple(param.shape)}, got {master.dtype} {tuple(master.shape)}"
                )
        self._given_ids = {id(m): n for n, m in self._given.items()}
        self._masters: dict[str, torch.Tensor] = {}  # name -> master, owned names only
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (module param, master)
        self._groups: list[CopyGroup] | None = None  # _pairs by (device, dtypes); None: regroup
        self._old_groups: list[CopyGroup] | None = None  # the groups before a regroup (their kept buffers)
        # The module's parameters this wrapper holds no master for, and (len(_params), len(_masters)) then.
        self._unheld: list[tuple[str, torch.Tensor]] = []
        self._unheld_key: tuple[int, int] | None = None

    def _master_for(self, param: torch.Tensor, adopt: bool = False) -> torch.Tensor:
        """Return the master that stands for ``param`` (a module parameter or a master).

        ``adopt``: a tensor of neither kind becomes a new module parameter (Apex's
        ``add_param_group``): a low one gets an fp32 master, an fp32 one is its own.
        """
        name = self._names.get(id(param))
        if name is None:
            name = self._given_ids.get(id(param))
            if name is None and adopt:
                return self._adopt(param)
            if name is None:
                raise AmpValueError(
                    "optimizer does not own the model's parameters: it holds a tensor of "
                    f"shape {tuple(param.shape)} and dtype {param.dtype} that is neither a "
                    "parameter of the module nor one of its fp32 masters. Build the optimizer "
                    "over the converted module's parameters or over the original model's "
                    "(fp32) parameters, after conversion."
                )
            if name not in self._params:  # a master of a parameter the module dropped
                return param
        if name in self._masters:
            return self._masters[name]
        module_param = self._params[name]
        master = self._given.get(name)
        if master is not None and is_dtensor(module_param) and not is_dtensor(master):
            # FSDP2 sharded the module: keep only this rank's shard of the fp32 master
            # (cut from the full original, so no value is rounded through bf16).
            master = self._given[name] = shard_like(master, module_param)
        if master is None:
            if module_param.dtype in LOW:
                master = nn.Parameter(
                    module_param.detach().to(torch.float32), module_param.requires_grad
                )
            else:
                master = module_param  # fp32 already: its own master
        self._masters[name] = master
        if master is not module_param:
            self._pairs.append((module_param, master))
            self._old_groups, self._groups = self._groups or self._old_groups, None
        return master

    def _adopt(self, param: torch.Tensor) -> torch.Tensor:
        resolved = self._resolve(param) if self._resolve is not None else None
        if resolved is not None:
            name, module_param, master = resolved
        else:  # a parameter of another O2 module: its master is the model parameter it was cast from
            name, module_param, master = f"added.{self._added}", param, getattr(param, MASTER_ATTR, None)
            self._added += 1
        if name in self._params and self._params[name] is not module_param:
            raise AmpValueError(f"add_param_group: a parameter named {name!r} is already optimized")
        self._params[name] = module_param
        self._names[id(module_param)] = name
        if master is not None and master is not module_param:
            self._given[name] = master
            self._given_ids[id(master)] = name
        return self._master_for(module_param)

    def _register_over(self, module: nn.Module) -> None:
        """Count this wrapper among those that hold parameters of ``module`` (:meth:`_refuse_uncovered_grads`)."""
        _MAPPINGS_OVER.setdefault(module, weakref.WeakSet()).add(self)

    def _refuse_uncovered_grads(self) -> None:
        """Refuse a gradient on a module parameter that no MasterWeightOptimizer over the module would apply.

        Several optimizers may split one module's parameters (torch's recipe: SGD for the body, AdamW for the
        head); a parameter that none of them holds would train silently never. Only parameters this wrapper does
        not hold are looked at, and only when one has a gradient are the module's other wrappers asked.
        """
        key = (len(self._params), len(self._masters))  # (both only grow: add_param_group)
        if self._unheld_key != key:
            self._unheld_key = key
            self._unheld = [(n, p) for n, p in self._params.items() if n not in self._masters]
        unheld = [(n, p) for n, p in self._unheld if p.grad is not None]
        if not unheld:
            return
        held = {id(p) for opt in _MAPPINGS_OVER.get(self.module, ()) for n, p in opt._params.items()
                if n in opt._masters}
        missing = [n for n, p in unheld if id(p) not in held]
        if missing:
            raise AmpValueError(
                f"module parameters {missing} have gradients but no MasterWeightOptimizer over this module holds "
                "them, so they would never be updated: build another MasterWeightOptimizer over them (one optimizer "
                "per part of the model works), add them with add_param_group() to one of them, or set "
                "requires_grad=False on them.")

    def _move_state_to_masters(self) -> None:
        # An optimizer that already stepped the module's parameters keeps that
        # state; it now belongs to the masters.
        for name, master in self._masters.items():
            param = self._params[name]
            if param is not master and param in self.optimizer.state:
                self.optimizer.state[master] = self.optimizer.state.pop(param)
