"""Fit a user's optimizer to its converted model(s) and keep the per-optimizer state ``scale_loss`` needs.

* O0/O1: the converted module shares the model's fp32 parameters, so the
  optimizer is left as it is.
* O2 (master weights): the model's own fp32 parameters are the masters; the
  optimizer keeps stepping them, wrapped in
  :class:`~amp_fx.runtime.MasterWeightOptimizer`, which copies the low
  gradients in and the updated values out.
* O3 (or ``master_weights=False``): the optimizer is pointed at the converted
  module's low-precision parameters, group by group, keeping group options.

:class:`OptimizerRecord` holds what Apex kept in ``optimizer._amp_stash``:
gradients set aside while another loss back-propagates, whether the grads are
still scaled (``delay_unscale``), and a pending "skip the next step".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from amp_fx.runtime import MasterWeightOptimizer
from amp_fx.errors import AmpRuntimeError, AmpValueError

__all__ = ["OptimizerRecord", "check_ownership", "fit_optimizer"]


def check_ownership(optimizer: torch.optim.Optimizer, owners: dict[int, tuple[int, str]]) -> None:
    """Raise unless every tensor ``optimizer`` steps is a parameter of one of the models."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in owners:
                raise AmpValueError(
                    "optimizer does not own the model's parameters: it holds a tensor of shape "
                    f"{tuple(param.shape)} ({param.dtype}) that is no parameter of the model(s) "
                    "passed to amp_fx.initialize. Build the optimizer over model.parameters() of "
                    "the models you pass, and pass all of them in the same call."
                )


def _view_module(params: dict[str, nn.Parameter], config: Any) -> nn.Module:
    """A module holding exactly ``params`` under their dotted names (for MasterWeightOptimizer)."""
    root = nn.Module()
    root.amp_config = config  # the level that made these parameters (MasterWeightOptimizer checks it)
    for name, param in params.items():
        owner = root
        *path, leaf = name.split(".")
        for atom in path:
            if not hasattr(owner, atom):
                owner.add_module(atom, nn.Module())
            owner = getattr(owner, atom)
        owner.register_parameter(leaf, param)
    return root


def fit_optimizer(
    optimizer: torch.optim.Optimizer,
    owners: dict[int, tuple[int, str]],
    converted: list[nn.Module],
    *,
    cast_params: bool,
    master_weights: bool,
    fp32_grad_accumulation: bool = False,
    compiled_update: bool | str | None = None,
    compiled_model: bool = False,
) -> tuple[Any, "OptimizerRecord"]:
    """Return (the optimizer the user should step, its record) for the level's parameter layout.

    ``compiled_update``: the wrapper's (O2). ``compiled_model``: a model was given ``torch.compile``d, so None turns
    the compiled update on as over a compiled module (the wrapper holds the converted module, not the compiled one).
    """
    prefix = len(converted) > 1  # names must stay unique across models
    module_params: dict[int, nn.Parameter] = {}  # id(original) -> converted module's tensor
    names: dict[int, str] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            index, name = owners[id(param)]
            module_params[id(param)] = converted[index].get_parameter(name)
            names[id(param)] = f"{index}.{name}" if prefix else name
    if not cast_params:
        shared = all(module_params[id(p)] is p for g in optimizer.param_groups for p in g["params"])
        if not shared:  # convert() promises O0/O1 modules share the model's parameters
            raise AmpRuntimeError(
                "the O0/O1 module does not share the model's parameters (convert() promises it does): this is an "
                "amp_fx bug; please report it. Meanwhile pass the optimizer the converted module's parameters.")
        return optimizer, OptimizerRecord(optimizer)
    if master_weights:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        masters = {names[id(p)]: p for p in params}
        module = converted[0]
        trainable = {n for n, p in module.named_parameters() if p.requires_grad}
        if prefix or not trainable <= set(masters):
            # The optimizer steps parameters of several models, or part of one: give the wrapper a
            # module holding exactly those (it refuses trainable parameters no group holds).
            module = _view_module({names[id(p)]: module_params[id(p)] for p in params}, module.amp_config)
        wrapped = MasterWeightOptimizer(optimizer, module, masters=masters, fp32_grad_accumulation=fp32_grad_accumulation,
                                        compiled_update=compiled_update)
        if compiled_update is None and compiled_model:
            wrapped._compile_update_by_default()
        wrapped._resolve = _resolver(owners, converted, prefix)
        return wrapped, OptimizerRecord(wrapped, masters=True)
    # No masters: the optimizer steps the low-precision tensors the module runs with.
    for group in optimizer.param_groups:
        old = group["params"]
        group["params"] = [module_params[id(p)] for p in old]
        for before, after in zip(old, group["params"]):
            if before in optimizer.state:
                optimizer.state[after] = optimizer.state.pop(before)
    _map_added_groups(optimizer, _resolver(owners, converted, prefix))
    return optimizer, OptimizerRecord(optimizer)


def _resolver(owners: dict[int, tuple[int, str]], converted: list[nn.Module], prefix: bool) -> Callable:
    """param -> (name, converted module's tensor, fp32 master or None) for any model initialize converted.

    ``param`` may be an original model's parameter or a converted module's; both
    name the same slot. The original fp32 parameter is the master (no third copy).
    """
    slots = dict(owners)
    for index, module in enumerate(converted):
        for name, param in module.named_parameters():
            slots.setdefault(id(param), (index, name))

    def resolve(param: torch.Tensor) -> Optional[tuple[str, torch.Tensor, Optional[torch.Tensor]]]:
        slot = slots.get(id(param))
        if slot is None:
            return None
        index, name = slot
        master = getattr(converted[index], "amp_fx_masters", {}).get(name)
        return (f"{index}.{name}" if prefix else name), converted[index].get_parameter(name), master

    return resolve


def _map_added_groups(optimizer: torch.optim.Optimizer, resolve: Callable) -> None:
    """Make ``optimizer.add_param_group`` take an original model's parameters as its converted low ones.

    At O3 the optimizer steps the converted module's tensors; a group of the
    original model's parameters would otherwise train tensors nothing runs with.
    """
    add = optimizer.add_param_group

    def add_param_group(param_group: dict[str, Any]) -> None:
        group = dict(param_group)
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        group["params"] = [(resolve(p) or (None, p))[1] for p in params]
        add(group)

    add_param_group.__doc__ = add.__doc__
    optimizer.add_param_group = add_param_group  # type: ignore[method-assign]


@dataclass(eq=False)
class OptimizerRecord:
    """``scale_loss``'s bookkeeping for one optimizer returned by ``initialize``."""

    optimizer: Any
    masters: bool = False  # a MasterWeightOptimizer: accumulate in the fp32 master grads
    scaled: bool = False  # grads hold a still-scaled sum (delay_unscale=True blocks)
    skip_pending: bool = False
    session: Any = None  # the initialize call (its loss scalers) this optimizer belongs to
    _stash: list = field(default_factory=list)
    # The master optimizer's _grad_epoch when a block last left its unscaled sum in the
    # master grads; any other epoch means those grads are an old iteration's.
    _summed_epoch: Optional[int] = None

    # --------------------------------------------------------------- stash
    @property
    def module_params(self) -> list[torch.Tensor]:
        """The tensors backward writes gradients into (groups added later included)."""
        if self.masters:
            return list(self.optimizer.module_parameters())
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _grad_holders(self) -> list[torch.Tensor]:
        # Where the unscaled running sum lives: the fp32 masters for O2, else the module's tensors.
        if self.masters:
            return list(self.optimizer.master_parameters())
        return self.module_params

    def stash_grads(self) -> None:
        """Set the unscaled grads aside, so the next backward starts from none (Apex's stash)."""
        if self.scaled:
            return  # a delayed sum keeps accumulating, still scaled
        if self.masters and self._summed_epoch != self.optimizer._grad_epoch:
            # First block since the last step or zero_grad(): the master grads are derived from the
            # model's, never kept, so whatever they hold is stale (the model's may have been zeroed).
            for _, master in self.optimizer._pairs:
                master.grad = None
        self._stash = [(p, p.grad) for p in self._grad_holders() if p.grad is not None]
        for p, _ in self._stash:
            p.grad = None
        if self.masters:
            for p in self.module_params:
                p.grad = None
            self.optimizer._discard_synced_grads()  # the next unscale must copy the new grads

    def restore_grads(self) -> None:
        """Add the stashed grads back onto this loss's (unscaled) grads."""
        add_to, add_from = [], []
        for p, old in self._stash:
            if p.grad is None:
                p.grad = old
            else:
                add_to.append(p.grad)
                add_from.append(old)
        if add_to:
            with torch.no_grad():
                torch._foreach_add_(add_to, add_from)
        self._stash = []
        if self.masters:
            # The fp32 master grads now hold the whole unscaled sum; the module's low grads get it too (rounded),
            # so that clip_grad_norm_(model.parameters()) after the block clips it, and step() copies only edits.
            self.optimizer._mirror_master_grads()
            self._summed_epoch = self.optimizer._grad_epoch

    def has_new_grads(self) -> bool:
        """Whether backward wrote any gradient for this optimizer since the stash."""
        if self.masters and self.optimizer._fp32_accum:  # backward added into the masters and freed the low grads
            return any(p.grad is not None for p in self.optimizer.master_parameters())
        return any(p.grad is not None for p in self.module_params)

    # ---------------------------------------------------------------- skip
    def skip_next_step(self) -> None:
        """Make the optimizer's next ``step()`` call do nothing and return False (then behave normally again).

        Apex patched the instance's ``step`` the same way; an LR scheduler's own
        wrapper (also an instance attribute) is put back untouched.
        """
        if self.skip_pending:
            return
        optimizer = self.optimizer
        had_own = "step" in optimizer.__dict__
        original = optimizer.__dict__.get("step")

        def skipped_step(*args: Any, **kwargs: Any) -> bool:
            if had_own:
                optimizer.step = original
            else:
                del optimizer.step
            self.skip_pending = False
            self._summed_epoch = None  # the skipped iteration's sum must not leak into the next
            return False

        optimizer.step = skipped_step
        self.skip_pending = True
