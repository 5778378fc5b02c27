"""Recipe: sharded training with FSDP2 (fully_shard per block and at the root), 2 processes, gloo, CPU.

    python examples/recipe_fsdp2.py

Order matters: convert per block, shard, then build the optimizer (fully_shard
replaces the parameters with DTensor shards, so an optimizer built earlier
would hold the old ones)::

    gm = amp_fx.runtime.convert_for_sharding(model, "O1", blocks=Block, dtype=torch.bfloat16)
    for block in gm.blocks.children():
        fully_shard(block)
    fully_shard(gm)
    optimizer = torch.optim.AdamW(gm.parameters())              # O2: MasterWeightOptimizer(..., gm)
    scaler = amp_fx.LossScaler(dtype=torch.bfloat16)             # inf/NaN verdict reduced across ranks

Prints the losses of one process on the whole batch beside two ranks on one
half each (FSDP2 averages their gradients), for O1, O2 and FSDP2 +
torch.autocast, and the bytes of fp32 masters each rank holds at O2.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import amp_fx
from amp_fx.runtime import MasterWeightOptimizer, convert_for_sharding
from amp_fx.runtime.distributed import local_tensor

WORLD, STEPS = 2, 5


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Net(nn.Module):
    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.inp, self.head = nn.Linear(16, d), nn.Linear(d, 10)
        self.blocks = nn.ModuleList([Block(d) for _ in range(4)])

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def run(recipe: str, rank: int | None) -> dict:
    """Train 5 steps; the data is split over the ranks when ``rank`` is given."""
    torch.manual_seed(0)
    model = Net()
    if recipe == "autocast":
        gm = model
    else:  # O2: FSDP2 gathers one dtype per block, so the norms' parameters go bf16 too (fp32 masters)
        extra = {"keep_batchnorm_fp32": False} if recipe == "O2" else {}
        gm = convert_for_sharding(model, recipe, blocks=Block, dtype=torch.bfloat16, **extra)
    if rank is not None:
        # Leave param_dtype unset beside amp_fx (it casts each weight per op); reduce low grads in fp32.
        policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
        for block in gm.blocks.children():
            fully_shard(block, mp_policy=policy)
        fully_shard(gm, mp_policy=policy)
    if recipe == "O2":
        optimizer = MasterWeightOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), gm)
    else:
        optimizer = torch.optim.AdamW(gm.parameters(), lr=1e-3)
    del model  # at O2 the masters are this rank's shards; drop the full fp32 model
    scaler = amp_fx.LossScaler(dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        x, y = torch.randn(32, 16, generator=g), torch.randint(0, 10, (32,), generator=g)
        if rank is not None:
            x, y = x.chunk(WORLD)[rank], y.chunk(WORLD)[rank]
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=recipe == "autocast"):
            loss = F.cross_entropy(gm(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        loss = loss.detach().clone()
        if rank is not None:
            dist.all_reduce(loss)
            loss /= WORLD
        losses.append(loss.item())
    out = {"loss": losses}
    if recipe == "O2":
        out["master_bytes"] = sum(local_tensor(m).untyped_storage().nbytes() for m in optimizer.master_parameters())
        out["model_bytes"] = sum(p.numel() * 4 for p in Net().parameters())
    return out


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        torch.save({r: run(r, rank) for r in ("O1", "O2", "autocast")}, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(port, out_dir), nprocs=WORLD)
        ranks = [torch.load(os.path.join(out_dir, f"{r}.pt")) for r in range(WORLD)]
    print("| recipe | step | 1 process | 2 ranks | rel. diff |\n|---|---|---|---|---|")
    for recipe in ("O1", "O2", "autocast"):
        one = run(recipe, None)["loss"]
        for step, (a, b) in enumerate(zip(one, ranks[0][recipe]["loss"])):
            print(f"| {recipe} | {step} | {a:.5f} | {b:.5f} | {abs(a - b) / a:.1e} |")
    for rank, result in enumerate(ranks):
        o2 = result["O2"]
        print(f"rank {rank}: O2 fp32 master bytes {o2['master_bytes']} of the model's {o2['model_bytes']} "
              f"({o2['master_bytes'] / o2['model_bytes']:.3f})")


if __name__ == "__main__":
    sys.exit(main())
