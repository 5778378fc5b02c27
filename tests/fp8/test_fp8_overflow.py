"""find_overflow reports fp8 saturation: per fp8 GEMM, the values clamped at the format's max and flushed to zero.

Rule under test: on a module with fp8 GEMMs, ``amp_fx.find_overflow`` counts,
in its own forward (and backward), what each quantization clamped and
flushed -- the counts ``fp8_report`` gives -- reports the first GEMM that
clamped (delayed scaling quantizing a planted large activation with a stale
scale), carries every GEMM's row in ``report.fp8``, adds its step to the
delayed ``saturated_steps``, and puts the fp8 state back.  A model whose GEMMs
clamp nothing (current scaling, or delayed within range) reports None.
Each count is checked against plain torch: the scale by TE's formula from
the warm-up step's amax, then ``|x * scale| > 448`` and ``q(x) == 0 & x != 0``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import amp_fx

E4M3, E4M3_MAX = torch.float8_e4m3fn, 448.0


class Planted(nn.Module):
    """fc1 reads ``x * gain`` (the plant: raise ``gain`` after a step), fc2 reads ``x``."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 32), nn.Linear(32, 32)
        self.register_buffer("gain", torch.ones(()))

    def forward(self, x):
        return self.fc1(x * self.gain) + self.fc2(x)


def _setup(recipe="delayed", **options):
    torch.manual_seed(0)
    model = Planted()
    x = torch.randn(8, 32)
    x[0, :4] = 1e-6  # far below e4m3's smallest subnormal (2**-9) at these scales: flushed to zero
    fp8 = {"recipe": recipe, "size_rule": "all", **({"margin": 1} if recipe == "delayed" else {}), **options}
    gm = amp_fx.convert(model, "O1", example_inputs=(x,), fp8=fp8)
    return model, gm, x


def _counts(tensor, scale):
    """(saturated fraction, flushed fraction) of quantizing ``tensor`` with ``scale``, in plain torch."""
    scaled = tensor.float() * scale
    quantized = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).float()
    n = tensor.numel()
    # beyond the max by more than the float32 scale's rounding (fp8_ops._record: current scaling maps amax to the max)
    return (scaled.abs() > E4M3_MAX * (1 + 2.0 ** -22)).sum().item() / n, ((quantized == 0) & (tensor != 0)).sum().item() / n


def test_stale_delayed_scale_on_a_planted_activation_is_reported():
    model, gm, x = _setup()
    gm(2 * x).sum().backward()  # the warm-up step: the history holds amax(2x)
    model.gain.fill_(16.0)  # the plant: fc1's input is now 8x what its scale was made for
    before = {k: v.clone() for k, v in gm.state_dict().items()}
    report = amp_fx.find_overflow(gm, x, backward=True)
    assert report is not None and report.kind == "fp8 saturation"
    assert (report.phase, report.module, report.op, report.operand) == ("forward", "fc1", "fp8_linear", "input")
    assert report.dtype == "float8_e4m3fn" and report.dtype_max == E4M3_MAX and report.nonfinite == 0
    assert report.override == {"module:fc1": "low"} and "saturation" in str(report)
    # plain torch: delayed scale from the warm-up amax, margin 1: (448 / amax) / 2, in float32
    scale = (E4M3_MAX / (2 * x).abs().max()) / 2.0
    w_scales = [(E4M3_MAX / m.weight.detach().abs().max()) / 2.0 for m in (model.fc1, model.fc2)]
    expected = {"fc1": {"input": _counts(16 * x, scale), "weight": _counts(model.fc1.weight.detach(), w_scales[0])},
                "fc2": {"input": _counts(x, scale), "weight": _counts(model.fc2.weight.detach(), w_scales[1])}}
    assert expected["fc1"]["input"][0] > 0.3 and expected["fc2"]["input"][0] == 0  # the plant planted
    for gemm, rows in expected.items():
        for role, (saturated, flushed) in rows.items():
            row = report.fp8.gemms[gemm][role]
            assert row["saturated"] == pytest.approx(saturated, rel=1e-6, abs=0), (gemm, role)
            assert row["flushed"] == pytest.approx(flushed, rel=1e-6, abs=0), (gemm, role)
            assert row["calls"] == 1
        # grad_output: the sum's gradient, ones in bf16, against a scale made for ones: nothing clamps
        assert report.fp8.gemms[gemm]["grad_output"]["saturated"] == 0 and report.fp8.gemms[gemm]["grad_output"]["calls"] == 1
    assert report.fp8.gemms["fc2"]["input"]["flushed"] == pytest.approx(4 / x.numel())
    assert report.fp8.gemms["fc1"]["input"]["scale"] == scale.item()  # the stale scale it quantized with
    assert report.fp8.gemms["fc1"]["input"]["next_scale"] == ((E4M3_MAX / (16 * x).abs().max()) / 2.0).item()
    assert report.saturated == report.fp8.gemms["fc1"]["input"]["saturated"]
    assert report.max_abs == (16 * x).abs().max().item()
    # the diagnosis changed nothing: history, scales, tracking
    assert all(torch.equal(v, before[k]) for k, v in gm.state_dict().items())
    assert not any(s.track for s in amp_fx.fp8_states(gm).values())
    # the policy it suggests keeps fc1 bf16: nothing clamps any more
    pinned = amp_fx.convert(model, "O1", example_inputs=(x,), fp8={"recipe": "delayed", "size_rule": "all", "margin": 1},
                            policy=report.override)
    model.gain.fill_(1.0)
    pinned(2 * x).sum().backward()
    model.gain.fill_(16.0)
    assert amp_fx.find_overflow(pinned, x, backward=True) is None


def test_saturated_steps_count_training_and_the_diagnosis():
    """track_fp8 during training counts the steps that clamped; find_overflow's row adds its own, then restores."""
    model, gm, x = _setup(history_len=1, amax_compute="most_recent")
    amp_fx.track_fp8(gm)
    gains = [1.0, 16.0, 1.0, 16.0, 1.0]
    for gain in gains:
        model.gain.fill_(gain)
        gm(x).sum().backward()
    # plain count: a step clamps fc1's input when its gain outgrew the previous step's (margin 1: 2x headroom)
    clamped = sum(1 for before, now in zip(gains, gains[1:]) if now > 2 * before)
    (state,) = [s for name, s in amp_fx.fp8_states(gm).items() if name == "fc1"]
    assert int(state.saturated_steps[0]) == clamped == 2
    model.gain.fill_(16.0)
    report = amp_fx.find_overflow(gm, x)
    assert report.fp8.gemms["fc1"]["input"]["saturated_steps"] == clamped + 1
    assert report.fp8.gemms["fc2"]["input"]["saturated_steps"] == 0
    assert report.fp8.gemms["fc1"]["grad_output"]["calls"] == 0 and "(not run)" in str(report.fp8)  # forward only
    assert int(state.saturated_steps[0]) == clamped and state.track  # put back


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_current_scaling_never_clamps(recipe):
    """The same plant under current scaling: every scale fits its tensor, find_overflow reports None, counts 0."""
    model, gm, x = _setup(recipe)
    gm(2 * x).sum().backward()
    model.gain.fill_(16.0)
    assert amp_fx.find_overflow(gm, x, backward=True) is None
    table = amp_fx.fp8_report(gm, x)  # the same counts, one source: all rows measured, none clamped
    for rows in table.gemms.values():
        for row in rows.values():
            assert row["calls"] == 1 and row["saturated"] == 0


def test_delayed_within_range_reports_none():
    model, gm, x = _setup()
    gm(2 * x).sum().backward()
    assert amp_fx.find_overflow(gm, x, backward=True) is None  # gain 1: x within the range made for 2x


def test_twin_of_an_fp8_gemm_is_fp32():
    """The fp32 twin runs an fp8 GEMM as an fp32 GEMM: a forward overflow report elsewhere still sees fp32 values."""
    model, gm, x = _setup()
    from amp_fx.inspection.twin_run import TwinRun

    run = TwinRun(gm, (x,))
    values = {node.name: (low, twin) for node, low, twin in run.steps()}
    (name,) = [n.name for n in gm.graph.nodes if n.target is amp_fx.graph_ops.fp8_ops.fp8_linear][:1] or [None]
    low, twin = values[name]
    assert low.dtype == torch.bfloat16 and twin.dtype == torch.float32
    torch.testing.assert_close(twin, torch.nn.functional.linear(x * model.gain, model.fc1.weight), rtol=0, atol=0)


def test_an_inf_overflow_report_carries_the_fp8_table():
    """fp16 with an fp8 GEMM before an activation-activation matmul that overflows: the inf/NaN report comes first,
    and its fp8 table says the GEMM it passed clamped nothing (0, as plain torch counts with torchao's scale)."""

    class Logits(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(32, 32)

        def forward(self, x):
            h = self.fc1(x)
            return h @ h.transpose(-2, -1)

    torch.manual_seed(0)
    model, x = Logits(), torch.randn(8, 32) * 60
    gm = amp_fx.convert(model, "O1", dtype=torch.float16, example_inputs=(x,), fp8={"size_rule": "all"})
    report = amp_fx.find_overflow(gm, x)
    assert (report.kind, report.op, report.dtype) == ("overflow", "matmul", "float16") and report.nonfinite > 0
    rows = report.fp8.gemms["fc1"]
    # torchao's tensorwise scale: finfo.max / amax in float64, then float32
    scale = lambda t: torch.tensor(E4M3_MAX / t.abs().max().double().item(), dtype=torch.float32)  # noqa: E731
    assert (rows["input"]["saturated"], rows["input"]["flushed"]) == _counts(x, scale(x)) == (0.0, 0.0)
    assert rows["weight"]["saturated"] == _counts(model.fc1.weight.detach(), scale(model.fc1.weight.detach()))[0] == 0
    assert rows["input"]["scale"] == scale(x).item()
    assert rows["grad_output"]["calls"] == 0  # forward only: no backward ran
    assert "fp8 GEMMs" in str(report)
