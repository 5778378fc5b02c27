"""Bodies of higher-order ops under backend="amp_fx": checkpointed regions and nested compile regions (issue 12, point 2)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import amp_fx
from probes import Capture, aot_capture


class Block(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class Checkpointed(nn.Module):
    """A low GEMM in front (its bf16 output enters the region), two checkpointed blocks, a head."""

    def __init__(self):
        super().__init__()
        self.stem, self.blocks, self.head = nn.Linear(32, 32), nn.ModuleList([Block(), Block()]), nn.Linear(32, 8)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.head(x)


def _hops(gm, name):
    return [n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.HigherOrderOperator)
            and n.target.name() == name]


def _gemm_dtypes(graphs):
    """(count, set of input dtypes) of the mm/addmm nodes in AOTAutograd's ATen graphs."""
    dtypes, count = set(), 0
    for gm in graphs:
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
                count += 1
                dtypes.update(a.meta["val"].dtype for a in node.args if isinstance(a, torch.fx.Node))
    return count, dtypes


def _grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_checkpointed_bodies_run_low_and_stay_checkpointed():
    """Every GEMM inside checkpoint() runs bf16, the regions stay checkpointed, output and gradients match autocast."""
    torch.manual_seed(0)
    model = Checkpointed()
    reference = copy.deepcopy(model)
    capture = Capture()
    x = torch.randn(4, 32)
    out = torch.compile(model, backend=amp_fx.backend(dtype=torch.bfloat16, inner=capture, cast_model_outputs=False))(x)
    (graph,) = capture.graphs
    assert len(_hops(graph, "tag_activation_checkpoint")) == 2  # checkpointing kept: still one node per region
    report = amp_fx.last_report()
    assert report.totals()["region_bodies"] == 2
    gemms = [(r.name, r.decision) for r in report.nodes if r.op == "linear"]
    assert len(gemms) == 6 and all(decision == "low" for _, decision in gemms), gemms
    norms = [r.decision for r in report.nodes if r.op == "layer_norm"]
    assert norms == ["fp32", "fp32"]
    assert any("kept whole" in r.reason for r in report[0].nodes if r.op == "tag_activation_checkpoint")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = reference(x)
    torch.testing.assert_close(out, expected, atol=1e-2, rtol=1e-2)
    out.float().square().sum().backward()
    expected.float().square().sum().backward()
    ours, theirs = _grads(model), _grads(reference)
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], atol=3e-2, rtol=3e-2, msg=name)


def test_checkpointed_gemms_run_in_bf16_in_the_aten_graphs():
    """AOTAutograd's forward and backward graphs (recomputation included) hold only bf16 GEMMs."""
    torch.manual_seed(0)
    inner, forward, backward = aot_capture()
    compiled = torch.compile(Checkpointed(), backend=amp_fx.backend(dtype=torch.bfloat16, inner=inner))
    compiled(torch.randn(4, 32, requires_grad=True)).float().sum().backward()
    count, dtypes = _gemm_dtypes(forward + backward)
    assert count >= 6 * 3 and dtypes == {torch.bfloat16}, (count, dtypes)  # forward, backward and recomputed GEMMs


class Shared(nn.Module):
    """One nested compile region called for two layers: invoke_subgraph with one shared body."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for layer in self.layers:
            x = _region(layer, x)
        return x


@torch.compiler.nested_compile_region
def _region(layer, x):
    return layer(x)


def test_nested_compile_region_body_is_converted():
    """invoke_subgraph bodies are converted once; the shared body names no single layer's weights."""
    torch.manual_seed(0)
    model = Shared()
    reference = copy.deepcopy(model)
    capture = Capture()
    x = torch.randn(4, 32)
    # Dynamo inlines a region body that only one call site uses; keep them as invoke_subgraph here.
    with torch._dynamo.config.patch(inline_single_use_invoke_subgraph=False):
        out = torch.compile(model, backend=amp_fx.backend(dtype=torch.bfloat16, inner=capture, cast_model_outputs=False))(x)
    (graph,) = capture.graphs
    assert len(_hops(graph, "invoke_subgraph")) == 2
    report = amp_fx.last_report()
    bodies = report.totals()["region_bodies"]
    assert bodies >= 1
    linears = [r.decision for r in report.nodes if r.op == "linear"]
    assert linears == ["low"] * (2 * bodies), linears
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = reference(x)
    torch.testing.assert_close(out.float(), expected.float(), atol=1e-2, rtol=1e-2)


def _gpt2(checkpointing):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32, bos_token_id=0, eos_token_id=0,
        use_cache=False, attn_implementation="sdpa", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    return model


@pytest.mark.slow
def test_hf_gpt2_with_gradient_checkpointing_runs_its_gemms_low():
    """GPT-2 with gradient_checkpointing_enable(): as many low GEMMs as without it, every mm/addmm dispatched bf16."""
    ids = torch.randint(0, 128, (2, 16))
    counts = {}
    for checkpointing in (False, True):
        model = _gpt2(checkpointing)
        reference = copy.deepcopy(model)
        be = amp_fx.backend(dtype=torch.bfloat16, inner="aot_eager")
        compiled = torch.compile(model, backend=be)
        out = compiled(input_ids=ids, labels=ids)
        counts[checkpointing] = sum(1 for r in be.report.nodes if r.op in ("addmm", "mm", "linear") and r.decision == "low")
        expected = reference(input_ids=ids, labels=ids)
        torch.testing.assert_close(out.loss, expected.loss, atol=2e-2, rtol=1e-2)
        out.loss.backward()
        expected.loss.backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=2e-2, rtol=5e-2, msg=name)
        torch._dynamo.reset()
    assert counts[True] == counts[False] == 9, counts  # 4 per block x 2 + the LM head
    inner, forward, backward = aot_capture()
    torch.compile(_gpt2(True), backend=amp_fx.backend(dtype=torch.bfloat16, inner=inner))(input_ids=ids, labels=ids).loss.backward()
    count, dtypes = _gemm_dtypes(forward + backward)
    assert count >= 9 * 3 and dtypes == {torch.bfloat16}, (count, dtypes)
