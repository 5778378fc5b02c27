"""Which device type a model or graph computes on: the one rule every part of amp_fx uses.

``convert()`` and the torch.compile backend each call :func:`device_type_of`
once per conversion and keep the answer in ``PassContext.device_type``;
passes read it from there (the default low dtype, which autocast regions are
the model's own, whether GEMM padding pays, which ``custom_fwd`` applies).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Optional

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils._pytree import tree_leaves

__all__ = ["device_type_of", "low_dtype_for"]

# node.meta keys that hold a node's (fake) value: Dynamo's, and make_fx / torch.export's.
_VALUE_KEYS = ("example_value", "val")


def _node_values(gm: fx.GraphModule) -> Iterator[Any]:
    """The values the tracer recorded on ``gm``'s nodes, placeholders first."""
    nodes = list(gm.graph.nodes)
    for node in [n for n in nodes if n.op == "placeholder"] + [n for n in nodes if n.op != "placeholder"]:
        for key in _VALUE_KEYS:
            if key in node.meta:
                yield from tree_leaves(node.meta[key])
                break


def _evidence(module: Optional[nn.Module], example_inputs: Iterable[Any]) -> Iterator[torch.Tensor]:
    """Every tensor that says where the model runs, most telling first."""
    for value in tree_leaves(list(example_inputs)):
        if isinstance(value, torch.Tensor):
            yield value
    if isinstance(module, fx.GraphModule):
        for value in _node_values(module):
            if isinstance(value, torch.Tensor):
                yield value
    if module is not None:
        yield from module.parameters()
        yield from module.buffers()


def device_type_of(module: Optional[nn.Module] = None, example_inputs: Iterable[Any] = ()) -> str:
    """The device type ("cpu", "cuda", ...) of the floating tensors ``module`` computes with.

    Evidence, in order; the first floating tensor decides:

    1. ``example_inputs`` (nested tuples, lists and dicts too).  A Dynamo
       graph's example inputs include its lifted parameters.
    2. When ``module`` is a GraphModule, the values its tracer recorded on the
       nodes (Dynamo's ``example_value``, torch.export's ``val``: fake tensors
       carry the device of the real ones), placeholders first.
    3. ``module``'s parameters, then its buffers.

    When no floating tensor is found, the first tensor of any dtype decides
    (a model of integer buffers on CUDA still runs on CUDA); with no tensor
    at all (a model without parameters, traced without example inputs) the
    answer is ``"cpu"``.  Tensors on the ``meta`` device hold no data and run
    nowhere: they are not evidence.
    """
    fallback: Optional[str] = None
    for tensor in _evidence(module, example_inputs):
        device = tensor.device.type
        if device == "meta":
            continue
        if tensor.is_floating_point():
            return device
        fallback = fallback or device
    return fallback or "cpu"


def low_dtype_for(device_type: str) -> torch.dtype:
    """The low dtype autocast picks for a device: float16 on CUDA, bfloat16 elsewhere."""
    return torch.float16 if device_type == "cuda" else torch.bfloat16
