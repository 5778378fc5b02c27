"""export_route: a conversion through torch.export, failed or not, leaves the user's example inputs as they were.

torch.export marks the dynamic dimensions of the tensors it is given (``_dynamo_weak_dynamic_indices``...) and
leaves the marks there; a later ``torch.compile`` called with the same tensor then traced those dimensions as
symbols from its first call and captured other graphs (Longformer: 18 graphs after a failed ``convert()``, 4
without; issue 42).
"""

from __future__ import annotations

import torch
from torch import nn

import amp_fx


class _DataDependent(nn.Module):
    """Fails both whole-graph traces: symbolic_trace on the ``if``, torch.export on its data-dependent guard."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        if h.sum() > 0:
            return h * 2
        return h


def _compiled_graph_inputs(model: nn.Module, x: torch.Tensor) -> list[list[str]]:
    """The placeholders' example values of every graph the amp_fx backend compiles for one call (shapes, symbols)."""
    seen = []

    def inner(gm, example_inputs):
        seen.append([str(n.meta.get("example_value")) for n in gm.graph.nodes if n.op == "placeholder"])
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=amp_fx.backend(level="O1", inner=inner))(x).sum().backward()
    torch._dynamo.reset()
    return seen


def test_a_failed_conversion_leaves_the_inputs_and_a_later_compile_as_they_were():
    torch.manual_seed(0)
    model, x = _DataDependent(), torch.randn(4, 8)
    alone = _compiled_graph_inputs(model, torch.randn(4, 8))
    # Both whole-graph traces fail; the conversion captures from the call instead (converter/call_capture.py).
    converted = amp_fx.convert(model, "O1", dtype="bf16", example_inputs=(x,))
    assert converted.amp_report.route == "dynamo"
    assert "torch.export" in converted.amp_report.trace_failure
    assert not [k for k in vars(x) if "dynamo" in k]  # torch.export's dimension marks are gone
    after = _compiled_graph_inputs(model, x)
    assert len(after) == len(alone) >= 1
    assert after == alone  # the same graphs with the same (static) inputs: no dimension traced as a symbol
