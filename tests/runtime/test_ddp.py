"""DistributedDataParallel around converted modules: 2 processes on gloo (CPU), both APIs.

One spawn runs every configuration (spawning costs seconds). What it checks:

- both ranks end with bit-identical weights;
- the first step's gradients equal one process's on the concatenated batch,
  to the rounding of the dtype the gradients are computed in (the two
  halves are reduced in another order, so not bit for bit; at O0 to fp32
  rounding), and the weights
  after every step land within the recipes' tolerance of that run;
- an inf produced in rank 1's backward at step 2 reaches DDP's gradient
  all-reduce, so *every* rank's scaler sees it and skips step 2 (no extra
  collective is needed to keep the ranks' skip decisions in step);
- ``destroy_process_group()`` after DDP really frees the group (its gloo
  threads end), so no rank tears them down while it exits: that race once
  aborted a rank (amp_fx/runtime/process_group_release.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "examples"))

import _common  # noqa: E402
import recipe_ddp  # noqa: E402

CONFIGS = (("O0", torch.bfloat16), ("O2", torch.float16), ("O3", torch.bfloat16))
INJECT = (1, 2, "inf")  # rank 1, step 2



@pytest.mark.slow
def test_ddp_matches_one_process_and_every_rank_skips_the_same_step():
    ranks = recipe_ddp.run_ddp(steps=4, inject=INJECT, configs=CONFIGS)
    single = recipe_ddp.run_single(steps=4, skip_step=INJECT[1], configs=CONFIGS)
    assert set(ranks[0]) == set(single) and len(single) == 2 * len(CONFIGS)
    for (api, level, dtype_name), one in single.items():
        dtype = getattr(torch, dtype_name.replace("torch.", ""))
        r0, r1 = ranks[0][(api, level, dtype_name)], ranks[1][(api, level, dtype_name)]
        where = f"{api} {level} {dtype_name}"
        assert r0["skipped"] == r1["skipped"] == one["skipped"] == [INJECT[1]], where
        assert all(torch.equal(r0["weights"][k], r1["weights"][k]) for k in r0["weights"]), where
        assert all(torch.isfinite(w).all() for w in r0["weights"].values()), where
        # Gradients of step 0: the average of the two halves' against the whole batch's, within an ulp
        # of the largest (a few at O3, whose backward also sums over the batch in the low dtype).
        ulps = 1e-6 if level == "O0" else torch.finfo(dtype).eps * (4 if level == "O3" else 1)
        for name, grad in one["grads"].items():
            bound = ulps * grad.abs().max().item()
            assert (r0["grads"][name] - grad).abs().max().item() <= bound, f"{where} {name}"
        tol = 1e-6 if level == "O0" else _common.tolerance(level, dtype)
        assert _common.max_diff(r0["weights"], one["weights"]) <= tol, where


# A fresh interpreter, as a spawned rank: amp_fx.runtime imported first (recipe_ddp.py and the FSDP2
# worker import it at the top), then a gloo group, DDP around a converted module, one step, destroy.
RELEASE_SCRIPT = r"""
import json, os, time
import amp_fx.runtime
import torch, torch.distributed as dist
from torch import nn

def gloo_threads():
    names = [open(f"/proc/self/task/{task}/comm").read().strip() for task in os.listdir("/proc/self/task")]
    return sorted(name for name in names if "gloo" in name or "tcpstore" in name)

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
net = nn.parallel.DistributedDataParallel(amp_fx.convert(nn.Linear(4, 4), "O1", dtype=torch.bfloat16))
net(torch.randn(2, 4)).sum().backward()
running = gloo_threads()  # after collectives ran on them (a thread names itself once it starts)
del net
dist.destroy_process_group()
for _ in range(50):  # a thread may take a moment to leave /proc once joined; a leaked one stays
    if not gloo_threads():
        break
    time.sleep(0.1)
print(json.dumps({"running": running, "left": gloo_threads()}))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread names from /proc")
def test_destroy_process_group_after_ddp_ends_the_gloo_threads():
    """DDP's constructor imports torch._dynamo, which imported torch.distributed.nn after init_process_group and bound
    the live group as a default argument, so destroy_process_group could not free it; amp_fx.runtime imports it first."""
    run = subprocess.run([sys.executable, "-c", RELEASE_SCRIPT], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    threads = json.loads(run.stdout.strip().splitlines()[-1])
    assert threads["running"], threads  # the group did run threads, so their absence below means something
    assert threads["left"] == [], threads
