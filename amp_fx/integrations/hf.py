"""Hugging Face Trainer with amp_fx: ``AmpFxTrainer(model=model, args=args, amp_level="O2", ...)`` in place of ``bf16=True``.

:class:`AmpFxTrainer` is a ``transformers.Trainer`` that keeps the model it is
given as ``trainer.model`` (the Trainer reads its signature, its loss kwargs,
its ``save_pretrained`` with tied weights, and builds the optimizer over its
parameters) and runs the forward through amp_fx:

* by default, every level: ``amp_fx.convert(model, level, example_kwarg_inputs=<the
  first training batch>)``, run eagerly (no compile: ``bf16=True``'s cost, not
  inductor's).  At O0/O1 the converted module shares the model's parameters.
* O0/O1 with ``TrainingArguments(torch_compile=True)``: ``torch.compile(model,
  backend=amp_fx.backend(level))``, the Trainer's ``torch_compile_backend`` as the
  inner compiler.  The compiled forward calls the model's own, so ``train()``/``eval()``
  switch dropout as usual, and every keyword the Trainer passes (``num_items_in_batch``:
  the loss is normalised over the whole accumulated batch as with ``bf16=True``)
  reaches the model.  The Trainer itself does not compile a second time.
* At O2 the model's fp32 parameters are the masters: the Trainer's
  own optimizer is built over them and wrapped in
  :class:`amp_fx.MasterWeightOptimizer`, gradients are copied into them before
  the Trainer clips, and ``save_pretrained`` writes them (fp32).

fp16 (``amp_dtype=torch.float16``; the default on CUDA) trains with an
:class:`amp_fx.LossScaler` as a GradScaler loop would: the loss is scaled
before the Trainer's backward, the gradients unscaled before it clips and
measures them, a step whose gradients overflowed is skipped (and so is that
step's scheduler step), and the scale is updated; its state is saved with the
Trainer's checkpoints (``amp_fx_scaler.pt``) and restored on resume.

``TrainingArguments(torch_compile_backend="amp_fx")`` (which Accelerate refuses
as a DynamoBackend) is taken as ``amp_level="O1"`` compiled.  Transformers is imported
here only, never by ``import amp_fx``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional, Union

import torch
from torch import nn

import transformers

from amp_fx.converter.api import convert
from amp_fx.dynamo.backend import backend
from amp_fx.errors import PACKAGE, AmpRuntimeError, AmpValueError
from amp_fx.ir.config import LEVELS
from amp_fx.runtime import LossScaler, MasterWeightOptimizer

__all__ = ["AmpFxTrainer"]

_BACKEND_LEVELS = ("O0", "O1")  # the backend sees no parameters to own: O2/O3 convert the model
# The Trainer's own steps this class hooks into (transformers 5): where it clips, measures and counts.
_TRAINER_HOOKS = ("_clip_grad_norm", "_get_grad_norm", "_get_num_items_in_batch", "_save_optimizer_and_scheduler",
                  "_load_optimizer_and_scheduler")
_SCALER_FILE = "amp_fx_scaler.pt"  # the loss scaler's state, next to the Trainer's optimizer.pt


class _ZeroLowGrads(transformers.TrainerCallback):
    """After each optimizer step, zero the converted module's low gradients (O2/O3).

    The Trainer zeroes ``model.zero_grad()``: the model's parameters, which at O2 are
    the masters. Backward writes into the converted module's bf16 copies, which it
    never reaches, so without this their gradients would add up over all steps.
    """

    def __init__(self, trainer: "AmpFxTrainer"):
        self.trainer = trainer

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        converted = self.trainer.amp_model
        if converted is not None:
            converted.zero_grad(set_to_none=True)


class AmpFxTrainer(transformers.Trainer):
    """A ``transformers.Trainer`` whose forward runs converted by amp_fx (module docstring).

    Args (besides the Trainer's):
        amp_level: ``"O0"``-``"O3"`` (default ``"O1"``).
        amp_dtype: the low dtype; ``None``: bf16 on CPU, fp16 on CUDA. fp16 trains with a loss scaler.
        amp_scaler: the :class:`amp_fx.LossScaler` for fp16 (default ``LossScaler(dtype=torch.float16)``:
            dynamic, from 2**16, as GradScaler).
        amp_options: options for :func:`amp_fx.convert` (e.g. ``{"policy": {...}}``), or for
            :func:`amp_fx.backend` when O0/O1 compile (``torch_compile=True``, e.g. ``{"inner": "aot_eager"}``).

    ``TrainingArguments(bf16=True)`` or ``fp16=True`` is refused: autocast would run on top of amp_fx's casts.
    """

    def __init__(self, *args: Any, amp_level: Optional[str] = None, amp_dtype: Union[None, str, torch.dtype] = None,
                 amp_options: Optional[dict] = None, amp_scaler: Optional[LossScaler] = None, **kwargs: Any) -> None:
        missing = [name for name in _TRAINER_HOOKS if not hasattr(transformers.Trainer, name)]
        if missing:
            raise AmpRuntimeError(
                f"AmpFxTrainer needs transformers 5 (its Trainer has {', '.join(missing)}: where it clips gradients, "
                f"measures their norm and counts a batch's labels); this is transformers {transformers.__version__}. "
                "Upgrade transformers, or use torch.compile(model, backend='amp_fx') with the plain Trainer.")
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        compile_name = getattr(training_args, "torch_compile_backend", None)
        # torch_compile=True at O0/O1 compiles through amp_fx's backend; torch_compile_backend="amp_fx" means O1 so
        # (the name sets torch_compile=True in TrainingArguments too)
        compiled = bool(getattr(training_args, "torch_compile", False)) and (amp_level or "O1") in _BACKEND_LEVELS
        if compile_name == "amp_fx" or compiled:
            # The Trainer must not compile again around amp_fx's (and Accelerate's DynamoBackend has no "amp_fx").
            training_args = dataclasses.replace(training_args, torch_compile=False, torch_compile_backend=None)
            if "args" in kwargs:
                kwargs["args"] = training_args
            else:
                args = (args[0], training_args, *args[2:])
        super().__init__(*args, **kwargs)
        amp_level = amp_level or "O1"
        self.amp_compiled = compiled  # O0/O1 under torch.compile(backend=amp_fx.backend(...)); else converted, eager
        if amp_level not in LEVELS:
            raise AmpValueError(f"AmpFxTrainer: amp_level must be one of {list(LEVELS)}, got {amp_level!r}")
        if amp_level == "O3":
            raise AmpValueError(
                "AmpFxTrainer(amp_level='O3'): O3 trains the converted module's own bf16 parameters, which the "
                "Trainer's optimizer (built over the model's parameters) does not reach. Use O1 or O2.")
        if self.args.bf16 or self.args.fp16:
            raise AmpValueError(
                "AmpFxTrainer got TrainingArguments(bf16=True or fp16=True): the Trainer would run the converted "
                "model under torch.autocast too. Leave bf16/fp16 False; amp_level= replaces them.")
        if not compiled and self.args.gradient_checkpointing:
            raise AmpValueError(
                f"AmpFxTrainer(amp_level={amp_level!r}) with TrainingArguments(gradient_checkpointing=True): the "
                "Trainer then makes transformers register a forward hook on the input embeddings "
                "(enable_input_require_grads), which the torch.export route that converts the model cannot "
                "keep. Use amp_level='O1' with TrainingArguments(torch_compile=True) (torch.compile keeps "
                "checkpointing and the hook), or gradient_checkpointing=False.")
        if self.args.torch_compile:
            raise AmpValueError(
                f"AmpFxTrainer(amp_level={amp_level!r}) got TrainingArguments(torch_compile=True): the Trainer would "
                "compile the model around amp_fx's conversion, whose parameters are not the model's. Leave "
                "torch_compile False, or use amp_level='O1' with torch_compile=True (amp_fx's backend compiles).")
        device_type = next(self.model.parameters()).device.type
        dtype = amp_dtype if amp_dtype is not None else (torch.float16 if device_type == "cuda" else torch.bfloat16)
        if dtype in (torch.float16, "fp16", "float16", "half"):
            dtype = torch.float16
        if amp_scaler is not None and not isinstance(amp_scaler, LossScaler):
            raise AmpValueError(f"AmpFxTrainer(amp_scaler=...) takes an {PACKAGE}.LossScaler, got {type(amp_scaler).__name__}")
        self.amp_level = amp_level
        self.amp_dtype = dtype
        # fp16: a loss scaler around the Trainer's backward and step (bf16 needs none unless one is given)
        self.amp_scaler = amp_scaler if amp_scaler is not None else (
            LossScaler(dtype=torch.float16, level=amp_level) if dtype == torch.float16 else None)
        self.amp_options = dict(amp_options or {})
        self.amp_model: Optional[nn.Module] = None  # what compute_loss calls in place of self.model
        if compiled:
            if compile_name not in (None, "amp_fx"):
                self.amp_options.setdefault("inner", compile_name)  # the Trainer's torch_compile_backend, e.g. inductor
            fp8 = self.amp_options.get("fp8")
            recipe = fp8.get("recipe") if isinstance(fp8, dict) else getattr(fp8, "recipe", fp8)
            if recipe == "delayed":
                raise AmpValueError(
                    f"AmpFxTrainer(amp_level={amp_level!r}, amp_options={{'fp8': 'delayed', ...}}) with torch_compile=True: "
                    "the torch.compile backend cannot keep delayed scaling's amax history in the model. Leave "
                    "torch_compile False or use amp_level='O2' (the model is converted, the history lives in its "
                    "buffers), or fp8='tensorwise' / 'rowwise'.")
            compiler = backend(level=amp_level, dtype=dtype, **self.amp_options)
            self.amp_model = torch.compile(self.model, backend=compiler)
        self._masters: Optional[MasterWeightOptimizer] = None
        if not compiled:
            self.add_callback(_ZeroLowGrads(self))

    # ------------------------------------------------------------ conversion (O2/O3)
    def _example_batch(self) -> dict:
        """The first training batch, collated and placed, without iterating a dataloader (no RNG is consumed)."""
        if self.train_dataset is None:
            raise AmpValueError(f"AmpFxTrainer(amp_level={self.amp_level!r}) converts the model with the first training "
                                "batch as example inputs, and has no train_dataset.")
        dataset, collate = self.train_dataset, self.data_collator
        if isinstance(dataset, torch.utils.data.IterableDataset):
            raise AmpValueError(f"AmpFxTrainer(amp_level={self.amp_level!r}) converts the model with the first training "
                                "batch as example inputs, and an IterableDataset has no first items to read without "
                                "consuming it. Use amp_level='O1' with TrainingArguments(torch_compile=True) "
                                "(torch.compile needs no example inputs).")
        # the columns the Trainer's own dataloader drops (those the model's forward does not take)
        if hasattr(dataset, "column_names") and hasattr(dataset, "remove_columns"):
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collate = self._get_collator_with_removed_columns(collate, description="training")
        size = min(self.args.per_device_train_batch_size, len(dataset))
        return self._prepare_inputs(dict(collate([dataset[i] for i in range(size)])))

    def _converted(self) -> nn.Module:
        if self.amp_model is None:
            example = self._example_batch()
            count = self._get_num_items_in_batch([example], self.args.device)
            if self.model_accepts_loss_kwargs and count is not None:
                example["num_items_in_batch"] = count  # the Trainer passes it every training step: a graph input
            self.amp_model = convert(self.model, self.amp_level, dtype=self.amp_dtype, example_kwarg_inputs=example,
                                     **self.amp_options)
        return self.amp_model

    def create_optimizer(self, model: Optional[nn.Module] = None) -> torch.optim.Optimizer:
        """The Trainer's optimizer, over the model's (fp32) parameters; at O2 wrapped with the converted module's masters."""
        optimizer = super().create_optimizer(model)
        if not self.amp_compiled:
            converted = self._converted()
            if converted.amp_config.master_weights and not isinstance(optimizer, MasterWeightOptimizer):
                self.optimizer = self._masters = MasterWeightOptimizer(optimizer, converted)
        return self.optimizer

    def _clip_grad_norm(self, model: nn.Module) -> Any:
        self._sync_master_grads()
        self._unscale()
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        self._sync_master_grads()
        self._unscale()
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    def _sync_master_grads(self) -> None:
        # The Trainer clips and measures model.parameters(): at O2 those are the masters, whose gradients
        # are copied from the bf16 ones at the step; copy them now (once per step) so it reads this step's.
        if self._masters is not None:
            self._masters._sync_grads_to_masters()

    # ------------------------------------------------------------ fp16: the loss scaler in the Trainer's loop
    def _stepped(self) -> Any:
        """The optimizer the scaler unscales and steps: the Trainer's (or MasterWeightOptimizer), inside Accelerate's."""
        inner = getattr(self.optimizer, "optimizer", None)
        if inner is None:
            raise AmpRuntimeError("AmpFxTrainer with a loss scaler expects the Trainer's optimizer prepared by "
                                  f"Accelerate (an AcceleratedOptimizer), got {type(self.optimizer).__name__}.")
        return inner

    def _unscale(self) -> None:
        # Before the Trainer clips or measures the gradients: they must be the true ones (GradScaler's unscale_).
        if self.amp_scaler is not None and not self.amp_scaler.is_unscaled(self._stepped()):
            self.amp_scaler.unscale_(self._stepped())

    def _scaled_step(self, closure: Any = None) -> bool:
        """The Trainer's ``optimizer.step()`` under the scaler: skipped on overflow (with its scheduler step)."""
        self._sync_master_grads()
        self._unscale()
        taken = self.amp_scaler.step(self._stepped())
        self.amp_scaler.update()
        if not taken and self.lr_scheduler is not None:  # as a GradScaler loop: no schedule step for a skipped one
            scheduler = self.lr_scheduler
            own = scheduler.__dict__.get("step")

            def skipped(*args: Any, **kwargs: Any) -> None:
                if own is None:
                    del scheduler.step
                else:
                    scheduler.step = own

            scheduler.step = skipped
        return taken

    def training_step(self, model: nn.Module, inputs: dict, num_items_in_batch: Any = None) -> torch.Tensor:
        """The Trainer's step; with a loss scaler its backward gets the scaled loss (the logged loss is not)."""
        if self.amp_scaler is None:
            return super().training_step(model, inputs, num_items_in_batch)
        optimizer = self.optimizer
        if getattr(optimizer.__dict__.get("step"), "__func__", None) is not AmpFxTrainer._scaled_step:
            self._stepped()  # (checks Accelerate wrapped it)
            optimizer.step = self._scaled_step  # this prepared optimizer only; the Trainer calls it once per step
        accelerator = self.accelerator
        own = accelerator.__dict__.get("backward")
        backward = accelerator.backward
        accelerator.backward = lambda loss, **kw: backward(self.amp_scaler.scale(loss), **kw)
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        finally:
            if own is None:
                del accelerator.backward
            else:
                accelerator.backward = own

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        if self.amp_scaler is not None and self.args.should_save:
            torch.save(self.amp_scaler.state_dict(), os.path.join(output_dir, _SCALER_FILE))

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        path = os.path.join(checkpoint, _SCALER_FILE) if checkpoint is not None else None
        if self.amp_scaler is not None and path is not None and os.path.isfile(path):
            self.amp_scaler.load_state_dict(torch.load(path, weights_only=True))

    # ------------------------------------------------------------ the forward
    def _runner(self, model: nn.Module) -> nn.Module:
        """The converted forward, in the mode the Trainer put ``model`` in."""
        runner = self.amp_model if self.amp_compiled else self._converted()
        if runner.training != model.training:
            # The Trainer switches the model it holds (train() for training, eval() in evaluate());
            # the converted module follows it: dropout on while training, off while evaluating.
            runner.train(model.training)
        return runner

    def compute_loss(self, model: nn.Module, inputs: dict, return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        """The Trainer's loss, computed by the converted forward."""
        return super().compute_loss(self._runner(model), inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)

    def prediction_step(self, model: nn.Module, inputs: dict, prediction_loss_only: bool,
                        ignore_keys: Optional[list] = None) -> Any:
        """The Trainer's evaluation step (with labels: compute_loss; without: the forward), converted."""
        return super().prediction_step(self._runner(model), inputs, prediction_loss_only, ignore_keys=ignore_keys)
