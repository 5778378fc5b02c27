"""Recipe: gradient accumulation — N micro-batches per optimizer step, one scale per effective batch.

    python examples/recipe_accumulation.py

GradScaler style: ``scaler.scale(loss / N).backward()`` for each micro-batch,
``scaler.step``/``scaler.update`` once per effective batch, so every micro-batch
of an effective batch is scaled by the same factor. Apex style: the first N-1
``scale_loss`` blocks use ``delay_unscale=True`` (gradients stay scaled, no
check, no scale update), the last one unscales, checks and updates.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from _common import (setup_run, LR, clone, compare_table, make_batches, make_net, maybe, poison_, setup_apex,
                     setup_gradscaler, weights)
import amp_fx

N = 4  # micro-batches per optimizer step


def train_reference(model, batches, skip=()):
    """fp32 torch accumulating N micro-batches (effective steps in ``skip`` are not taken)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    optimizer.zero_grad()
    for i, (x, y) in enumerate(batches):
        (F.mse_loss(model(x), y) / N).backward()
        if (i + 1) % N == 0:
            if i // N not in skip:
                optimizer.step()
            optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train_gradscaler(model, batches, level, dtype, inject=None, scales=None, **scaler_kwargs):
    """``inject`` and the skipped list count effective steps; ``scales`` collects the scale per micro-batch."""
    gm, optimizer, scaler = setup_gradscaler(model, level, dtype, **scaler_kwargs)
    skipped = []
    optimizer.zero_grad()
    for i, (x, y) in enumerate(batches):
        if scales is not None:
            scales.append(scaler.get_scale())
        scaler.scale(F.mse_loss(gm(x).float(), y) / N).backward()
        if (i + 1) % N == 0:
            if maybe(inject, i // N):
                poison_(gm, maybe(inject, i // N))
            if not scaler.step(optimizer):
                skipped.append(i // N)
            scaler.update()  # once per effective batch
            optimizer.zero_grad()
    return weights(model, gm), skipped


def train_apex(model, batches, level, dtype, inject=None, scales=None, growth_interval=None, **properties):
    gm, optimizer = setup_apex(model, level, dtype, **properties)
    scaler = amp_fx.apex.amp.loss_scalers()[0]
    if growth_interval is not None:
        scaler.set_growth_interval(growth_interval)
    skipped = []
    optimizer.zero_grad()
    for i, (x, y) in enumerate(batches):
        if scales is not None:
            scales.append(scaler.get_scale())
        last = (i + 1) % N == 0
        with amp_fx.scale_loss(F.mse_loss(gm(x).float(), y) / N, optimizer, delay_unscale=not last) as scaled:
            scaled.backward()
            if last and maybe(inject, i // N):
                poison_(gm, maybe(inject, i // N))
        if last:
            if optimizer.step() is False:
                skipped.append(i // N)
            optimizer.zero_grad()
    return weights(model, gm), skipped


def main(effective_steps: int = 4, inject=None) -> list[tuple]:
    setup_run()
    inject = {1: "inf"} if inject is None else inject
    batches = make_batches(effective_steps * N, batch=4)
    net = make_net()
    reference = train_reference(clone(net), batches, skip=set(inject))
    trainers = {
        "gradscaler": lambda m, level, dtype, inj: train_gradscaler(m, batches, level, dtype, inj),
        "apex": lambda m, level, dtype, inj: train_apex(m, batches, level, dtype, inj),
    }
    return compare_table(f"accumulating {N} micro-batches of 4 per step, inf injected at effective steps "
                         f"{sorted(inject)}", reference, trainers, lambda: clone(net), inject)


if __name__ == "__main__":
    main()
