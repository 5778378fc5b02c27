"""Test probes: record which ATen ops ran and in which dtypes, and which graphs a backend was handed."""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode

GEMM_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "convolution", "_convolution",
                      "mkldnn_rnn_layer", "_scaled_dot_product_flash_attention_for_cpu", "addmv", "mv", "addbmm"})
CAST_OPS = frozenset({"_to_copy"})


class OpRecorder(TorchDispatchMode):
    """Record (op name, input float dtypes) for every ATen op dispatched inside the block."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dtypes = tuple(a.dtype for a in torch.utils._pytree.tree_leaves((args, kwargs))
                       if isinstance(a, torch.Tensor) and a.is_floating_point())
        self.calls.append((func.overloadpacket.__name__, dtypes))
        return func(*args, **kwargs)

    def dtypes_of(self, names) -> dict[str, set]:
        """op name -> set of input dtypes it saw, for the ops in ``names``."""
        out = defaultdict(set)
        for name, dtypes in self.calls:
            if name in names:
                out[name].update(dtypes)
        return dict(out)

    def count(self, names) -> int:
        """How many calls of the ops in ``names`` were dispatched."""
        return sum(1 for name, _ in self.calls if name in names)


def aot_capture():
    """aot_autograd inner backend that records the forward and backward ATen graphs."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    fw, bw = [], []

    def keep(store):
        def compiler(gm, example_inputs):
            store.append(gm)
            return make_boxed_func(gm.forward)
        return compiler

    return aot_autograd(fw_compiler=keep(fw), bw_compiler=keep(bw)), fw, bw


class Capture:
    """Inner backend that keeps the graphs amp_fx hands over and runs them eagerly."""

    def __init__(self):
        self.graphs: list[fx.GraphModule] = []
        self.autocast_on: list[bool] = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        self.autocast_on.append(torch.is_autocast_enabled("cpu"))
        return gm.forward


# GEMM ops whose FLOPs the run-time measure counts, with how their FLOPs follow from the shapes.
def _mm_flops(a, b) -> int:
    return 2 * a.shape[0] * a.shape[1] * b.shape[1]


def _bmm_flops(a, b) -> int:
    return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]


def _conv_flops(x, w) -> int:
    out_elements_per_channel = 1
    for size in x.shape[2:]:  # an upper bound for strided/padded convs is not needed: same shapes on both sides
        out_elements_per_channel *= size
    return 2 * x.shape[0] * w.numel() * out_elements_per_channel


class GemmFlops(TorchDispatchMode):
    """Count the GEMM FLOPs that ran in each dtype, at dispatch (mm, addmm, bmm, baddbmm, linear, convolution).

    ``low_share(dtype)`` is the share of FLOPs whose operands ran in ``dtype``.  The
    measure runs below autocast and below any graph, so it reads eager autocast, a
    converted module and a captured one alike.  (Convolution FLOPs use the input's
    spatial size, so compare equal shapes only.)
    """

    def __init__(self):
        super().__init__()
        self.flops: dict[torch.dtype, int] = defaultdict(int)

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # torch.compile compiles as if this mode were absent and it sees the compiled code's ops when they run
        # (otherwise Dynamo runs every frame eagerly under it, and the measure would read another program).
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        flops = 0
        if name in ("mm",) and len(tensors) >= 2:
            flops = _mm_flops(tensors[0], tensors[1])
        elif name == "addmm" and len(tensors) >= 3:
            flops = _mm_flops(tensors[1], tensors[2])
        elif name == "bmm" and len(tensors) >= 2:
            flops = _bmm_flops(tensors[0], tensors[1])
        elif name == "baddbmm" and len(tensors) >= 3:
            flops = _bmm_flops(tensors[1], tensors[2])
        elif name in ("convolution", "_convolution", "convolution_backward") and len(tensors) >= 2:
            x, w = (tensors[1], tensors[2]) if name == "convolution_backward" else (tensors[0], tensors[1])
            flops = _conv_flops(x, w) * (2 if name == "convolution_backward" else 1)
        if flops:
            dtype = tensors[1].dtype if name in ("addmm", "baddbmm") else tensors[0].dtype
            self.flops[dtype] += flops
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.flops.values())

    def low_share(self, dtype: torch.dtype = torch.bfloat16) -> float:
        """The share of GEMM FLOPs that ran in ``dtype`` (0 when no GEMM ran)."""
        return self.flops.get(dtype, 0) / self.total if self.total else 0.0


def captured_because(model, *fragments, level="O1", **convert_kwargs):
    """``convert(model)`` where no whole graph exists: it captures from the call, and its report keeps the
    whole-graph capture's error, which names every fragment (the construct, its line, the ways out).

    Returns the converted module and that error's text.
    """
    import amp_fx

    converted = amp_fx.convert(model, level, **convert_kwargs)
    report = converted.amp_report
    assert report.route == "dynamo", report.route
    message = report.trace_failure
    missing = [fragment for fragment in fragments if fragment not in message]
    assert not missing, (missing, message)
    assert all(line in str(report) for line in message.splitlines())  # print(report) shows it
    return converted, message
