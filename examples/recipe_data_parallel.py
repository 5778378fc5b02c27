"""Recipe: ``nn.DataParallel`` around a converted module, GradScaler-style and Apex-style.

    python examples/recipe_data_parallel.py

Convert (or ``initialize``) first, then wrap the returned module: DataParallel
replicates it over the visible GPUs and gathers the outputs; the scaler and
the optimizer work on the converted module's parameters as without it. On a
machine without GPUs DataParallel calls the module directly, so the weights
must equal the unwrapped run's bit for bit; with GPUs, to rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from _common import (LR, clone, compare_table, make_batches, make_net, maybe, poison_, setup_apex, setup_gradscaler,
                     setup_run, weights)
import amp_fx


def train_gradscaler(model, batches, level, dtype, inject=None, parallel=True):
    gm, optimizer, scaler = setup_gradscaler(model, level, dtype)
    net = nn.DataParallel(gm) if parallel else gm  # wrap after converting
    skipped = []
    for step, (x, y) in enumerate(batches):
        optimizer.zero_grad()
        scaler.scale(F.mse_loss(net(x).float(), y)).backward()
        if maybe(inject, step):
            poison_(gm, maybe(inject, step))
        if not scaler.step(optimizer):
            skipped.append(step)
        scaler.update()
    return weights(model, gm), skipped


def train_apex(model, batches, level, dtype, inject=None, parallel=True):
    gm, optimizer = setup_apex(model, level, dtype)  # initialize the bare model ...
    net = nn.DataParallel(gm) if parallel else gm  # ... then wrap what it returned
    skipped = []
    for step, (x, y) in enumerate(batches):
        optimizer.zero_grad()
        with amp_fx.scale_loss(F.mse_loss(net(x).float(), y), optimizer) as scaled_loss:
            scaled_loss.backward()
            if maybe(inject, step):
                poison_(gm, maybe(inject, step))
        if optimizer.step() is False:
            skipped.append(step)
    return weights(model, gm), skipped


def train_reference(model, batches, skip=()):
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step, (x, y) in enumerate(batches):
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        if step not in skip:
            optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def main(steps: int = 8, inject=None) -> list[tuple]:
    setup_run()
    inject = {5: "inf"} if inject is None else inject
    batches = make_batches(steps)
    net = make_net()
    reference = train_reference(clone(net), batches, skip=set(inject))
    print(f"DataParallel over {torch.cuda.device_count()} GPU(s)")
    trainers = {
        "gradscaler": lambda m, level, dtype, inj: train_gradscaler(m, batches, level, dtype, inj),
        "apex": lambda m, level, dtype, inj: train_apex(m, batches, level, dtype, inj),
    }
    return compare_table(f"nn.DataParallel(converted), inf injected at steps {sorted(inject)}", reference, trainers,
                         lambda: clone(net), inject)


if __name__ == "__main__":
    main()
