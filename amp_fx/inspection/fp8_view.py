"""What the fp8 GEMMs of a converted module did last: their scales, and the values they saturated or flushed to zero.

``fp8_report(converted, *inputs)`` runs one forward and backward on
``inputs`` with the counts on (as ``find_overflow`` runs a step to
diagnose it) and gives them back, leaving the module as it was: its fp8
state (delayed scaling's history included) and its gradients are restored.
``fp8_report(converted)`` without inputs reads each fp8 GEMM's
:class:`~amp_fx.graph_ops.fp8_ops.Fp8GemmState` after a forward (and
backward): per operand (input, weight, grad_output) the scale it was
quantized with (rowwise: the smallest row's).  ``track_fp8(converted)``
turns on the saturation counts, which cost one reduction per quantized
tensor: the fraction of values clamped at the format's max, the fraction of
nonzero values rounded to zero, and (delayed scaling's stale scales) how many
calls saturated anything.  ``str()`` of the report is a table.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn as nn

from amp_fx.graph_ops.fp8_ops import ROLES
from amp_fx.passes.fp8_gemms import fp8_group, fp8_states

__all__ = ["fp8_report", "track_fp8", "Fp8Report", "read_fp8", "fp8_diagnosis"]


def track_fp8(converted: nn.Module, on: bool = True) -> int:
    """Count saturation and flushes in every fp8 GEMM of ``converted`` from its next call on; returns how many GEMMs."""
    states = fp8_states(converted)
    for state in states.values():
        state.track = on
    return len(states)


@dataclass
class Fp8Report:
    """Per fp8 GEMM and operand: the last scale, saturated and flushed fractions, calls that saturated."""

    gemms: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)

    def saturated(self) -> dict[str, dict[str, float]]:
        """``{gemm: {operand: fraction}}`` of the operands that saturated anything in the last call."""
        return {name: {role: row["saturated"] for role, row in rows.items() if row["saturated"]}
                for name, rows in self.gemms.items() if any(row["saturated"] for row in rows.values())}

    def __str__(self) -> str:
        lines = ["fp8 GEMMs: gemm / operand / scale / saturated / flushed to zero / calls that saturated"]
        for name, rows in self.gemms.items():
            for role, row in rows.items():
                if row["tracked"] and not row["calls"]:
                    lines.append(f"  {name:<20} {role:<12} {row['scale']:>12.6g} {'(not run)':>10}")
                    continue
                lines.append(f"  {name:<20} {role:<12} {row['scale']:>12.6g} {row['saturated']:>10.3%} "
                             f"{row['flushed']:>10.3%} {row['saturated_steps']:>6}")
        return "\n".join(lines)

    __repr__ = __str__


def read_fp8(converted: nn.Module) -> Fp8Report:
    """What every fp8 GEMM's :class:`~amp_fx.graph_ops.fp8_ops.Fp8GemmState` recorded (the one source of the counts).

    Per operand: ``scale`` (what its last call quantized with; ``next_scale``: delayed
    scaling's for the next call, else the same), ``saturated`` and ``flushed`` fractions, ``amax`` (local
    max |x|), ``saturated_steps``, and ``calls`` (quantizations counted while tracked).
    """
    report = Fp8Report()
    for name, state in fp8_states(converted).items():
        report.gemms[name] = {
            role: {"scale": float(state.used_scale[i]), "next_scale": float(state.scale[i]), "saturated": float(state.saturated[i]),
                   "flushed": float(state.flushed[i]), "saturated_steps": int(state.saturated_steps[i]),
                   "amax": float(state.amax[i]), "calls": int(state.calls[i]), "tracked": state.track}
            for i, role in enumerate(ROLES)
        }
    return report


_read = read_fp8


@contextlib.contextmanager
def fp8_diagnosis(converted: nn.Module) -> Iterator[Callable[[], Fp8Report]]:
    """Count saturation in a diagnosis run, then put every fp8 GEMM's state back; yields the reader.

    Inside: tracking on, the last call's fractions and the call counts zeroed
    (``saturated_steps`` goes on from what training counted), and delayed
    scaling's group paused (no collective starts in a run only one rank makes).
    Afterwards the buffers, tracking flags and the step's pending amaxes are as before.
    """
    states = fp8_states(converted)
    group = fp8_group(converted)
    saved = {name: ({k: b.clone() for k, b in state.named_buffers()}, state.track) for name, state in states.items()}
    flags = (group.pending, group.stepped, group.paused) if group is not None else None
    pending = {name: None if state.pending_amax is None else state.pending_amax.clone() for name, state in states.items()}
    try:
        with torch.no_grad():
            for state in states.values():
                state.track = True
                for buffer in (state.saturated, state.flushed, state.amax, state.calls):
                    buffer.zero_()
        if group is not None:
            group.paused = True
        yield lambda: read_fp8(converted)
    finally:
        for name, (buffers, track) in saved.items():
            with torch.no_grad():
                for key, value in buffers.items():
                    states[name].get_buffer(key).copy_(value)
            states[name].track = track
            states[name].pending_amax = pending[name]
        if group is not None:
            group.pending, group.stepped, group.paused = flags


def _default_loss(output: Any) -> torch.Tensor:
    leaves = [t for t in torch.utils._pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return sum(t.float().sum() for t in leaves)


def fp8_report(converted: nn.Module, *inputs: Any, loss_fn: Optional[Callable[[Any], torch.Tensor]] = None,
               **kwarg_inputs: Any) -> Fp8Report:
    """The scales and saturation counts of every fp8 GEMM of ``converted``.

    Without inputs: what the GEMMs recorded in their last call (counts
    only while :func:`track_fp8` is on).  With positional and/or keyword
    inputs (``fp8_report(gm, input_ids=ids)``, as the module takes them): one
    forward, and a backward of ``loss_fn(output)`` (default: the sum of the
    floating outputs, a Hugging Face output's ``loss`` included), run with
    the counts on; the module's fp8 state and gradients are put back
    afterwards, so the diagnosis changes nothing.
    """
    if not inputs and not kwarg_inputs:
        return _read(converted)
    grads = {p: p.grad for p in converted.parameters()}
    for p in grads:
        p.grad = None
    try:
        with fp8_diagnosis(converted) as read:
            output = converted(*inputs, **kwarg_inputs)
            (loss_fn or _default_loss)(output).backward()
            return read()
    finally:
        for p, grad in grads.items():
            p.grad = grad
