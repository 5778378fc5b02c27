"""What the amp_fx backend hands its inner compiler: aten ops an inductor can fuse, GEMMs as autocast's.

The fused LayerNorm (``layer_norm_fp32_stats``, a custom autograd Function)
is no barrier for the inner compiler: AOTAutograd traces it into aten ops,
forward and backward.  And the GEMMs the inner compiler gets are autocast's,
one for one, in the same dtypes.  (Inductor itself is too slow to compile
here; ``benchmarks/compile_step_time.py --kernels`` compares its kernels.)
"""

from __future__ import annotations

import collections
import copy
import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_fx
from amp_fx.graph_ops.fused_norms import layer_norm_fp32_stats
from probes import aot_capture

_GEMMS = ("mm", "addmm", "bmm")


class LinearGeluNorm(nn.Module):
    """Two (Linear -> GELU -> LayerNorm) layers and a head: the MLP of issue 41's table, small."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(2))
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(2))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        for layer, norm in zip(self.layers, self.norms):
            x = norm(F.gelu(layer(x)))
        return F.cross_entropy(self.head(x), labels)


def _inputs():
    return torch.randn(8, 32), torch.randint(0, 10, (8,))


def _calls(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def _gemm_signature(gm):
    """(op, input dtypes) of every GEMM in an ATen graph, sorted: what the inner compiler must run as GEMMs."""
    found = []
    for node in _calls(gm):
        name = getattr(node.target, "_opname", None)
        if name in _GEMMS:
            dtypes = tuple(str(a.meta["val"].dtype) for a in node.args if isinstance(a, torch.fx.Node))
            found.append((name, dtypes))
    return sorted(found)


def _amp_fx_graphs(model, inputs):
    """The graphs Dynamo handed the backend, and the forward and backward ATen graphs its inner compiler got."""
    inner, fw, bw = aot_capture()
    dynamo_graphs = []

    def recording(gm, example_inputs):
        dynamo_graphs.append(gm)
        return inner(gm, example_inputs)

    compiled = torch.compile(model, backend=amp_fx.backend(level="O1", dtype=torch.bfloat16, inner=recording))
    compiled(*inputs).backward()
    return dynamo_graphs, fw, bw


@pytest.fixture(scope="module")
def case():
    """The model, its batch, and what one amp_fx training step handed the inner compiler (compiled once per module)."""
    torch.manual_seed(0)
    model, inputs = LinearGeluNorm(), _inputs()
    return model, inputs, _amp_fx_graphs(copy.deepcopy(model), inputs)


def test_the_fused_layer_norm_reaches_the_inner_compiler_as_aten_ops(case):
    """Rule: AOTAutograd traces layer_norm_fp32_stats into aten ops, forward and backward: nothing opaque remains."""
    _, _, (dynamo_graphs, fw, bw) = case
    assert len(dynamo_graphs) == len(fw) == len(bw) == 1
    fused = [n for n in _calls(dynamo_graphs[0]) if n.target is layer_norm_fp32_stats]
    assert len(fused) == 2  # both norms are fused (the premise of this test)
    for graph in (fw[0], bw[0]):
        calls = _calls(graph)
        opaque = [n.target for n in calls if not isinstance(n.target, torch._ops.OpOverload) and n.target is not operator.getitem]
        assert calls and not opaque
    forward_ops = collections.Counter(getattr(n.target, "_opname", None) for n in _calls(fw[0]))
    backward_ops = collections.Counter(getattr(n.target, "_opname", None) for n in _calls(bw[0]))
    assert forward_ops["native_layer_norm"] == 2
    assert backward_ops["native_layer_norm_backward"] >= 2


def test_the_inner_compiler_gets_autocasts_gemms_in_autocasts_dtypes(case):
    """Rule: forward and backward, the GEMMs handed to the inner compiler are compiled autocast's, dtypes included."""
    model, inputs, (_, fw, bw) = case
    inner, fw_ref, bw_ref = aot_capture()
    reference = torch.compile(copy.deepcopy(model), backend=inner)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = reference(*inputs)
    loss.backward()
    assert len(fw) == len(bw) == len(fw_ref) == len(bw_ref) == 1
    forward, backward = _gemm_signature(fw[0]), _gemm_signature(bw[0])
    assert len(forward) == 3 and len(backward) == 5  # 3 Linears: 3 forward GEMMs, 2 + 3 backward (no input grad for x)
    assert all(dtypes == ("torch.bfloat16",) * len(dtypes) for _, dtypes in forward + backward)
    assert forward == _gemm_signature(fw_ref[0])
    assert backward == _gemm_signature(bw_ref[0])
