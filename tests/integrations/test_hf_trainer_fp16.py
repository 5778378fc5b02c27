"""AmpFxTrainer trains fp16 with a loss scaler, as a hand-written GradScaler loop does (issue 36, item 8).

Before, ``amp_dtype=torch.float16`` was refused.  The reference is the loop a user writes by hand with
``torch.amp.GradScaler("cpu")`` over the same converted module, data order, AdamW and linear schedule:
scale, backward, unscale_, clip, step (skipped on overflow, and then no schedule step), update.  The scale
starts at 2**20 so that the first steps overflow in fp16 and are skipped on both sides.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

import amp_fx  # noqa: E402
from amp_fx.integrations.hf import AmpFxTrainer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")

STEPS, BATCH, INIT_SCALE = 16, 8, 2.0**20


class Regressor(nn.Module):
    """A small MLP the Trainer drives: forward(x, labels) -> {"loss": ...} (no loss kwargs: plain mean)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))

    def forward(self, x, labels):
        return {"loss": F.mse_loss(self.net(x).float(), labels)}


class Rows(torch.utils.data.Dataset):
    def __init__(self, rows=STEPS * BATCH * 2):
        g = torch.Generator().manual_seed(3)
        self.x, self.y = torch.randn(rows, 16, generator=g), torch.randn(rows, 4, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


def _args(out, **overrides):
    options = dict(output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=1e-2,
                   logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0, data_seed=0,
                   max_grad_norm=1.0, disable_tqdm=True, dataloader_num_workers=0, remove_unused_columns=False)
    options.update(overrides)
    return transformers.TrainingArguments(**options)


def _trainer(out, level="O1", **overrides):
    return AmpFxTrainer(model=Regressor(), args=_args(out, **overrides), train_dataset=Rows(), amp_level=level,
                        amp_dtype=torch.float16,
                        amp_scaler=amp_fx.LossScaler(init_scale=INIT_SCALE, dtype=torch.float16))


def _logged(trainer):
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


def _by_hand(out):
    """The GradScaler loop over what the Trainer would use: its batches, its AdamW groups, its schedule."""
    template = _trainer(out)  # not trained: only its dataloader, optimizer and scheduler are read
    model = template.model
    gm = amp_fx.convert(model, "O1", dtype=torch.float16)
    template.create_optimizer_and_scheduler(num_training_steps=STEPS)
    optimizer, scheduler = template.optimizer, template.lr_scheduler
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    losses, skipped = [], 0
    for _, batch in zip(range(STEPS), template.get_train_dataloader()):
        loss = gm(**batch)["loss"]
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        if scaler.get_scale() < before:
            skipped += 1  # GradScaler backs off exactly when it skipped the step
        else:
            scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, skipped, model


def test_fp16_o1_equals_a_hand_gradscaler_loop(tmp_path):
    trainer = _trainer(tmp_path / "trainer")
    trainer.train()
    losses, skipped, model = _by_hand(tmp_path / "hand")
    assert trainer.amp_scaler.skipped_steps == skipped >= 2  # the overflowing first steps, skipped on both sides
    assert trainer.amp_scaler.get_scale() == INIT_SCALE / 2**skipped
    # The same converted graph, the same fp16 kernels, the same unscale (a multiply by the fp32 inverse of a power
    # of two: exact), AdamW and schedule: the same numbers.
    assert _logged(trainer) == losses
    for (name, p), q in zip(trainer.model.named_parameters(), model.parameters()):
        assert torch.equal(p, q), name
    assert losses[-1] < losses[skipped]  # and it trains


def test_fp16_o2_trains_masters_and_the_scaler_state_resumes(tmp_path):
    """O2: the scaler unscales the fp32 masters' gradients; its state goes into checkpoints and comes back."""
    full = _trainer(tmp_path / "full", level="O2", save_strategy="steps", save_steps=8)
    full.train()
    assert isinstance(full.optimizer.optimizer, amp_fx.MasterWeightOptimizer)
    assert full.amp_scaler.skipped_steps >= 2 and _logged(full)[-1] < _logged(full)[full.amp_scaler.skipped_steps]
    assert all(p.dtype == torch.float32 for p in full.model.parameters())
    resumed = _trainer(tmp_path / "resumed", level="O2")
    saved = torch.load(tmp_path / "full" / "checkpoint-8" / "amp_fx_scaler.pt", weights_only=True)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-8"))
    assert isinstance(saved, dict) and saved  # a real state was written
    # The steps after the checkpoint equal the uninterrupted run's only if the scale came back (from the fresh
    # 2**20 the first resumed steps would overflow and be skipped again).
    assert _logged(resumed)[8:] == _logged(full)[8:] and len(_logged(resumed)) == STEPS
    assert resumed.amp_scaler.get_scale() == full.amp_scaler.get_scale()
