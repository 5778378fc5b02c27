"""Fault injection: inf/NaN in chosen gradients at chosen steps, and resuming from a checkpoint in a fresh process.

- the steps that got a fault, and only they, are skipped, per optimizer;
- the scale backs off (after ``hysteresis`` consecutive overflows) and grows
  back after ``growth_interval`` clean steps, in the exact expected sequence;
- a skipped step changes no parameter, master weight or optimizer state;
- a checkpoint (model, optimizer with masters, scaler) loaded in a fresh
  process continues bit-identically to the uninterrupted run.

Run as a script (``python test_faults.py DIR``) it is the fresh process.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "examples"))

import amp_fx  # noqa: E402
from amp_fx.apex.amp import loss_scalers  # noqa: E402
from amp_fx.runtime import LossScaler, MasterWeightOptimizer  # noqa: E402
from _common import make_batches, make_net, poison_  # noqa: E402

FP16 = torch.float16



def snapshot(gm, model, optimizer):
    """Everything a step may change: the module's params, the masters, the optimizer's state."""
    return {
        "module": {n: p.detach().clone() for n, p in gm.named_parameters()},
        "masters": {n: p.detach().clone() for n, p in model.named_parameters()},
        "optimizer": copy.deepcopy(optimizer.state_dict()),
    }


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def o2_pair(seed):
    """An O2 fp16 module with Adam over its masters (the model's fp32 parameters)."""
    model = make_net(seed)
    gm = amp_fx.convert(model, "O2", dtype=FP16)
    return model, gm, MasterWeightOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), gm)


# --------------------------------------------------------- fault patterns
def test_faults_in_one_of_two_optimizers_with_hysteresis_and_growth():
    """GradScaler style, two losses and two optimizers on one scaler (hysteresis=2, growth_interval=3)."""
    faults = {1: (0, "inf"), 2: (1, "nan"), 6: (1, "inf"), 10: (0, "nan"), 11: (0, "inf"), 12: (1, "inf")}
    # The scale after each step's update, worked by hand from the rules:
    # 1: first overflow, hysteresis holds; 2: second in a row, halve; 3-5: three clean, double;
    # 6: one overflow (held), resets growth; 7-9: double; 10 held; 11, 12: halve, halve again.
    expected_scales = [1024, 1024, 512, 512, 512, 1024, 1024, 1024, 1024, 2048, 2048, 1024, 512, 512]
    pairs = [o2_pair(0), o2_pair(1)]
    scaler = LossScaler(init_scale=1024.0, growth_interval=3, hysteresis=2)
    scales, skipped = [], []
    for step, (x, y) in enumerate(make_batches(len(expected_scales))):
        for _, _, opt in pairs:
            opt.zero_grad()
        losses = [F.mse_loss(gm(x), y) for _, gm, _ in pairs]
        for scaled in scaler.scale(losses):  # a list of losses, scaled alike
            scaled.backward()
        if step in faults:
            index, kind = faults[step]
            poison_(pairs[index][1], kind, "fc2.weight")
        before = [snapshot(gm, model, opt) for model, gm, opt in pairs]
        for i, (model, gm, opt) in enumerate(pairs):
            stepped = scaler.step(opt)
            after = snapshot(gm, model, opt)
            if stepped:
                assert not same(after["masters"], before[i]["masters"]), (step, i)
            else:
                skipped.append((step, i))
                assert same(after, before[i]), f"skipped step {step} changed optimizer {i}"
        scaler.update()
        scales.append(scaler.get_scale())
    assert skipped == [(s, f[0]) for s, f in sorted(faults.items())]
    assert scales == expected_scales
    assert scaler.skipped_steps == len(faults)
    for model, gm, _ in pairs:
        assert all(torch.isfinite(p).all() for p in list(model.parameters()) + list(gm.parameters()))


def test_faults_in_one_of_two_losses_apex_style():
    """Apex style, num_losses=2: a fault in one loss backs off that loss's scaler only, skips only the
    optimizer that loss's block named, and the scale grows back after growth_interval clean steps."""
    models = [make_net(0), make_net(1)]
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in models]
    gms, opts = amp_fx.initialize(models, opts, opt_level="O2", dtype=FP16, num_losses=2, verbosity=0)
    for scaler in loss_scalers():
        scaler.update(new_scale=64.0)
        scaler.set_growth_interval(2)
    faults = {2: (1, "nan"), 4: (0, "inf")}  # step: (loss_id, kind)
    expected = {0: [64, 128, 128, 256, 128, 128, 256], 1: [64, 128, 64, 64, 128, 128, 256]}
    scales = {0: [], 1: []}
    for step, (x, y) in enumerate(make_batches(7)):
        for opt in opts:
            opt.zero_grad()
        before = [snapshot(gm, model, opt) for gm, model, opt in zip(gms, models, opts)]
        stepped = []
        for loss_id, (gm, opt) in enumerate(zip(gms, opts)):
            with amp_fx.scale_loss(F.mse_loss(gm(x), y), opt, loss_id=loss_id) as scaled:
                scaled.backward()
                if faults.get(step, (None,))[0] == loss_id:
                    poison_(gm, faults[step][1])
            stepped.append(opt.step() is not False)
            scales[loss_id].append(loss_scalers()[loss_id].get_scale())
        for i, (gm, model, opt) in enumerate(zip(gms, models, opts)):
            hit = faults.get(step, (None,))[0] == i
            assert stepped[i] is not hit, (step, i)
            assert same(snapshot(gm, model, opt), before[i]) is hit, (step, i)
    assert scales == expected
    assert [s.skipped_steps for s in loss_scalers()] == [1, 1]


# ------------------------------------------------------ checkpoint/resume
CHECKPOINT_AT, TOTAL = 10, 30
FAULTS = {3: "inf", 12: "nan", 13: "inf", 21: "inf"}  # before and after the checkpoint


def build(api):
    """Fresh model, O2 fp16 module, optimizer with masters and scaler, as a training script would."""
    model = make_net(0)
    adam = torch.optim.Adam(model.parameters(), lr=1e-2)
    if api == "gradscaler":
        gm = amp_fx.convert(model, "O2", dtype=FP16)
        scaler = LossScaler(init_scale=2.0**10, growth_interval=4, hysteresis=2, max_scale=2.0**12)
        return gm, MasterWeightOptimizer(adam, gm), scaler
    gm, opt = amp_fx.initialize(model, adam, opt_level="O2", dtype=FP16, loss_scale="dynamic",
                                max_loss_scale=2.0**12, verbosity=0)
    loss_scalers()[0].set_growth_interval(4)  # saved in the scaler's state, so it must come back too
    return gm, opt, loss_scalers()[0]


def train(api, gm, opt, scaler, start, stop):
    """Steps ``start..stop-1``; returns per step (loss bits, scale, stepped)."""
    records = []
    batches = make_batches(TOTAL)
    for step in range(start, stop):
        x, y = batches[step]
        opt.zero_grad()
        loss = F.mse_loss(gm(x), y)
        if api == "gradscaler":
            scaler.scale(loss).backward()
            if step in FAULTS:
                poison_(gm, FAULTS[step])
            stepped = scaler.step(opt)
            scaler.update()
        else:
            with amp_fx.scale_loss(loss, opt) as scaled:
                scaled.backward()
                if step in FAULTS:
                    poison_(gm, FAULTS[step])
            stepped = opt.step() is not False
        records.append((loss.item(), scaler.get_scale(), stepped))
    return records


def checkpoint(api, gm, opt, scaler):
    return {"model": gm.state_dict(), "optimizer": opt.state_dict(),
            "scaler": scaler.state_dict() if api == "gradscaler" else amp_fx.state_dict()}


def restore(api, state):
    gm, opt, scaler = build(api)
    gm.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])  # the masters, then copied into the module
    if api == "gradscaler":
        scaler.load_state_dict(state["scaler"])
    else:
        amp_fx.load_state_dict(state["scaler"])
    return gm, opt, scaler


def final_state(gm, opt, scaler):
    return {"module": {n: p.detach().clone() for n, p in gm.named_parameters()},
            "masters": [p.detach().clone() for p in amp_fx.apex.amp.master_params(opt)],
            "optimizer": copy.deepcopy(opt.state_dict()), "scaler": scaler.state_dict()}


def resume_in_this_process(folder: str) -> None:
    """The fresh process: load each API's checkpoint, train to the end, save what happened."""
    torch.set_num_threads(1)
    for api in ("gradscaler", "apex"):
        objs = restore(api, torch.load(os.path.join(folder, f"{api}.ckpt")))
        records = train(api, *objs, CHECKPOINT_AT, TOTAL)
        torch.save({"records": records, "final": final_state(*objs)}, os.path.join(folder, f"{api}.resumed"))


@pytest.mark.slow
def test_checkpoint_resumed_in_a_fresh_process_is_bit_identical(tmp_path):
    uninterrupted = {}
    for api in ("gradscaler", "apex"):
        objs = build(api)
        head = train(api, *objs, 0, CHECKPOINT_AT)
        assert [r[2] for r in head] == [s not in FAULTS for s in range(CHECKPOINT_AT)]
        torch.save(checkpoint(api, *objs), tmp_path / f"{api}.ckpt")
        uninterrupted[api] = (train(api, *objs, CHECKPOINT_AT, TOTAL), final_state(*objs))
    done = subprocess.run([sys.executable, os.path.abspath(__file__), str(tmp_path)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for api, (records, final) in uninterrupted.items():
        resumed = torch.load(tmp_path / f"{api}.resumed")
        assert len(records) == TOTAL - CHECKPOINT_AT == 20
        assert [r[2] for r in records] == [s not in FAULTS for s in range(CHECKPOINT_AT, TOTAL)]
        assert len({r[1] for r in records}) > 1  # the scale moved after the checkpoint
        assert resumed["records"] == records, api  # every loss bit, scale and skip decision
        assert same(resumed["final"], final), api


if __name__ == "__main__":
    resume_in_this_process(sys.argv[1])
