"""Recipe: the plain mixed-precision training loop, GradScaler-style and Apex-style, checked against fp32.

    python examples/train_plain.py

Trains the same tiny model on the same batches in fp32 (plain torch) and with
amp_fx at O0-O3 in bf16 and fp16, through both APIs, with one inf injected
into a gradient at step 3: the step is skipped and the weights land within a
few ulps of the dtype from the fp32 run (which skips the same step).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from _common import (setup_run, LR, clone, compare_table, make_batches, make_net, maybe, poison_, setup_apex, setup_gradscaler,
                     weights)
import amp_fx


def train_reference(model, batches, skip=()):
    """fp32 torch: the loop every amp_fx run is compared with (steps in ``skip`` are not taken)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step, (x, y) in enumerate(batches):
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        if step not in skip:
            optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train_gradscaler(model, batches, level, dtype, inject=None):
    """GradScaler protocol: ``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()``."""
    gm, optimizer, scaler = setup_gradscaler(model, level, dtype)
    skipped = []
    for step, (x, y) in enumerate(batches):
        optimizer.zero_grad()
        loss = F.mse_loss(gm(x).float(), y)
        scaler.scale(loss).backward()
        if maybe(inject, step):
            poison_(gm, maybe(inject, step))
        if not scaler.step(optimizer):  # False: inf/NaN gradients, step skipped
            skipped.append(step)
        scaler.update()
    return weights(model, gm), skipped


def train_apex(model, batches, level, dtype, inject=None):
    """Apex: ``with amp_fx.scale_loss(loss, opt) as s: s.backward()`` then ``opt.step()``."""
    gm, optimizer = setup_apex(model, level, dtype)
    scaler = amp_fx.apex.amp.loss_scalers()[0]
    skipped = []
    for step, (x, y) in enumerate(batches):
        optimizer.zero_grad()
        loss = F.mse_loss(gm(x).float(), y)
        before = scaler.skipped_steps
        with amp_fx.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
            if maybe(inject, step):
                poison_(gm, maybe(inject, step))
        optimizer.step()  # does nothing if the block found inf/NaN
        if scaler.skipped_steps > before:
            skipped.append(step)
    return weights(model, gm), skipped


def main(steps: int = 8, inject=None) -> list[tuple]:
    setup_run()
    inject = {3: "inf"} if inject is None else inject
    batches = make_batches(steps)
    net = make_net()
    reference = train_reference(clone(net), batches, skip=set(inject))
    trainers = {
        "gradscaler": lambda m, level, dtype, inj: train_gradscaler(m, batches, level, dtype, inj),
        "apex": lambda m, level, dtype, inj: train_apex(m, batches, level, dtype, inj),
    }
    return compare_table(f"plain loop, {steps} SGD steps, inf injected at steps {sorted(inject)}", reference,
                         trainers, lambda: clone(net), inject)


if __name__ == "__main__":
    main()
