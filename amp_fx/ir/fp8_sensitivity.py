"""Measured fp8 sensitivity: each GEMM operand's quantization error under each recipe, on real (example) values.

``operand_errors(x, w_t)`` quantizes a GEMM's activation ``x`` (M x K) and
weight ``w_t`` (K x N) exactly as each recipe's three GEMMs quantize them
(:mod:`amp_fx.graph_ops.fp8_ops`), dequantizes, and measures the error of
each quantization as the **mean over rows of the row's relative error**
``|deq(q(t))_r - t_r| / |t_r|`` (2-norms; rows: x's tokens, W's output
channels).  A per-row mean, not one norm over the whole tensor, so that a few
outlier rows cannot hide the rows a tensorwise scale rounds to zero.

Per recipe, the quantizations measured:

- ``tensorwise``: x and W with one e4m3 scale each;
- ``rowwise``: x per token (forward) and per column (grad_weight), W per
  output channel (forward) and per input channel (grad_input), power-of-two scales;
- ``rowwise_with_gw_hp``: x per token, W per output channel and tensorwise
  (power of two, grad_input); grad_weight is not quantized.

grad_output is not measured: a forward calibration has none.  A recipe's
sensitivity is its largest operand error.  :class:`Fp8Sensitivity` folds
several calls of one GEMM (the max).  :func:`capture_sensitivity` runs a
graph on example inputs and measures the GEMMs it is asked about.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from amp_fx.graph_ops.fp8_scaling import E4M3, amax_of, amax_to_scale, quantize

__all__ = ["operand_errors", "Fp8Sensitivity", "capture_sensitivity", "MEASURED"]

MEASURED = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


@torch.no_grad()
def _row_error(t: torch.Tensor, dim: Optional[int], power_of_two: bool, norm_dim: int) -> float:
    """Mean relative error of ``t`` quantized to e4m3 (scaled along ``dim``; None: tensorwise), per row of ``norm_dim``."""
    t = t.float()
    scale = amax_to_scale(amax_of(t, dim), E4M3, power_of_two)
    dequantized = quantize(t, scale, E4M3).float() / scale
    norms = torch.linalg.vector_norm(t, dim=norm_dim)
    errors = torch.linalg.vector_norm(dequantized - t, dim=norm_dim)
    rows = norms > 0
    return float((errors[rows] / norms[rows]).mean()) if bool(rows.any()) else 0.0


@torch.no_grad()
def operand_errors(x: torch.Tensor, w_t: torch.Tensor) -> dict[str, dict[str, float]]:
    """``{recipe: {"input": error, "weight": error}}`` for a GEMM ``x @ w_t`` (x: ... x K, w_t: K x N)."""
    x = x.reshape(-1, x.shape[-1])
    if x.shape[0] == 0:
        return {recipe: {"input": 0.0, "weight": 0.0} for recipe in MEASURED}
    # x's rows are tokens (norms over K: dim 1); w_t's are output channels (its columns: norms over K, dim 0).
    x_tensor, x_row, x_col = (_row_error(x, d, p, 1) for d, p in ((None, False), (-1, True), (0, True)))
    w_tensor, w_row, w_col = (_row_error(w_t, d, p, 0) for d, p in ((None, False), (0, True), (-1, True)))
    w_tensor_p2 = _row_error(w_t, None, True, 0)
    return {
        "tensorwise": {"input": x_tensor, "weight": w_tensor},
        "rowwise": {"input": max(x_row, x_col), "weight": max(w_row, w_col)},
        "rowwise_with_gw_hp": {"input": x_row, "weight": max(w_row, w_tensor_p2)},
    }


@dataclass
class Fp8Sensitivity:
    """One GEMM's measured operand errors per recipe (the max over its calls) and the rows it was measured on."""

    errors: dict[str, dict[str, float]] = field(default_factory=dict)
    rows: int = 0
    calls: int = 0

    def add(self, measured: dict[str, dict[str, float]], rows: int) -> None:
        for recipe, operands in measured.items():
            mine = self.errors.setdefault(recipe, {})
            for operand, value in operands.items():
                mine[operand] = max(mine.get(operand, 0.0), value)
        self.rows = max(self.rows, rows)
        self.calls += 1

    def of(self, recipe: str) -> float:
        """The recipe's sensitivity: its largest operand error."""
        return max(self.errors[recipe].values())


class _Capture(fx.Interpreter):
    """Runs the graph, measuring each asked GEMM's operands (``targets``: node -> (activation, weight, transpose))."""

    def __init__(self, gm: fx.GraphModule, targets: dict[fx.Node, tuple[Any, Any, bool]]):
        super().__init__(gm, garbage_collect_values=False)  # an operand's source dies at its cast, before the GEMM
        self.targets = targets
        self.found: dict[str, Fp8Sensitivity] = {}

    def run_node(self, node: fx.Node) -> Any:
        if node in self.targets:
            act, weight, transpose = self.targets[node]
            x, w = self.env.get(act), self.env.get(weight)
            if isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and w.dim() == 2 and x.dim() >= 1:
                w_t = w.t() if transpose else w
                self.found.setdefault(node.name, Fp8Sensitivity()).add(operand_errors(x, w_t),
                                                                       x.numel() // max(x.shape[-1], 1))
        return super().run_node(node)


def capture_sensitivity(gm: fx.GraphModule, targets: dict[fx.Node, tuple[Any, Any, bool]], args: list,
                        prepare: Optional[Callable[[], Any]] = None) -> dict[str, Fp8Sensitivity]:
    """Run ``gm``'s graph on ``args`` (one value per placeholder) without gradients; each target's measurements by name.

    ``targets`` maps a GEMM node to (its activation node, its weight node, whether the weight is N x K).
    The measurement reads values only: nothing in the module changes (``prepare``: a context, e.g. eval mode).
    """
    capture = _Capture(gm, targets)
    with torch.no_grad(), (prepare() if prepare is not None else _null()):
        capture.run(*args, enable_io_processing=False)
    return capture.found


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None
