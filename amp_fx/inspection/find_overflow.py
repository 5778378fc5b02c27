"""Find the node whose low-precision output (or gradient) overflowed, by running an fp32 twin beside it.

``find_overflow(converted, *inputs)`` steps through the converted graph node
by node with two :class:`torch.fx.Interpreter` runs: the graph as converted,
and an fp32 *twin* -- the same graph with every cast amp_fx inserted to a low
dtype turned into a cast to fp32 (and low-precision parameters read as fp32).
The first node whose low output holds inf/NaN while the twin's is finite is
where precision, not the model, broke.  ``backward=True`` does the same for
gradients: every input edge of every node is tapped (a ``view_as`` whose
gradient autograd returns), and the first edge, walking back from the loss,
whose low gradient is non-finite while the twin's is finite names the node
whose backward overflowed.

In a module with fp8 GEMMs the same run counts, per GEMM, the values each
fp8 quantization clamped at its format's max and flushed to zero (forward
operands e4m3, grad_output e5m2, with ``backward=True``): every report carries
that table as ``report.fp8``, and a run without inf/NaN reports the first fp8
GEMM that saturated (``kind="fp8 saturation"``; delayed scaling's stale scales
are what clamp).  The counts are the ones ``amp_fx.fp8_report`` gives
(:mod:`amp_fx.inspection.fp8_view`).

:func:`diagnose_collapse` is the entry point for the loss scaler: it gets a
callable that reproduces a training step and returns the report.

This module is the search and the loss scaler's entry point; the lock-step
run is :mod:`amp_fx.inspection.twin_run`, the report and the pin it suggests
:mod:`amp_fx.inspection.overflow_report`, the value helpers
:mod:`amp_fx.inspection.values`.  Their public names stay importable from here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
import torch.fx as fx
import torch.nn.functional as F

from amp_fx.graph_ops.outer_autocast import no_outer_autocast
from amp_fx.errors import AmpTypeError, AmpValueError, checks_keywords
from amp_fx.graph_ops.fp8_ops import E4M3, ROLES, fp8_linear, fp8_matmul
from amp_fx.inspection.fp8_view import Fp8Report, fp8_diagnosis
from amp_fx.inspection.overflow_report import (OverflowReport, overflowed, pin_override, pin_targets, report_at,
                                               saturation_at)
from amp_fx.inspection.twin_run import CALL_OPS, TwinRun, preserved_buffers
# Re-exported: calibration and older callers import the value helpers from here.
from amp_fx.inspection.values import (  # noqa: F401
    LOW_DTYPES, float_tensors, max_abs, nonfinite_count, plain_containers, value_dtype,
)

__all__ = ["find_overflow", "diagnose_collapse", "OverflowReport", "ReproStep", "TwinRun", "pin_override", "pin_targets", "plain_containers", "LOW_DTYPES"]


# -- the search -----------------------------------------------------------------
def default_loss(output: Any, target: Any = None) -> torch.Tensor:
    """Cross-entropy for an integer target, MSE for a floating one, the sum of the outputs without one."""
    tensors = float_tensors(output)
    if not tensors:
        raise AmpValueError("the model returned no floating tensor to take a loss of; pass loss_fn=")
    if target is None:
        return sum(t.float().sum() for t in tensors)
    if isinstance(target, torch.Tensor) and not target.is_floating_point():
        return F.cross_entropy(tensors[0].float(), target)
    return F.mse_loss(tensors[0].float(), torch.as_tensor(target, dtype=torch.float32))


@checks_keywords("find_overflow")
def find_overflow(
    converted: fx.GraphModule,
    *inputs: Any,
    target: Any = None,
    backward: bool = False,
    loss_fn: Optional[Callable[..., torch.Tensor]] = None,
    loss_scale: float = 1.0,
) -> Optional[OverflowReport]:
    """Return where the converted graph first overflows while its fp32 twin does not; None if nowhere.

    Args:
        converted: what :func:`amp_fx.convert` returned.
        inputs: the inputs of one forward (the batch that overflowed).
        target: the training target; with it, the loss ``loss_fn(output,
            target)`` is checked too (and drives ``backward``).
        backward: also localise overflow in the gradients.  The loss (the
            sum of the outputs without a target) is multiplied by
            ``loss_scale`` before the backward, as a loss scaler does.
        loss_fn: ``(output, target) -> loss``; by default cross-entropy for
            an integer target, MSE for a floating one.

    The module's buffers (batch-norm statistics, fp8 scales and histories) are
    restored afterwards, and no ``.grad`` is written: gradients are taken with
    ``torch.autograd.grad``.  With fp8 GEMMs the report (inf/NaN or fp8
    saturation) has ``fp8``, their saturation table of this run.
    """
    run = TwinRun(converted, inputs, tap_edges=backward)
    grad_mode = torch.enable_grad() if backward else torch.no_grad()
    gemms = _fp8_nodes(converted)
    if not gemms:
        with grad_mode, preserved_buffers(converted):
            return _search(converted, run, target, backward, loss_fn, loss_scale)
    with grad_mode, preserved_buffers(converted), fp8_diagnosis(converted) as read:
        report = _search(converted, run, target, backward, loss_fn, loss_scale)
        table = read()
    if report is None:
        report = _first_saturation(converted, gemms, table, backward)
    if report is not None:
        report.fp8 = table
    return report


def _fp8_nodes(converted: fx.GraphModule) -> list[tuple[fx.Node, str]]:
    """(node, its state's name) of every fp8 GEMM, in graph order."""
    found = []
    for node in converted.graph.nodes:
        if node.op == "call_function" and node.target in (fp8_linear, fp8_matmul) and len(node.args) > 3:
            state = node.args[3]
            if isinstance(state, fx.Node) and state.op == "get_attr":
                found.append((node, str(state.target).rsplit(".", 1)[-1]))
    return found


def _first_saturation(converted: fx.GraphModule, gemms: list, table: Fp8Report, backward: bool) -> Optional[OverflowReport]:
    """The first fp8 GEMM that clamped anything: forward operands in graph order, then grad_output walking back."""
    conversion = getattr(converted, "amp_report", None)
    stats = conversion.passes.get("fp8_gemms", {}) if conversion is not None else {}
    ops = {g["node"]: g["op"] for g in stats.get("gemms", [])}  # the op a policy names (linear, matmul, addmm)
    order = [("forward", node, name, role) for node, name in gemms for role in ROLES[:2]]
    if backward:
        order += [("backward", node, name, ROLES[2]) for node, name in reversed(gemms)]
    for phase, node, name, role in order:
        row = table.gemms.get(name, {}).get(role)
        if row and row["calls"] and row["saturated"] > 0:
            spec = node.args[2]
            dtype = spec.grad_dtype if role == ROLES[2] else E4M3
            return saturation_at(phase, node, role, row, dtype, table, ops.get(node.name))
    return None


def _search(converted: fx.GraphModule, run: TwinRun, target: Any, backward: bool,
            loss_fn: Optional[Callable[..., torch.Tensor]], loss_scale: float) -> Optional[OverflowReport]:
    """The inf/NaN search: forward node by node, the loss, then the backward edge by edge."""
    for node, low, twin in run.steps():
        if node.op in CALL_OPS and overflowed(low, twin):
            return report_at("forward", node, low, twin)
    low_out, twin_out = run.outputs
    losses = None
    if target is not None or backward:
        fn = loss_fn or default_loss
        with no_outer_autocast():
            losses = (fn(low_out, target), fn(twin_out, target))
        if overflowed(losses[0], losses[1]):
            loss_node = next(n for n in converted.graph.nodes if n.op == "output")
            report = report_at("forward", loss_node, losses[0], losses[1])
            report.op, report.node = "loss", "loss"
            return report
    if not backward:
        return None
    return _find_backward(run, losses, loss_scale)


def _find_backward(run: TwinRun, losses: tuple, loss_scale: float) -> Optional[OverflowReport]:
    grads = []
    for runner, loss in zip((run.low, run.twin), losses):
        tensors = [edge[-1] for edge in runner.edges]
        if not tensors or not loss.requires_grad:
            return None
        grads.append(torch.autograd.grad(loss * loss_scale, tensors, allow_unused=True))
    twin = {(n, i): g for (n, i, _, _), g in zip(run.twin.edges, grads[1])}
    position = {node: i for i, node in enumerate(run.gm.graph.nodes)}
    edges = sorted(zip(run.low.edges, grads[0]), key=lambda e: -position[e[0][0]])
    # Walk back from the loss: the first broken edge is where the overflow began.
    for (node, index, source, _), low in edges:
        other = twin.get((node, index))
        if low is not None and other is not None and overflowed(low, other):
            return report_at("backward", node, low, other, gradient_of=source, loss_scale=loss_scale)
    return None


# -- the loss scaler's entry point ----------------------------------------------
@dataclass
class ReproStep:
    """What reproduces one training step: the converted module, its inputs, and optionally the loss."""

    module: fx.GraphModule
    inputs: tuple
    target: Any = None
    loss_fn: Optional[Callable[..., torch.Tensor]] = None


def diagnose_collapse(reproduce: Callable[[], Union[ReproStep, tuple]], *, loss_scale: float = 1.0) -> Optional[OverflowReport]:
    """Reproduce a step whose gradients overflow at the minimum loss scale and say which node broke.

    ``reproduce()`` returns a :class:`ReproStep` or a tuple ``(module, inputs[, target[, loss_fn]])``;
    the forward is checked first, then the backward of ``loss * loss_scale``.
    """
    step = reproduce()
    if not isinstance(step, ReproStep):
        if not isinstance(step, tuple) or not 2 <= len(step) <= 4:
            raise AmpTypeError("reproduce() must return amp_fx.inspection.find_overflow.ReproStep or (module, inputs[, target[, loss_fn]])")
        step = ReproStep(*step)
    inputs = step.inputs if isinstance(step.inputs, (tuple, list)) else (step.inputs,)
    if not math.isfinite(loss_scale) or loss_scale <= 0:
        raise AmpValueError(f"loss_scale must be a positive finite number, got {loss_scale!r}")
    return find_overflow(step.module, *inputs, target=step.target, loss_fn=step.loss_fn, backward=True, loss_scale=loss_scale)
