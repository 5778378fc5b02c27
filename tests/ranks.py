"""Spawn gloo ranks for a test with a deadline, so a rank that hangs fails its test instead of stalling the suite.

``torch.multiprocessing.spawn`` joins its ranks without a timeout and gloo's
default collective timeout is 30 minutes, so one rank stuck in a collective or
in its teardown used to hold the whole suite until CI's own limit. Here:

- :func:`init_gloo` starts the rank's group with a collective timeout, so a
  rank left waiting on a peer raises (naming the collective) within it;
- :func:`spawn` joins the ranks against a deadline; past it, it kills them and
  raises, naming the ranks still running and whether each wrote its result.
"""

from __future__ import annotations

import datetime
import os
import socket
import time

import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = 120
DEADLINE_S = 300


def free_port() -> int:
    """A TCP port free on localhost now (for the rank-0 store)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_gloo(rank: int, world: int, port: int) -> None:
    """Join a ``world``-rank gloo group on localhost:``port``, with :data:`COLLECTIVE_TIMEOUT_S`."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))


def spawn(worker, args: tuple, nprocs: int, out_files=(), deadline_s: float = DEADLINE_S) -> None:
    """Run ``worker(rank, *args)`` on ``nprocs`` spawned ranks; raise when one fails or the deadline passes.

    ``out_files``: rank ``r``'s result path at index ``r``, only to say in the timeout message which ranks finished
    their work (a rank that wrote its result and then hung is stuck in its teardown).
    """
    context = mp.start_processes(worker, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + deadline_s
    while not context.join(timeout=2):  # join raises when a rank raised or died
        if time.monotonic() < deadline:
            continue
        running = [rank for rank, process in enumerate(context.processes) if process.is_alive()]
        for process in context.processes:
            process.kill()
        wrote = {rank: os.path.exists(path) for rank, path in enumerate(out_files)}
        raise TimeoutError(f"ranks {running} of {nprocs} still running after {deadline_s:.0f} s; killed them. "
                           f"Result written, by rank: {wrote or 'not tracked'}")
