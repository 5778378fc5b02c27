"""Accelerate with amp_fx: convert, then ``accelerator.prepare``, with the loss scaler in ``save_state``.

``Accelerator(mixed_precision="bf16")`` runs the model under ``torch.autocast``;
with amp_fx the Accelerator stays at ``mixed_precision="no"`` (the graph holds
the casts) and :func:`prepare` does the rest in the order that works::

    accelerator = Accelerator()                        # mixed_precision="no": amp_fx casts
    model, opt, scaler, loader = amp_fx.integrations.accelerate.prepare(accelerator, model, opt, loader, level="O2")
    for x, y in loader:
        opt.zero_grad()
        accelerator.backward(scaler.scale(loss_fn(model(x), y)))
        scaler.step(opt)
        scaler.update()

* the model is converted first (:func:`amp_fx.convert`), so Accelerate places
  and wraps the converted module;
* at O2 the optimizer becomes a :class:`amp_fx.MasterWeightOptimizer` before
  Accelerate wraps it (fp32 masters: the model's own parameters);
* the :class:`amp_fx.LossScaler` is registered with
  ``accelerator.register_for_checkpointing``, so ``save_state`` /
  ``load_state`` restore its scale with the weights, masters and optimizer state.

Accelerate is imported here only, never by ``import amp_fx``.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch import nn

import accelerate

from amp_fx.converter.api import convert
from amp_fx.errors import AmpTypeError, AmpValueError
from amp_fx.runtime import LossScaler, MasterWeightOptimizer
from amp_fx.frontend.compiled_modules import is_compiled

__all__ = ["prepare", "AcceleratedLossScaler"]


class AcceleratedLossScaler(LossScaler):
    """A :class:`amp_fx.LossScaler` that follows ``accelerator.accumulate()``: nothing happens between syncs.

    Inside ``with accelerator.accumulate(model):`` Accelerate's optimizer skips ``step()`` and
    ``zero_grad()`` on the micro-batches that only accumulate (``accelerator.sync_gradients`` is
    False).  A plain scaler would still unscale the low gradients there, in place, so the next
    micro-batch adds scaled gradients to unscaled ones (fp16), and at O2 copy a partial sum into
    the masters; its scale would also advance once per micro-batch.  This one does nothing on
    those micro-batches (``step`` returns False: no step was taken) and acts on the sync one.
    """

    def __init__(self, accelerator: "accelerate.Accelerator", **options: Any) -> None:
        super().__init__(**options)
        self._accelerator = accelerator

    def _accumulating(self) -> bool:
        return not self._accelerator.sync_gradients

    def unscale_(self, optimizer: Any) -> None:
        if not self._accumulating():
            super().unscale_(optimizer)

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> bool:
        return False if self._accumulating() else super().step(optimizer, *args, **kwargs)

    def update(self, *args: Any, **kwargs: Any) -> None:
        if not self._accumulating():
            super().update(*args, **kwargs)

    @classmethod
    def adopt(cls, scaler: LossScaler, accelerator: "accelerate.Accelerator") -> "AcceleratedLossScaler":
        """``scaler``'s options and state in an AcceleratedLossScaler (the one to use from then on)."""
        adopted = cls.__new__(cls)
        adopted.__dict__.update(scaler.__dict__)
        adopted._accelerator = accelerator
        return adopted



def _clip_masters(accelerator: "accelerate.Accelerator", converted: nn.Module, optimizer: Any,
                  masters_optimizer: MasterWeightOptimizer, scaler: LossScaler) -> None:
    """At O2, ``accelerator.clip_grad_norm_/value_`` clips what the step uses, whichever parameters it is given.

    The usual Accelerate line clips the model's parameters, which at O2 are the low copies: their gradients
    are not what the optimizer steps (it steps the fp32 masters' copies of them), so the clip did nothing
    (fp16: it also read still-scaled gradients, a norm of inf). Low parameters are replaced by their masters.
    Given the masters themselves (``amp_fx.master_params(opt)``, ``opt.master_parameters()``, or the original
    model's parameters, which are the masters at O2), the clip would find them without gradients before the
    step copies them: so whenever the clip touches a master, the scaler's ``unscale_`` runs first when it has
    not run this step, and the masters' gradients are copied from the module's if nothing has copied them yet
    (a scaler that neither scales nor checks copies nothing).
    """
    masters = getattr(converted, "amp_fx_masters", None) or {}
    master_of = {id(low): masters[name] for name, low in converted.named_parameters()
                 if name in masters and masters[name] is not low}
    if not master_of:
        return

    def redirected(clip: Any) -> Any:
        def clip_what_the_step_uses(parameters: Any, *args: Any, **kwargs: Any) -> Any:
            params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            stepped = {id(m) for m in masters_optimizer.master_parameters()}
            # (Not on a micro-batch accelerator.accumulate() only accumulates: a copy into the masters then
            # would be a partial sum that the step, seeing it synced, would not refresh.)
            if any(id(p) in master_of or id(p) in stepped for p in params) and accelerator.sync_gradients:
                if not scaler.is_unscaled(optimizer):
                    scaler.unscale_(optimizer)  # the masters' gradients, copied and unscaled
                if not masters_optimizer._grads_synced:
                    masters_optimizer._sync_grads_to_masters()
                params = list({id(q): q for q in (master_of.get(id(p), p) for p in params)}.values())
            return clip(params, *args, **kwargs)
        return clip_what_the_step_uses

    accelerator.clip_grad_norm_ = redirected(accelerator.clip_grad_norm_)
    accelerator.clip_grad_value_ = redirected(accelerator.clip_grad_value_)


def prepare(accelerator: "accelerate.Accelerator", model: nn.Module, optimizer: torch.optim.Optimizer, *others: Any,
            level: str = "O1", dtype: Union[None, str, torch.dtype] = None, scaler: Optional[LossScaler] = None,
            **convert_options: Any) -> tuple:
    """Convert ``model``, give the optimizer fp32 masters (O2), ``accelerator.prepare`` all, register the scaler.

    Args:
        accelerator: an ``accelerate.Accelerator`` built with ``mixed_precision="no"`` (amp_fx does the casting).
        model, optimizer: the fp32 model and an optimizer over its parameters.
        *others: anything else to pass through ``accelerator.prepare`` (data loaders, schedulers).
        level, dtype, **convert_options: as :func:`amp_fx.convert` (dtype None: fp16 on CUDA, bf16 otherwise,
            read from ``accelerator.device``).
        scaler: a :class:`amp_fx.LossScaler` whose options and state to start from; default
            ``LossScaler(dtype=dtype, level=level)``.  The scaler returned is an
            :class:`AcceleratedLossScaler`: it does nothing on the micro-batches ``accelerator.accumulate()``
            only accumulates, as Accelerate's optimizer does.

    Returns ``(model, optimizer, scaler, *others)``, the first two as Accelerate prepared them.
    """
    if not isinstance(accelerator, accelerate.Accelerator):
        raise AmpTypeError(f"prepare() takes an accelerate.Accelerator first, got {type(accelerator).__name__}")
    if accelerator.mixed_precision != "no":
        raise AmpValueError(
            f"prepare(): this Accelerator has mixed_precision={accelerator.mixed_precision!r}, so Accelerate would run "
            "the converted model under torch.autocast and scale the loss with its own GradScaler, on top of amp_fx's "
            "casts and LossScaler. Build it as Accelerator() (mixed_precision='no'); amp_fx's level replaces the setting. "
            "(Accelerate keeps one state per process: an earlier Accelerator(mixed_precision=...) in this process "
            "sets it for every later one; start a fresh process, or call "
            "accelerate.state.AcceleratorState._reset_state(True) before building the new Accelerator.)")
    if scaler is not None and not isinstance(scaler, LossScaler):
        raise AmpTypeError(f"prepare(scaler=...) takes an amp_fx.LossScaler, got {type(scaler).__name__}")
    if dtype is None:
        dtype = torch.float16 if accelerator.device.type == "cuda" else torch.bfloat16
    converted = convert(model.to(accelerator.device), level, dtype=dtype, **convert_options)
    if converted.amp_config.master_weights:
        optimizer = MasterWeightOptimizer(optimizer, converted)
    if scaler is None:
        scaler = AcceleratedLossScaler(accelerator, dtype=converted.amp_config.dtype, level=level)
    elif not isinstance(scaler, AcceleratedLossScaler):
        scaler = AcceleratedLossScaler.adopt(scaler, accelerator)  # the returned one follows accelerator.accumulate()
    prepared_model, prepared_opt, *prepared = accelerator.prepare(converted, optimizer, *others)
    if isinstance(optimizer, MasterWeightOptimizer):
        if is_compiled(prepared_model):
            # Accelerator(dynamo_backend=...) compiled the model: compilation was chosen, so the update is compiled
            # too, as MasterWeightOptimizer(compiled_update=None) does over a compiled module.
            optimizer._compile_update_by_default()
        if prepared_opt is not optimizer:
            # LossScaler finds the masters through AcceleratedOptimizer.optimizer; the user clips them by this name.
            prepared_opt.master_parameters = optimizer.master_parameters
        _clip_masters(accelerator, converted, prepared_opt, optimizer, scaler)
    accelerator.register_for_checkpointing(scaler)
    return (prepared_model, prepared_opt, scaler, *prepared)
