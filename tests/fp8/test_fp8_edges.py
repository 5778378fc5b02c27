"""fp8 at its edges: GEMMs without example inputs, illegal GEMMs a policy asks for, empty batches, compiling
delayed scaling, keyword inputs, and the settings fp8 is refused or supported with.

Rules under test: K and N of ``x @ W`` / ``mm`` / ``addmm`` come from the 2-D parameter W, so no example
inputs are needed; every GEMM gets a report line saying fp8 or why not, and a GEMM a policy asks fp8 for
that cannot be fp8 says so in its row; an empty batch gives the empty result and gradients bf16 gives;
``torch.compile`` of a delayed conversion runs its fp8 GEMMs eagerly and the rest compiled, bit for bit
eager under ``aot_eager``; ``fp8_report`` takes keyword inputs; fp8 at O0 is refused; fp8 with fp16 is
torchao's fp8 on the fp16 model.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_fx
from amp_fx.errors import AmpError, AmpValueError
from amp_fx.graph_ops.fp8_ops import fp8_matmul
from fp8_models import MLP, fp8_everywhere, run, torchao_model


class MatmulParam(nn.Module):
    """``x @ self.proj``, ``torch.mm`` or ``torch.addmm`` with a (64, 48) parameter."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.proj = nn.Parameter(torch.randn(64, 48) / 8)
        self.bias = nn.Parameter(torch.randn(48))

    def forward(self, x):
        if self.how == "matmul":
            return x @ self.proj
        if self.how == "torch.matmul":
            return torch.matmul(x, self.proj)
        flat = x.reshape(-1, 64)
        return torch.mm(flat, self.proj) if self.how == "mm" else torch.addmm(self.bias, flat, self.proj)


@pytest.mark.parametrize("how", ["matmul", "torch.matmul", "mm", "addmm"])
def test_parameter_gemm_is_fp8_without_example_inputs(how):
    """K and N are the parameter's: fp8 without example inputs, the same values as with them (same kernel)."""
    model = MatmulParam(how)
    x = torch.randn(8, 64)
    blind = amp_fx.convert(model, "O1", fp8={"size_rule": "all"})
    seen = amp_fx.convert(model, "O1", fp8={"size_rule": "all"}, example_inputs=(x,))
    assert blind.amp_report.count("fp8") == 1, blind.amp_report
    (line,) = [l for l in blind.amp_report.passes["fp8_gemms"]["report_lines"] if "K=" in l]
    assert "K=64 N=48 -> fp8 tensorwise" in line and "M=?" in line
    assert any(n.target is fp8_matmul for n in blind.graph.nodes)
    grad = torch.randn(8, 48)
    for ours, theirs in zip(run(blind, x, grad), run(seen, x, grad)):
        if isinstance(ours, dict):  # (mm and matmul leave the bias unused: no gradient on either side)
            assert all((ours[k] is None and theirs[k] is None) or torch.equal(ours[k], theirs[k]) for k in ours)
            assert ours["proj"] is not None
        else:
            assert torch.equal(ours, theirs)


def test_policy_fp8_on_matmul_without_example_inputs():
    gm = amp_fx.convert(MatmulParam("matmul"), "O1", policy={"op:matmul": "fp8"})
    assert gm.amp_report.count("fp8") == 1  # policy "fp8": any size, tensorwise
    assert amp_fx.summary(gm).fp8_gemms == 1


@pytest.mark.parametrize("example", [False, True])
def test_illegal_gemm_a_policy_forces_is_reported_and_its_row_claims_no_fp8(example):
    """Linear(64, 40) under policy 'fp8': a report line saying why not, a row saying bf16, summary '0 of 2'."""
    model = nn.Sequential(nn.Linear(64, 40), nn.ReLU(), nn.Linear(40, 64))
    inputs = (torch.randn(8, 64),) if example else None
    with pytest.warns(amp_fx.Fp8NothingConvertedWarning, match="1 by legality"):
        gm = amp_fx.convert(model, "O1", policy={"module:0": "fp8"}, example_inputs=inputs)
    report = gm.amp_report
    assert report.count("fp8") == 0
    lines = report.passes["fp8_gemms"]["report_lines"]
    assert any("linear (0)" in l and "kept bfloat16" in l and "not a multiple of 16" in l for l in lines), lines
    assert any("linear_1 (2)" in l and "kept bfloat16" in l for l in lines)
    assert lines[-1].startswith("0 of 2 GEMMs fp8")
    (row,) = [r for r in report.nodes if r.name == "linear"]
    assert row.decision == "low" and "not fp8" in row.reason and "GEMMs fp8" not in row.reason
    assert "fp8_gemms: linear linear (0)" in str(report)
    assert "fp8 GEMMs: 0 of 2" in str(amp_fx.summary(gm))


def test_fp8_asked_and_nothing_legal_says_zero():
    with pytest.warns(amp_fx.Fp8NothingConvertedWarning, match="not a multiple of 16"):
        gm = amp_fx.convert(nn.Linear(64, 40), "O1", fp8=True)
    summary = amp_fx.summary(gm)
    assert summary.fp8_gemms == 0 and summary.fp8_candidates == 1 and "fp8 GEMMs: 0 of 1" in str(summary)


def test_no_fp8_asked_no_fp8_lines():
    gm = amp_fx.convert(nn.Linear(64, 64), "O1")
    assert gm.amp_report.passes["fp8_gemms"]["report_lines"] == []
    assert "fp8" not in str(amp_fx.summary(gm))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "delayed"])
def test_empty_batch_gives_the_empty_result_and_gradients(recipe):
    """0 rows: output (0, 64) in bf16's dtype, an empty input gradient, zero weight/bias gradients, state untouched."""
    model = nn.Linear(64, 64)
    gm = amp_fx.convert(model, "O1", fp8={"recipe": recipe, "size_rule": "all"})
    plain = amp_fx.convert(copy.deepcopy(model), "O1")
    state = {k: v.clone() for k, v in gm.state_dict().items()}
    results = []
    for module in (gm, plain):
        x = torch.randn(0, 64, requires_grad=True)
        out = module(x)
        out.sum().backward()
        results.append((out, x.grad, module.weight.grad, module.bias.grad))
    for ours, theirs in zip(*results):
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype and torch.equal(ours, theirs)
    assert results[0][0].shape == (0, 64)
    assert all(torch.equal(v, state[k]) for k, v in gm.state_dict().items())
    y = gm(torch.randn(4, 64))  # and the next batch runs as ever
    assert y.shape == (4, 64) and torch.isfinite(y).all()


def test_compiled_delayed_runs_its_gemms_eagerly_bit_for_bit():
    """torch.compile(convert(fp8='delayed')): losses, gradients and amax histories equal eager's (aot_eager)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
    x, y = torch.randn(8, 32), torch.randint(0, 16, (8,))
    options = {"recipe": "delayed", "size_rule": "all", "history_len": 4}
    eager = amp_fx.convert(copy.deepcopy(model), "O1", fp8=options)
    compiled_gm = amp_fx.convert(copy.deepcopy(model), "O1", fp8=options)
    compiled = torch.compile(compiled_gm, backend="aot_eager")
    for _ in range(3):
        loss = F.cross_entropy(compiled(x), y)
        loss.backward()
        ref = F.cross_entropy(eager(x), y)
        ref.backward()
        assert torch.equal(loss, ref)
    for (name, a), (_, b) in zip(compiled_gm.named_parameters(), eager.named_parameters()):
        assert torch.equal(a.grad, b.grad), name
    for (name, a), (_, b) in zip(compiled_gm.named_buffers(), eager.named_buffers()):
        assert torch.equal(a, b), name
    history = amp_fx.fp8_states(eager)["0"].amax_history
    assert (history[:, :3] > 0).all()  # three steps recorded: the comparison covers the history's updates
    torch._dynamo.reset()


def test_backend_refusal_of_delayed_names_the_route_that_works():
    torch._dynamo.reset()
    backend = amp_fx.backend(level="O1", inner="aot_eager", fp8={"recipe": "delayed", "size_rule": "all"})
    with pytest.raises(Exception, match="run eagerly") as caught:
        torch.compile(nn.Linear(32, 32), backend=backend)(torch.randn(4, 32))
    chain = [caught.value, caught.value.__cause__, caught.value.__context__]
    assert any(isinstance(e, AmpError) for e in chain)
    torch._dynamo.reset()


class KeywordModel(nn.Module):
    """A Hugging Face-like forward: keyword inputs, a dict output holding the loss."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 32)
        self.fc = nn.Linear(32, 32)

    def forward(self, input_ids=None, labels=None):
        logits = self.fc(self.embed(input_ids))
        return {"logits": logits, "loss": logits.float().pow(2).mean() if labels is not None else None}


def test_fp8_report_takes_keyword_inputs():
    ids = torch.randint(0, 16, (2, 8))
    gm = amp_fx.convert(KeywordModel(), "O1", fp8={"size_rule": "all"}, example_kwarg_inputs={"input_ids": ids})
    assert gm.amp_report.count("fp8") == 1
    report = amp_fx.fp8_report(gm, input_ids=ids, loss_fn=lambda out: out["logits"].float().sum())
    (rows,) = report.gemms.values()
    assert all(row["calls"] == 1 for row in rows.values())
    assert rows["grad_output"]["scale"] > 0
    assert all(p.grad is None for p in gm.parameters())  # the diagnosis left no gradients


def test_current_scaling_counts_no_saturation_from_the_scale_rounding():
    """A weight whose amax times its float32 scale lands 1 ulp above 448 is not 'saturated' (nothing is clamped)."""
    from amp_fx.graph_ops.fp8_ops import E4M3, amax_to_scale

    model = nn.Linear(64, 64, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.randn(64, 64, generator=torch.Generator().manual_seed(46)))
    w = model.weight.detach()
    assert (w * amax_to_scale(w.abs().max(), E4M3)).abs().max() > 448  # the case under test is there
    gm = amp_fx.convert(model, "O1", fp8={"size_rule": "all"})
    (rows,) = amp_fx.fp8_report(gm, torch.randn(8, 64)).gemms.values()
    assert rows["weight"]["calls"] == 1 and rows["weight"]["saturated"] == 0 and rows["weight"]["saturated_steps"] == 0


@pytest.mark.parametrize("fp8", [True, "delayed", {"recipe": "rowwise"}])
def test_fp8_at_o0_is_refused(fp8):
    with pytest.raises(AmpValueError, match="O0.*O1"):
        amp_fx.convert(nn.Linear(64, 64), "O0", fp8=fp8)


@pytest.mark.parametrize("recipe,emulate", [("tensorwise", False), ("tensorwise", True), ("rowwise", False)])
def test_fp16_is_torchaos_fp8_on_the_fp16_model(recipe, emulate):
    """fp8 with dtype=torch.float16 is supported: an fp16 MLP at O3 equals torchao's Float8Linear on it, bit for bit."""
    torch.manual_seed(0)
    model = MLP().half()
    x = torch.randn(2, 8, 32).half()
    grad = torch.randn(2, 8, 32)
    gm = amp_fx.convert(model, "O3", dtype=torch.float16, example_inputs=(x,), fp8=fp8_everywhere(recipe, emulate))
    assert gm.amp_report.count("fp8") == 2 and gm.amp_report.dtype in ("float16", torch.float16)
    ours, theirs = run(gm, x, grad), run(torchao_model(model, recipe, emulate), x, grad)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1]) and ours[1].dtype == torch.float16
    assert all(torch.equal(ours[2][k], theirs[2][k]) for k in ours[2])
