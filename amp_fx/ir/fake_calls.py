"""How the dtype analysis runs one node on fake values: the call itself, its memo key, and its failures.

:mod:`amp_fx.ir.analysis` walks the graph; for a node whose inputs have fake
values it runs the op here (:func:`call_on_fakes`: leaf modules with their
parameters cast as the rewritten program casts them), keys the result by
the inputs' metadata so a model's repeated layers are fake-run once
(:func:`call_key`), and words the error for example inputs the model itself
rejects (:func:`examples_do_not_fit`).

A Dynamo graph that traced ``torch.vmap`` (transformers' Mamba scan runs
``associative_scan``, which vmaps its combine function) or ``torch.func.grad``
holds calls that push and pop functorch's per-thread transform levels
(``_vmap_increment_nesting`` ... ``_vmap_decrement_nesting``).  Fake-running
them changes that real state, so they run on every walk, in graph order, and
are never served from a memo (:func:`changes_transform_levels`); a walk that
stops half-way gives the levels back (:func:`transform_levels_kept`).  A
memoised push with a memo-missed pop left a level behind, and Dynamo then
refused its own graph: "Guard failed on the same frame it was created ...
compare_functorch_state".
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional

import torch
import torch.fx as fx

from amp_fx.errors import AmpValueError
from amp_fx.ir import meta
from amp_fx.ir.meta import ValueInfo

__all__ = ["examples_do_not_fit", "quiet_fake_kernels", "Described", "call_key", "fetch_attr", "call_on_fakes",
           "changes_transform_levels", "transform_levels_kept"]


def examples_do_not_fit(node: fx.Node, reason: str, examples: Mapping[fx.Node, Any]) -> AmpValueError:
    """The error for example inputs the model itself rejects: which node, where, and the shapes given."""
    shapes = {n.name: tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__ for n, v in examples.items()}
    where = node.meta.get(meta.SOURCE) or node.name
    return AmpValueError(
        f"the example inputs do not fit the model: {node.name} ({where}) fails on them in fp32 too: {reason.rstrip('.')}. "
        f"Example input shapes: {shapes}. Pass example_inputs / example_kwarg_inputs the model accepts "
        "(call model(*example_inputs) to check).")


@contextlib.contextmanager
def quiet_fake_kernels() -> Iterator[None]:
    """Silence FakeTensorMode's log of a failing meta kernel: the analysis records or raises it itself."""
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        fake_log.setLevel(level)


def changes_transform_levels(node: fx.Node) -> bool:
    """Whether ``node`` pushes or pops a functorch transform level (vmap, grad, jvp): state, not a value."""
    name = getattr(node.target, "__name__", "") if node.op == "call_function" else ""
    return name.endswith(("_increment_nesting", "_decrement_nesting"))


@contextlib.contextmanager
def transform_levels_kept() -> Iterator[None]:
    """Leave functorch's transform-level stack as deep as it was on entry, however the block ends."""
    depth = torch._C._functorch.get_dynamic_layer_stack_depth()
    try:
        yield
    finally:
        if torch._C._functorch.get_dynamic_layer_stack_depth() != depth:
            torch._C._functorch.pop_dynamic_layer_stack_and_undo_to_depth(depth)


_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)


@dataclass
class Described:
    """An input as the call will receive it: its value before the cast, and its info after."""

    before: ValueInfo
    after: ValueInfo


def call_key(node: fx.Node, args: tuple, kwargs: dict, target: Optional[torch.dtype]) -> Optional[tuple]:
    """A hashable description of a call by its inputs' metadata, or None when it cannot be described safely.

    Only functions and methods (a module's forward may read any attribute);
    only static shapes (a symbolic size stands for a value the key cannot see).
    """
    if node.op not in ("call_function", "call_method") or changes_transform_levels(node):
        return None
    parts: list = []

    def describe(value: Any) -> bool:
        if isinstance(value, Described):
            fake = value.before.fake
            if not isinstance(fake, torch.Tensor):
                return describe(fake) if not value.before.container else False
            if not all(isinstance(size, int) for size in (*fake.shape, *fake.stride())):
                return False
            parts.append(("t", value.after.dtype or fake.dtype, tuple(fake.shape), tuple(fake.stride()), fake.device.type))
            return True
        if isinstance(value, torch.Tensor):
            if not all(isinstance(size, int) for size in (*value.shape, *value.stride())):
                return False
            parts.append(("t", value.dtype, tuple(value.shape), tuple(value.stride()), value.device.type))
            return True
        if isinstance(value, (list, tuple)):
            parts.append(("(", type(value).__name__, len(value)))
            return all(describe(item) for item in value)
        if isinstance(value, slice):
            return describe((value.start, value.stop, value.step))
        if isinstance(value, _SCALARS) or value is Ellipsis:
            parts.append(("v", type(value).__name__, value))
            return True
        return False

    if not describe(args) or not describe(tuple(sorted(kwargs.items(), key=lambda item: item[0]))):
        return None
    return ("call", node.op, node.target, target, tuple(parts))


def fetch_attr(gm: fx.GraphModule, target: str) -> Any:
    value: Any = gm
    for atom in target.split("."):
        value = getattr(value, atom, None)
    return value


def call_on_fakes(gm: fx.GraphModule, node: fx.Node, args: tuple, kwargs: dict, target: Optional[torch.dtype]) -> Any:
    """Run ``node``'s op on fake inputs, as the rewritten program will (leaf modules with cast parameters)."""
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    if node.op == "call_method":
        self_arg, *rest = args
        return getattr(self_arg, str(node.target))(*rest, **kwargs)
    module = gm.get_submodule(str(node.target))
    params = {name: p for name, p in module.named_parameters() if p.is_floating_point() and target is not None and p.dtype not in (target, torch.float64)}
    if not params:
        return module(*args, **kwargs)
    return torch.func.functional_call(module, {name: p.to(target) for name, p in params.items()}, args, kwargs)
