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
