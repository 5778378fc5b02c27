"""Cost of the O2 module's check of its masters' versions before each call (amp_fx/graph_ops/master_sync.py).

Run from a checkout: ``python benchmarks/bench_master_sync.py`` (75 Linear 16x16 at O2 bf16: 150 parameters;
1 thread; the process's CPU time, median of 21 x 1000 calls).
"""

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
import amp_fx  # noqa: E402
from amp_fx.graph_ops.master_sync import sync_masters  # noqa: E402
torch.set_num_threads(1)
model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(75)])  # 150 parameters
gm = amp_fx.convert(model, "O2", dtype=torch.bfloat16)
n = sum(1 for _ in gm.parameters())
for _ in range(100): sync_masters(gm)
ts = []
for _ in range(21):
    t = time.process_time()
    for _ in range(1000): sync_masters(gm)
    ts.append((time.process_time() - t) / 1000)
print(f"{n} parameters: sync_masters {statistics.median(ts)*1e6:.1f} us per call (median of 21 x 1000, CPU clock)")
