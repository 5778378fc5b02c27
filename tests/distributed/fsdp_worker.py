"""Training runs under FSDP2 (2 ranks, gloo, CPU) and their one-process references, for test_fsdp2.py.

``launch(job, ...)`` spawns two processes that each run ``job`` and write what
they measured to ``out_dir/rank{r}.pt``; ``train(...)`` without a rank is the
one-process reference on the whole batch (the ranks take one half each, and
FSDP2 averages their gradients, so both see the same mean gradient).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import amp_fx
from amp_fx.runtime import LossScaler, MasterWeightOptimizer
from amp_fx.runtime.distributed import convert_for_sharding, init_optimizer_state, local_tensor

from ranks import free_port, init_gloo, spawn  # tests/ranks.py (tests/conftest.py puts tests/ on the path)

WORLD = 2
STEPS = 5
DIM = 32


class Block(nn.Module):
    """Pre-norm residual MLP block: a LayerNorm (fp32 under O1) and two Linears (bf16)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.ln(x))))


class Net(nn.Module):
    def __init__(self, d: int = DIM) -> None:
        super().__init__()
        self.inp = nn.Linear(12, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(3)])
        self.head = nn.Linear(d, 5)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def batches(steps: int = STEPS):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 12, generator=g), torch.randint(0, 5, (16,), generator=g)) for _ in range(steps)]


def build(level: str, rank=None, mp=None):
    """Convert a seeded Net per block; shard each block and the root when ``rank`` is given."""
    torch.manual_seed(0)
    model = Net()
    # At O2 FSDP2 wants one dtype per sharded block: the norms' parameters go bf16 too (fp32 masters).
    extra = {"keep_batchnorm_fp32": False} if level == "O2" else {}
    gm = convert_for_sharding(model, level, blocks=Block, dtype=torch.bfloat16, **extra)
    if rank is not None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        if mp is None and level == "O2":  # the recommended setting: reduce the bf16 gradients in fp32
            mp = {"reduce_dtype": torch.float32}
        policy = {} if mp is None else {"mp_policy": MixedPrecisionPolicy(**mp)}
        for block in gm.blocks.children():
            fully_shard(block, **policy)
        fully_shard(gm, **policy)
    # SGD with momentum: its updates follow the gradients' values (Adam's would amplify the
    # rounding differences of near-zero gradients), and it has state to checkpoint.
    params = model.parameters() if level == "O2" else gm.parameters()
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if level == "O2":
        opt = MasterWeightOptimizer(opt, gm)
    del model  # the masters (O2) are this rank's shards now; nothing else holds the full fp32 copy
    return gm, opt


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float().clone()


def initialize_sharded(rank=None):
    """amp_fx.initialize on a model fully_shard already sharded: refused, naming the order that works."""
    from torch.distributed.fsdp import fully_shard

    model = Net()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    amp_fx.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1")
    return {}


def masters_before_shard(rank=None):
    """MasterWeightOptimizer built before fully_shard: its first step is refused, naming the order."""
    from torch.distributed.fsdp import fully_shard

    model = Net()
    gm = convert_for_sharding(model, "O2", blocks=Block, dtype=torch.bfloat16, keep_batchnorm_fp32=False)
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), gm)
    for block in gm.blocks.children():
        fully_shard(block)
    fully_shard(gm)
    x, y = batches()[0]
    F.cross_entropy(gm(x), y).backward()
    LossScaler(dtype=torch.bfloat16).step(opt)
    return {}


def train(level, rank=None, inject=None, save_at=None, resume=None, ckpt_dir=None, mp=None):
    """Train; returns per-step losses and full parameters, skipped steps and the master bytes held."""
    gm, opt = build(level, rank, mp)
    scaler = LossScaler(dtype=torch.bfloat16)
    data = batches()
    first = 0
    if resume is not None:
        first = resume
        _load(gm, opt, scaler, ckpt_dir)
    out = {"loss": {}, "params": {}, "skipped": [], "state_equal_after_skip": None}
    for step in range(first, len(data)):
        x, y = data[step]
        if rank is not None:
            half = x.shape[0] // WORLD
            x, y = x[rank * half:(rank + 1) * half], y[rank * half:(rank + 1) * half]
        opt.zero_grad()
        if step == first:
            with CastLog() as casts:
                logits = gm(x)
            out["casts"] = casts.log
        else:
            logits = gm(x)
        loss = F.cross_entropy(logits, y)
        scaler.scale(loss).backward()
        if inject is not None and inject == (rank, step):
            grad = gm.get_parameter("blocks.1.fc1.weight").grad
            local_tensor(grad).view(-1)[0] = float("inf")  # only this rank's shard
        before = _snapshot(gm, opt) if inject is not None and inject[1] == step else None
        if not scaler.step(opt):
            out["skipped"].append(step)
        scaler.update()
        if before is not None:
            after = _snapshot(gm, opt)
            out["state_equal_after_skip"] = all(torch.equal(a, b) for a, b in zip(before, after))
        mean = loss.detach().clone()
        if rank is not None:
            dist.all_reduce(mean)
            mean /= WORLD
        out["loss"][step] = mean.item()
        out["params"][step] = {n: full(p) for n, p in gm.named_parameters()}
        out["scale"] = scaler.get_scale()
        if save_at is not None and step + 1 == save_at:
            _save(gm, opt, scaler, ckpt_dir)
    if level == "O2":
        masters = list(opt.master_parameters())
        out["master_bytes"] = sum(local_tensor(m).untyped_storage().nbytes() for m in masters)
        out["master_is_dtensor"] = all(hasattr(m, "full_tensor") for m in masters)
        out["model_fp32_bytes"] = sum(p.numel() * 4 for p in Net().parameters())
    return out


class CastLog(TorchDispatchMode):
    """Record every dtype conversion run inside the block: (source dtype, target dtype, shape)."""

    def __enter__(self):
        self.log = []
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype) and isinstance(out, torch.Tensor):
            if out.dtype != args[0].dtype:
                self.log.append((str(args[0].dtype), str(out.dtype), tuple(args[0].shape)))
        return out


def _snapshot(gm, opt):
    tensors = [local_tensor(p).detach().clone() for p in gm.parameters()]
    for state in opt.state.values():
        tensors += [local_tensor(v).clone() for v in state.values() if torch.is_tensor(v)]
    if hasattr(opt, "master_parameters"):
        tensors += [local_tensor(m).detach().clone() for m in opt.master_parameters()]
    return tensors


def _state(gm, opt, scaler):
    return {"model": gm.state_dict(), "optim": opt.state_dict(), "scaler": scaler.state_dict()}


def _save(gm, opt, scaler, ckpt_dir):
    import torch.distributed.checkpoint as dcp
    dcp.save(_state(gm, opt, scaler), checkpoint_id=ckpt_dir)


def _load(gm, opt, scaler, ckpt_dir):
    import torch.distributed.checkpoint as dcp
    init_optimizer_state(opt)  # DCP loads in place: the optimizer's state tensors must exist
    state = _state(gm, opt, scaler)
    dcp.load(state, checkpoint_id=ckpt_dir)
    gm.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    scaler.load_state_dict(state["scaler"])


# ------------------------------------------------------------------ launching
def _worker(rank: int, port: int, out_dir: str, jobs: list) -> None:
    torch.set_num_threads(1)
    init_gloo(rank, WORLD, port)
    try:
        results = {}
        for name, kwargs in jobs:
            try:
                job = train_gpt2 if name.startswith("gpt2") else initialize_sharded if name == "refused_initialize" \
                    else masters_before_shard if name == "refused_masters_first" else train
                results[name] = job(rank=rank, **kwargs)
            except (ValueError, RuntimeError) as err:  # a job named "refused..." expects amp_fx to refuse it
                if not name.startswith("refused"):
                    raise
                results[name] = {"error": str(err)}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def launch(out_dir: str, jobs: list) -> list[dict]:
    """Run ``jobs`` ([(name, train kwargs)]) on 2 spawned ranks; return each rank's {name: result}."""
    paths = [os.path.join(out_dir, f"rank{r}.pt") for r in range(WORLD)]
    spawn(_worker, (free_port(), out_dir, jobs), WORLD, paths)
    return [torch.load(path, weights_only=False) for path in paths]


# ------------------------------------------------------------ Hugging Face GPT-2
def gpt2_batches(steps: int = 3):
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, 64, (4, 8), generator=g) for _ in range(steps)]


def train_gpt2(route: str, rank=None, steps: int = 3):
    """GPT-2 (2 layers, from a config) at O1, sharded per GPT2Block; ``route``: "convert", "backend" or "fp32"."""
    import time

    import transformers
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                     bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, attn_implementation="sdpa")
    model = transformers.GPT2LMHeadModel(config)
    data = gpt2_batches(steps)
    if route == "convert":  # torch.export traces GPT-2, so only the blocks are converted
        net = convert_for_sharding(model, "O1", blocks=GPT2Block, dtype=torch.bfloat16, convert_root=False,
                                   example_kwarg_inputs={"input_ids": data[0][:2], "use_cache": False})
    else:
        net = model
    blocks = list(net.transformer.h)
    if rank is not None:
        from torch.distributed.fsdp import fully_shard
        for block in blocks:
            fully_shard(block)
        fully_shard(net)
    if route == "backend":
        for block in blocks:
            # aot_eager: the amp_fx rewrite without inductor's C++ compile (minutes on 2 shared cores).
            block.compile(backend="amp_fx", options={"level": "O1", "dtype": torch.bfloat16, "inner": "aot_eager"})
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    out = {"loss": {}, "seconds": {}}
    for step, ids in enumerate(data):
        start = time.perf_counter()
        # The converted blocks are specialised on the half batch a rank sees: one process
        # runs both halves and averages their gradients, as FSDP2 does across the ranks.
        halves = ids.chunk(WORLD) if rank is None else [ids.chunk(WORLD)[rank]]
        opt.zero_grad()
        mean = torch.zeros(())
        for part in halves:
            loss = net(input_ids=part, labels=part, use_cache=False).loss / len(halves)
            loss.backward()
            mean += loss.detach()
        opt.step()
        if rank is not None:
            dist.all_reduce(mean)
            mean /= WORLD
        out["loss"][step] = mean.item()
        out["seconds"][step] = time.perf_counter() - start
    out["params"] = {n: full(p) for n, p in net.named_parameters()}
    return out
