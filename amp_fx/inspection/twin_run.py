"""Run a converted graph and its fp32 twin node by node, recording both values of every node.

The graph as converted runs in one :class:`torch.fx.Interpreter`; the fp32
*twin* -- the same graph with every cast amp_fx inserted to a low dtype turned
into a cast to fp32 (and low-precision parameters read as fp32) -- runs in a
second, in lock step and with the same random state.  With ``tap_edges`` every
input edge of every node is tapped (a ``view_as`` whose gradient autograd
returns), so a backward can be compared edge by edge too.  The overflow finder
and calibration both read these recordings.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.node import map_arg

from amp_fx.ir import meta
from amp_fx.ir.cast_nodes import cast_target, is_inserted_cast
from amp_fx.graph_ops.fp8_ops import fp8_linear, fp8_matmul
from amp_fx.graph_ops.outer_autocast import no_outer_autocast
from amp_fx.errors import AmpTypeError
from amp_fx.inspection.values import LOW_DTYPES, plain_containers

__all__ = ["TwinRun", "CALL_OPS", "preserved_buffers"]

CALL_OPS = ("call_function", "call_method", "call_module")


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
def preserved_buffers(gm: nn.Module) -> Iterator[None]:
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
        tap = self.edges is not None and (n.op in CALL_OPS or n.op == "output") and not _writes_inplace(n)
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
    """The fp32 twin: inserted casts to a low dtype cast to fp32; low parameters are read as fp32; fp8 GEMMs run in fp32."""

    def __init__(self, gm: fx.GraphModule, masters: Optional[dict[str, torch.Tensor]] = None):
        super().__init__(gm)
        self.masters = dict(masters or {})

    def run_node(self, n: fx.Node) -> Any:
        if n.op in CALL_OPS and is_inserted_cast(n) and cast_target(n) in LOW_DTYPES:
            args, _ = self.fetch_args_kwargs_from_env(n)
            value = args[0]
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                return value.to(torch.float32)
            return value
        if n.op == "call_function" and n.target in (fp8_linear, fp8_matmul):
            # An fp8 GEMM's twin is the GEMM in fp32 (and leaves the fp8 state, which the low run records, alone).
            args, _ = self.fetch_args_kwargs_from_env(n)
            x, other = args[0].float(), args[1].float()
            return torch.nn.functional.linear(x, other) if n.target is fp8_linear else torch.matmul(x, other)
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
