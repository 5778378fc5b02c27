"""Seeded random tiny graphs that mix LOW, FP32, FOLLOW and PROMOTE ops, for the cast-placement tests."""

from __future__ import annotations

import random

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["random_graph"]

_ROWS, _COLS = 2, 4


class _Params(nn.Module):
    """Weights (4x4), biases and a gain (4,) that the random graphs read."""

    def __init__(self, seed: int):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        for i in range(3):
            self.register_parameter(f"w{i}", nn.Parameter(torch.randn(_COLS, _COLS, generator=generator) * 0.5))
        for i in range(2):
            self.register_parameter(f"b{i}", nn.Parameter(torch.randn(_COLS, generator=generator) * 0.5))


# How often each op is drawn: enough FP32 sources and broadcasts that the
# greedy placement is sometimes beaten.
_WEIGHTS = {"linear": 3, "matmul": 2, "softmax": 2, "layer_norm": 2, "rowsum": 3, "expand": 3, "relu": 2,
            "tanh": 2, "scale": 1, "flip": 1, "add": 2, "mul": 1, "where": 1, "add_bias": 3, "cat_narrow": 1,
            "addcmul": 1}


def _pick(rng: random.Random, pool: list) -> fx.Node:
    # Prefer recent values, so that chains grow, but fan out too.
    return pool[-1] if rng.random() < 0.5 else rng.choice(pool)


def random_graph(seed: int, max_ops: int = 8) -> tuple[fx.GraphModule, tuple[torch.Tensor]]:
    """A GraphModule of 3..max_ops random ops on (2, 4) values, and its example input."""
    rng = random.Random(seed)
    root = _Params(seed)
    graph = fx.Graph()
    x = graph.placeholder("x")
    full: list[fx.Node] = [x]  # values of shape (2, 4)
    rows: list[fx.Node] = []  # values of shape (2, 1)
    params = {name: None for name, _ in root.named_parameters()}

    def param(name: str) -> fx.Node:
        if params[name] is None:
            params[name] = graph.get_attr(name)
        return params[name]

    for _ in range(rng.randint(3, max_ops)):
        kind = rng.choices(list(_WEIGHTS), weights=list(_WEIGHTS.values()))[0]
        a, b = _pick(rng, full), rng.choice(full)
        w, bias = param(f"w{rng.randrange(3)}"), param(f"b{rng.randrange(2)}")
        if kind == "linear":
            full.append(graph.call_function(F.linear, (a, w, bias)))
        elif kind == "matmul":
            full.append(graph.call_function(torch.matmul, (a, w)))
        elif kind == "softmax":
            full.append(graph.call_function(torch.softmax, (a, -1)))
        elif kind == "layer_norm":
            full.append(graph.call_function(F.layer_norm, (a, (_COLS,))))
        elif kind == "rowsum":
            rows.append(graph.call_method("sum", (a, -1), {"keepdim": True}))
        elif kind == "expand" and rows:
            full.append(graph.call_method("expand", (rng.choice(rows), _ROWS, _COLS)))
        elif kind in ("relu", "tanh"):
            full.append(graph.call_function(getattr(torch, kind), (a,)))
        elif kind == "scale":
            full.append(graph.call_function(torch.mul, (a, 0.5)))
        elif kind == "flip":
            full.append(graph.call_function(torch.flip, (a, [0])))
        elif kind in ("add", "mul"):
            full.append(graph.call_function(getattr(torch, kind), (a, b)))
        elif kind == "where":
            positive = graph.call_function(torch.gt, (b, 0))
            full.append(graph.call_function(torch.where, (positive, a, b)))
        elif kind == "add_bias":
            full.append(graph.call_function(torch.add, (a, bias)))
        elif kind == "cat_narrow":
            both = graph.call_function(torch.cat, ([a, b], -1))
            full.append(graph.call_method("narrow", (both, -1, rng.randrange(_COLS + 1), _COLS)))
        elif kind == "addcmul":
            full.append(graph.call_function(torch.addcmul, (a, b, rng.choice(full)), {"value": 0.5}))
    outputs = [full[-1]] + ([rng.choice(full[1:])] if len(full) > 2 and rng.random() < 0.4 else [])
    graph.output(tuple(outputs) if len(outputs) > 1 else outputs[0])
    graph.eliminate_dead_code()
    gm = fx.GraphModule(root, graph)
    example = (torch.randn(_ROWS, _COLS, generator=torch.Generator().manual_seed(seed)),)
    return gm, example
