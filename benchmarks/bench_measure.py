"""What ``benchmarks/benchmark.py`` measures: step time in interleaved rounds, peak memory, cast kernels.

Timing.  Shared machines change speed several-fold for minutes at a time,
so absolute times from different moments do not compare.  Modes are run in
*rounds*: each round runs every mode for ``repeats`` steps (in a rotated
order, so no mode always follows the same neighbour), and each mode's time
in a round is divided by its baseline's time *in the same round*.  The
reported ratio is the median of those per-round ratios; its spread is the
range between the lower and upper quartile of them.  ``--clock cpu`` times
with this process's CPU time instead of elapsed time: under other jobs' load
a 1-thread CPU step's wall time grows several-fold, its CPU time hardly.

Peak memory.  On CUDA: ``torch.cuda.max_memory_allocated`` over one step.
On CPU no allocator keeps a peak, and ``tracemalloc`` cannot see tensor
storage, so :func:`cpu_profile` runs one step under
``torch.profiler`` with ``profile_memory=True``, which records every
allocation and free of the CPU allocator (activations, gradients, casts,
temporaries inside kernels, optimizer scratch), and takes the largest
running sum: the step's transient peak above what was live when it began.
The table adds the bytes the training state holds when the step begins
(parameters, buffers, optimizer state, fp32 masters: :func:`state_bytes`),
so that O2's second copy of the weights counts against it.  Gradients are
set to None before the step, so they count in the transient part.

GEMM share.  The same profiled CPU steps split op self time into matrix
multiplies, convolutions and attention kernels -- work that autocast and
amp_fx do identically (same kernels, shapes and dtypes) -- and everything
else: casts, elementwise ops, norms, autograd bookkeeping, the optimizer and
the scaler, which is the part of a step amp_fx can change.  The table gives
the GEMM share and the ratio of the "other" time to the baseline's (median
over interleaved profiled rounds).

Casts.  :class:`CastCounter` is a ``TorchDispatchMode`` that counts the
kernels that change a tensor's floating dtype: ``aten._to_copy`` (what
``.to``/``.float()``/autocast's casts become), ``aten.copy_`` between
dtypes, ``prims.convert_element_type`` -- in forward, backward and the
optimizer step alike.  Compiled modes are not counted: their casts are
fused into generated kernels and never reach the dispatcher.

Bytes.  :class:`ByteCounter` (a ``TorchDispatchMode`` too) adds up the bytes
every non-GEMM kernel of the step reads and writes -- casts, the optimizer
and the scaler, norms, elementwise ops -- by kind.  It does not depend on the
CPU: it is the figure to drive down where bf16 is emulated (AVX2), and the one
that explains the time ratios where it is native.  Reads are the tensor
arguments' bytes, writes the outputs' (an in-place or ``out=`` kernel reads
and writes its target); views, allocations of uninitialised memory and
metadata ops move no data and count nothing.  Kernels fused in generated code
(compiled modes) never reach the dispatcher, so those modes are not counted.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CastCounter", "ByteCounter", "BYTE_KINDS", "cpu_profile", "profile_step", "is_gemm", "state_bytes", "RoundTimer", "ModeStats", "spread", "CLOCKS"]


class CastCounter(TorchDispatchMode):
    """Count dtype-changing kernels (and the bytes they write) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.bytes = 0
        self.by_op: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = getattr(func, "overloadpacket", None)
        name = getattr(packet, "__name__", str(func))
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        changed = None
        if name in ("_to_copy", "to", "convert_element_type") and isinstance(out, torch.Tensor) and source is not None:
            changed = out if out.dtype != source.dtype else None
        elif name == "copy_" and len(args) > 1 and isinstance(args[1], torch.Tensor):
            changed = args[0] if args[0].dtype != args[1].dtype else None
        if changed is not None:
            self.count += 1
            self.bytes += changed.numel() * changed.element_size()
            self.by_op[name] = self.by_op.get(name, 0) + 1
        return out


# Ops that move no tensor data: views, metadata, fresh uninitialised memory.
_NO_DATA = {"view", "_unsafe_view", "t", "transpose", "permute", "expand", "as_strided", "detach", "alias", "slice",
            "select", "unsqueeze", "squeeze", "reshape", "empty", "empty_like", "empty_strided", "new_empty",
            "new_empty_strided", "lift_fresh", "_local_scalar_dense", "is_same_size", "split", "split_with_sizes",
            "unbind", "chunk", "narrow", "diagonal", "numpy_T", "view_as", "unflatten", "flatten", "sym_size",
            "sym_stride", "sym_numel", "sym_storage_offset", "set_", "_has_compatible_shallow_copy_type"}
_WRITE_ONLY = {"copy_", "_foreach_copy_", "zero_", "_foreach_zero_", "fill_"}
BYTE_KINDS = ("cast", "optimizer", "norm", "elementwise")


def _tensors(value: Any) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    seen, total = set(), 0
    for t in tensors:
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if key not in seen and t.device.type != "meta":
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def _byte_kind(name: str, args: tuple) -> str:
    if name in ("_to_copy", "to", "convert_element_type"):
        return "cast"
    if name == "copy_" and len(args) > 1 and isinstance(args[1], torch.Tensor) and args[0].dtype != args[1].dtype:
        return "cast"
    if name.startswith(("_foreach_", "_fused_", "_amp_")):
        return "optimizer"
    if "norm" in name:
        return "norm"
    return "elementwise"


class ByteCounter(TorchDispatchMode):
    """Bytes read and written by every non-GEMM kernel while active, by kind (:data:`BYTE_KINDS`).

    Not counted: GEMM, convolution and attention kernels (the same work in every mode), and
    kernels that move no data (views, ``empty``).  Each kernel's read bytes are its distinct
    tensor arguments' sizes, its written bytes its outputs' (an in-place kernel both reads and
    writes its target); a kernel that reads only part of an argument is over-counted alike in
    every mode.
    """

    def __init__(self) -> None:
        super().__init__()
        self.by_kind: dict[str, int] = {kind: 0 for kind in BYTE_KINDS}

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = getattr(func, "overloadpacket", None)
        name = getattr(packet, "__name__", str(func))
        if name in _NO_DATA or is_gemm(f"aten::{name}"):
            return out
        overwritten = args[:1] if name in _WRITE_ONLY else ()  # a target these kernels never read
        read = _nbytes(_tensors((args[len(overwritten):], tuple(kwargs.values()))))
        if name.startswith("_fused_"):  # (params, grads, state...): everything but the gradients is updated
            written = _nbytes(_tensors((args[0], args[2:])))
        elif name.endswith("_") or "out" in kwargs:  # in place / out=
            written = _nbytes(_tensors(args[:1])) + _nbytes(_tensors(kwargs.get("out")))
        else:
            written = _nbytes(_tensors(out))
        self.by_kind[_byte_kind(name, args)] += read + written
        return out


def state_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (shared and tied tensors counted once)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


_GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_int_mm")


def is_gemm(name: str) -> bool:
    """True for the matrix-multiply, convolution and attention kernels (the GEMM-bound work of a step)."""
    return name in _GEMM_OPS or "scaled_dot_product" in name or ("conv" in name and "convert" not in name)


def cpu_profile(fn: Callable[[], Any]) -> tuple[int, float, float]:
    """Run ``fn`` once under the profiler; return its transient peak bytes, GEMM seconds and other op seconds.

    The peak is the largest running sum of the CPU allocator's allocations and
    frees while ``fn`` runs.  GEMM seconds are the self time of GEMM,
    convolution and attention kernels; other seconds the self time of every
    other op (the profiler adds a little to each op, so these are inflated
    alike in every mode; they compare across modes, not with the timed steps).
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and _is_cpu_event(e)]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    averages = prof.key_averages()
    total = sum(a.self_cpu_time_total for a in averages) / 1e6
    gemm = sum(a.self_cpu_time_total for a in averages if is_gemm(a.key)) / 1e6
    return peak, gemm, total - gemm


def _is_cpu_event(event: Any) -> bool:
    device_type = event.device_type()
    return getattr(device_type, "name", str(device_type)).upper().endswith("CPU")


def profile_step(fn: Callable[[], Any], device: str) -> tuple[int, float, float]:
    """Transient peak bytes of ``fn`` above what was allocated when it began, GEMM and other op seconds (NaN on CUDA)."""
    if device == "cuda":
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start, float("nan"), float("nan")
    return cpu_profile(fn)


def spread(values: list[float]) -> tuple[float, float]:
    """Lower and upper quartile of ``values`` (the middle half of the rounds)."""
    if len(values) < 2:
        return (values[0], values[0]) if values else (float("nan"), float("nan"))
    ordered = sorted(values)
    q = statistics.quantiles(ordered, n=4, method="inclusive")
    return q[0], q[2]


@dataclass
class ModeStats:
    """Per-mode timings: one median step time per round."""

    per_round: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.per_round)


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


class RoundTimer:
    """Time named step functions in interleaved rounds; ratios are taken within a round.

    ``clock``: ``"wall"`` (elapsed time, the default) or ``"cpu"`` (this process's CPU
    time: on a machine shared with other jobs it leaves out the time they hold the
    cores, which wall time counts; CPU steps at 1 thread only, since it adds up threads).
    """

    def __init__(self, steps: dict[str, Callable[[], Any]], sync: Callable[[], None] = lambda: None,
                 clock: str = "wall"):
        if clock not in CLOCKS:
            raise ValueError(f"clock must be one of {tuple(CLOCKS)}, got {clock!r}")
        self.steps = steps
        self.sync = sync
        self.clock = CLOCKS[clock]
        self.stats = {name: ModeStats() for name in steps}

    def run(self, rounds: int, repeats: int, on_round: Optional[Callable[[int], None]] = None) -> None:
        names = list(self.steps)
        for r in range(rounds):
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:  # rotate: no mode always runs after the same one
                times = []
                for _ in range(repeats):
                    self.sync()
                    start = self.clock()
                    self.steps[name]()
                    self.sync()
                    times.append(self.clock() - start)
                self.stats[name].per_round.append(statistics.median(times))
            if on_round is not None:
                on_round(r)

    def ratios(self, name: str, baseline: str) -> list[float]:
        """``name``'s step time over ``baseline``'s, one value per round."""
        return [a / b for a, b in zip(self.stats[name].per_round, self.stats[baseline].per_round)]
