"""Training without fp32 masters: O3 + stochastic rounding / Kahan against O2, in accuracy, memory and speed.

    python examples/train_masterless.py             # every table (a few minutes on one thread)
    python examples/train_masterless.py --quick     # fewer epochs and steps, one small timing batch

Four measurements, each in one table:

1. digits MLP (scikit-learn's 8x8 digits, no download): test accuracy after
   Adam at lr 1e-3 and at a small lr 1e-4, for O0 (fp32), O2 (bf16 weights,
   fp32 masters), plain O3 (the optimizer steps the bf16 weights itself) and
   O3 through :class:`amp_fx.runtime.LowPrecisionOptimizer` (nearest,
   stochastic, Kahan).
2. a small language model on a synthetic order-2 Markov source: test loss
   (cross-entropy, nats per token; the source's entropy is the floor).
3. memory on a ~10M-parameter MLP after one Adam step: bytes per parameter
   measured from the tensors each setup holds (weights, gradients, masters or
   compensation, optimizer state).
4. step time of O3 + stochastic rounding against a plain O3 step, whole
   training steps and the optimizer step alone, with the CPU's bf16 support.

Every run starts from the same weights and sees the same batches, so the
differences come from how updates are rounded.
"""

from __future__ import annotations

import argparse
import bisect
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from _common import print_rows, setup_run  # noqa: E402
import amp_fx  # noqa: E402
from amp_fx.runtime import LowPrecisionOptimizer, MasterWeightOptimizer  # noqa: E402
from amp_fx.runtime.training_memory import ROLES, measure_training_memory  # noqa: E402

LOW = torch.bfloat16
# (setup, state dtype): the rows of every table.
RUNS = (("O0", None), ("O2", None), ("O3", None), ("O3+nearest", None), ("O3+stochastic", None),
        ("O3+kahan", None), ("O3+stochastic", LOW), ("O3+kahan", LOW))


def build(model: nn.Module, setup: str, make_optimizer, state_dtype=None, seed: int = 0):
    """(module to train, optimizer to step) for ``setup``: O0, O2, O3, or O3+nearest/stochastic/kahan."""
    if setup == "O0":
        return model, make_optimizer(model.parameters())
    if setup == "O2":  # the model's fp32 parameters are the masters
        gm = amp_fx.convert(model, "O2", dtype=LOW)
        return gm, MasterWeightOptimizer(make_optimizer(model.parameters()), gm)
    gm = amp_fx.convert(model, "O3", dtype=LOW)
    if setup == "O3":  # the optimizer steps the bf16 weights itself
        return gm, make_optimizer(gm.parameters())
    update = setup.split("+", 1)[1]
    return gm, LowPrecisionOptimizer(make_optimizer(gm.parameters()), gm, update=update,
                                     state_dtype=state_dtype, seed=seed)


def label(setup: str, state_dtype) -> str:
    return setup + (" (bf16 state)" if state_dtype == LOW else "")


# ------------------------------------------------------------------ digits
def load_digits(test_size: int = 400, seed: int = 0):
    """(x_train, y_train, x_test, y_test): flattened 8x8 images in [0, 1], labels int64; a fixed split."""
    from sklearn.datasets import load_digits as sk_load_digits

    data = sk_load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    test, train = order[:test_size], order[test_size:]
    return x[train], y[train], x[test], y[test]


def digits_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))


@dataclass
class Result:
    setup: str
    metric: float  # test accuracy in percent (digits) or test loss in nats/token (LM)
    train_loss: float
    seconds: float


def train_digits(setup: str, data, lr: float = 1e-3, epochs: int = 20, state_dtype=None, batch: int = 64) -> Result:
    """Train :func:`digits_mlp` with Adam; test accuracy (percent) and final full-train-set loss."""
    x_train, y_train, x_test, y_test = data
    gm, opt = build(digits_mlp(), setup, lambda p: torch.optim.Adam(p, lr=lr), state_dtype)
    gen = torch.Generator().manual_seed(1)
    start = time.perf_counter()
    for _ in range(epochs):
        order = torch.randperm(len(y_train), generator=gen)
        for i in range(0, len(order), batch):
            idx = order[i:i + batch]
            opt.zero_grad()
            F.cross_entropy(gm(x_train[idx]).float(), y_train[idx]).backward()
            opt.step()
    seconds = time.perf_counter() - start
    with torch.no_grad():
        accuracy = 100.0 * (gm(x_test).float().argmax(1) == y_test).float().mean().item()
        train_loss = F.cross_entropy(gm(x_train).float(), y_train).item()
    return Result(label(setup, state_dtype), accuracy, train_loss, seconds)


# -------------------------------------------------------- language model
def markov_tokens(n: int, vocab: int = 32, seed: int = 0) -> tuple[torch.Tensor, float]:
    """``n`` tokens from a random order-2 Markov source, and the source's entropy (nats/token)."""
    gen = torch.Generator().manual_seed(seed)
    # Peaked next-token distributions (a few likely successors per context), as text has.
    logits = torch.randn(vocab, vocab, vocab, generator=gen) * 2.5
    probs = logits.softmax(-1)
    uniform = torch.rand(n, generator=gen, dtype=torch.float64).tolist()
    cdf = probs.double().cumsum(-1).tolist()
    seq = [0, 1]
    for i in range(2, n):  # sequential by nature; plain Python lists keep it fast
        row = cdf[seq[-2]][seq[-1]]
        seq.append(min(bisect.bisect_right(row, uniform[i]), vocab - 1))
    tokens = torch.tensor(seq, dtype=torch.int64)
    # Entropy of the source, weighted by how often each context occurs in the sample.
    entropy_per_context = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
    counts = torch.zeros(vocab, vocab)
    counts.index_put_((tokens[:-2], tokens[1:-1]), torch.ones(n - 2), accumulate=True)
    return tokens, float((entropy_per_context * counts).sum() / counts.sum())


class TrigramLM(nn.Module):
    """Embed the previous two tokens, an MLP, next-token logits: a small neural language model."""

    def __init__(self, vocab: int = 32, dim: int = 32, hidden: int = 256):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.fc1 = nn.Linear(2 * dim, hidden)
        self.fc2 = nn.Linear(hidden, vocab)

    def forward(self, context: torch.Tensor) -> torch.Tensor:
        h = self.embed(context).flatten(1)
        return self.fc2(F.gelu(self.fc1(h)))


def lm_data(n_train: int = 60_000, n_test: int = 20_000, vocab: int = 32):
    """(train contexts, train targets, test contexts, test targets, source entropy)."""
    tokens, entropy = markov_tokens(n_train + n_test, vocab)
    context = torch.stack([tokens[:-2], tokens[1:-1]], 1)
    target = tokens[2:]
    return context[:n_train], target[:n_train], context[n_train:], target[n_train:], entropy


def train_lm(setup: str, data, lr: float = 3e-3, steps: int = 600, state_dtype=None, batch: int = 256) -> Result:
    """Train :class:`TrigramLM` with AdamW; the test loss in nats per token."""
    x_train, y_train, x_test, y_test, _ = data
    torch.manual_seed(0)
    gm, opt = build(TrigramLM(), setup, lambda p: torch.optim.AdamW(p, lr=lr, weight_decay=0.01), state_dtype)
    gen = torch.Generator().manual_seed(1)
    start = time.perf_counter()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        idx = torch.randint(len(y_train), (batch,), generator=gen)
        opt.zero_grad()
        loss = F.cross_entropy(gm(x_train[idx]).float(), y_train[idx])
        loss.backward()
        opt.step()
    seconds = time.perf_counter() - start
    with torch.no_grad():
        test_loss = F.cross_entropy(gm(x_test).float(), y_test).item()
    return Result(label(setup, state_dtype), test_loss, loss.item(), seconds)


# ---------------------------------------------------------------- memory
def big_mlp(width: int = 1536, depth: int = 5, d_io: int = 256, seed: int = 0) -> nn.Module:
    """An MLP of ~10.2M parameters (the default sizes)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(d_io, width), nn.GELU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.GELU()]
    layers.append(nn.Linear(width, d_io))
    return nn.Sequential(*layers)


def measure_memory(setup: str, state_dtype=None, batch: int = 32):
    """MemoryReport of ``setup`` with Adam on :func:`big_mlp`, after one step (gradients still held)."""
    gm, opt = build(big_mlp(), setup, lambda p: torch.optim.Adam(p, lr=1e-4), state_dtype)
    x = torch.randn(batch, 256, generator=torch.Generator().manual_seed(0))
    opt.zero_grad()
    F.mse_loss(gm(x).float(), x).backward()
    opt.step()
    return measure_training_memory(gm, opt)


# ----------------------------------------------------------------- speed
def step_times(batch: int, repeats: int = 5, runs=(("O3", None), ("O3+stochastic", None), ("O3+stochastic", LOW))):
    """{label: (median whole-step seconds, median optimizer-step seconds)} on :func:`big_mlp`, interleaved."""
    x = torch.randn(batch, 256, generator=torch.Generator().manual_seed(0))
    setups = {label(s, d): build(big_mlp(), s, lambda p: torch.optim.Adam(p, lr=1e-4), d) for s, d in runs}
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in setups}
    for i in range(repeats + 1):
        for name, (gm, opt) in setups.items():  # interleaved, so load on the machine hits all alike
            start = time.perf_counter()
            opt.zero_grad()
            F.mse_loss(gm(x).float(), x).backward()
            mid = time.perf_counter()
            opt.step()
            end = time.perf_counter()
            if i:  # the first round warms up allocations
                times[name].append((end - start, end - mid))
    return {k: (statistics.median(t for t, _ in v), statistics.median(o for _, o in v)) for k, v in times.items()}


def bf16_support() -> str:
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = f.read()
        flags = ", ".join(flag for flag in ("avx512_bf16", "amx_bf16") if flag in cpu.split()) or "neither"
    except OSError:
        flags = "unknown"
    return f"torch.ops.mkldnn._is_mkldnn_bf16_supported() = {torch.ops.mkldnn._is_mkldnn_bf16_supported()}; " \
           f"cpu flags avx512_bf16/amx_bf16: {flags}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer epochs/steps and a smaller timing batch")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    setup_run()
    torch.set_num_threads(args.threads)
    epochs, steps, timing_batches = (8, 300, (256,)) if args.quick else (20, 600, (1024, 4096))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); {bf16_support()}")

    digits = load_digits()
    rows = [("setup", "acc % (lr 1e-3)", "train loss", "acc % (lr 1e-4)", "train loss", "s (lr 1e-3)")]
    for setup, state_dtype in RUNS:
        normal = train_digits(setup, digits, 1e-3, epochs, state_dtype)
        small = train_digits(setup, digits, 1e-4, epochs, state_dtype)
        rows.append((normal.setup, f"{normal.metric:.2f}", f"{normal.train_loss:.4f}", f"{small.metric:.2f}",
                     f"{small.train_loss:.4f}", f"{normal.seconds:.2f}"))
    print_rows(f"digits MLP: {len(digits[1])} train / {len(digits[3])} test, Adam, {epochs} epochs, batch 64", rows)

    lm = lm_data()
    rows = [("setup", "test loss (lr 3e-3)", "test loss (lr 1e-4)", "s (lr 3e-3)")]
    for setup, state_dtype in RUNS:
        normal = train_lm(setup, lm, 3e-3, steps, state_dtype)
        small = train_lm(setup, lm, 1e-4, steps, state_dtype)
        rows.append((normal.setup, f"{normal.metric:.4f}", f"{small.metric:.4f}", f"{normal.seconds:.2f}"))
    print_rows(f"trigram LM on an order-2 Markov source (entropy {lm[4]:.4f} nats/token): AdamW, "
               f"{steps} steps, batch 256", rows)

    rows = [("setup", *ROLES, "total", "state dtypes")]
    for setup, state_dtype in (("O2", None), ("O3", None), ("O3+nearest", None), ("O3+stochastic", None),
                               ("O3+stochastic", LOW), ("O3+kahan", None), ("O3+kahan", LOW)):
        report = measure_memory(setup, state_dtype)
        states = ", ".join(f"{k} {v}" for k, v in report.state_dtypes.items())
        rows.append((label(setup, state_dtype), *report.row(), states))
    print_rows(f"bytes per parameter after one Adam step, measured: MLP of {report.params:,} parameters", rows)

    rows = [("batch", "setup", "whole step ms", "vs O3", "optimizer step ms", "vs O3")]
    for batch in timing_batches:
        times = step_times(batch)
        base_step, base_opt = times["O3"]
        for name, (step, opt) in times.items():
            rows.append((batch, name, f"{step * 1e3:.0f}", f"{step / base_step:.2f}x", f"{opt * 1e3:.0f}",
                         f"{opt / base_opt:.2f}x"))
    print_rows(f"step time, Adam on the same MLP, median of 5 interleaved steps; O3 = the optimizer "
               f"stepping bf16 weights itself", rows)

if __name__ == "__main__":
    main()
