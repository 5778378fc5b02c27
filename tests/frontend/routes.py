"""Run one model through each conversion route, the way a user would, for the front-end tests.

Routes: ``symbolic`` (convert, no example inputs), ``symbolic+examples``,
``export`` (convert with example inputs of a model fx cannot trace, so
torch.export traces it) and ``backend`` (torch.compile with amp_fx and
aot_eager).  Each returns a callable and a way to read its report.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn

import amp_fx
from probes import GEMM_OPS, OpRecorder, aot_capture

ROUTES = ("symbolic", "symbolic+examples", "export", "backend")
CONVERT_ROUTES = ROUTES[:3]


class Untraceable(nn.Module):
    """Wraps a model behind a branch on a traced size: fx cannot trace it, torch.export can."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> Any:
        if x.shape[0] > 0:  # fx: a Proxy used as a bool; export: a static size
            return self.inner(x)
        return self.inner(x + 1)


@dataclass
class Converted:
    """What a route made: the callable, its report(s), and the model it runs."""

    fn: Callable[..., Any]
    model: nn.Module
    route: str
    backend: Any = None
    forward_graphs: list = field(default_factory=list)  # backend: the ATen forward graphs AOTAutograd made

    def gemm_dtypes(self, *args: Any) -> list[set]:
        """Run once; the set of input float dtypes of each GEMM that ran, in order."""
        self.fn(*args)
        if self.backend is not None:  # Dynamo does not run compiled code under a dispatch mode: read the graph
            out = []
            for graph in self.forward_graphs:
                for node in graph.graph.nodes:
                    packet = getattr(node.target, "overloadpacket", None)
                    if packet is not None and packet.__name__ in GEMM_OPS:
                        vals = [a.meta.get("val") for a in node.all_input_nodes]
                        out.append({v.dtype for v in vals if isinstance(v, torch.Tensor) and v.is_floating_point()})
            return out
        with OpRecorder() as rec:
            self.fn(*args)
        return [set(dtypes) for name, dtypes in rec.calls if name in GEMM_OPS]

    def report(self) -> Any:
        """The conversion report (for the backend, the report of the first Dynamo graph)."""
        if self.backend is not None:
            return self.backend.report[0]
        return self.fn.amp_report

    def records(self, op: str, module_suffix: str = "") -> list:
        """Report records of original nodes with canonical op ``op`` in a module whose path ends with the suffix."""
        return [r for r in self.report().nodes
                if r.op == op and not r.inserted and (r.module or "").endswith(module_suffix)]


def convert(model: nn.Module, route: str, example: torch.Tensor, *, level: str = "O1", dtype: torch.dtype = torch.bfloat16) -> Converted:
    """Convert ``model`` by ``route``; ``example`` is the input used where the route takes examples."""
    if route == "symbolic":
        gm = amp_fx.convert(model, level, dtype=dtype)
        assert gm.amp_report.route == "symbolic_trace"
        return Converted(gm, model, route)
    if route == "symbolic+examples":
        gm = amp_fx.convert(model, level, dtype=dtype, example_inputs=(example,))
        assert gm.amp_report.route == "symbolic_trace"
        return Converted(gm, model, route)
    if route == "export":
        wrapped = Untraceable(model)
        gm = amp_fx.convert(wrapped, level, dtype=dtype, example_inputs=(example,))
        assert gm.amp_report.route == "torch.export"
        return Converted(gm, wrapped, route)
    if route == "backend":
        assert level in ("O0", "O1"), "the backend converts graphs, not parameters: O0/O1 only"
        torch._dynamo.reset()
        inner, forward_graphs, _ = aot_capture()
        be = amp_fx.backend(level=level, dtype=dtype, inner=inner)
        compiled = torch.compile(model, backend=be)
        return Converted(compiled, model, route, backend=be, forward_graphs=forward_graphs)
    raise ValueError(route)


def eager_autocast(model: nn.Module, *args: Any, dtype: torch.dtype = torch.bfloat16) -> Any:
    """The reference: the model run eagerly under torch.autocast on CPU."""
    with torch.autocast("cpu", dtype=dtype):
        return model(*args)


class RoundST(torch.autograd.Function):
    """Straight-through rounding: round forward, identity backward (the classic STE a trace must not drop)."""

    @staticmethod
    def forward(ctx, x):
        return x.round()

    @staticmethod
    def backward(ctx, grad):
        return grad
