"""Train side by side: amp_fx (O1, LossScaler) against torch.autocast + torch.amp.GradScaler, same seed and batches.

    python examples/train_vs_autocast.py                # 200 steps, digits and a char LM, fp16 and bf16
    python examples/train_vs_autocast.py --steps 50

Each task starts both runs from the same weights and feeds the same batches;
the amp_fx loop is the README's recipe (``loss = f(gm(x))`` outside the
converted module). It prints the final loss of each (the trained weights' fp32
loss over the whole data set, so no single batch decides) and their relative
difference.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F
from torch import nn

import amp_fx

TEXT = ("the quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat and "
        "a bird sings in the old oak tree by the river where children play in the summer sun ") * 8


def digits_task(seed: int = 0):
    """(model, batch(step) -> (x, y), everything as one (x, y)): an MLP on scikit-learn's 8x8 digits."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 10))
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))

    def batch(step: int):
        idx = order[(step * 64) % (len(y) - 64):][:64]
        return x[idx], y[idx]

    return model, batch, (x, y)


class CharLM(nn.Module):
    """Embeds the previous ``context`` characters and predicts the next one."""

    def __init__(self, vocab: int, context: int = 8, width: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, 16)
        self.body = nn.Sequential(nn.Linear(16 * context, width), nn.LayerNorm(width), nn.GELU(), nn.Linear(width, vocab))

    def forward(self, ids):
        return self.body(self.embed(ids).flatten(1))


def char_lm_task(seed: int = 0, context: int = 8):
    chars = sorted(set(TEXT))
    ids = torch.tensor([chars.index(c) for c in TEXT])
    windows = ids.unfold(0, context + 1, 1)
    torch.manual_seed(seed)
    model = CharLM(len(chars), context)
    gen = torch.Generator().manual_seed(seed)
    picks = [torch.randint(0, len(windows), (64,), generator=gen) for _ in range(64)]

    def batch(step: int):
        rows = windows[picks[step % len(picks)]]
        return rows[:, :-1], rows[:, -1]

    return model, batch, (windows[:, :-1], windows[:, -1])


TASKS = {"digits": digits_task, "char_lm": char_lm_task}


def run_autocast(model, batch, dtype, steps, lr, loss_fn=F.cross_entropy):
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)
    losses = []
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    return losses


def run_amp_fx(model, batch, dtype, steps, lr, loss_fn=F.cross_entropy):
    gm = amp_fx.convert(model, "O1", dtype=dtype)
    opt = torch.optim.SGD(gm.parameters(), lr=lr, momentum=0.9)
    scaler = amp_fx.LossScaler(dtype=dtype)
    losses = []
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        loss = loss_fn(gm(x), y)  # outside the module, as the README says: gm returns fp32
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    return losses


@torch.no_grad()
def final_loss(model: nn.Module, data) -> float:
    """The trained weights' loss over the whole data set, in fp32 (one number, no batch noise)."""
    x, y = data
    return F.cross_entropy(model(x), y).item()


def compare(task: str, dtype: torch.dtype, steps: int = 200, lr: float = 0.01) -> dict:
    """Final fp32 losses over the whole data set after each run, and their relative difference."""
    model, batch, data = TASKS[task]()
    theirs, ours = copy.deepcopy(model), copy.deepcopy(model)
    first = run_autocast(theirs, batch, dtype, steps, lr)[0]
    run_amp_fx(ours, batch, dtype, steps, lr)  # O1 shares the parameters: ``ours`` is trained
    a, b = final_loss(theirs, data), final_loss(ours, data)
    return {"task": task, "dtype": str(dtype)[6:], "steps": steps, "first": first,
            "autocast": a, "amp_fx": b, "rel_diff": abs(a - b) / abs(a)}


def main(steps: int = 200) -> list[dict]:
    torch.set_num_threads(1)
    rows = [compare(task, dtype, steps) for task in TASKS for dtype in (torch.float16, torch.bfloat16)]
    print(f"{'task':8} {'dtype':9} {'steps':>5} {'first':>7} {'autocast':>9} {'amp_fx':>9} {'rel diff':>9}")
    for r in rows:
        print(f"{r['task']:8} {r['dtype']:9} {r['steps']:5d} {r['first']:7.4f} {r['autocast']:9.4f} "
              f"{r['amp_fx']:9.4f} {r['rel_diff']:9.2e}")
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    main(parser.parse_args().steps)
