"""The benchmark script runs end to end on tiny sizes and prints one table row per mode, with numbers that add up."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCHMARKS)

import benchmark  # noqa: E402
from bench_measure import BYTE_KINDS, ByteCounter, CastCounter, RoundTimer  # noqa: E402
from bench_modes import MODES  # noqa: E402


def test_quick_run_prints_every_mode_with_sane_figures(capsys):
    """--quick on the MLP: every mode trains, is timed against its baseline, and the casts are counted."""
    threads = torch.get_num_threads()
    results = benchmark.main(["--quick", "--model", "mlp", "--rounds", "2", "--repeats", "1", "--warmup", "1", "--profile-rounds", "1",
                              "--depths", "1,2", "--cast-diff"])
    assert torch.get_num_threads() == threads  # main() restores the caller's thread count
    out = capsys.readouterr().out
    rows = results["mlp"]["rows"]
    assert list(rows) == list(MODES)
    for mode, row in rows.items():
        assert f"| {mode} " in out
        assert row["ms"] > 0 and row["peak_bytes"] > 0
        assert math.isfinite(row["loss"]) and row["skipped"] == 0, mode
    # Each baseline is its own reference: its ratio is exactly 1 in every round.
    assert rows["torch.autocast"]["ratio"] == rows["compile+autocast"]["ratio"] == 1.0
    # fp32 casts nothing; O3 casts only at graph entry/exit, far fewer than autocast's per-op casts.
    assert rows["fp32"]["casts"] == 0
    assert 0 < rows["amp_fx O3"]["casts"] <= rows["amp_fx O2"]["casts"] < rows["torch.autocast"]["casts"]
    assert "convert() time vs depth" in out and "torch.export route" in out
    # Bytes moved by non-GEMM kernels: counted for the eager modes only (compiled kernels never reach the dispatcher).
    for mode, (group, _) in MODES.items():
        assert ("moved" in rows[mode]) == (group == "eager"), mode
    assert all(rows[m]["moved"]["optimizer"] > 0 for m in MODES if "moved" in rows[m])
    assert rows["fp32"]["moved"]["cast"] == 0 < rows["torch.autocast"]["moved"]["cast"]
    # --cast-diff: every eager amp_fx mode's kernels against autocast's; on a plain MLP O1 casts what autocast casts,
    # one for one (same dtypes and shapes), and O2 casts fewer.
    amp_modes = [m for m, (group, _) in MODES.items() if group == "eager" and m.startswith("amp_fx")]
    assert len(amp_modes) == 3
    for mode in amp_modes:
        assert f"kernels of one step, {mode} vs torch.autocast" in out
    o1_extra, o1_missing = benchmark.kernel_diff(rows["amp_fx O1"]["kernels"], rows["torch.autocast"]["kernels"])
    assert not [k for k in (*o1_extra, *o1_missing) if k.startswith("cast ")], (o1_extra, o1_missing)
    o2_extra, o2_missing = benchmark.kernel_diff(rows["amp_fx O2"]["kernels"], rows["torch.autocast"]["kernels"])
    assert any(k.startswith("cast float32->bfloat16") for k in o2_missing)


def test_kernel_log_names_casts_by_dtype_change_and_shape_and_the_diff_counts_the_difference():
    """A cast is keyed by its dtype change and shape, a same-dtype copy apart from it, another kernel by op and dtypes;
    views count nothing; the diff gives what one side runs more often than the other, in both directions."""
    x = torch.randn(4, 3)
    with benchmark.KernelLog() as ours:
        low = x.to(torch.bfloat16)
        low.float()
        x.t().unsqueeze(0)  # views: nothing
        torch.ops.aten._to_copy.default(x, dtype=torch.float32)  # a copy that changes no dtype
        x + 1
    with benchmark.KernelLog() as theirs:
        x.to(torch.bfloat16)
        x.to(torch.bfloat16)
    assert dict(ours.kernels) == {"cast float32->bfloat16 (4, 3)": 1, "cast bfloat16->float32 (4, 3)": 1,
                                  "cast float32 copy (4, 3)": 1, "add (float32)": 1}
    extra, missing = benchmark.kernel_diff(ours.kernels, theirs.kernels)
    assert extra == {"add (float32)": 1, "cast bfloat16->float32 (4, 3)": 1, "cast float32 copy (4, 3)": 1}
    assert missing == {"cast float32->bfloat16 (4, 3)": 1}


def test_targets_are_issue_41s():
    """Each model gets issue 41's limits: O1 0.90 (MLP) / 0.95, O2 0.80 / 0.85, compiled 0.95, the MLP's GEMM floor
    1.7x, peaks O1 <= autocast's and O2 <= 0.8x autocast's."""
    def row(ratio, peak=100.0, share=0.7):
        return {"ratio": ratio, "peak_bytes": peak, "gemm_share": share}

    rows = {"torch.autocast": row(1.0), "amp_fx O1": row(0.91), "amp_fx O2": row(0.79, peak=79.0, share=0.5),
            "compile+autocast": row(1.0), 'compile(backend="amp_fx")': row(0.96)}
    mlp = {label: met for label, met, _ in benchmark.check_targets({"name": "mlp", "rows": rows})}
    assert mlp == {"amp_fx O1 <= 0.9x torch.autocast": False, "amp_fx O2 <= 0.8x torch.autocast": True,
                   'compile(backend="amp_fx") <= 0.95x compile+autocast': False,
                   "torch.autocast step <= 1.7x its GEMMs": True, "amp_fx O1 step <= 1.7x its GEMMs": True,
                   "amp_fx O2 step <= 1.7x its GEMMs": False,
                   "amp_fx O1 peak <= 1.001x torch.autocast's": True, "amp_fx O2 peak <= 0.8x torch.autocast's": True}
    gpt = {label: met for label, met, _ in benchmark.check_targets({"name": "gpt", "rows": rows})}
    assert gpt["amp_fx O1 <= 0.95x torch.autocast"] and gpt["amp_fx O2 <= 0.85x torch.autocast"]
    assert not any("GEMMs" in label for label in gpt)


def test_time_targets_name_their_gemm_floor():
    """A time target's figures give the mode's GEMM floor (its GEMMs over the baseline's step) and say when the
    target lies below it: then no saving outside the GEMMs can meet it on that machine."""
    rows = {"torch.autocast": {"ratio": 1.0, "peak_bytes": 1.0, "gemm_share": 0.88, "gemm_floor": 0.88},
            "amp_fx O2": {"ratio": 0.97, "peak_bytes": 1.0, "gemm_share": 0.9, "gemm_floor": 0.87},
            "amp_fx O1": {"ratio": 1.0, "peak_bytes": 1.0, "gemm_share": 0.88, "gemm_floor": 0.88}}
    figures = {label: text for label, _, text in benchmark.check_targets({"name": "transformer", "rows": rows})}
    assert figures["amp_fx O2 <= 0.85x torch.autocast"] == "0.97; below its GEMM floor 0.87"
    assert figures["amp_fx O1 <= 0.95x torch.autocast"] == "1.00; GEMM floor 0.88"


def test_cast_counter_counts_only_dtype_changes():
    """_to_copy to another dtype and copy_ across dtypes count; same-dtype copies and other ops do not."""
    x = torch.randn(4, 3)
    with CastCounter() as counter:
        y = x.to(torch.bfloat16)  # 1
        x.clone().to(torch.float32)  # same dtype: no kernel at all
        torch.empty(4, 3).copy_(y)  # 2: bf16 -> fp32 copy
        torch.empty(4, 3).copy_(x)  # same dtype
        (x + 1).sum()
    assert counter.count == 2
    assert counter.bytes == 4 * 3 * 2 + 4 * 3 * 4


def test_byte_counter_counts_reads_and_writes_of_non_gemm_kernels():
    """A cast reads its source and writes its result; in-place ops read and write their target; copy_ only writes it;
    a fused optimizer writes what it updates, not the gradients; GEMMs and views count nothing."""
    x, w = torch.randn(8, 4), torch.randn(4, 4)
    dst = torch.empty(8, 4, dtype=torch.bfloat16)
    params, grads, bufs = [torch.randn(16)], [torch.randn(16)], [torch.zeros(16)]
    with ByteCounter() as moved:
        x.to(torch.bfloat16)  # cast: 128 read + 64 written
        dst.copy_(x)  # cast: 128 read + 64 written (dst not read)
        x.mm(w)  # GEMM: nothing
        x.t().view(4, 8)  # views: nothing
        x.mul_(2.0)  # elementwise: 128 read + 128 written
        torch._fused_sgd_(params, grads, bufs, weight_decay=0.0, momentum=0.9, lr=0.1, dampening=0.0,
                          nesterov=False, maximize=False, is_first_step=False)  # 3 x 64 read + 2 x 64 written
    assert set(moved.by_kind) == set(BYTE_KINDS)
    assert moved.by_kind == {"cast": 2 * (128 + 64), "optimizer": 5 * 64, "norm": 0, "elementwise": 256}
    assert moved.total == sum(moved.by_kind.values())


def test_cpu_clock_times_this_process_only():
    """--clock cpu: a step that sleeps (another job holding the core, as far as this process sees) costs ~0 CPU time."""
    import time

    steps = {"sleep": lambda: time.sleep(0.02), "work": lambda: torch.randn(256, 256).mm(torch.randn(256, 256))}
    timer = RoundTimer(steps, clock="cpu")
    timer.run(rounds=2, repeats=1)
    assert timer.stats["sleep"].median < 0.01
    wall = RoundTimer({"sleep": steps["sleep"]})
    wall.run(rounds=1, repeats=1)
    assert wall.stats["sleep"].median >= 0.02
    with pytest.raises(ValueError, match="clock must be one of"):
        RoundTimer(steps, clock="gpu")
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--clock", "cpu", "--threads", "2"])


def test_one_pass_o2_prototype_steps_like_master_weight_optimizer():
    """The lever-2 prototype (bench_o2_step --one-pass) updates masters and bf16 parameters as O2's SGD does."""
    import bench_o2_step

    torch.manual_seed(0)
    base = bench_o2_step.make_mlp(32, 2)
    data = (torch.randn(4, 32), torch.randn(4, 32))
    o2 = bench_o2_step.build_modes(base, data, "sgd", sgd_impl="fused")["O2"]
    one_pass = bench_o2_step.OnePassO2(base, {"lr": 1e-2, "momentum": 0.9}, data, backend="aot_eager")
    for group in o2.opt.param_groups:
        group["lr"] = 1e-2
    for _ in range(3):
        o2.step()
        one_pass.step()
    masters = list(o2.opt.master_parameters())
    assert len(masters) == len(one_pass.masters) == 8
    for ours, theirs in zip(one_pass.masters, masters):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)  # fp32 update: only fused-FMA rounding apart
    for ours, theirs in zip(one_pass.lows, o2.module.parameters()):
        assert ours.dtype == theirs.dtype
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=8e-3, atol=1e-6)  # one bf16 rounding apart


def test_fused_sgd_option_builds_fused_optimizers():
    """--sgd fused gives every side SGD(fused=True) (O2: the optimizer it wraps); a bad kind is refused up front."""
    from bench_models import build_case
    from bench_modes import build_trainer

    case = build_case("mlp", preset="quick")
    for mode in ("torch.autocast", "amp_fx O1", "amp_fx O2"):
        trainer = build_trainer(mode, case.model, case.inputs, "cpu", torch.bfloat16, "aot_eager", "fused")
        inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        assert inner.param_groups[0]["fused"] is True, mode
    with pytest.raises(ValueError, match="sgd must be one of"):
        build_trainer("fp32", case.model, case.inputs, "cpu", torch.bfloat16, "aot_eager", "loop")


@pytest.mark.parametrize("mode", ["amp_fx O1", "amp_fx O2"])
def test_amp_fx_modes_match_fp32_loss(mode):
    """The modes train the same model: amp_fx's first loss is the fp32 model's within bf16 rounding."""
    from bench_models import build_case
    from bench_modes import build_trainer

    case = build_case("gpt", preset="quick")
    losses = {}
    for name in ("fp32", mode):
        trainer = build_trainer(name, case.model, case.inputs, "cpu", torch.bfloat16, "aot_eager")
        trainer.zero()
        losses[name] = float(trainer.work().detach())
    assert losses[mode] == pytest.approx(losses["fp32"], rel=2e-2)


def test_parameter_casts_sit_just_before_their_first_reader():
    """In an export-route graph (parameters at the top) each weight cast is moved down to its first reader.

    A cast left at the top casts its gradient back last in backward, keeping every
    low-precision weight gradient alive to the end (measured under inductor).
    """
    import amp_fx
    from amp_fx.ir.cast_nodes import cast_source, is_inserted_cast
    from bench_models import Encoder, ExportOnly

    torch.manual_seed(0)
    model = ExportOnly(Encoder(16, 2, 2))
    inputs = (torch.randn(2, 4, 16), torch.randint(0, 10, (2,)))
    gm = amp_fx.convert(model, "O1", example_inputs=inputs)
    assert gm.amp_report.route == "torch.export"
    weight_casts = [n for n in gm.graph.nodes if is_inserted_cast(n) and cast_source(n).op in ("get_attr", "placeholder")]
    assert len(weight_casts) >= 12  # qkv, proj, fc1, fc2 weight and bias per block
    for cast in weight_casts:
        node = cast.next
        while is_inserted_cast(node):  # casts sunk to the same reader stack up before it
            node = node.next
        assert node is min(cast.users), f"{cast.name} is not just before its first reader"
    torch.testing.assert_close(gm(*inputs), model(*inputs), rtol=2e-2, atol=2e-2)


def test_inference_and_fused_tables(capsys):
    """--inference-only --fused on tiny sizes: O1 casts no parameter after warm-up, autocast casts them all;
    the GroupNorm CNN fuses its norms and counts fewer casts than with fuse_precision=False."""
    results = benchmark.main(["--quick", "--model", "mlp", "--inference-only", "--fused", "--inference-batches", "1",
                              "--rounds", "1", "--repeats", "1", "--warmup", "1"])
    out = capsys.readouterr().out
    assert "mkldnn bf16 supported" in out and "inference, eval() + no_grad" in out
    rows = results["inference mlp batch 1"]["rows"]
    assert rows["amp_fx O1"]["param_casts"] == 0
    assert rows["torch.autocast"]["param_casts"] == rows["amp_fx O1 no cache"]["param_casts"] > 0
    fused = results["fused"]["rows"]
    assert fused["amp_fx O1"]["fused"] > 0 and fused["amp_fx O1"]["casts"] < fused["amp_fx O1 fuse_precision=False"]["casts"]
    assert all(row["ms"] > 0 for row in (*rows.values(), *fused.values()))
