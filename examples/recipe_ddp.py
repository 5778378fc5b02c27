"""Recipe: DistributedDataParallel around a converted module (2 processes, gloo, CPU).

    python examples/recipe_ddp.py

Convert (or ``initialize``) the bare model, then wrap the result in DDP. Each
rank trains on its half of every batch; DDP averages the gradients, so the
weights match one process training on the whole batch (to the rounding of
the low dtype), and both ranks hold identical weights.

Skipping stays in step across ranks without any extra collective: an inf or
NaN produced during one rank's backward reaches DDP's gradient all-reduce and
comes back to every rank (inf + x = inf, NaN + x = NaN), so every rank's
scaler sees it and skips the same step. (A gradient edited by hand on one rank
*after* backward would not be seen by the others; don't do that.)
"""

from __future__ import annotations

import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from _common import (make_batches, make_net, max_diff, print_rows, setup_apex, setup_gradscaler, setup_run,
                     tolerance, weights)
import amp_fx

WORLD = 2
CONFIGS = (("O1", torch.bfloat16), ("O2", torch.float16), ("O3", torch.bfloat16))


def _poison_hook(kind: str):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad.view(-1)[0] = float(kind)
        return grad
    return hook


def train(api, level, dtype, batches, rank=None, inject=None, first_grads=None):
    """Train :func:`make_net` on ``batches``; under DDP when ``rank`` is given (each rank takes its half).

    ``inject = (rank, step, kind)`` makes that rank's backward produce an inf/NaN at that step, before
    DDP's all-reduce (a tensor hook on the gradient, as an overflow inside backward would).
    ``first_grads`` (a dict) receives the unscaled gradients of the first step.
    """
    model = make_net()
    if api == "gradscaler":
        gm, optimizer, scaler = setup_gradscaler(model, level, dtype)
    else:
        gm, optimizer = setup_apex(model, level, dtype)
        scaler = amp_fx.apex.amp.loss_scalers()[0]
    net = DDP(gm) if rank is not None else gm  # wrap the converted module, after convert/initialize
    skipped = []
    for step, (x, y) in enumerate(batches):
        if rank is not None:
            half = x.shape[0] // WORLD
            x, y = x[rank * half:(rank + 1) * half], y[rank * half:(rank + 1) * half]
        handle = None
        if inject is not None and inject[:2] == (rank, step):
            handle = gm.get_parameter("fc1.weight").register_hook(_poison_hook(inject[2]))
        optimizer.zero_grad()
        loss = F.mse_loss(net(x).float(), y)
        if api == "gradscaler":
            scaler.scale(loss).backward()
            if step == 0 and first_grads is not None:
                first_grads.update({n: p.grad.float() / scaler.get_scale() for n, p in gm.named_parameters()})
            if not scaler.step(optimizer):
                skipped.append(step)
            scaler.update()
        else:
            with amp_fx.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
                if step == 0 and first_grads is not None:
                    first_grads.update({n: p.grad.float() / scaler.get_scale() for n, p in gm.named_parameters()})
            if optimizer.step() is False:
                skipped.append(step)
        if handle is not None:
            handle.remove()
    return weights(model, gm), skipped


def _worker(rank: int, port: int, out_dir: str, steps: int, inject, configs) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        setup_run()
        batches = make_batches(steps, batch=16)
        results = {}
        for level, dtype in configs:
            for api in ("gradscaler", "apex"):
                grads: dict = {}
                got, skipped = train(api, level, dtype, batches, rank=rank, inject=inject, first_grads=grads)
                results[(api, level, str(dtype))] = {"weights": got, "skipped": skipped, "grads": grads}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ddp(steps: int = 4, inject=(1, 2, "inf"), configs=CONFIGS) -> list[dict]:
    """Spawn the ranks; return each rank's results ``{(api, level, dtype): {weights, skipped, grads}}``."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(free_port(), out_dir, steps, inject, configs), nprocs=WORLD, join=True)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(WORLD)]


def run_single(steps: int = 4, skip_step=None, configs=CONFIGS) -> dict:
    """The same training in one process on the whole batches (the step ``skip_step`` poisoned)."""
    batches = make_batches(steps, batch=16)
    inject = None if skip_step is None else (None, skip_step, "inf")
    results = {}
    for level, dtype in configs:
        for api in ("gradscaler", "apex"):
            grads: dict = {}
            got, skipped = train(api, level, dtype, batches, inject=inject, first_grads=grads)
            results[(api, level, str(dtype))] = {"weights": got, "skipped": skipped, "grads": grads}
    return results


def main(steps: int = 4) -> list[tuple]:
    setup_run()
    inject = (1, 2, "inf")
    ranks = run_ddp(steps, inject)
    single = run_single(steps, skip_step=inject[1])
    rows = [("api", "level", "dtype", "rank0 == rank1", "max |grad - single|", "max |w - single|", "tolerance",
             "skipped (rank0, rank1)")]
    for key, one in single.items():
        api, level, dtype = key
        r0, r1 = ranks[0][key], ranks[1][key]
        same = all(torch.equal(r0["weights"][k], r1["weights"][k]) for k in r0["weights"])
        rows.append((api, level, dtype.replace("torch.", ""), same, f"{max_diff(r0['grads'], one['grads']):.1e}",
                     f"{max_diff(r0['weights'], one['weights']):.1e}",
                     f"{tolerance(level, getattr(torch, dtype.replace('torch.', ''))):.1e}",
                     (r0["skipped"], r1["skipped"])))
    print_rows(f"DDP, {WORLD} processes on gloo vs one process on the whole batch; inf in rank "
               f"{inject[0]}'s backward at step {inject[1]}", rows)
    return rows


if __name__ == "__main__":
    main()
