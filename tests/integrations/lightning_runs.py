"""A tiny LightningModule and a runner that records every step's loss, for tests/integrations/test_lightning.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import lightning.pytorch as pl

WIDTH, BATCH, STEPS_PER_EPOCH = 32, 8, 10


class TinyRegressor(pl.LightningModule):
    """A LightningModule written for fp32 / autocast: nothing in it knows about amp_fx."""

    def __init__(self, poison_step: int | None = None):
        super().__init__()
        self.model = nn.Sequential(nn.Linear(WIDTH, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 4))
        self.poison_step = poison_step  # this step's loss is made inf, so its gradients are non-finite

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        if batch_idx == self.poison_step:
            loss = loss * float("inf")
        self.log("train_loss", loss)
        return {"loss": loss}

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)}


def data() -> torch.utils.data.DataLoader:
    """STEPS_PER_EPOCH fixed batches, unshuffled: an epoch is the same steps in every run."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS_PER_EPOCH * BATCH, WIDTH, generator=g)
    y = torch.randint(0, 4, (STEPS_PER_EPOCH * BATCH,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH, shuffle=False)


class _Losses(pl.Callback):
    def __init__(self, weights: list | None):
        self.losses: list[float] = []
        self.weights = weights  # when a list: the first layer's weight after every step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())
        if self.weights is not None:
            self.weights.append(module.state_dict()["model.0.weight"].clone())


def fit(epochs: int, *, precision: str | None = None, plugin=None, ckpt_path=None, save_to=None,
        gradient_clip_val=None, poison_step=None, weights=None, compile_child=False):
    """Train a fresh TinyRegressor (seed 0) for ``epochs`` epochs; return (losses, module, trainer).

    ``compile_child``: the module's child is ``torch.compile(child, backend="aot_eager")``, as a user compiles it."""
    torch.manual_seed(0)
    module = TinyRegressor(poison_step)
    if compile_child:
        module.model = torch.compile(module.model, backend="aot_eager")
    losses = _Losses(weights)
    kwargs = dict(precision=precision) if precision else dict(plugins=[plugin])
    trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[losses], gradient_clip_val=gradient_clip_val, **kwargs)
    trainer.fit(module, data(), ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return losses.losses, module, trainer
