"""Two gloo ranks training one converted module on different data under delayed fp8 scaling (for test_fp8_delayed.py)."""

from __future__ import annotations

import gc
import os

import torch
import torch.distributed as dist

import amp_fx

from ranks import free_port, init_gloo, spawn  # tests/ranks.py (tests/conftest.py puts tests/ on the path)


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_gloo(rank, 2, port)
    try:
        torch.manual_seed(0)  # the same model on both ranks
        model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
        gm = amp_fx.convert(model, "O1", example_inputs=(torch.randn(4, 32),),
                            fp8={"recipe": "delayed", "size_rule": "all", "history_len": 4})
        torch.manual_seed(100 + rank)  # different data on each rank: local amaxes differ
        for step in range(3):
            x = torch.randn(4, 32) * (1 + rank) * (step + 1)
            gm(x).pow(2).sum().backward()
        # The last step's amaxes are reduced at the next forward; reading the state now asks for that sync first.
        amp_fx.fp8_sync(gm)
        states = {name: (s.scale.clone(), s.amax_history.clone()) for name, s in amp_fx.fp8_states(gm).items()}
        torch.save(states, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def launch(out_dir: str) -> list[dict]:
    """Run the two ranks; return each rank's {gemm: (scale, amax_history)}."""
    paths = [os.path.join(out_dir, f"rank{r}.pt") for r in range(2)]
    spawn(_worker, (free_port(), out_dir), 2, paths)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(2)]


def _counting_worker(rank: int, port: int, out_dir: str, ddp: bool) -> None:
    """Train 4 optimizer steps (lazy sync) and 3 more of 2 micro-batches each (sync on the optimizer step), counting all_reduce calls.

    ``ddp``: under DistributedDataParallel with its default buffer broadcast (its gradient all-reduce and
    broadcast run in C++ and are not counted: the count is amp_fx's).
    """
    torch.set_num_threads(1)
    init_gloo(rank, 2, port)
    calls = []
    real = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
        gm = amp_fx.convert(model, "O1", example_inputs=(torch.randn(4, 32),),
                            fp8={"recipe": "delayed", "size_rule": "all", "history_len": 8})
        net = torch.nn.parallel.DistributedDataParallel(gm) if ddp else gm
        opt = torch.optim.SGD(gm.parameters(), lr=0.01)
        torch.manual_seed(100 + rank)
        per_step, local_amax = [], []

        def micro_batch(scale):
            x = torch.randn(4, 32) * scale
            local_amax.append(x.abs().max().item())
            net(x).pow(2).sum().backward()

        for step in range(4):  # the sync happens at the next forward
            before = len(calls)
            micro_batch((1 + rank) * (step + 1))
            opt.step()
            opt.zero_grad()
            per_step.append(len(calls) - before)
        handle = amp_fx.fp8_sync(gm, opt)  # from here: at each optimizer step
        for step in range(3):
            before = len(calls)
            for _ in range(2):
                micro_batch(1 + rank + step)
            opt.step()
            opt.zero_grad()
            per_step.append(len(calls) - before)
        handle.remove()
        (state,) = [s for name, s in amp_fx.fp8_states(gm).items() if name == "0"]
        torch.save({"per_step": per_step, "sizes": calls, "local_amax": local_amax,
                    "history": state.amax_history.clone(), "scale": state.scale.clone()},
                   os.path.join(out_dir, f"count{rank}{'ddp' if ddp else ''}.pt"))
    finally:
        dist.all_reduce = real
        # DDP's reducer holds the group: freed after destroy_process_group, it would be the group's last owner, and
        # its destructor joins gloo's worker threads while holding the GIL one of them may need (a deadlock seen
        # here about 1 run in 12). Free it while the group is still registered, once every rank's work is done.
        net = None
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


def launch_counting(out_dir: str, ddp: bool = False) -> list[dict]:
    """Run the counting ranks; return each rank's per-step all_reduce counts, sizes, local input amaxes and GEMM 0's state."""
    paths = [os.path.join(out_dir, f"count{r}{'ddp' if ddp else ''}.pt") for r in range(2)]
    spawn(_counting_worker, (free_port(), out_dir, ddp), 2, paths)
    return [torch.load(path) for path in paths]
