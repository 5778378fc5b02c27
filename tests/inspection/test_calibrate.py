"""calibrate pins exactly the node that low precision cannot hold, with the measurement as its reason, and nothing on clean models."""

import pytest
import torch

import amp_fx
import zoo
from planted_models import IllConditioned, PlantedAttention

FP16 = torch.float16


def _decisions(gm):
    return {n.name: n.meta.get("amp_fx.decision") for n in gm.graph.nodes if not n.meta.get("amp_fx.inserted")}


def test_planted_overflow_is_pinned_and_nothing_else():
    model = PlantedAttention()
    batches = [torch.randn(2, 4, 16) for _ in range(2)]
    plain = amp_fx.convert(model, "O1", dtype=FP16, example_inputs=(batches[0],))
    assert not torch.isfinite(plain(batches[0])).all()
    calibrated = amp_fx.calibrate(model, batches, "O1", dtype=FP16)
    result = calibrated.amp_calibration
    assert result.moved == ["matmul"] and result.policy == {"module:logits": "fp32"}
    changed = {name for name, d in _decisions(calibrated).items() if _decisions(plain)[name] != d}
    assert changed == {"matmul"}
    with torch.no_grad():
        for batch in batches:
            torch.testing.assert_close(calibrated(batch).float(), model(batch), atol=2e-2, rtol=2e-2)
        measured = max(model.fp32_logits(b).abs().max().item() for b in batches)
    (finding,) = result.findings
    assert (finding.kind, finding.module) == ("range", "logits")
    assert finding.value == pytest.approx(measured, rel=1e-6) and finding.threshold == 0.25 * 65504
    record = calibrated.amp_report.node("matmul")
    assert (record.decision, record.rule) == ("fp32", "calibration")
    assert f"max |x| {measured:.4g}" in record.reason and "module:logits" in record.reason
    # The policy it found reproduces the result with a plain convert.
    again = amp_fx.convert(model, "O1", dtype=FP16, example_inputs=(batches[0],), policy=result.policy)
    assert _decisions(again) == _decisions(calibrated)


@pytest.mark.parametrize("name", ["mlp", "cnn", "sdpa"])
def test_clean_models_get_nothing_pinned(name):
    model, example, _ = zoo.build(name)
    batches = [example, zoo.CORE_MODELS[name][0].example()]
    for dtype in (FP16, torch.bfloat16):
        calibrated = amp_fx.calibrate(model, batches, "O1", dtype=dtype)
        assert calibrated.amp_calibration.moved == []
        assert _decisions(calibrated) == _decisions(amp_fx.convert(model, "O1", dtype=dtype, example_inputs=example))
        assert "0 node(s) moved" in calibrated.amp_report.notes[-1]


def test_ill_conditioned_gemm_is_pinned_by_its_error_with_the_value_it_reads():
    model, x = IllConditioned(), torch.randn(8, 16)
    plain = amp_fx.convert(model, "O1", dtype=torch.bfloat16, example_inputs=(x,))
    calibrated = amp_fx.calibrate(model, [x], "O1", dtype=torch.bfloat16)
    findings = {f.node: f for f in calibrated.amp_calibration.findings}
    assert set(findings) == {"linear_1", "add"}  # fc's GEMM, and the add whose bf16 result it reads
    assert findings["linear_1"].kind == "error" and findings["linear_1"].module == "fc"
    assert findings["linear_1"].value > 10 * findings["linear_1"].threshold  # far above the bar
    assert "relative error" in calibrated.amp_report.node("linear_1").reason
    with torch.no_grad():
        reference = model(x)
        plain_error = (plain(x).float() - reference).abs().max()
        calibrated_error = (calibrated(x).float() - reference).abs().max()
    assert calibrated_error < plain_error / 20


def test_calibrate_leaves_the_model_alone_and_checks_its_arguments():
    model, example, _ = zoo.build("cnn")
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calibrated = amp_fx.calibrate(model, [example], "O1", dtype=torch.bfloat16)
    assert model.training and calibrated.training and all(m.training for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="at least one batch"):
        amp_fx.calibrate(model, [], "O1")
    with pytest.raises(ValueError, match="range_fraction"):
        amp_fx.calibrate(model, [example], "O1", range_fraction=2.0)
