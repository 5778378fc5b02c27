"""Two gloo ranks training one converted module on different data under delayed fp8 scaling (for test_fp8_delayed.py)."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import amp_fx


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)  # the same model on both ranks
        model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
        gm = amp_fx.convert(model, "O1", example_inputs=(torch.randn(4, 32),),
                            fp8={"recipe": "delayed", "size_rule": "all", "history_len": 4})
        torch.manual_seed(100 + rank)  # different data on each rank: local amaxes differ
        for step in range(3):
            x = torch.randn(4, 32) * (1 + rank) * (step + 1)
            gm(x).pow(2).sum().backward()
        states = {name: (s.scale.clone(), s.amax_history.clone()) for name, s in amp_fx.fp8_states(gm).items()}
        torch.save(states, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def launch(out_dir: str) -> list[dict]:
    """Run the two ranks; return each rank's {gemm: (scale, amax_history)}."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, out_dir), nprocs=2)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(2)]
