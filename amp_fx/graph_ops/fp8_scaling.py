"""fp8 scales and quantization, the scaled GEMM kernel call, and delayed scaling's history update (:class:`Fp8Group`).

The arithmetic of torchao's float8 training (0.18): ``scale = finfo(fp8).max /
clamp(amax, min=1e-12)`` in float64 rounded to float32 (power-of-two scales
round it down), ``q(t) = saturate(t.float() * scale).to(fp8)``, and
``torch._scaled_mm`` with the reciprocal scales (``emulate``: an fp32 ``mm``
of the dequantized operands).  :mod:`amp_fx.graph_ops.fp8_ops` builds the
GEMMs of a linear layer from these.

Delayed scaling's history is updated in one of two ways (:class:`Fp8Group`
decides).  Alone (no process group, no step hook) every call records its amax
and computes the next scale at once.  Under ``torch.distributed`` (or after
``amp_fx.fp8_sync(gm, optimizer)``) a call only folds its *local* amax into the
step's pending amax (``Fp8GemmState.pending_amax``, the max over the step's
calls; no buffer, so DDP's buffer broadcast leaves it alone) and keeps the
scale; :meth:`Fp8Group.sync` then max-reduces every GEMM's pending amaxes in
one ``all_reduce`` of one flattened tensor, pushes them into the histories
(one entry per step) and recomputes every scale -- once per step: at the first
fp8 GEMM of the forward after a backward, or at the optimizer step.
This module imports only torch.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["amax_of", "amax_to_scale", "quantize", "scaled_mm", "delayed_scale", "Fp8Group", "E4M3", "E5M2", "EPS"]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
EPS = 1e-12  # amax floor, so an all-zero tensor gets a finite scale (torchao's value)


# --------------------------------------------------------------------------
# Scales and quantization
# --------------------------------------------------------------------------
@torch.no_grad()
def amax_of(tensor: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """``max(abs(tensor))``: of the whole tensor (0-dim) or along ``dim`` (kept as a size-1 dim)."""
    if dim is None:
        return torch.max(torch.abs(tensor))
    return torch.amax(torch.abs(tensor), dim=dim, keepdim=True)


@torch.no_grad()
def amax_to_scale(amax: torch.Tensor, dtype: torch.dtype, power_of_two: bool = False) -> torch.Tensor:
    """float32 ``finfo(dtype).max / max(amax, EPS)``, divided in float64 (eager and compiled agree)."""
    scale = (torch.finfo(dtype).max / torch.clamp(amax.to(torch.float64), min=EPS)).to(torch.float32)
    if power_of_two:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def quantize(tensor: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor * scale`` in float32, saturated to ``dtype``'s range, rounded to ``dtype`` (nearest even)."""
    limit = torch.finfo(dtype).max
    return (tensor.to(torch.float32) * scale).clamp(min=-limit, max=limit).to(dtype)


def _row_major(tensor: torch.Tensor) -> bool:
    stride = tensor.stride()
    return stride[0] > stride[1] and stride[1] == 1


def scaled_mm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, out_dtype: torch.dtype,
              *, fast_accum: bool, emulate: bool) -> torch.Tensor:
    """``(a / a_scale) @ (b / b_scale)`` of 2-D fp8 operands, in ``out_dtype``.

    Scales are 0-dim (tensorwise), or ``(M, 1)`` and ``(1, N)`` (rowwise).
    ``torch._scaled_mm`` wants ``a`` row-major and ``b`` column-major and
    multiplies by the reciprocal scales; a rowwise GEMM without fast
    accumulation runs the tensorwise kernel and scales its result after, and
    one with a float32 or float16 result runs in bfloat16 (the rowwise kernel
    makes no other), as torchao does.
    """
    if emulate:
        return torch.mm(a.float() / a_scale, b.float() / b_scale).to(out_dtype)
    if not _row_major(a):
        a = a.contiguous()
    if _row_major(b):
        b = b.t().contiguous().t()
    a_inverse, b_inverse = a_scale.reciprocal(), b_scale.reciprocal()
    rowwise = a_scale.shape == (a.shape[0], 1) and b_scale.shape == (1, b.shape[1])
    post_scale = None
    if rowwise and not fast_accum:
        post_scale = a_inverse * b_inverse
        a_inverse = a_inverse.new_ones(())
        b_inverse = a_inverse.new_ones(())
    kernel_dtype = torch.bfloat16 if rowwise and out_dtype in (torch.float16, torch.float32) else out_dtype
    out = torch._scaled_mm(a, b, scale_a=a_inverse, scale_b=b_inverse, out_dtype=kernel_dtype, use_fast_accum=fast_accum)
    if post_scale is not None:
        out *= post_scale
    return out.to(out_dtype) if kernel_dtype != out_dtype else out


# --------------------------------------------------------------------------
# Delayed scaling and records
# --------------------------------------------------------------------------
@torch.no_grad()
def delayed_scale(history: torch.Tensor, old_scale: torch.Tensor, dtype: torch.dtype, amax_compute: str,
                  margin: int) -> torch.Tensor:
    """Transformer Engine's scale from an amax history: ``fp8_max / amax / 2**margin``; an amax of 0 or inf keeps ``old_scale``."""
    amax = history.max() if amax_compute == "max" else history[0]
    scale = (torch.finfo(dtype).max / amax) / (2.0 ** margin)
    return torch.where(torch.isfinite(amax) & (amax > 0), scale, old_scale)


def _world_size() -> int:
    """The default process group's size; 1 without one."""
    import torch.distributed as dist  # noqa: PLC0415 (lazy: most runs have no process group)

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class Fp8Group:
    """The delayed-scaling GEMMs of one converted module, whose histories are updated (and reduced) together.

    A plain object every :class:`Fp8GemmState` of the module points to (not a
    module: it is no state of its own).  ``deferred()``: calls record local
    amaxes and leave the scales to :meth:`sync` -- under a process group of
    more than one rank, or once ``on_step`` (a step hook calls :meth:`sync`).
    ``paused``: a diagnosis run (``find_overflow``, ``fp8_report``) that must
    start no collective.
    """

    def __init__(self) -> None:
        self.states: list[Any] = []
        self.pending = False  # local amaxes recorded since the last sync
        self.stepped = False  # a backward recorded grad_output amaxes since: the next forward is a new step
        self.on_step = False  # amp_fx.fp8_sync(gm, optimizer): sync at the optimizer step, not the next forward
        self.paused = False
        self.syncs = 0  # how many syncs reduced across ranks (one all_reduce each)

    def deferred(self) -> bool:
        return self.on_step or _world_size() > 1

    def before_forward(self) -> None:
        """The lazy sync point: the first fp8 GEMM of a forward after a backward reduces that step's amaxes."""
        if self.stepped and not self.on_step and not self.paused:
            self.sync()

    @torch.no_grad()
    def sync(self) -> bool:
        """Max-reduce the step's pending amaxes across ranks (one all_reduce), push them into the histories, rescale.

        Every delayed GEMM contributes its 3 pending amaxes (-1 for an operand
        no call quantized: it gets no history entry), so the flattened tensor
        has the same length on every rank.  Every rank must call it at the
        same point (as it calls the forward); returns whether it communicated.
        """
        states = [s for s in self.states if s.delayed]  # all of them: the same length on every rank
        communicated = False
        if states:
            flat = torch.cat([_pending(s) for s in states])
            if _world_size() > 1:
                import torch.distributed as dist  # noqa: PLC0415

                dist.all_reduce(flat, op=dist.ReduceOp.MAX)
                communicated = True
                self.syncs += 1
            for i, s in enumerate(states):
                if s.spec is None:
                    continue  # never called here: no recipe options to compute a scale with
                for role, dtype in enumerate(_role_dtypes(s.spec)):
                    amax = flat[3 * i + role]
                    if amax < 0:
                        continue  # not quantized since the last sync
                    history = s.amax_history[role]
                    history.copy_(torch.roll(history, 1))
                    history[0] = amax
                    s.scale[role].copy_(delayed_scale(history, s.scale[role], dtype, s.spec.amax_compute, s.spec.margin))
                s.pending_amax = None
        self.pending = self.stepped = False
        return communicated


def _pending(state: Any) -> torch.Tensor:
    """A state's pending amaxes (-1: none), on its own device."""
    if state.pending_amax is None:
        return torch.full((3,), -1.0, device=state.scale.device)
    return state.pending_amax


def _role_dtypes(spec: Any) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
    return E4M3, E4M3, spec.grad_dtype


@torch.no_grad()
def _record(state: Optional[Any], role: int, tensor: torch.Tensor, quantized: torch.Tensor,
            scale: torch.Tensor, dtype: torch.dtype) -> None:
    """Write the scale used and, while ``state.track``, the saturated and flushed fractions, the amax and a call count."""
    if state is None:
        return
    state.used_scale[role].copy_(scale.min())
    if not state.delayed:
        state.scale[role].copy_(scale.min())
    if state.track:
        limit = torch.finfo(dtype).max
        scaled = tensor.to(torch.float32) * scale
        count = max(tensor.numel(), 1)
        # Clamped: beyond the largest finite value.  Current scaling maps the amax to the max through a float32
        # scale and a float32 product (two roundings of 2**-24 each), so its amax may land one ulp above: no clamp.
        saturated = (scaled.abs() > limit * (1 + 2.0 ** -22)).sum() / count
        state.saturated[role].copy_(saturated)
        state.flushed[role].copy_(((quantized.to(torch.float32) == 0) & (tensor != 0)).sum() / count)
        state.saturated_steps[role] += (saturated > 0).to(torch.int64)
        state.amax[role].copy_(amax_of(tensor).to(torch.float32))
        state.calls[role] += 1


@torch.no_grad()
def _delayed_update(state: Any, role: int, tensor: torch.Tensor, spec: Any, dtype: torch.dtype) -> None:
    """Record ``tensor``'s amax (newest first) and compute the scale its next call uses; deferred: fold it into the step's."""
    amax = amax_of(tensor).to(torch.float32)
    state.spec = spec
    group = getattr(state, "group", None)
    if group is not None and group.deferred():
        # local until Fp8Group.sync reduces it across ranks: one history entry per step, the max of its calls
        if state.pending_amax is None:
            state.pending_amax = torch.full((3,), -1.0, device=amax.device)
        state.pending_amax[role] = torch.maximum(state.pending_amax[role], amax)
        group.pending = True
        return
    history = state.amax_history[role]
    history.copy_(torch.roll(history, 1))
    history[0] = amax
    state.scale[role].copy_(delayed_scale(history, state.scale[role], dtype, spec.amax_compute, spec.margin))
