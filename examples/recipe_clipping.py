"""Recipe: gradient clipping — unscale first, then clip the (fp32 master) gradients, then step.

    python examples/recipe_clipping.py

GradScaler style: ``scaler.unscale_(opt)`` then ``clip_grad_norm_``; Apex
style: the gradients are already unscaled when the ``scale_loss`` block ends,
so clip ``amp_fx.apex.amp.master_params(opt)`` right after it. At O2 the clipped
gradients are the fp32 masters'. Each run lands within a few ulps of fp32
training with the same clipping; the step with an injected NaN is skipped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from _common import (setup_run, LR, clone, compare_table, make_batches, make_net, maybe, params_of, poison_, setup_apex,
                     setup_gradscaler, weights)
import amp_fx

MAX_NORM = 0.8  # below the gradient norms here (1.6-1.9), so every step clips


def train_reference(model, batches, skip=()):
    """fp32 torch with clipping (steps in ``skip`` are not taken)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step, (x, y) in enumerate(batches):
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        if step not in skip:
            optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train_gradscaler(model, batches, level, dtype, inject=None):
    gm, optimizer, scaler = setup_gradscaler(model, level, dtype)
    skipped, norms = [], []
    for step, (x, y) in enumerate(batches):
        optimizer.zero_grad()
        scaler.scale(F.mse_loss(gm(x).float(), y)).backward()
        if maybe(inject, step):
            poison_(gm, maybe(inject, step))
        scaler.unscale_(optimizer)  # true gradients from here on (fp32 masters at O2)
        norms.append(float(torch.nn.utils.clip_grad_norm_(params_of(optimizer), MAX_NORM)))
        if not scaler.step(optimizer):  # does not unscale again
            skipped.append(step)
        scaler.update()
    return weights(model, gm), skipped


def train_apex(model, batches, level, dtype, inject=None):
    gm, optimizer = setup_apex(model, level, dtype)
    scaler = amp_fx.apex.amp.loss_scalers()[0]
    skipped = []
    for step, (x, y) in enumerate(batches):
        optimizer.zero_grad()
        with amp_fx.scale_loss(F.mse_loss(gm(x).float(), y), optimizer) as scaled_loss:
            scaled_loss.backward()
            if maybe(inject, step):
                poison_(gm, maybe(inject, step))
        # Unscaled as the block ended: clip the gradients the optimizer will use.
        torch.nn.utils.clip_grad_norm_(amp_fx.apex.amp.master_params(optimizer), MAX_NORM)
        if optimizer.step() is False:  # the skipped step returns False
            skipped.append(step)
    assert scaler.skipped_steps == len(skipped)
    return weights(model, gm), skipped


def main(steps: int = 8, inject=None) -> list[tuple]:
    setup_run()
    inject = {4: "nan"} if inject is None else inject
    batches = make_batches(steps)
    net = make_net()
    reference = train_reference(clone(net), batches, skip=set(inject))
    trainers = {
        "gradscaler": lambda m, level, dtype, inj: train_gradscaler(m, batches, level, dtype, inj),
        "apex": lambda m, level, dtype, inj: train_apex(m, batches, level, dtype, inj),
    }
    return compare_table(f"gradient clipping to norm {MAX_NORM}, NaN injected at steps {sorted(inject)}",
                         reference, trainers, lambda: clone(net), inject)


if __name__ == "__main__":
    main()
