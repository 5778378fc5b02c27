"""What a person reads about fp8: the graph's op names, the report, summary(), and saturation counts.

Rules under test: the rewritten graph calls ``fp8_linear`` / ``fp8_matmul`` by
name (print_readable shows them); every fp8 GEMM is in the report with its
recipe and why, and in ``summary()`` with its FLOP share; after a forward and
backward ``fp8_report`` gives each operand's scale, and with ``track_fp8`` the
fraction saturated at the format's max and flushed to zero.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import amp_fx
from amp_fx.graph_ops.fp8_ops import E4M3, amax_to_scale, fp8_linear


def _converted(**fp8):
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    return model, amp_fx.convert(model, "O1", example_inputs=(torch.randn(4, 32),),
                                 fp8={"size_rule": "all", **fp8})


def test_graph_calls_named_fp8_ops_and_drops_the_weight_casts():
    _, gm = _converted()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(fp8_linear) == 2
    assert "fp8_linear" in gm.code and "Fp8Spec('tensorwise'" in gm.code
    # the weights are quantized from fp32: no bf16 cast of a weight is left (the biases' casts are)
    weight_casts = [r for r in gm.amp_report.casts if "weight" in r.reason and "bias" not in r.reason]
    assert weight_casts == []
    assert gm.amp_report.weight_casts == 2  # the two bias casts


def test_report_and_summary_name_every_fp8_gemm():
    _, gm = _converted(recipe="rowwise")
    report = gm.amp_report
    assert report.count("fp8") == 2
    for record in (r for r in report.nodes if r.decision == "fp8"):
        assert record.op == "fp8_linear" and record.reason.startswith("fp8 rowwise")
    lines = report.passes["fp8_gemms"]["report_lines"]
    assert sum("-> fp8 rowwise" in line for line in lines) == 2 and "100.0% of GEMM FLOPs" in lines[-1]
    assert report.to_json()  # JSON-ready with the fp8 stats
    summary = amp_fx.summary(gm)
    assert summary.fp8_gemms == 2 and summary.fp8_flop_share == 1.0
    assert "fp8 GEMMs: 2 of 2, 100.0% of GEMM FLOPs" in str(summary)


def test_scales_after_a_forward_are_torchaos():
    """The recorded input and weight scales are finfo.max / amax of what was quantized."""
    model, gm = _converted()
    x = torch.randn(4, 32)
    gm(x).sum().backward()
    rows = amp_fx.fp8_report(gm).gemms["0"]
    assert rows["input"]["scale"] == amax_to_scale(x.abs().max(), E4M3).item()
    assert rows["weight"]["scale"] == amax_to_scale(model[0].weight.detach().abs().max(), E4M3).item()
    assert rows["grad_output"]["scale"] > 0


def test_saturation_and_flushes_are_counted():
    """Delayed scaling's stale scale saturates a 100x larger input; tiny values flush to zero; counts per call."""
    _, gm = _converted(recipe="delayed")
    assert amp_fx.track_fp8(gm) == 2
    gm(torch.randn(4, 32)).sum().backward()
    assert amp_fx.fp8_report(gm).saturated() == {}
    x = torch.randn(4, 32) * 100
    x[0, :8] = 1e-12  # far below e4m3's smallest subnormal at this scale
    gm(x).sum().backward()
    report = amp_fx.fp8_report(gm)
    row = report.gemms["0"]["input"]
    assert row["saturated"] > 0.5 and row["saturated_steps"] == 1
    assert row["flushed"] == pytest.approx(8 / x.numel())
    assert "0" in report.saturated() and "input" in str(report)


def test_untracked_gemms_count_nothing():
    _, gm = _converted(recipe="delayed")
    gm(torch.randn(4, 32) * 100).sum().backward()
    gm(torch.randn(4, 32) * 1e4).sum().backward()
    assert all(row["saturated"] == 0 and not row["tracked"] for rows in amp_fx.fp8_report(gm).gemms.values()
               for row in rows.values())


def test_backend_route_matches_convert_and_refuses_delayed():
    """torch.compile(backend=amp_fx.backend(fp8=...)) makes the same fp8 GEMMs; delayed scaling there is refused."""
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)).bfloat16()
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    backend = amp_fx.backend(level="O1", inner="aot_eager", fp8={"size_rule": "all"})
    y = torch.compile(model, backend=backend)(x)
    assert sum(graph.report.count("fp8") for graph in backend.report.graphs) == 2
    gm = amp_fx.convert(model, "O1", example_inputs=(x,), fp8={"size_rule": "all"})
    assert torch.equal(y, gm(x))
    torch._dynamo.reset()
    refused = torch.compile(nn.Linear(32, 32), backend=amp_fx.backend(level="O1", inner="aot_eager",
                                                                      fp8={"recipe": "delayed", "size_rule": "all"}))
    with pytest.raises(Exception, match="delayed"):
        refused(torch.randn(4, 32))


def test_one_shot_diagnosis_restores_state_and_grads():
    """fp8_report(gm, x): counts from one step on x, and the module's history, scales and gradients as they were."""
    model, gm = _converted(recipe="delayed")
    gm(torch.randn(4, 32)).sum().backward()
    state_before = {k: v.clone() for k, v in gm.state_dict().items()}
    grad_before = model[0].weight.grad.clone()
    report = amp_fx.fp8_report(gm, torch.randn(4, 32) * 100)
    assert report.gemms["0"]["input"]["saturated"] > 0.5  # the stale scale saturated the large input
    assert all(torch.equal(v, state_before[k]) for k, v in gm.state_dict().items())
    assert torch.equal(model[0].weight.grad, grad_before)
    assert not any(s.track for s in amp_fx.fp8_states(gm).values())
