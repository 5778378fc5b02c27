"""Recipe: gradient penalty — differentiate the scaled loss, unscale by hand, add the penalty, backward.

    python examples/recipe_gradient_penalty.py

As in the PyTorch AMP docs: ``torch.autograd.grad(scaler.scale(loss), params,
create_graph=True)`` gives scaled gradients; multiplying them by
``1 / scaler.get_scale()`` unscales them without touching ``.grad``; the
penalty (their norm) joins the loss, and the sum is scaled and back-propagated
as usual. The penalty is taken over the parameters the module runs with.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from _common import (setup_run, LR, clone, compare_table, make_batches, make_net, maybe, poison_, setup_apex,
                     setup_gradscaler, weights)
import amp_fx


def penalized(loss, params, scale):
    """``loss + ||d loss / d params||`` from gradients of ``loss * scale`` (unscaled by hand)."""
    scaled_grads = torch.autograd.grad(loss * scale if scale != 1.0 else loss, params, create_graph=True)
    inv_scale = 1.0 / scale
    norm = torch.sqrt(sum((g.float() * inv_scale).pow(2).sum() for g in scaled_grads))
    return loss + norm


def train_reference(model, batches, skip=()):
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step, (x, y) in enumerate(batches):
        optimizer.zero_grad()
        penalized(F.mse_loss(model(x), y), list(model.parameters()), 1.0).backward()
        if step not in skip:
            optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train_gradscaler(model, batches, level, dtype, inject=None):
    gm, optimizer, scaler = setup_gradscaler(model, level, dtype)
    skipped = []
    for step, (x, y) in enumerate(batches):
        optimizer.zero_grad()
        loss = F.mse_loss(gm(x).float(), y)
        scaled_grads = torch.autograd.grad(scaler.scale(loss), list(gm.parameters()), create_graph=True)
        inv_scale = 1.0 / scaler.get_scale()
        norm = torch.sqrt(sum((g.float() * inv_scale).pow(2).sum() for g in scaled_grads))
        scaler.scale(loss + norm).backward()
        if maybe(inject, step):
            poison_(gm, maybe(inject, step))
        if not scaler.step(optimizer):
            skipped.append(step)
        scaler.update()
    return weights(model, gm), skipped


def train_apex(model, batches, level, dtype, inject=None):
    gm, optimizer = setup_apex(model, level, dtype)
    scaler = amp_fx.apex.amp.loss_scalers()[0]  # loss_id 0's scaler: its scale is the one scale_loss uses
    skipped = []
    for step, (x, y) in enumerate(batches):
        optimizer.zero_grad()
        loss = F.mse_loss(gm(x).float(), y)
        loss = penalized(loss, list(gm.parameters()), scaler.get_scale())
        with amp_fx.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
            if maybe(inject, step):
                poison_(gm, maybe(inject, step))
        if optimizer.step() is False:
            skipped.append(step)
    return weights(model, gm), skipped


def main(steps: int = 8, inject=None) -> list[tuple]:
    setup_run()
    inject = {2: "inf"} if inject is None else inject
    batches = make_batches(steps)
    net = make_net()
    reference = train_reference(clone(net), batches, skip=set(inject))
    trainers = {
        "gradscaler": lambda m, level, dtype, inj: train_gradscaler(m, batches, level, dtype, inj),
        "apex": lambda m, level, dtype, inj: train_apex(m, batches, level, dtype, inj),
    }
    return compare_table(f"gradient penalty, inf injected at steps {sorted(inject)}", reference, trainers,
                         lambda: clone(net), inject)


if __name__ == "__main__":
    main()
