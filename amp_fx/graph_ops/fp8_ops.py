"""The fp8 ops a rewritten graph calls: scale, quantize, scaled GEMM, and the GEMM's autograd Function.

``passes/fp8_gemms.py`` turns a GEMM painted fp8 into one call of
:func:`fp8_linear` (``x @ weight.t()``) or :func:`fp8_matmul` (``x @ other``).
Inside, :class:`Fp8Matmul` runs the three GEMMs of a linear layer in fp8:

- forward: ``output = q(x) @ q(w_t)`` (e4m3 operands, fast accumulation);
- backward: ``grad_input = q(grad_out) @ q(w_t).t()`` and
  ``grad_weight = q(grad_out).t() @ q(x)``, re-quantizing the saved
  high-precision ``x`` and ``w_t`` (grad_output in e5m2 for the tensorwise
  and delayed recipes, e4m3 for rowwise), without fast accumulation.

The arithmetic is torchao's float8 training (0.18) step for step, so that a
GEMM here is bit for bit ``convert_to_float8_training``'s on the same inputs:
``scale = finfo(fp8).max / clamp(amax, min=1e-12)`` computed in float64 and
rounded to float32 (power-of-two scales round it down); ``q(t) =
saturate(t.float() * scale).to(fp8)``; ``torch._scaled_mm`` with the
reciprocal scales; the same operand layouts; and with ``emulate=True`` an
fp32 ``mm`` of the dequantized operands.  Gradients pass straight through the
quantization.

Recipes (``spec.recipe``):

- ``"tensorwise"``: one scale per tensor, recomputed on every call (torchao's default);
- ``"rowwise"``: one power-of-two scale per row of each GEMM operand (torchao's ``rowwise``);
- ``"rowwise_with_gw_hp"``: rowwise forward; grad_input from a rowwise grad_output and a tensorwise weight;
  grad_weight in high precision (torchao's ``rowwise_with_gw_hp``);
- ``"delayed"``: Transformer Engine's delayed scaling; each tensor is quantized with a
  scale computed from the amax history of earlier calls, and then records its own amax.
  History and scales are the tensors of an :class:`Fp8GemmState` (module buffers).

An empty batch (no rows) returns the empty result, an empty input gradient and
a zero weight gradient, and records nothing.  Under ``torch.compile`` a
delayed GEMM runs eagerly (``torch.compiler.disable``: its backward updates
the module's history, which a traced backward cannot keep).

Every call also writes into its :class:`Fp8GemmState` the scales it used and,
when ``state.track`` is on (``amp_fx.find_overflow``, ``amp_fx.fp8_report``), the
fraction of values saturated at the format's max and flushed to zero.

Scales, quantization, the scaled GEMM kernel call and delayed scaling's shared history update
live in :mod:`amp_fx.graph_ops.fp8_scaling` (re-exported here).
This module imports only torch.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
import torch.nn as nn
from torch.fx import Proxy

from amp_fx.errors import AmpNotImplementedError
from amp_fx.graph_ops.fp8_scaling import (E4M3, E5M2, EPS, Fp8Group, _delayed_update, _record, amax_of,  # noqa: F401
                                          amax_to_scale, delayed_scale, quantize, scaled_mm)

__all__ = ["Fp8Spec", "Fp8GemmState", "Fp8Group", "Fp8Matmul", "fp8_linear", "fp8_matmul", "amax_of", "amax_to_scale",
           "quantize", "scaled_mm", "delayed_scale", "E4M3", "E5M2", "EPS", "ROLES"]

ROLES = ("input", "weight", "grad_output")  # the rows of an Fp8GemmState's tensors


class Fp8Spec(NamedTuple):
    """How one fp8 GEMM runs: the recipe and its options (a NamedTuple: fx prints it as a constant of the graph)."""

    recipe: str = "tensorwise"  # tensorwise | rowwise | rowwise_with_gw_hp | delayed
    out_dtype: torch.dtype = torch.bfloat16  # the forward GEMM's result (the level's low dtype)
    emulate: bool = False  # fp32 mm of the dequantized operands instead of torch._scaled_mm
    amax_compute: str = "max"  # delayed: "max" of the history or its "most_recent" entry
    margin: int = 0  # delayed: scale = fp8_max / amax / 2**margin

    @property
    def rowwise(self) -> bool:
        """Scales per row of each operand (torchao's axiswise), rounded down to powers of two."""
        return self.recipe in ("rowwise", "rowwise_with_gw_hp")

    @property
    def grad_dtype(self) -> torch.dtype:
        """grad_output's fp8 format: e5m2 (range) except the rowwise recipes, which keep e4m3 as torchao's do."""
        return E4M3 if self.rowwise else E5M2

    @property
    def power_of_two(self) -> bool:
        return self.rowwise


class Fp8GemmState(nn.Module):
    """One fp8 GEMM's state: scales, delayed scaling's amax history, saturation counts (rows: :data:`ROLES`).

    ``scale`` holds the scale each operand was quantized with last (rowwise:
    the smallest row's).  Under delayed scaling ``scale`` and ``amax_history``
    are the recipe's state and persistent (in ``state_dict``); otherwise they
    are records and not saved.  ``saturated`` / ``flushed``: the fraction of
    the last call's values clamped at the format's max / rounded to zero
    (nonzero before), written while ``track`` is True.  ``saturated_steps``
    counts calls with any saturation (delayed scaling's stale scales show there).
    """

    def __init__(self, delayed: bool = False, history_len: int = 16):
        super().__init__()
        self.delayed = delayed
        self.track = False
        self.register_buffer("scale", torch.ones(3), persistent=delayed)
        self.register_buffer("amax_history", torch.zeros(3, history_len if delayed else 1), persistent=delayed)
        self.register_buffer("saturated", torch.zeros(3), persistent=False)
        self.register_buffer("flushed", torch.zeros(3), persistent=False)
        self.register_buffer("saturated_steps", torch.zeros(3, dtype=torch.int64), persistent=False)
        # The scale each operand's last call was quantized with (delayed: ``scale`` is already the next call's).
        self.register_buffer("used_scale", torch.ones(3), persistent=False)
        # While tracked: the local amax of the last call, and how many calls quantized each operand.
        self.register_buffer("amax", torch.zeros(3), persistent=False)
        self.register_buffer("calls", torch.zeros(3, dtype=torch.int64), persistent=False)
        self.group: Optional[Fp8Group] = None  # the module's GEMMs that share one history update (fp8_gemms sets it)
        # Deferred updates: this step's local amax per operand, -1 where none yet (a plain tensor, not a buffer).
        self.pending_amax: Optional[torch.Tensor] = None
        self.spec: Optional[Fp8Spec] = None  # the recipe of the last call (the group's sync needs its margin)
        if delayed:
            # The pending amaxes are no buffer (DDP would broadcast rank 0's over the others'), but a checkpoint
            # saved between a backward and the next sync must carry them: a state_dict entry of their own.
            self.register_state_dict_post_hook(_save_pending)
            self.register_load_state_dict_pre_hook(_load_pending)

    def extra_repr(self) -> str:
        return f"delayed={self.delayed}, history_len={self.amax_history.shape[1]}"


PENDING_KEY = "pending_amax"  # a delayed state's state_dict entry: the step's local amaxes, -1 where none


def _save_pending(module: Fp8GemmState, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    pending = module.pending_amax
    state_dict[prefix + PENDING_KEY] = (torch.full((3,), -1.0, device=module.scale.device) if pending is None
                                        else pending.detach().clone())


def _load_pending(module: Fp8GemmState, state_dict: dict, prefix: str, *args: Any) -> None:
    """Restore the pending amaxes (and the group's flags: the next forward or step syncs them); a key may be absent."""
    value = state_dict.pop(prefix + PENDING_KEY, None)
    if value is None:
        return
    pending = value.detach().clone().to(module.scale.device, torch.float32)
    module.pending_amax = None if bool((pending < 0).all()) else pending
    group = module.group
    if group is not None and module.pending_amax is not None:
        group.pending = True
        group.stepped = group.stepped or bool(pending[2] >= 0)  # a backward recorded: the next forward syncs


def _quantize_as(tensor: torch.Tensor, role: int, dtype: torch.dtype, spec: Fp8Spec, state: Optional[Fp8GemmState],
                 dim: Optional[int] = None, scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 tensor, its scale) of one GEMM operand under ``spec``'s recipe (``dim``: rowwise's reduced dim)."""
    if scale is None:
        if spec.recipe == "delayed":
            scale = state.scale[role].clone()
        else:
            scale = amax_to_scale(amax_of(tensor, dim if spec.rowwise else None), dtype, spec.power_of_two)
    quantized = quantize(tensor, scale, dtype)
    _record(state, role, tensor, quantized, scale, dtype)
    return quantized, scale


# --------------------------------------------------------------------------
# The GEMM
# --------------------------------------------------------------------------
class Fp8Matmul(torch.autograd.Function):
    """``x @ w_t`` (``w_t``: K x N) as three fp8 GEMMs; gradients for ``x`` and ``w_t`` (module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w_t: torch.Tensor, spec: Fp8Spec, state: Optional[Fp8GemmState],
                record: bool = True, recompute: bool = False) -> torch.Tensor:
        ctx.save_for_backward(x, w_t)
        ctx.spec, ctx.state = spec, state
        group = getattr(state, "group", None)  # None: a state saved before groups existed
        if spec.recipe == "delayed" and group is not None and record:
            group.before_forward()
        if x.numel() == 0:
            # An empty batch (no rows: a last ragged batch, an empty expert): nothing to scale or record.
            ctx.empty = True
            return x.new_zeros(*x.shape[:-1], w_t.shape[1], dtype=spec.out_dtype)
        ctx.empty = False
        x2 = x.reshape(-1, x.shape[-1])
        if recompute and spec.recipe == "delayed":
            # Activation checkpointing recomputes this forward inside the backward: quantize with the scales the
            # forward used (alone, the state's scale has moved on since) and record nothing a second time.
            x8, x_scale = _quantize_as(x2, 0, E4M3, spec, None, scale=state.used_scale[0].clone())
            w8, w_scale = _quantize_as(w_t, 1, E4M3, spec, None, scale=state.used_scale[1].clone())
        else:
            x8, x_scale = _quantize_as(x2, 0, E4M3, spec, state, dim=-1)
            w8, w_scale = _quantize_as(w_t, 1, E4M3, spec, state, dim=0)
        if spec.recipe == "delayed":
            ctx.scales = (x_scale, w_scale)
            if record:  # a training forward; evaluation (no_grad) uses the trained scales and changes nothing
                _delayed_update(state, 0, x2, spec, E4M3)
                _delayed_update(state, 1, w_t, spec, E4M3)
        out = scaled_mm(x8, x_scale, w8, w_scale, spec.out_dtype, fast_accum=True, emulate=spec.emulate)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        x, w_t = ctx.saved_tensors
        spec, state = ctx.spec, ctx.state
        if ctx.empty:
            return _empty_backward(x, w_t, grad_out, spec, state)
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        delayed = spec.recipe == "delayed"
        if delayed and torch.compiler.is_compiling():
            # AOTAutograd would trace grad_output's history update into the backward graph as a write to a
            # constant: the history would silently go stale.  Refused rather than wrong.
            raise AmpNotImplementedError(
                "fp8 recipe 'delayed' records grad_output's amax in the backward, which a traced backward cannot "
                "keep in the module's buffers; torch.compile of amp_fx.convert(model, fp8='delayed') runs its "
                "delayed GEMMs eagerly (docs/fp8.md), but this backward was traced: run it eagerly, or use "
                "fp8='tensorwise' / 'rowwise', which compile whole")
        if spec.recipe == "rowwise_with_gw_hp":
            return _gw_hp_backward(x, w_t, grad_out, g2, x2, spec, state)
        x_scale, w_scale = ctx.scales if delayed else (None, None)
        # grad_input = grad_out @ w: rows of grad_out, rows of w_t (its columns once transposed)
        g8, g_scale = _quantize_as(g2, 2, spec.grad_dtype, spec, state, dim=-1)
        w8, w_scale = _quantize_as(w_t, 1, E4M3, spec, None, dim=-1, scale=w_scale)
        grad_x = scaled_mm(g8, g_scale, w8.t(), w_scale.t(), _grad_dtype(x, grad_out), fast_accum=False,
                           emulate=spec.emulate)
        # grad_weight = grad_out.t() @ x: both scaled along the rows M they sum over
        if not delayed:
            g8, g_scale = _quantize_as(g2, 2, spec.grad_dtype, spec, None, dim=0)
        x8, x_scale = _quantize_as(x2, 0, E4M3, spec, None, dim=0, scale=x_scale)
        grad_w = scaled_mm(g8.t(), g_scale.t(), x8, x_scale, _grad_dtype(w_t, grad_out), fast_accum=False,
                           emulate=spec.emulate)
        if delayed:
            _delayed_update(state, 2, g2, spec, spec.grad_dtype)
            group = getattr(state, "group", None)
            if group is not None and group.pending:
                group.stepped = True  # the next forward starts a new step: it syncs this one
        return grad_x.reshape(*grad_out.shape[:-1], grad_x.shape[-1]), grad_w.t(), None, None, None, None


def _gw_hp_backward(x: torch.Tensor, w_t: torch.Tensor, grad_out: torch.Tensor, g2: torch.Tensor, x2: torch.Tensor,
                    spec: Fp8Spec, state: Optional[Fp8GemmState]) -> tuple:
    """torchao's ``rowwise_with_gw_hp`` backward: grad_input in fp8, grad_weight in high precision.

    grad_input = q_row(grad_out) @ q_tensor(w): grad_output e4m3 with a power-of-two scale per row, the weight
    e4m3 with one power-of-two scale, repeated along K so the rowwise kernel runs (torchao's ``preprocess_addmm``;
    the emulated division reads the same value either way).  grad_weight = grad_out.t() @ x of the unquantized
    operands, a plain ``mm`` in the weight gradient's dtype (bf16 on a bf16 model, as torchao's).
    """
    g8, g_scale = _quantize_as(g2, 2, E4M3, spec, state, dim=-1)
    w_scale = amax_to_scale(amax_of(w_t), E4M3, power_of_two=True)
    w8 = quantize(w_t, w_scale, E4M3).t()  # N x K
    grad_x = scaled_mm(g8, g_scale, w8, w_scale.repeat(w8.shape[1]).reshape(1, -1), _grad_dtype(x, grad_out),
                       fast_accum=False, emulate=spec.emulate)
    dtype = _grad_dtype(w_t, grad_out)  # an fp32 weight at O1: its gradient in fp32, from the bf16 grad_output
    grad_w = torch.mm(g2.t().to(dtype), x2.to(dtype))
    return grad_x.reshape(*grad_out.shape[:-1], grad_x.shape[-1]), grad_w.t(), None, None, None, None


def _empty_backward(x: torch.Tensor, w_t: torch.Tensor, grad_out: torch.Tensor, spec: Fp8Spec,
                    state: Optional[Fp8GemmState]) -> tuple:
    """The gradients of an empty batch: an empty input gradient and a zero weight gradient (a sum of no rows)."""
    group = getattr(state, "group", None)
    if spec.recipe == "delayed" and group is not None and group.deferred():
        group.stepped = True  # the other ranks' GEMMs saw rows: this rank must join the next forward's sync too
    grad_x = torch.zeros_like(x, dtype=_grad_dtype(x, grad_out))
    grad_w = torch.zeros_like(w_t, dtype=_grad_dtype(w_t, grad_out))
    return grad_x, grad_w, None, None, None, None


def _grad_dtype(operand: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """A gradient's dtype: its operand's (an fp32 weight's gradient is computed in fp32), else grad_out's."""
    return operand.dtype if operand.dtype in (torch.float32, torch.bfloat16, torch.float16) else grad_out.dtype


def _proxy_call(fn: Any, args: tuple) -> Optional[Proxy]:
    """Stay one node when fx re-traces the rewritten graph (unpickling, converting again)."""
    proxy = next((a for a in args if isinstance(a, Proxy)), None)
    return None if proxy is None else proxy.tracer.create_proxy("call_function", fn, args, {})


@torch.compiler.disable(reason="amp_fx: a delayed-scaling fp8 GEMM updates its amax history in the backward; "
                                "it runs eagerly (docs/fp8.md, Limits)")
def _delayed_gemm(x: torch.Tensor, w_t: torch.Tensor, spec: Fp8Spec, state: Optional[Fp8GemmState]) -> torch.Tensor:
    """A delayed-scaling GEMM, run eagerly inside a compiled module: one graph break, the rest of the graph compiles.

    Its backward records grad_output's amax into the module's buffers, which AOTAutograd cannot keep (it would
    trace the write as one to a constant), so torch.compile leaves this call (forward and backward) to eager.
    """
    # Under no_grad (evaluation) a delayed GEMM records no amax and starts no sync: an evaluation must not move
    # the scales training uses next, nor join a collective the other ranks may not make.
    # A forward run while autograd runs a backward is activation checkpointing's recomputation: its amaxes were
    # recorded by the forward it repeats.
    recompute = torch._C._current_graph_task_id() != -1
    return Fp8Matmul.apply(x, w_t, spec, state, torch.is_grad_enabled() and not recompute, recompute)


def _gemm(x: torch.Tensor, w_t: torch.Tensor, spec: Fp8Spec, state: Optional[Fp8GemmState]) -> torch.Tensor:
    if spec.recipe == "delayed":
        return _delayed_gemm(x, w_t, spec, state)
    return Fp8Matmul.apply(x, w_t, spec, state)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, spec: Fp8Spec, state: Optional[Fp8GemmState] = None) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias: it is added after, in ``spec.out_dtype``) as fp8 GEMMs."""
    traced = _proxy_call(fp8_linear, (x, weight, spec, state))
    if traced is not None:
        return traced
    return _gemm(x, weight.t(), spec, state)


def fp8_matmul(x: torch.Tensor, other: torch.Tensor, spec: Fp8Spec, state: Optional[Fp8GemmState] = None) -> torch.Tensor:
    """``x @ other`` with a 2-D ``other`` (K x N, a parameter) as fp8 GEMMs."""
    traced = _proxy_call(fp8_matmul, (x, other, spec, state))
    if traced is not None:
        return traced
    return _gemm(x, other, spec, state)
