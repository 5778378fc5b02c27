"""Read what a Dynamo graph says about itself: which placeholders are weights, and on which device.

With ``inline_inbuilt_nn_modules`` (always on in recent torch) Dynamo lifts
every parameter and buffer a graph reads to a placeholder.  Its
``node.meta["grapharg"]`` holds the real tensor and the Dynamo *source* the
value was read from, e.g. ``L['self']._modules['fc1']._parameters['weight']``;
from that source this module derives the readable FQN ``fc1.weight`` that the
report, weight-cast dedup and module policies use.
"""

from __future__ import annotations

import re
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

__all__ = ["placeholder_params", "source_fqn", "target_fqn", "graph_device_type", "low_dtype_for"]

# One step of a Dynamo source name: .attr, ['key'] or [index].
_STEP = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[\s*'([^']*)'\s*\]|\[\s*\"([^\"]*)\"\s*\]|\[\s*(-?\d+)\s*\]")
# Containers that nn.Module uses internally; they are not part of the FQN.
_CONTAINERS = frozenset({"_modules", "_parameters", "_buffers"})
_WEIGHT_CONTAINERS = ("_parameters", "_buffers")


def _source_name(source: Any) -> Optional[str]:
    name = getattr(source, "name", None)
    if callable(name):
        name = name()
    return name if isinstance(name, str) else None


def source_fqn(name: str) -> Optional[str]:
    """``L['self']._modules['fc1']._parameters['weight']`` -> ``fc1.weight``; None when no weight is named.

    The root (``L['self']``, ``G['model']``, a closure cell) is dropped; so are
    the module's internal containers (``_modules``, ``_parameters``, ``_buffers``).
    """
    if not any(f"{c}[" in name or f".{c}." in name for c in _WEIGHT_CONTAINERS) and not name.endswith((".weight", ".bias")):
        return None
    root = re.match(r"^(?:[A-Za-z_][A-Za-z0-9_]*\[\s*'[^']*'\s*\]|[A-Za-z_][A-Za-z0-9_]*)", name)
    rest = name[root.end():] if root else name
    atoms = []
    for match in _STEP.finditer(rest):
        atom = next(group for group in match.groups() if group is not None)
        if atom not in _CONTAINERS:
            atoms.append(atom)
    return ".".join(atoms) or None


def target_fqn(target: str) -> Optional[str]:
    """Fallback from a placeholder name: ``L_self_modules_fc1_parameters_weight_`` -> ``fc1.weight``."""
    text = target.strip("_")
    for prefix in ("L_self_", "L_", "G_"):
        if text.startswith(prefix):
            text = text[len(prefix):]
            break
    marker = re.search(r"(?:^|_)(parameters|buffers)_", text)
    if marker is None:
        return None
    parts = re.split(r"(?:^|_)(?:modules|parameters|buffers)_", text)
    return ".".join(part for part in parts if part) or None


def placeholder_params(gm: fx.GraphModule, example_inputs: Sequence[Any] = ()) -> dict[str, str]:
    """Map each placeholder that holds a parameter or buffer to its FQN.

    A placeholder is a weight when its real value is an ``nn.Parameter`` or
    its Dynamo source reads a module's ``_parameters`` / ``_buffers``.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out: dict[str, str] = {}
    for index, node in enumerate(placeholders):
        grapharg = node.meta.get("grapharg")
        example = getattr(grapharg, "example", None) if grapharg is not None else None
        if example is None and index < len(example_inputs):
            example = example_inputs[index]
        name = _source_name(getattr(grapharg, "source", None)) if grapharg is not None else None
        fqn = source_fqn(name) if name else None
        if fqn is None and (isinstance(example, nn.Parameter) or isinstance(node.meta.get("example_value"), nn.Parameter)):
            fqn = target_fqn(str(node.target)) or (name or str(node.target))
        if fqn is not None:
            out[node.name] = fqn
    return out


def graph_device_type(gm: fx.GraphModule, example_inputs: Sequence[Any] = ()) -> str:
    """The device type of the graph's floating tensors ("cpu" when none is seen)."""
    values = list(example_inputs) + [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
    for value in values:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.device.type
    return "cpu"


def low_dtype_for(device_type: str) -> torch.dtype:
    """The low dtype autocast picks for a device: float16 on CUDA, bfloat16 elsewhere."""
    return torch.float16 if device_type == "cuda" else torch.bfloat16
