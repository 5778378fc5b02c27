"""Per-step time of O2's master-weight step against autocast + an fp32 optimizer and against O1 (issue 14).

Run from a checkout::

    python benchmarks/bench_o2_step.py                      # AdamW, 9 rounds x 3 steps, 1 thread
    python benchmarks/bench_o2_step.py --optimizer sgd --rounds 15

The model is an MLP of 6 x (Linear 1024->1024, GELU, LayerNorm), batch 256,
bf16 on CPU, MSE loss computed outside the module. Every mode trains its own
copy with the same optimizer class and learning rate:

- ``autocast fused``: ``torch.autocast`` + the optimizer over the fp32
  parameters at its fastest setting on the device (AdamW/Adam
  ``fused=True``, SGD ``foreach=True``); no scaler, as PyTorch's bf16 recipe.
  The baseline of every ratio (issue 27: a comparison counts only against
  the fastest optimizer setting torch offers).
- ``autocast``: the same with ``foreach``/``fused`` left unset (torch steps
  CPU tensors one at a time).
- ``O1 fused``: ``amp_fx.convert(model, "O1")`` and the fastest optimizer over
  its (fp32) parameters, with ``amp_fx.LossScaler`` (bf16: no scaling, but the
  inf/NaN check and skip).
- ``O2``: ``amp_fx.convert(model, "O2")`` + ``MasterWeightOptimizer`` over
  the fp32 masters + ``LossScaler``: the step as shipped (the fused step
  ``MasterWeightOptimizer`` chooses where the optimizer left it unset, run chunk
  by chunk with each chunk's gradient copy into kept fp32 buffers before it and
  its copy back after it: ``amp_fx/runtime/chunked_step.py``).
- ``O2 plain step``: ``O2`` held to the plain route (a no-op step pre-hook on the
  inner optimizer keeps the chunked step off): one copy of all gradients in,
  the optimizer's step over all masters, one copy of all masters out, the inf/NaN
  check on the fp32 copies. ``O2`` against it is what issue 41's chunked step buys.
- ``O2 fresh grads``: the same with ``keep_grad_buffers=False`` (the masters'
  gradients allocated afresh every step, as before issue 27).
- ``O2 foreach`` (SGD only): the same with ``foreach=True``, the SGD step O2
  chose before issue 27.
- ``O2 fp32 accum``: the same with ``fp32_grad_accumulation=True`` (each low
  gradient added into the master's fp32 gradient during backward).
- ``O2 loop``: the same with ``foreach=False``, i.e. the one-at-a-time step
  the inner optimizer took before ``MasterWeightOptimizer`` chose one.
- ``O2 bf16 norms``: ``O2`` with ``policy={"op:layer_norm": "low"}``: the
  norms in bf16, as CPU autocast runs them. Not a recommendation; it
  measures what O2's fp32 norms cost against autocast.

With ``--compiled-update`` one more mode, ``O2 compiled update``: ``O2`` with
``MasterWeightOptimizer(..., compiled_update=True)`` (SGD, Adam or AdamW; the
update of each parameter group one inductor-compiled pass that reads the bf16
gradients as they are and writes optimizer state, fp32 master and bf16
parameter: ``amp_fx/runtime/compiled_update.py``). Its first step makes the
optimizer state on the chunked route and its second compiles (seconds), both
in the warm-up. ``--compiled-update aot_eager`` names another backend.

With ``--one-pass`` (SGD only) one more mode, the prototype the compiled update
grew from (kept for comparison; not what amp_fx ships): ``O2 one pass`` checks the module's bf16 gradients for inf/NaN and
then updates momentum, fp32 master and bf16 parameter in one inductor-compiled
pass that reads the bf16 gradients as they are (no fp32 gradient copies, no
separate copy back): what issue 41's "update and low-precision copy in one
pass over memory" would buy on this CPU. It compiles (tens of seconds) before
the rounds. ``--sgd-impl fused`` makes the autocast baseline's SGD
``fused=True`` (torch's fastest SGD on CPU) instead of ``foreach=True``.

Timing: modes run in interleaved rounds (rotated order), ``repeats`` steps
each; a mode's time in a round is the median of its steps, divided by the
baseline's in the same round; the table gives the median of those per-round
ratios and their quartiles. The clock is this process's CPU time by default
(``--clock cpu``; ``wall`` for elapsed time): on a machine shared with other
jobs it leaves out the time they hold the cores. ``update`` is the part of the step after
``backward()``: scaler check and unscale, gradient copies, optimizer step,
copy back.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

import amp_fx  # noqa: E402
from bench_measure import spread  # noqa: E402
from benchmark import cpu_capability  # noqa: E402

__all__ = ["main", "make_mlp", "build_modes"]

BASELINE = "autocast fused"
OPTIMIZERS: dict[str, tuple[type, dict, dict]] = {
    # name -> (class, options, the faster implementation an autocast user can choose)
    "adamw": (torch.optim.AdamW, {"lr": 1e-4}, {"fused": True}),
    "adam": (torch.optim.Adam, {"lr": 1e-4}, {"fused": True}),
    "sgd": (torch.optim.SGD, {"lr": 1e-4, "momentum": 0.9}, {"foreach": True}),
}


def make_mlp(width: int = 1024, depth: int = 6) -> nn.Module:
    """``depth`` x (Linear width->width, GELU, LayerNorm)."""
    return nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width))])


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = time.perf_counter  # set by main(): --clock


class Mode:
    """One way to train: a module to run, an optimizer, an optional scaler and autocast; ``step()`` times its update."""

    def __init__(self, module: Callable, opt: Any, scaler: Any, autocast: bool, data: tuple) -> None:
        self.module, self.opt, self.scaler, self.autocast, self.data = module, opt, scaler, autocast, data
        self.last_update = float("nan")

    def step(self) -> None:
        x, y = self.data
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            out = self.module(x)
        loss = F.mse_loss(out.float(), y)
        loss = loss if self.scaler is None else self.scaler.scale(loss)
        loss.backward()
        start = clock()
        if self.scaler is None:
            self.opt.step()
        else:
            self.scaler.step(self.opt)
            self.scaler.update()
        self.last_update = clock() - start

    def skipped(self) -> int:
        return int(getattr(self.scaler, "skipped_steps", 0) or 0)


class OnePassO2(Mode):
    """Prototype (SGD with momentum): O2 with the update and the bf16 copy in one compiled pass (module docstring)."""

    def __init__(self, base: nn.Module, options: dict, data: tuple, backend: str = "inductor") -> None:
        gm = amp_fx.convert(copy.deepcopy(base), "O2", dtype=torch.bfloat16)
        super().__init__(gm, None, None, False, data)
        named = [(n, p) for n, p in gm.named_parameters() if p.requires_grad]
        originals = getattr(gm, "amp_fx_masters", None) or {}  # the fp32 values the bf16 parameters were cast from
        self.lows = [p for _, p in named]
        # (fp32 norms: their own master, written twice)
        self.masters = [originals.get(n, p).detach().float().clone() for n, p in named]
        self.bufs = [torch.zeros_like(m) for m in self.masters]
        self.lr, self.momentum = options["lr"], options["momentum"]
        self.found, self.one = torch.zeros(()), torch.ones(())

        def update(masters: list, grads: list, bufs: list, lows: list, lr: float, momentum: float) -> None:
            for master, grad, buf, low in zip(masters, grads, bufs, lows):
                new_buf = buf * momentum + grad.float()  # (buf starts at 0: the first step's buf = grad, as torch's)
                new_master = master - lr * new_buf
                buf.copy_(new_buf)
                master.copy_(new_master)
                low.copy_(new_master)

        self.update = torch.compile(update, backend=backend, fullgraph=True, dynamic=False)

    def step(self) -> None:
        x, y = self.data
        for p in self.lows:
            p.grad = None
        loss = F.mse_loss(self.module(x).float(), y)
        loss.backward()
        start = clock()
        grads = [p.grad for p in self.lows]
        self.found.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_(grads, self.found, self.one)  # bf16: no scale, the check only
        if not self.found.item():
            with torch.no_grad():
                self.update(self.masters, grads, self.bufs, [p.data for p in self.lows], self.lr, self.momentum)
        self.last_update = clock() - start


def build_modes(base: nn.Module, data: tuple, optimizer: str, one_pass: bool = False,
                sgd_impl: str = "foreach", compiled_update: Optional[str] = None) -> dict[str, Mode]:
    """Every mode on its own deep copy of ``base``."""
    cls, options, faster = OPTIMIZERS[optimizer]
    if optimizer == "sgd":
        faster = {sgd_impl: True}
    modes: dict[str, Mode] = {}
    names = [BASELINE, "autocast", "O1 fused", "O2", "O2 plain step", "O2 fresh grads", "O2 fp32 accum", "O2 loop", "O2 bf16 norms"]
    if optimizer == "sgd":
        names.insert(6, "O2 foreach")  # the implementation O2 chose for SGD before the lean update
    if compiled_update:
        names.insert(4, "O2 compiled update")
    for name in names:
        model = copy.deepcopy(base)
        impl = (faster if name.endswith("fused") else {"foreach": False} if name.endswith("loop")
                else {"foreach": True} if name.endswith("foreach") else {})
        if name.startswith("autocast"):
            modes[name] = Mode(model, cls(model.parameters(), **options, **impl), None, True, data)
        elif name.startswith("O1"):
            gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16)
            scaler = amp_fx.LossScaler(dtype=torch.bfloat16)
            modes[name] = Mode(gm, cls(gm.parameters(), **options, **impl), scaler, False, data)
        else:
            # "O2 bf16 norms" runs layer_norm in bf16, as CPU autocast does (not a recommendation: it shows
            # how much of O2's step the fp32 norms cost against autocast's bf16 ones)
            policy = {"op:layer_norm": "low"} if name == "O2 bf16 norms" else None
            gm = amp_fx.convert(model, "O2", dtype=torch.bfloat16, policy=policy)
            keep = name != "O2 fresh grads"
            mw = amp_fx.MasterWeightOptimizer(cls(model.parameters(), **options, **impl), gm, keep_grad_buffers=keep,
                                              fp32_grad_accumulation=name == "O2 fp32 accum",
                                              compiled_update=compiled_update if name == "O2 compiled update" else False)
            if name == "O2 plain step":
                mw.optimizer.register_step_pre_hook(lambda *args: None)  # a step hook keeps the chunked step off
            modes[name] = Mode(gm, mw, amp_fx.LossScaler(dtype=torch.bfloat16), False, data)
    if one_pass:
        if optimizer != "sgd":
            raise SystemExit("--one-pass is a prototype for SGD with momentum only")
        modes["O2 one pass"] = OnePassO2(base, options, data)
    return modes


def time_rounds(modes: dict[str, Mode], rounds: int, repeats: int) -> dict[str, dict[str, list[float]]]:
    """Per mode, per round: the median step seconds and median update seconds of ``repeats`` steps."""
    names = list(modes)
    out = {name: {"step": [], "update": []} for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:  # rotate: no mode always follows the same one
            steps, updates = [], []
            for _ in range(repeats):
                start = clock()
                modes[name].step()
                steps.append(clock() - start)
                updates.append(modes[name].last_update)
            out[name]["step"].append(statistics.median(steps))
            out[name]["update"].append(statistics.median(updates))
    return out


def ratio_cell(values: list[float], base: list[float]) -> str:
    ratios = [a / b for a, b in zip(values, base)]
    low, high = spread(ratios)
    return f"{statistics.median(ratios):5.2f} [{low:.2f}, {high:.2f}]"


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizer", default="adamw", choices=tuple(OPTIMIZERS))
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--width", type=int, default=1024, help="the MLP's width (4096: 64 MiB fp32 weights)")
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1: a shared machine)")
    parser.add_argument("--one-pass", action="store_true",
                        help="SGD: add the prototype 'O2 one pass' (update + bf16 copy in one compiled pass; docstring)")
    parser.add_argument("--compiled-update", nargs="?", const="inductor", default=None, metavar="BACKEND",
                        help="add 'O2 compiled update' (MasterWeightOptimizer(compiled_update=BACKEND), default inductor)")
    parser.add_argument("--sgd-impl", default="foreach", choices=("foreach", "fused"),
                        help="SGD: the autocast baseline's implementation (fused: torch's fastest on CPU)")
    parser.add_argument("--clock", default="cpu", choices=tuple(CLOCKS),
                        help="cpu: this process's CPU time (default: on a shared machine it leaves out the time other "
                             "processes hold the cores); wall: elapsed time")
    args = parser.parse_args(argv)
    global clock
    clock = CLOCKS[args.clock]
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    base = make_mlp(args.width, args.depth)
    data = (torch.randn(args.batch, args.width), torch.randn(args.batch, args.width))
    modes = build_modes(base, data, args.optimizer, args.one_pass, args.sgd_impl, args.compiled_update)
    inner = modes["O2"].opt.param_groups[0]
    print(f"torch {torch.__version__}, {args.threads} thread(s); {cpu_capability()}")
    print(f"torch.ops.mkldnn._is_mkldnn_bf16_supported() = {torch.ops.mkldnn._is_mkldnn_bf16_supported()}; "
          f"baseline: {BASELINE} ({({args.sgd_impl: True} if args.optimizer == 'sgd' else OPTIMIZERS[args.optimizer][2])})")
    print(f"MLP {args.depth} x (Linear {args.width}->GELU->LayerNorm), {sum(p.numel() for p in base.parameters())} parameters, "
          f"batch {args.batch}, bf16, {args.optimizer}; O2's inner step: foreach={inner['foreach']} "
          f"fused={inner.get('fused')}; {args.rounds} rounds x {args.repeats} steps; clock: {args.clock}")
    for name, mode in modes.items():
        start = time.perf_counter()
        for _ in range(max(args.warmup, 3) if name == "O2 compiled update" else args.warmup):  # (state, compile)
            mode.step()
        if name == "O2 compiled update":
            print(f"O2 compiled update: warm-up (first step, compile) {time.perf_counter() - start:.1f} s wall")
    print(f"O2's route: {modes['O2'].opt.last_step_route}; O2 plain step's: {modes['O2 plain step'].opt.last_step_route}")
    if "O2 compiled update" in modes:
        print(f"O2 compiled update's route: {modes['O2 compiled update'].opt.last_step_route}")
    times = time_rounds(modes, args.rounds, args.repeats)
    base_t = times[BASELINE]
    print(f"\n{'mode':19} {'step ms':>8} {'ratio to baseline':>20} {'update ms':>10} {'update ratio':>20} skipped")
    for name, t in times.items():
        print(f"{name:19} {statistics.median(t['step']) * 1e3:8.1f} {ratio_cell(t['step'], base_t['step']):>20} "
              f"{statistics.median(t['update']) * 1e3:10.1f} {ratio_cell(t['update'], base_t['update']):>20} "
              f"{modes[name].skipped():7d}")
    return times


if __name__ == "__main__":
    main()
