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

:func:`diagnose_collapse` is the entry point for the loss scaler: it gets a
callable that reproduces a training step and returns the report.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.node import map_arg
from torch.utils import _pytree as pytree

from amp_fx.ir import meta
from amp_fx.ir.cast_nodes import cast_target, is_inserted_cast
from amp_fx.graph_ops.outer_autocast import no_outer_autocast
from amp_fx.errors import AmpTypeError, AmpValueError, checks_keywords

__all__ = ["find_overflow", "diagnose_collapse", "OverflowReport", "ReproStep", "TwinRun", "pin_override", "pin_targets", "plain_containers", "LOW_DTYPES"]

LOW_DTYPES = (torch.float16, torch.bfloat16)
_CALLS = ("call_function", "call_method", "call_module")


# -- small value helpers --------------------------------------------------------
def float_tensors(value: Any) -> list[torch.Tensor]:
    """The floating tensors inside ``value`` (tensors, tuples, lists, dicts)."""
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def nonfinite_count(value: Any) -> int:
    """How many inf/NaN elements ``value`` holds."""
    return sum(int((~torch.isfinite(t)).sum()) for t in float_tensors(value))


def max_abs(value: Any) -> float:
    """Largest finite magnitude inside ``value`` (0.0 when there is none)."""
    best = 0.0
    for t in float_tensors(value):
        finite = t.detach()[torch.isfinite(t.detach())]
        if finite.numel():
            best = max(best, float(finite.abs().max()))
    return best


def value_dtype(value: Any) -> Optional[torch.dtype]:
    """The dtype of the first floating tensor in ``value``."""
    tensors = float_tensors(value)
    return tensors[0].dtype if tensors else None


def plain_containers(value: Any) -> Any:
    """fx's immutable dicts and lists as plain ones (``functional_call`` mutates its parameter dict)."""
    if isinstance(value, dict):
        return {k: plain_containers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_containers(v) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(plain_containers(v) for v in value)
    return value


def _writes_inplace(node: fx.Node) -> bool:
    target = str(node.target)
    return bool(meta.INPLACE.get(node)) or node.kwargs.get("inplace") is True or (
        node.op == "call_method" and target.endswith("_") and not target.endswith("__"))


def _rng_state() -> tuple:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


@contextlib.contextmanager
def _preserved_buffers(gm: nn.Module) -> Iterator[None]:
    """Restore every buffer afterwards: two runs must not update batch-norm statistics twice."""
    saved = [(b, b.detach().clone()) for b in gm.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


# -- the two interpreters -------------------------------------------------------
class _Runner(fx.Interpreter):
    """Runs the converted graph node by node; optionally taps every input edge for its gradient."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm, garbage_collect_values=False)
        # (consumer, position, input name, tapped tensor) when gradients are wanted.
        self.edges: Optional[list[tuple[fx.Node, int, str, torch.Tensor]]] = None

    def start(self, inputs: Sequence[Any], tap_edges: bool) -> None:
        self.env = {}
        self.args_iter = iter(inputs)
        self.edges = [] if tap_edges else None

    def fetch_args_kwargs_from_env(self, n: fx.Node) -> tuple[tuple, dict]:
        tap = self.edges is not None and (n.op in _CALLS or n.op == "output") and not _writes_inplace(n)
        position = [0]

        def load(arg: fx.Node) -> Any:
            value = self.env[arg]
            if tap and isinstance(value, torch.Tensor) and value.requires_grad:
                # A distinct autograd node per (consumer, input): its gradient is
                # exactly what this consumer's backward sent to this input.
                value = value.view_as(value)
                self.edges.append((n, position[0], arg.name, value))
                position[0] += 1
            return value

        return plain_containers(map_arg(n.args, load)), plain_containers(map_arg(n.kwargs, load))


class _TwinRunner(_Runner):
    """The fp32 twin: inserted casts to a low dtype cast to fp32; low parameters are read as fp32."""

    def __init__(self, gm: fx.GraphModule, masters: Optional[dict[str, torch.Tensor]] = None):
        super().__init__(gm)
        self.masters = dict(masters or {})

    def run_node(self, n: fx.Node) -> Any:
        if n.op in _CALLS and is_inserted_cast(n) and cast_target(n) in LOW_DTYPES:
            args, _ = self.fetch_args_kwargs_from_env(n)
            value = args[0]
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                return value.to(torch.float32)
            return value
        return super().run_node(n)

    def get_attr(self, target: Any, args: tuple, kwargs: dict) -> Any:
        if target in self.masters:
            return self.masters[target]
        value = super().get_attr(target, args, kwargs)
        if isinstance(value, torch.Tensor) and value.dtype in LOW_DTYPES:
            return value.float()
        return value

    def call_module(self, target: Any, args: tuple, kwargs: dict) -> Any:
        module = self.fetch_attr(target)
        replaced = {}
        for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
            full = f"{target}.{name}"
            if full in self.masters:
                replaced[name] = self.masters[full]
            elif tensor.dtype in LOW_DTYPES:
                replaced[name] = tensor.float()
        if not replaced:
            return super().call_module(target, args, kwargs)
        return torch.func.functional_call(module, replaced, args, kwargs)


class TwinRun:
    """Run a converted graph and its fp32 twin in lock step; ``steps()`` yields (node, low, twin)."""

    def __init__(self, gm: fx.GraphModule, inputs: Sequence[Any], *, tap_edges: bool = False):
        _require_converted(gm)
        self.gm = gm
        self.low = _Runner(gm)
        self.twin = _TwinRunner(gm, getattr(gm, "amp_fx_masters", None))
        twin_inputs = [x.float() if isinstance(x, torch.Tensor) and x.dtype in LOW_DTYPES else x for x in inputs]
        self.low.start(list(inputs), tap_edges)
        self.twin.start(twin_inputs, tap_edges)
        self.outputs: Optional[tuple[Any, Any]] = None

    def step(self, node: fx.Node) -> tuple[Any, Any]:
        """Run one node in both graphs with the same random state; return (low, twin) values."""
        state = _rng_state()
        low = self.low.run_node(node)
        _set_rng_state(state)
        twin = self.twin.run_node(node)
        self.low.env[node], self.twin.env[node] = low, twin
        return low, twin

    def steps(self) -> Iterator[tuple[fx.Node, Any, Any]]:
        """Yield every node with its low and twin values, in graph order."""
        with no_outer_autocast():
            for node in self.gm.graph.nodes:
                low, twin = self.step(node)
                if node.op == "output":
                    self.outputs = (low, twin)
                yield node, low, twin


def _require_converted(gm: Any) -> None:
    if not isinstance(gm, fx.GraphModule) or not any(meta.DECISION.on(n) for n in gm.graph.nodes):
        raise AmpTypeError(
            f"expected the module amp_fx.convert returned (a GraphModule with amp_fx annotations), got {type(gm).__name__}. "
            "Convert the model first: converted = amp_fx.convert(model, 'O1', dtype=torch.float16)."
        )


# -- the report -----------------------------------------------------------------
def pin_override(node: fx.Node) -> dict[str, str]:
    """The policy entry that pins ``node`` to fp32: its innermost module, else its op."""
    module = meta.MODULE_PATH.get(node) or ""
    if module:
        return {f"module:{module}": "fp32"}
    op = meta.OP.get(node) or str(node.target)
    return {f"op:{op}": "fp32"}


def pin_targets(node: fx.Node) -> list[fx.Node]:
    """The nodes to pin when ``node`` overflowed: a cast's consumers (they asked for low), else the node."""
    if is_inserted_cast(node):
        users = [u for u in node.users if u.op in _CALLS and not meta.INSERTED.get(u)]
        return users or [node]
    return [node]


@dataclass
class OverflowReport:
    """Where precision broke: the node, its module and source line, how big the value was, and the fix."""

    phase: str  # "forward" or "backward"
    node: str
    op: Optional[str]
    module: str
    source: Optional[str]
    decision: str
    dtype: Optional[str]
    max_abs: float  # the largest |value| the fp32 twin computed there
    dtype_max: Optional[float]  # the largest finite value of ``dtype``
    nonfinite: int  # inf/NaN elements in the low-precision value
    override: dict[str, str] = field(default_factory=dict)
    pin_nodes: list[str] = field(default_factory=list)
    gradient_of: Optional[str] = None  # backward: the input whose gradient broke
    # backward: the largest power-of-two loss scale under which this gradient fits ``dtype``.
    safe_loss_scale: Optional[float] = None

    def __str__(self) -> str:
        what = "output" if self.phase == "forward" else f"backward (gradient of its input {self.gradient_of!r})"
        lines = [
            f"{self.phase} overflow at node {self.node!r} (op {self.op}, module {self.module or '<root>'!r}, decision {self.decision})",
            f"  its {what} holds {self.nonfinite} inf/NaN in {self.dtype}; the fp32 twin's is finite with max |x| = {self.max_abs:.4g}"
            + (f" ({self.dtype} max is {self.dtype_max:.4g})" if self.dtype_max else ""),
        ]
        if self.source:
            lines.append(f"  source: {self.source}")
        if self.override:
            lines.append(f"  pin it with policy={self.override!r}" + (f" (pins {', '.join(self.pin_nodes)})" if self.pin_nodes else ""))
        else:
            lines.append("  no policy can pin it: lower the loss scale or cast the model outputs to fp32")
        if self.safe_loss_scale is not None:
            lines.append(f"  a loss scale of {self.safe_loss_scale:g} or less keeps this gradient in range "
                         f"(a gradient is stored in its value's dtype, so pinning only moves an overflow this large upstream)")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        from dataclasses import asdict

        return asdict(self)


def _report(phase: str, node: fx.Node, low: Any, twin: Any, gradient_of: Optional[str] = None,
            loss_scale: Optional[float] = None) -> OverflowReport:
    dtype = value_dtype(low)
    targets = pin_targets(node) if node.op != "output" else []
    override: dict[str, str] = {}
    for target in targets:
        override.update(pin_override(target))
    biggest, safe = max_abs(twin), None
    if loss_scale is not None and dtype is not None and biggest > 0:
        safe = 2.0 ** math.floor(math.log2(loss_scale * float(torch.finfo(dtype).max) / biggest))
    return OverflowReport(
        phase=phase, node=node.name, op=meta.OP.get(node) or (str(node.target) if node.op != "output" else "output"),
        module=meta.MODULE_PATH.get(node) or "", source=meta.SOURCE.get(node),
        decision=meta.DECISION.get(node, "none"), dtype=str(dtype).replace("torch.", "") if dtype else None,
        max_abs=biggest, dtype_max=float(torch.finfo(dtype).max) if dtype else None,
        nonfinite=nonfinite_count(low), override=override, pin_nodes=[t.name for t in targets], gradient_of=gradient_of,
        safe_loss_scale=safe,
    )


def _broke(low: Any, twin: Any) -> bool:
    return nonfinite_count(low) > 0 and nonfinite_count(twin) == 0


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

    The module's buffers (batch-norm statistics) are restored afterwards, and
    no ``.grad`` is written: gradients are taken with ``torch.autograd.grad``.
    """
    run = TwinRun(converted, inputs, tap_edges=backward)
    grad_mode = torch.enable_grad() if backward else torch.no_grad()
    with grad_mode, _preserved_buffers(converted):
        for node, low, twin in run.steps():
            if node.op in _CALLS and _broke(low, twin):
                return _report("forward", node, low, twin)
        low_out, twin_out = run.outputs
        losses = None
        if target is not None or backward:
            fn = loss_fn or default_loss
            with no_outer_autocast():
                losses = (fn(low_out, target), fn(twin_out, target))
            if _broke(losses[0], losses[1]):
                loss_node = next(n for n in converted.graph.nodes if n.op == "output")
                report = _report("forward", loss_node, losses[0], losses[1])
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
        if low is not None and other is not None and _broke(low, other):
            return _report("backward", node, low, other, gradient_of=source, loss_scale=loss_scale)
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
