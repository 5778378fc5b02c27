"""fp32 master weights for a low-precision module (Apex O2), as an optimizer wrapper.

The module that runs holds fp16/bf16 parameters; updating them directly loses
small updates to rounding. :class:`MasterWeightOptimizer` lets the wrapped
optimizer step fp32 "master" copies instead and copies them back after every
step::

    mw = MasterWeightOptimizer(torch.optim.AdamW(model.parameters()), gm)
    scaler = LossScaler()
    for x, y in data:
        mw.zero_grad()
        scaler.scale(loss_fn(gm(x), y)).backward()
        scaler.unscale_(mw)                                   # optional: clip
        torch.nn.utils.clip_grad_norm_(gm.parameters(), 1.0)  # or mw.master_parameters()
        scaler.step(mw)
        scaler.update()

How it cooperates with :class:`~amp_fx.runtime.LossScaler`: the scaler calls
``_sync_grads_to_masters()`` before it checks/unscales an optimizer's
gradients, so it unscales the fp32 master grads (no fp16 underflow on unscale);
``step()`` syncs only if nobody did this iteration (so clipped master grads are
not overwritten); on a skipped step the scaler calls ``_discard_synced_grads()``.
After unscaling, the scaler calls ``_mirror_master_grads()``: the module's low
gradients then hold the true values, and whatever is done to them before the
step (a clip of ``gm.parameters()``) reaches the masters at the step
(:mod:`amp_fx.runtime.grad_edits`).

The masters' gradients are derived, never kept: every unscale or step copies
them from the module's gradients, so zeroing the module's gradients in any way
(``optimizer.zero_grad()``, ``module.zero_grad()``, ``p.grad = None``) zeroes
them, as in Apex.

Where the wrapped optimizer leaves ``foreach`` and ``fused`` unset and its
masters are on CPU, Adam, AdamW and SGD step fused (torch would step them one
tensor at a time there; see :mod:`amp_fx.runtime.step_impl`); pass
``foreach=False`` to keep the loop. A step then takes one of three routes
(``mw.last_step_route`` says which, and why not the one before):

* **compiled** (``compiled_update=True``/a backend name, or by default over a
  ``torch.compile``d module; :mod:`amp_fx.runtime.compiled_update`): SGD, Adam
  or AdamW on CPU fp32 masters, once the optimizer state exists (from the second
  step on; plain SGD from the first), one compiled pass per
  parameter group reads the low gradients as they are and writes optimizer
  state, master and low parameter; within a few ulp of the chunked route.
* **chunked** (:mod:`amp_fx.runtime.chunked_step`: fused SGD/Adam/AdamW, CPU
  fp32 masters, no step hook of the user's on this wrapper, on the wrapped
  optimizer or global; see :meth:`MasterWeightOptimizer.step` for what a
  wrapper's hook sees): chunk by chunk of about 2 MiB of
  masters, the chunk's gradients are copied to fp32, torch's fused kernel
  steps it and its masters are copied into the module, while all of it is in
  cache; bit for bit the plain route. Where nothing was copied before the step
  (bf16 under ``scaler.step``, whose inf/NaN check then reads the low
  gradients as backward left them; a plain ``mw.step()``), the gradients go
  through one small fp32 scratch buffer and the masters hold no gradient
  after the step (4 bytes per low parameter less held; read or clip the
  module's low gradients, or call ``scaler.unscale_`` first, which copies
  them into the masters').
* **plain**: one ``torch._foreach_copy_`` of the module's gradients into the
  masters' per (device, dtype) group, the wrapped optimizer's ``step()``, one
  ``torch._foreach_copy_`` of the masters back. Under a
  :class:`~amp_fx.runtime.LossScaler` that unscales (fp16) or after the user's
  ``scaler.unscale_``, the way in is one copy per gradient, each checked for
  inf/NaN (and unscaled) right after its copy, while it is still in cache
  (``_sync_check_and_unscale_``); the chunked route then steps on those
  copies. The masters' fp32 gradients are copied into buffers kept from the
  last step (``keep_grad_buffers=True``, the default): no allocation per
  step, at 4 bytes per low parameter held between steps.

What each route costs: docs/performance.md, "O2 update".

With ``fp32_grad_accumulation=True`` the masters' gradients are kept instead:
each low gradient is added into its master's fp32 gradient as backward makes
it, and freed (:mod:`amp_fx.runtime.fp32_grad_accumulation`), so the sum over
k micro-batches rounds in fp32, not in bf16/fp16. The masters' gradients are
then the accumulator: the wrapper's ``step()`` frees them after
the update, a step the scaler skips drops them, and ``mw.zero_grad()`` zeroes
them; ``module.zero_grad()`` does not reach them (the low gradients are already
gone). Clip ``mw.master_parameters()``; the module's low parameters hold no
gradient. Opt-in: it costs 4 bytes per low parameter from backward to the
step, and DDP/FSDP reduce the low gradients the hook frees (refused under
``torch.distributed``).

Under FSDP2 (module sharded by ``fully_shard`` before this wrapper is built)
each master is a DTensor shard placed like its parameter, cut from the full
fp32 original, so a rank holds 1/world_size of the masters; gradients and
masters are copied shard to shard.

Which master stands for which parameter (given, copied, adopted, sharded) is
:mod:`amp_fx.runtime.master_mapping`; this module is the step around it.
"""

from __future__ import annotations

from itertools import chain
from typing import Any, Callable, Iterator, Mapping

import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import optimizer as torch_optimizer

from amp_fx.graph_ops.master_sync import record, writers
from amp_fx.runtime.wrapped_optimizer import WrappedOptimizer, check_inner_optimizer

from . import fp32_grad_accumulation as fp32_accum
from . import grad_edits
from .dtensors import is_dtensor, local_tensor, refuse_replaced_params
from .chunked_step import chunked_step, has_user_step_hooks, why_not_chunked
from .compiled_update import CompiledUpdate, check_compiled_update, why_not_compiled
from .master_copies import CopyGroup, group_pairs
from .master_mapping import MasterMapping, check_fp32_accumulation, check_module
from .overflow import check_and_unscale_, grads_of
from amp_fx.frontend.compiled_modules import is_compiled, unwrap_compiled
from .step_impl import fused_sgd_guard, prefer_fast_step
from amp_fx.errors import AmpKeyError, AmpRuntimeError, AmpValueError, AmpWarning, checks_keywords

__all__ = ["MasterWeightOptimizer", "NoLowGradientsWarning"]


class NoLowGradientsWarning(AmpWarning):
    """fp32_grad_accumulation: nothing edited the masters between ``scaler.unscale_`` and the step.

    The module's low parameters hold no gradient there (each was added into its master and freed), so a
    ``clip_grad_norm_(gm.parameters(), m)`` after ``unscale_`` returned 0.0 and clipped nothing.
    """

class MasterWeightOptimizer(MasterMapping, WrappedOptimizer):
    """Step fp32 master copies of a low-precision module's parameters, then copy them back.

    Args:
        optimizer: built over the fp32 masters, or over the module's own
            parameters (its entries are then swapped for the masters, group
            options kept, as Apex did): all of them, or a part where other
            MasterWeightOptimizers over the module hold the rest (a gradient
            none holds is refused at the step).
        module: the module that runs (or ``torch.compile`` of it); its
            fp16/bf16 parameters get masters, other parameters (fp32 norms)
            are their own masters. A module converted at O0/O1, or one with no
            low-precision parameter, is refused: it needs no masters.
        masters: ``{name: fp32 Parameter}`` named as in
            ``module.named_parameters()``. Defaults to ``module.amp_fx_masters``
            (set by the converter to the original fp32 parameters, so no third
            copy exists); missing entries are created by copying.
        scaler: optional :class:`~amp_fx.runtime.LossScaler`. Only needed when
            calling ``mw.step()`` directly (Apex style): it then checks, unscales
            and skips through the scaler and returns whether it stepped. With
            ``scaler.step(mw)`` it is not needed.
        fp32_grad_accumulation: add each low gradient into its master's fp32
            gradient as backward makes it, and free it (default False; module
            docstring): gradient accumulation over micro-batches then rounds in
            fp32. Costs 4 bytes per low parameter between backward and step.
        keep_grad_buffers: reuse one fp32 gradient buffer per master from step
            to step (default True) instead of allocating the masters'
            gradients afresh at every step: faster where tensors are large
            (no page faults on fresh memory; :mod:`amp_fx.runtime.master_copies`),
            but the 4 bytes per low parameter stay held between steps,
            through forward and backward. A buffer anybody else still holds
            (a reference kept from ``master.grad``, a view of it) is never
            overwritten: a new one is made. False frees them at
            ``zero_grad()``, as torch does.
        compiled_update: step SGD/Adam/AdamW with one ``torch.compile``d pass
            per parameter group that reads the low gradients as they are and
            writes optimizer state, fp32 master and low parameter
            (:mod:`amp_fx.runtime.compiled_update`). ``True``: inductor;
            a string: that ``torch.compile`` backend; ``False``: never;
            ``None`` (default): inductor where ``module`` is a
            ``torch.compile``d module (compilation was chosen), else never.
            ``True``/a string refuse what it cannot step (fp32_grad_accumulation,
            sharded or non-CPU masters, another optimizer class), and a string
            that names no registered backend; a compile that
            fails raises there, and under ``None`` warns once
            (:class:`~amp_fx.runtime.compiled_update.CompiledUpdateWarning`) and
            steps the chunked route. The first step of SGD with momentum, Adam
            or AdamW runs the chunked or plain route (it makes the optimizer
            state). Dynamo runs :meth:`step` eagerly: to compile the update, pass
            this, not ``torch.compile(lambda: mw.step())``.

    ``param_groups``, ``state`` and ``defaults`` are the wrapped optimizer's own
    objects, so LR schedulers built over this wrapper (or over the wrapped
    optimizer) drive the real learning rates.
    """

    @checks_keywords("MasterWeightOptimizer")
    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        module: nn.Module,
        masters: Mapping[str, torch.Tensor] | None = None,
        scaler: Any = None,
        fp32_grad_accumulation: bool = False,
        keep_grad_buffers: bool = True,
        compiled_update: bool | str | None = None,
    ) -> None:
        check_inner_optimizer(optimizer, "MasterWeightOptimizer")
        check_compiled_update(compiled_update)
        if compiled_update is None:  # on where the user chose compilation for the module
            backend, strict = ("inductor" if is_compiled(module) else None), False
        else:
            backend, strict = ("inductor" if compiled_update is True else compiled_update or None), True
        module = unwrap_compiled(module)
        check_module(module)
        if not isinstance(fp32_grad_accumulation, bool):
            raise AmpValueError(f"fp32_grad_accumulation must be True or False, got {fp32_grad_accumulation!r}")
        if fp32_grad_accumulation:
            check_fp32_accumulation(module)
        if not isinstance(keep_grad_buffers, bool):
            raise AmpValueError(f"keep_grad_buffers must be True or False, got {keep_grad_buffers!r}")
        self._fp32_accum = fp32_grad_accumulation
        self._keep_buffers = keep_grad_buffers
        self.optimizer = optimizer
        self.module = module
        self._scaler = scaler
        # Bumped by every real step and zero_grad(): master grads summed before the
        # last bump are stale (amp_fx.scale_loss reads it between loss blocks).
        self._grad_epoch = 0
        # amp_fx.initialize sets it: param -> (name, module param, master) or None, so that
        # add_param_group() can take the parameters of its other converted models.
        self._resolve: Callable[[torch.Tensor], Any] | None = None
        self._added = 0
        self._init_face()
        self._grads_synced = False
        # Checked for inf/NaN on the low gradients, not yet copied into the masters' (the chunked step copies them).
        self._grads_deferred = False
        # The reciprocal scale the deferred gradients still need (fp16: the compiled update multiplies it in).
        self._deferred_inv = 1.0
        # Which way the last step() went: "compiled", "chunked", or "optimizer.step (<why not chunked>)"; where the
        # compiled update is on but did not run, "(not compiled: <why>)" follows.
        self.last_step_route = ""
        # The compiled update (compiled_update.py), or None where off.
        self._compiled = None if backend is None else CompiledUpdate(backend, strict)
        # The chunked step's fp32 scratch gradient (CHUNK_BYTES and a bit), kept from step to step.
        self._scratch = [torch.empty(0)]
        # The low gradients as _mirror_master_grads() left them (grad_edits.mirror): edits until the step reach the masters.
        self._grad_marks: grad_edits.Marks | None = None
        # fp32_grad_accumulation: the masters' gradients' versions right after the user's scaler.unscale_ (a clip
        # of the masters moves them; one of gm.parameters() finds no gradient and cannot), and whether it warned.
        self._versions_at_unscale: list[int] | None = None
        self._warned_no_low_grads = False
        self._map_parameters(module, masters)

        # Map everything first and swap last: a refused optimizer is left untouched. The optimizer may hold a
        # part of the module's parameters (another optimizer the rest): a step refuses a gradient none applies.
        swapped = [[self._master_for(p) for p in g["params"]] for g in optimizer.param_groups]
        if strict and self._compiled is not None:
            reason = "fp32_grad_accumulation=True (the masters' gradients are the accumulator)" if fp32_grad_accumulation \
                else why_not_compiled(optimizer, [m for group in swapped for m in group])
            if reason is not None:
                raise AmpValueError(
                    f"MasterWeightOptimizer(compiled_update={compiled_update!r}) cannot compile this update: {reason}. "
                    "Pass compiled_update=False (or leave it None) to step with the chunked or plain route.")
        for group, params in zip(optimizer.param_groups, swapped):
            group["params"] = params
        self._move_state_to_masters()
        prefer_fast_step(optimizer)
        self._claim_grads()
        self._register_over(module)
        if any(is_dtensor(p) for p in self._params.values()) and getattr(module, "amp_fx_masters", None):
            # The full fp32 originals must not stay referenced from the module: the masters are now
            # this rank's shards (the originals of trainable parameters another wrapper may hold stay).
            others = {n: m for n, m in module.amp_fx_masters.items()
                      if n not in self._masters and n in self._params and self._params[n].requires_grad}
            module.amp_fx_masters = {**others, **self._masters}

    # ------------------------------------------------ the optimizer's face

    def master_parameters(self) -> Iterator[torch.Tensor]:
        """Yield the fp32 tensors the optimizer steps (clip these, or the module's after ``unscale_``)."""
        for group in self.param_groups:
            yield from group["params"]

    def module_parameters(self) -> Iterator[torch.Tensor]:
        """Yield, for each tensor the optimizer steps, the tensor backward writes its gradient into."""
        module_of = {id(master): param for param, master in self._pairs}
        for group in self.param_groups:
            for master in group["params"]:
                yield module_of.get(id(master), master)

    def grad_buffer_bytes(self) -> int:
        """Bytes held by kept fp32 gradient buffers that no master's ``.grad`` points at now (``keep_grad_buffers``)."""
        return sum(group.buffer_bytes() for group in self._copy_groups())

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of parameters, as Apex did: low-precision ones get fp32 masters.

        The tensors may be the module's parameters, their masters, or tensors of
        another module (a second converted model): a low one gets a new fp32
        master, an fp32 one is its own master. The existing groups and their
        state (momentum) are kept.
        """
        group = dict(param_group)
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        group["params"] = [self._master_for(p, adopt=True) for p in params]
        self.optimizer.add_param_group(group)
        prefer_fast_step(self.optimizer)
        self._claim_grads()

    def _claim_grads(self) -> None:
        """Route the low gradients into the masters' (fp32_grad_accumulation), or take back an older wrapper's route."""
        if self._fp32_accum:
            for param, master in self._pairs:
                fp32_accum.claim(param, master, self)
        else:
            fp32_accum.release(param for param, _ in self._pairs)

    def _free_master_grads(self) -> None:
        """fp32_grad_accumulation: the masters' gradients are this step's accumulator; free them."""
        for _, master in self._pairs:
            master.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of the masters and of the module's low-precision parameters."""
        self.optimizer.zero_grad(set_to_none)
        with torch.no_grad():
            for group in self._copy_groups():
                group.clear_param_grads(set_to_none)
        self._grads_synced = self._grads_deferred = False
        self._grad_epoch += 1

    # ------------------------------------------------------------------ step
    def _copy_groups(self) -> list[CopyGroup]:
        """The (module param, master) pairs by (device, dtypes), regrouped after the pairs changed."""
        if self._groups is None:
            old = {id(m): b for g in (self._old_groups or ()) for m, b in zip(g.masters, g.buffers) if b is not None}
            self._groups = group_pairs(self._pairs, self._keep_buffers)
            for group in self._groups:  # a regroup (add_param_group) keeps the buffers it already has
                group.buffers = [old.get(id(m)) for m in group.masters]
            self._old_groups = None
            self._sync_entries = writers(self._pairs)  # the converted modules' records these copies refresh
            self._low_of = {id(m): p for g in self._groups for p, m in zip(g.params, g.masters)}
        return self._groups

    def _sync_grads_to_masters(self) -> None:
        """Copy the module's low-precision grads into fp32 master grads (once per iteration; later: their edits)."""
        if self._grads_synced:
            self._copy_deferred_grads()
            if self._grad_marks is not None:  # clipped (or otherwise edited) since unscale_: the masters follow
                grad_edits.apply_edits(self._pairs, self._grad_marks)
                self._grad_marks = None
            return
        self._grad_marks = None
        if dist.is_available() and dist.is_initialized():
            # Only fully_shard (which needs a process group) replaces parameters; the
            # check walks every parameter's path, so single processes skip it.
            refuse_replaced_params(self.module, self._params)
        if self._fp32_accum:
            # The hooks added every gradient backward made; one set by hand (or before the hooks) is added now.
            fp32_accum.drain(self._pairs)
        else:
            with torch.no_grad():
                for group in self._copy_groups():
                    group.copy_grads_to_masters()
        self._grads_synced = True

    def _copy_deferred_grads(self) -> None:
        """Copy the low gradients into the masters' now where the check left the copy to the step (and the unscale,
        where it left that to the compiled update: every master gradient, own-master fp32 ones too)."""
        if self._grads_deferred:
            self._grads_deferred = False
            with torch.no_grad():
                for group in self._copy_groups():
                    group.copy_grads_to_masters()
                if self._deferred_inv != 1.0:  # (fp32 products rounded once: the bits of the scaler's kernel)
                    grads = [m.grad for m in self.master_parameters() if m.grad is not None]
                    if grads:
                        torch._foreach_mul_(grads, torch.full((), self._deferred_inv, dtype=torch.float32))
            self._deferred_inv = 1.0

    def _can_defer(self) -> bool:
        """Whether the gradient copy may wait for the step (plain tensors in one process, no fp32 accumulation)."""
        if self._fp32_accum or (dist.is_available() and dist.is_initialized()) or has_user_step_hooks(self):
            return False
        if any(group.sharded for group in self._copy_groups()):
            return False
        return why_not_chunked(self.optimizer) is None or self._compiled_may_run()

    def _compiled_may_run(self) -> bool:
        """Whether the compiled update is on and nothing known before the step rules it out."""
        return self._compiled is not None and self._compiled.failed is None and not self._fp32_accum and \
            why_not_compiled(self.optimizer) is None

    def _sync_check_and_unscale_(self, inv_scale: float,
                                 step_follows: bool = False) -> dict[torch.device, torch.Tensor] | None:
        """Copy the low grads into the masters' and check/unscale each right after its copy; the verdicts per device.

        What :class:`~amp_fx.runtime.LossScaler` calls in place of ``_sync_grads_to_masters()`` followed by a check
        of every master gradient: the same kernels and bits, but each gradient is checked while its copy is still
        in cache. None (nothing done) where that path does not apply: already synced this iteration,
        fp32_grad_accumulation (nothing to copy), or torch.distributed (sharded gradients are reduced over ranks).

        ``step_follows`` (the scaler's own check in ``scaler.step``: no user code runs before the step): with
        nothing to unscale (``inv_scale`` 1) and where the chunked step applies, the low gradients are checked
        as they are (half the bytes of their fp32 copies; the same verdict, the conversion is exact) and their
        copy is left to the step, which makes it chunk by chunk (:mod:`~amp_fx.runtime.chunked_step`).
        """
        if self._grads_synced or self._fp32_accum or (dist.is_available() and dist.is_initialized()):
            return None
        groups = self._copy_groups()
        if any(group.sharded for group in groups):
            return None
        self._grad_marks = None
        # fp16 under the compiled update: the unscale is left to it (multiplied in as it reads each gradient); only
        # a reciprocal in (0, 1] may wait, as x * inv cannot then overflow unseen after the check.
        unscale_later = inv_scale == 1.0 or (0.0 < inv_scale < 1.0 and self._compiled_may_run())
        if step_follows and unscale_later and self._can_defer() and \
                not any(p.grad is not None and p.grad.is_sparse for p, _ in self._pairs):
            checked_grads = [p.grad for p, _ in self._pairs if p.grad is not None]
            copied = {id(m) for _, m in self._pairs}
            checked_grads += [m.grad for m in self.master_parameters() if id(m) not in copied and m.grad is not None]
            self._grads_synced = self._grads_deferred = True
            self._deferred_inv = inv_scale
            return check_and_unscale_(checked_grads, 1.0)  # (the check only: the low gradients keep their bits)
        found: dict[torch.device, torch.Tensor] = {}
        inverses: dict[torch.device, torch.Tensor] = {}

        def verdict(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
            if device not in found:
                found[device] = torch.zeros((), dtype=torch.float32, device=device)
                inverses[device] = torch.full((), inv_scale, dtype=torch.float32, device=device)
            return found[device], inverses[device]

        with torch.no_grad():
            for group in groups:
                if group.masters:
                    group.copy_grads_to_masters(check=verdict(group.masters[0].device))
            # Masters that are their own module parameter (fp32 ones) got their gradients from autograd.
            copied = {id(m) for group in groups for m in group.masters}
            others = [m for m in self.master_parameters() if id(m) not in copied]
            for device, flag in check_and_unscale_(grads_of([{"params": others}]), inv_scale).items():
                found[device] = found[device] + flag if device in found else flag
        # A device whose masters all had no gradient checked nothing: like check_and_unscale_, report none for it.
        checked = {m.grad.device for m in self.master_parameters() if m.grad is not None}
        self._grads_synced = True
        return {device: flag for device, flag in found.items() if device in checked}

    def _mirror_master_grads(self, write: bool = True, by_unscale: bool = False) -> None:
        """Give the module's low gradients their masters' (unscaled, summed) values and watch them until the step.

        What :class:`~amp_fx.runtime.LossScaler` calls after unscaling (``write`` False where the scale was 1:
        the low gradients hold those values already) and ``amp_fx.scale_loss`` after its block: at O2,
        ``clip_grad_norm_(model.parameters())`` then reads and clips true gradients, and
        :mod:`~amp_fx.runtime.grad_edits` carries the clip over to the fp32 masters at the step.
        fp32_grad_accumulation frees the low gradients and FSDP2 shards them: nothing is mirrored there
        (fp32_grad_accumulation after the user's ``scaler.unscale_``, ``by_unscale``: the step warns once when
        nothing edited the masters, the sign of a clip of ``gm.parameters()`` that found no gradient).
        """
        self._copy_deferred_grads()  # (amp_fx.scale_loss checks through the scaler's step check, then mirrors)
        self._grads_synced = True
        if self._fp32_accum and by_unscale:
            self._versions_at_unscale = [m.grad._version for m in self.master_parameters() if m.grad is not None]
        if self._fp32_accum or any(group.sharded for group in self._copy_groups()):
            return
        self._grad_marks = grad_edits.mirror(self._pairs, write)

    def _discard_synced_grads(self) -> None:
        """Forget this iteration's sync (the scaler skipped the step; fp32_grad_accumulation: drop the sum too)."""
        self._grads_synced = self._grads_deferred = False
        self._versions_at_unscale = None
        if self._fp32_accum:
            self._free_master_grads()

    def _compile_update_by_default(self) -> None:
        """Do what ``compiled_update=None`` does over a ``torch.compile``d module: inductor, a failed compile warns.

        For ``amp_fx.initialize`` given a compiled model: the wrapper it builds holds the converted module (or a
        view of some of its parameters), not the compiled one, so it cannot see that compilation was chosen."""
        if self._compiled is None:
            self._compiled = CompiledUpdate("inductor", strict=False)

    def _copy_masters_to_module(self) -> None:
        with torch.no_grad():
            for group in self._copy_groups():
                group.copy_masters_to_params()
        record(self._sync_entries)  # the low copies hold their masters: no re-copy at the next call (core/master_sync.py)

    # Dynamo runs it eagerly: torch.compile(lambda: mw.step()) (torch's compiled-optimizer recipe) would otherwise
    # trace the chunked step's in-place fused kernels over the masters and fail to functionalize them; eagerly,
    # the step is the same as uncompiled, and the compiled update's own torch.compile still compiles inside it.
    @torch.compiler.disable
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Step the masters with the wrapped optimizer and copy them into the module.

        ``closure`` (optional) is evaluated once, before the step. When this
        wrapper was given a ``scaler`` and is called directly, the scaler
        checks and unscales first and a non-finite step is skipped; the return
        value is then whether it stepped.

        Step hooks registered on this wrapper (``register_step_pre_hook``/``register_step_post_hook``) or
        globally run around the update as torch runs them, and the step then takes the plain route. Before a
        pre-hook of the user's runs (without a closure), the gradients are made ready for it: checked and
        unscaled (the scaler's verdict first: a skipped step runs no hook, as under ``scaler.step``), copied
        into the masters, and the masters' true values mirrored into the module's low gradients. The hook may
        then read or edit either: an edit of a master's gradient is stepped as it is, one of a low gradient is
        carried over to its master (:mod:`amp_fx.runtime.grad_edits`), so the same hook does the same thing on
        every route and dtype.
        """
        with torch.autograd.profiler.record_function(f"Optimizer.step#{type(self).__name__}.step"):
            args: tuple[Any, ...] = (self,) if closure is None else (self, closure)
            kwargs: dict[str, Any] = {}
            checked = prepared = False
            if closure is None:
                self._refuse_uncovered_grads()  # (before anything is checked, copied or hooked)
            if closure is None and has_user_step_hooks(self, pre_only=True):
                prepared = True
                checked = self._scaler is not None and not self._scaler._is_stepping(self)
                if checked and not self._scaler._begin_step(self):
                    return False
                self._grads_for_hooks()
            for hook in chain(torch_optimizer._global_optimizer_pre_hooks.values(),
                              self._optimizer_step_pre_hooks.values()):
                result = hook(self, args, kwargs)
                if result is not None:
                    if not (isinstance(result, tuple) and len(result) == 2):
                        raise AmpRuntimeError(
                            f"the step pre-hook {hook!r} returned {result!r}: a step pre-hook must return None or a "
                            "tuple (new_args, new_kwargs), as for any torch optimizer.")
                    args, kwargs = result
            if prepared and self._fp32_accum:
                self._refuse_low_grads_from_hooks()
            out = self._step(*args[1:], _checked=checked, **kwargs)
            self._optimizer_step_code()
            for hook in chain(self._optimizer_step_post_hooks.values(),
                              torch_optimizer._global_optimizer_post_hooks.values()):
                hook(self, args, kwargs)
            return out

    # Runs its hooks itself (above), where the gradients are ready for them: torch's Optimizer must not wrap it.
    step.hooked = True  # type: ignore[attr-defined]

    def _grads_for_hooks(self) -> None:
        """Give a pre-hook of the user's the masters' true gradients, mirrored into the low ones and watched."""
        self._sync_grads_to_masters()  # (already synced: edits made since the user's unscale_ are carried over)
        self._mirror_master_grads(write=True)

    def _refuse_low_grads_from_hooks(self) -> None:
        """fp32_grad_accumulation: refuse low gradients a pre-hook set (the masters' are the gradients there)."""
        named = [self._names[id(param)] for param, _ in self._pairs if param.grad is not None]
        if named:
            raise AmpValueError(
                f"a step pre-hook set gradients of the module's low-precision parameters {named}, but with "
                "fp32_grad_accumulation=True the fp32 masters' gradients are what is stepped (each low gradient was "
                "added into its master's and freed), so the edit would be lost. Edit the masters' gradients in the "
                "hook instead: amp_fx.master_params(optimizer) (optimizer.master_parameters()).")

    def _step(self, closure: Callable[[], Any] | None = None, _checked: bool = False) -> Any:
        """:meth:`step` within its hooks; ``_checked``: the scaler's verdict was taken already (step it)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            self._grads_synced = self._grads_deferred = False
            self._refuse_uncovered_grads()
        scaler = self._scaler
        if _checked:
            loss = True
        elif scaler is not None and not scaler._is_stepping(self):
            if not scaler._begin_step(self, step_follows=True):
                return False
            loss = True
        if not self._grads_synced and self._can_defer():
            self._grads_synced = self._grads_deferred = True  # (no check: the copy waits for the chunks)
            self._deferred_inv = 1.0
        if not self._grads_deferred:
            self._sync_grads_to_masters()
        self._warn_if_clip_found_no_low_grads()
        not_compiled = self._step_compiled()
        if not_compiled is None:
            self.last_step_route = "compiled"
        else:
            if self._deferred_inv != 1.0:
                self._copy_deferred_grads()  # (the unscale the compiled update would have done, done here)
            reason = self._step_chunked()
            if reason is not None:
                self._sync_grads_to_masters()  # (a deferred copy happens now)
                with fused_sgd_guard(self.optimizer):
                    self.optimizer.step()
                self._copy_masters_to_module()
            route = "chunked" if reason is None else f"optimizer.step ({reason})"
            self.last_step_route = route if not not_compiled else f"{route} (not compiled: {not_compiled})"
        if self._fp32_accum:
            self._free_master_grads()  # the next micro-batches start a new sum (and the 4 bytes/param are freed)
        self._grads_synced = self._grads_deferred = False
        self._grad_epoch += 1
        return loss

    def _step_compiled(self) -> str | None:
        """Step with the compiled update (:mod:`~amp_fx.runtime.compiled_update`); why not (nothing done) or None.

        "" where the compiled update is off (``compiled_update=False``, or None over a module not compiled)."""
        if self._compiled is None:
            return ""
        inv = self._deferred_inv if self._grads_deferred else 1.0
        return self._step_fast(why_not_compiled,
                               lambda sources: self._compiled.step(self.optimizer, sources, self._low_of, inv))

    def _step_chunked(self) -> str | None:
        """Step and copy back chunk by chunk (:mod:`~amp_fx.runtime.chunked_step`); why not (nothing done) or None."""
        return self._step_fast(why_not_chunked,
                               lambda sources: chunked_step(self.optimizer, sources, self._low_of, self._scratch))

    def _step_fast(self, why_not: Callable[[torch.optim.Optimizer], str | None],
                   step: Callable[[dict[int, torch.Tensor]], set[int] | str]) -> str | None:
        """A route that steps the masters and writes their low copies itself (chunked or compiled): why not, or None.

        ``step`` gets the deferred low gradients by master id and returns the ids of the masters whose low copy it
        wrote, or why it did not step (nothing changed: the next route steps)."""
        if self._fp32_accum:
            return "fp32_grad_accumulation"
        if has_user_step_hooks(self):
            return "a step hook is registered on the MasterWeightOptimizer"
        groups = self._copy_groups()
        if any(group.sharded for group in groups):
            return "sharded masters"
        reason = why_not(self.optimizer)
        if reason is not None:
            return reason
        sources: dict[int, torch.Tensor] = {}
        if self._grads_deferred:
            for group in groups:
                group.grad_sources(sources)
        written = step(sources)
        if isinstance(written, str):
            return written
        with torch.no_grad():  # masters without a gradient: their low copy is rewritten too, as by the plain step
            rest = [(p, m) for g in groups for p, m in zip(g.params, g.masters) if id(m) not in written]
            if rest:
                torch._foreach_copy_([p for p, _ in rest], [m for _, m in rest])
        record(self._sync_entries)
        return None

    def _warn_if_clip_found_no_low_grads(self) -> None:
        """fp32_grad_accumulation: warn once when the user unscaled and then edited no master gradient.

        ``unscale_`` is called to clip; torch's clip multiplies the gradients it clips even when the clip does not
        engage, so a clip of the masters moves their version counters. Unmoved, the clip (if any) went to the
        module's parameters, which hold no gradient here. Ints compared: nothing is synced.
        """
        before, self._versions_at_unscale = self._versions_at_unscale, None
        if before is None or self._warned_no_low_grads:
            return
        now = [m.grad._version for m in self.master_parameters() if m.grad is not None]
        if now == before and not any(param.grad is not None for param, _ in self._pairs):
            self._warned_no_low_grads = True
            warnings.warn(
                "MasterWeightOptimizer(fp32_grad_accumulation=True): nothing changed the fp32 master gradients "
                "between scaler.unscale_(optimizer) and the step, and the module's low-precision parameters hold no "
                "gradient (each is added into its master and freed): a clip_grad_norm_(model.parameters(), ...) "
                "there returns 0.0 and clips nothing. Clip optimizer.master_parameters() "
                "(amp_fx.master_params(optimizer)) instead. (Warned once.)",
                NoLowGradientsWarning, stacklevel=3)

    # ------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Return the wrapped optimizer's state and the masters' values (by parameter name).

        Tensors are references, as in ``Optimizer.state_dict``; ``torch.save`` copies.
        """
        return {
            "optimizer": self.optimizer.state_dict(),
            "masters": {name: m.detach() for name, m in self._masters.items()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore masters and optimizer state, then copy the masters into the module.

        A plain optimizer state (no ``"masters"``) loads into the wrapped
        optimizer only; the masters then keep their values.
        """
        if "masters" not in state_dict:
            self.optimizer.load_state_dict(state_dict)
            prefer_fast_step(self.optimizer)
            return
        saved = state_dict["masters"]
        missing = sorted(set(self._masters) - set(saved))
        unexpected = sorted(set(saved) - set(self._masters))
        if missing or unexpected:
            raise AmpKeyError(
                f"master weights in the state do not match this model: missing {missing}, "
                f"unexpected {unexpected}; rebuild the model and optimizer as when saving."
            )
        names = list(self._masters)
        with torch.no_grad():
            torch._foreach_copy_([local_tensor(self._masters[n]) for n in names],
                                 [local_tensor(saved[n]) for n in names])
        self._copy_masters_to_module()
        self.optimizer.load_state_dict(state_dict["optimizer"])
        prefer_fast_step(self.optimizer)  # a plain optimizer's saved groups leave the choice unset
        self._grads_synced = False
