"""torch.compile of a converted module: amp_fx's autograd Functions trace into one graph, no break at them.

Dynamo breaks the graph at an ``autograd.Function`` that defines ``jvp``; the fused layer_norm
(``layer_norm_fp32_stats``) and the shared cast read (``shared_cast_read``) each define one for eager
forward-mode AD. Under Dynamo a subclass with torch's default jvp runs instead, so
``torch.compile(amp_fx.convert(model))`` is one graph an inner compiler can fuse, not one graph per norm or per
shared cast with eager code between them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import amp_fx


class _Block(nn.Module):
    """q, k, v read the block's input (fp32 in the first block: one cast shared by three readers at O1), and
    Linear -> GELU -> LayerNorm (fused at O1 and O2: a low input, read low) scales the result."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.up, self.norm = nn.Linear(width, width), nn.LayerNorm(width)
        self.q, self.k, self.v = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        return (q * k).softmax(-1) * v * self.up(self.norm(torch.nn.functional.gelu(self.up(x))))


def _converted(level: str) -> torch.fx.GraphModule:
    torch.manual_seed(0)
    return amp_fx.convert(nn.Sequential(_Block(), _Block()), level, dtype=torch.bfloat16)


@pytest.mark.parametrize("level, functions", [("O1", ("layer_norm_fp32_stats", "shared_cast_read")),
                                              ("O2", ("layer_norm_fp32_stats",))])
def test_a_converted_module_compiles_to_one_graph(level, functions):
    """Every GEMM of the model reaches the inner compiler in one graph (the module's own call checks before the
    graph may run eagerly: they hold no tensor op)."""
    gm = _converted(level)
    for name in functions:  # the Functions under test are in the graph
        assert name in gm.code, (name, gm.code)
    graphs: list[torch.fx.GraphModule] = []

    def backend(graph: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(graph)
        return graph.forward

    torch._dynamo.reset()
    torch.compile(gm, backend=backend)(torch.randn(4, 16))
    gemms = [[n for n in g.graph.nodes if n.target is torch._C._nn.linear] for g in graphs]
    assert [len(found) for found in gemms if found] == [10]  # up twice, q, k and v, in each of the two blocks
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_compiled_forward_and_gradients_equal_eager(level):
    """aot_eager runs the same aten kernels as eager: output and every gradient bit for bit."""
    gm = _converted(level)
    torch._dynamo.reset()
    compiled = torch.compile(gm, backend="aot_eager")
    x = torch.randn(4, 16)
    results = []
    for run in (gm, compiled):
        for p in gm.parameters():
            p.grad = None
        xi = x.clone().requires_grad_()
        out = run(xi)
        out.float().square().sum().backward()
        results.append((out, xi.grad, [p.grad for p in gm.parameters()]))
    (out_e, dx_e, grads_e), (out_c, dx_c, grads_c) = results
    assert out_c.dtype == out_e.dtype
    assert torch.equal(out_c, out_e) and torch.equal(dx_c, dx_e)
    assert len(grads_e) == len(list(gm.parameters())) == 20
    for ge, gc in zip(grads_e, grads_c):
        assert ge is not None and torch.equal(ge, gc)


def test_eager_forward_mode_ad_is_unchanged():
    """Outside Dynamo the Functions keep their jvp: the shared cast read's tangent, the fused norm's refusal."""
    gm = _converted("O1")
    x = torch.randn(4, 16)
    with pytest.raises(amp_fx.AmpError, match="fuse_precision=False"):
        torch.func.jvp(gm, (x,), (torch.ones_like(x),))
    unfused = amp_fx.convert(nn.Sequential(_Block(), _Block()), "O1", dtype=torch.bfloat16, fuse_precision=False)
    assert "shared_cast_read" in unfused.code
    _, tangent = torch.func.jvp(unfused, (x,), (torch.ones_like(x),))
    assert tangent.shape == (4, 16) and torch.isfinite(tangent.float()).all()
