"""fp8 GEMMs on a GPU: step time of bf16 autocast, amp_fx O1 bf16, amp_fx fp8 (each recipe) and torchao float8.

Two models, each trained a few steps under ``torch.compile`` (inductor):

- a GEMM-bound MLP: 4 x Linear(8192, 8192), 16384 tokens;
- a GPT block stack: d_model 4096, 2 pre-norm blocks, 4 x 2048 tokens.

Printed: one table, each row's step time and its ratio to bf16 autocast's
(measured in the same run).  Targets on H100/H200: amp_fx fp8 >= 1.3x faster
than bf16 autocast on the MLP, and no slower than torchao's
``convert_to_float8_training`` with the same recipe (<= 1.05x its step time).
amp_fx rows use the amp_fx compiler backend (``amp_fx.backend(inner="inductor",
fp8=...)``).  Delayed scaling is run eagerly through ``amp_fx.convert`` (amp_fx
refuses it under torch.compile: its backward writes the amax history), so its
row is not compiled.

    python examples/gpu_fp8.py            # the full run (about 3 minutes on an H100)
    python examples/gpu_fp8.py --smoke    # tiny shapes on CPU, aot_eager: checks the script, measures nothing
"""

from __future__ import annotations

import argparse
import copy
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_fx

warnings.filterwarnings("ignore")


class MLP(nn.Module):
    def __init__(self, d: int, layers: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(layers))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x)
        return x


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class GPTStack(nn.Module):
    def __init__(self, d: int, heads: int, layers: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _autocast(model, device):
    def forward(x):
        with torch.autocast(device, dtype=torch.bfloat16):
            return model(x)
    return forward


def _variants(model, example, device, backend):
    """(name, build) of every way to run ``model``: ``build(copy)`` returns the forward to time."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def compiled(fn):
        return torch.compile(fn, backend=backend)

    def amp_fx_compiled(m, **options):
        # The amp_fx backend: Dynamo's graph rewritten, then handed to the same inner backend.
        return torch.compile(m, backend=amp_fx.backend(level="O1", dtype=torch.bfloat16, inner=backend, **options))

    yield "bf16 autocast", lambda m: compiled(_autocast(m, device))
    yield "amp_fx O1 bf16", lambda m: amp_fx_compiled(m)
    for recipe in ("tensorwise", "rowwise"):
        yield f"amp_fx O1 fp8 {recipe}", lambda m, r=recipe: amp_fx_compiled(m, fp8={"recipe": r, "size_rule": "all"})
    for recipe in ("tensorwise", "rowwise"):
        yield f"torchao float8 {recipe}", lambda m, r=recipe: compiled(_autocast(
            convert_to_float8_training(m, config=Float8LinearConfig.from_recipe_name(r)), device))
    yield "amp_fx O1 fp8 delayed (eager)", lambda m: amp_fx.convert(
        m, "O1", dtype=torch.bfloat16, example_inputs=(example,), fp8={"recipe": "delayed", "size_rule": "all"})


def _step_time(forward, params, x, steps, warmup, device):
    opt = torch.optim.SGD(params, lr=1e-4)

    def step():
        opt.zero_grad(set_to_none=True)
        forward(x).float().pow(2).mean().backward()
        opt.step()

    for _ in range(warmup):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU with aot_eager (checks the script)")
    args = parser.parse_args()
    if args.smoke:
        device, backend, steps, warmup = "cpu", "aot_eager", 1, 1
        cases = [("MLP 4x64, 256 tokens", lambda: MLP(64), (256, 64)),
                 ("GPT 2 blocks d64", lambda: GPTStack(64, 4, 2), (2, 32, 64))]
    else:
        assert torch.cuda.is_available(), "this example measures a GPU; --smoke checks it on CPU"
        device, backend, steps, warmup = "cuda", "inductor", 10, 3
        cases = [("MLP 4x8192, 16384 tokens", lambda: MLP(8192), (16384, 8192)),
                 ("GPT 2 blocks d4096, 4x2048 tokens", lambda: GPTStack(4096, 32, 2), (4, 2048, 4096))]
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    rows = []
    for case, make, shape in cases:
        torch.manual_seed(0)
        base = make().to(device)
        x = torch.randn(*shape, device=device)
        reference = None
        for name, build in _variants(base, x, device, backend):
            model = copy.deepcopy(base)
            try:
                forward = build(model)
                seconds = _step_time(forward, list(model.parameters()) if not hasattr(forward, "parameters")
                                     else list(forward.parameters()), x, steps, warmup, device)
            except Exception as error:  # a row that cannot run says why; the table goes on
                rows.append((case, name, None, f"{type(error).__name__}: {str(error).splitlines()[0][:60]}"))
                continue
            reference = reference or seconds
            rows.append((case, name, seconds, f"{reference / seconds:.2f}x"))
            torch._dynamo.reset()
    print(f"{'model':<36} {'run':<32} {'step ms':>9}  vs bf16 autocast")
    for case, name, seconds, ratio in rows:
        shown = f"{seconds * 1e3:9.2f}" if seconds is not None else f"{'-':>9}"
        print(f"{case:<36} {name:<32} {shown}  {ratio}")


if __name__ == "__main__":
    main()
