"""Recipe: two models, two losses, two optimizers — one scaler (GradScaler) or one per loss (Apex).

    python examples/recipe_multiple_models.py

Both losses depend on both models (as in the PyTorch AMP docs). GradScaler
style: one scaler scales both losses, ``scaler.step`` decides per optimizer
whether its gradients are finite, and ``scaler.update()`` runs once per
iteration. Apex style: ``num_losses=2`` gives each loss its own scaler, and
each ``scale_loss`` block checks the gradients of the optimizers it names.

An inf injected into model 1's gradients during loss 1's backward: GradScaler
skips optimizer 1's step only (each optimizer judges its own gradients); Apex
skips both, because loss 1 was scaled into both optimizers and overflowed (an
optimizer steps only if no loss scaled into it overflowed), and so does
``amp_fx.scale_loss``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from _common import (setup_run, clone, compare_table, make_batches, make_net, maybe, poison_, setup_gradscaler, weights)
import amp_fx

LR = 0.005  # the losses weigh the outputs by up to 5: a smaller step than the other recipes
# ... and gradients near 1, which overflow fp16 at GradScaler's first scale (2**16) for a few steps
# while the scale calibrates. Start both APIs at 2**8 so the only skipped steps are the injected ones.
INIT_SCALE = 2.0**8

def losses(out0, out1, y):
    return F.mse_loss(2 * out0 + 3 * out1, y), F.mse_loss(3 * out0 - 5 * out1, y)


def merged(w0, w1):
    return {**{f"model0.{k}": v for k, v in w0.items()}, **{f"model1.{k}": v for k, v in w1.items()}}


def train_reference(models, batches, skip=()):
    """fp32 torch; ``skip`` holds (step, optimizer index) pairs that are not taken."""
    m0, m1 = models
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in models]
    for step, (x, y) in enumerate(batches):
        for opt in opts:
            opt.zero_grad()
        loss0, loss1 = losses(m0(x), m1(x), y)
        loss0.backward(retain_graph=True)
        loss1.backward()
        for i, opt in enumerate(opts):
            if (step, i) not in skip:
                opt.step()
    return merged(*({n: p.detach().clone() for n, p in m.named_parameters()} for m in models))


def train_gradscaler(models, batches, level, dtype, inject=None):
    """One LossScaler for both losses and both optimizers (the second setup's scaler is unused)."""
    m0, m1 = models
    gm0, opt0, scaler = setup_gradscaler(m0, level, dtype, lr=LR, init_scale=INIT_SCALE)
    gm1, opt1, _ = setup_gradscaler(m1, level, dtype, lr=LR)
    skipped = []
    for step, (x, y) in enumerate(batches):
        opt0.zero_grad()
        opt1.zero_grad()
        loss0, loss1 = losses(gm0(x).float(), gm1(x).float(), y)
        scaler.scale(loss0).backward(retain_graph=True)
        scaler.scale(loss1).backward()
        if maybe(inject, step):
            poison_(gm1, maybe(inject, step))  # a fault in model 1 only
        scaler.unscale_(opt0)  # optional (e.g. to clip optimizer 0's gradients)
        for i, opt in enumerate((opt0, opt1)):
            if not scaler.step(opt):  # each optimizer decides for itself
                skipped.append((step, i))
        scaler.update()  # once per iteration
    return merged(weights(m0, gm0), weights(m1, gm1)), skipped


def train_apex(models, batches, level, dtype, inject=None):
    """``initialize`` with both models and optimizers, ``num_losses=2``: a scaler per loss."""
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in models]
    (gm0, gm1), (opt0, opt1) = amp_fx.initialize(list(models), opts, opt_level=level, dtype=dtype, num_losses=2,
                                                 loss_scale="dynamic", max_loss_scale=INIT_SCALE, verbosity=0)
    skipped = []
    for step, (x, y) in enumerate(batches):
        opt0.zero_grad()
        opt1.zero_grad()
        loss0, loss1 = losses(gm0(x).float(), gm1(x).float(), y)
        with amp_fx.scale_loss(loss0, [opt0, opt1], loss_id=0) as scaled:
            scaled.backward(retain_graph=True)
        with amp_fx.scale_loss(loss1, [opt0, opt1], loss_id=1) as scaled:
            scaled.backward()
            if maybe(inject, step):
                poison_(gm1, maybe(inject, step))
        for i, opt in enumerate((opt0, opt1)):
            if opt.step() is False:
                skipped.append((step, i))
    return merged(weights(models[0], gm0), weights(models[1], gm1)), skipped


def main(steps: int = 8, inject=None) -> list[tuple]:
    setup_run()
    inject = {3: "inf"} if inject is None else inject
    batches = make_batches(steps)
    nets = (make_net(0), make_net(1))
    rows = []
    for api, train, skip in (("gradscaler", train_gradscaler, {(s, 1) for s in inject}),
                             ("apex", train_apex, {(s, i) for s in inject for i in (0, 1)})):
        reference = train_reference(clone(nets), batches, skip=skip)
        trainers = {api: lambda m, level, dtype, inj, train=train: train(m, batches, level, dtype, inj)}
        table = compare_table(f"two models, two losses, two optimizers, {api}-style; inf in model 1 at steps "
                              f"{sorted(inject)} (skipped: (step, optimizer))", reference, trainers,
                              lambda: clone(nets), inject)
        rows += table if not rows else table[1:]
    return rows


if __name__ == "__main__":
    main()
