"""Analysis: annotate every node with its op, module scope, source line, and what is known of its value.

Writes ``node.meta`` keys:

- ``amp_fx.op`` / ``amp_fx.inplace``: canonical op name and in-place flag
- ``amp_fx.module_path`` / ``amp_fx.module_stack``: enclosing modules, innermost first
- ``amp_fx.source``: the user source line that created the node
- ``amp_fx.is_tensor`` / ``amp_fx.is_float``: True, False or None (unknown)
- ``amp_fx.shape`` / ``amp_fx.orig_dtype``: from example values where there are any
- ``amp_fx.param``: the FQN when the node is a parameter or buffer

With example inputs, FakeTensor propagation gives every node's dtype and
shape (the model is put in eval mode meanwhile, so BatchNorm statistics and
counters are not touched, and its modes are restored).  Without them, only
parameters, buffers and a few ops of known result type are known: nothing is
assumed about the graph inputs.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
import torch.fx as fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from amp_fx.op_keys import canonical_op, is_inplace
from amp_fx.pass_manager import PassContext, PassResult
from amp_fx.tracing import module_stack_of, user_frame

__all__ = ["propagate_meta", "example_value", "eval_mode", "NON_TENSOR_METHODS"]

# Ops whose result is never a tensor (shapes, sizes, dtypes).
NON_TENSOR_METHODS = frozenset({"size", "dim", "numel", "ndimension", "nelement", "stride", "is_floating_point", "item", "tolist"})
_NON_TENSOR_ATTRS = frozenset({"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad"})


def example_value(node: fx.Node) -> Any:
    """Return the example/fake value recorded on ``node`` by export, Dynamo or FakeTensorProp."""
    if "val" in node.meta:
        return node.meta["val"]
    return node.meta.get("example_value")


@contextlib.contextmanager
def eval_mode(module: torch.nn.Module) -> Iterator[None]:
    """Run in eval mode and restore every submodule's flag (so propagation updates no statistics)."""
    flags = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag


def _fake_propagate(gm: fx.GraphModule, ctx: PassContext) -> None:
    args = tuple(ctx.example_inputs or ())
    kwargs = dict(ctx.example_kwarg_inputs or {})
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    # Keyword inputs bind to the remaining placeholders by name; the rest take their defaults.
    for placeholder in placeholders[len(args):]:
        default = placeholder.args[0] if placeholder.args else None
        args = args + (kwargs.get(str(placeholder.target), default),)
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with eval_mode(gm):
        FakeTensorProp(gm, mode).propagate(*args)


def _param_name(node: fx.Node, gm: fx.GraphModule, ctx: PassContext) -> Optional[str]:
    if node.op == "get_attr":
        try:
            value = gm.get_parameter(str(node.target))
        except AttributeError:
            try:
                value = gm.get_buffer(str(node.target))
            except AttributeError:
                return None
        return str(node.target) if isinstance(value, torch.Tensor) else None
    if node.op == "placeholder":
        return ctx.placeholder_params.get(node.name)
    return None


def _static_kind(node: fx.Node, gm: fx.GraphModule) -> tuple[Optional[bool], Optional[bool]]:
    """(is_tensor, is_float) for a node without an example value."""
    if node.op == "get_attr":
        value = gm
        for atom in str(node.target).split("."):
            value = getattr(value, atom, None)
        if isinstance(value, torch.Tensor):
            return True, value.is_floating_point()
        return False, False
    if node.op == "call_method" and node.target in NON_TENSOR_METHODS:
        return False, False
    if node.op == "call_function" and node.target is getattr and len(node.args) > 1 and node.args[1] in _NON_TENSOR_ATTRS:
        return False, False
    if node.op == "call_method" and node.target in ("float", "half", "bfloat16", "double"):
        return True, True
    if node.op == "call_method" and node.target in ("long", "int", "bool", "short", "byte"):
        return True, False
    if node.op == "output":
        return False, False
    return None, None


def propagate_meta(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Annotate every node (see module docstring); never changes the graph."""
    has_values = any(example_value(n) is not None for n in gm.graph.nodes if n.op != "output")
    if not has_values and (ctx.example_inputs is not None or ctx.example_kwarg_inputs):
        _fake_propagate(gm, ctx)
        has_values = True
    known = 0
    for node in gm.graph.nodes:
        meta = node.meta
        meta["amp_fx.op"] = canonical_op(node, gm)
        meta["amp_fx.inplace"] = is_inplace(node, gm) if node.op.startswith("call") else False
        stack = module_stack_of(node)
        param = _param_name(node, gm, ctx)
        if param is not None:
            meta["amp_fx.param"] = param
            owner = param.rpartition(".")[0]
            stack = stack or [(owner, None)]
        meta["amp_fx.module_stack"] = stack
        meta["amp_fx.module_path"] = stack[0][0] if stack else ""
        meta["amp_fx.source"] = user_frame(meta.get("stack_trace"))
        value = example_value(node)
        if isinstance(value, torch.Tensor):
            meta["amp_fx.is_tensor"] = True
            meta["amp_fx.is_float"] = value.is_floating_point()
            meta["amp_fx.orig_dtype"] = value.dtype
            meta["amp_fx.shape"] = tuple(value.shape)
            known += 1
        elif value is not None and node.op != "output":
            meta["amp_fx.is_tensor"] = False
            meta["amp_fx.is_float"] = False
            # Tuples of tensors (chunk, LSTM outputs): dtypes flow through getitem.
            leaves = [v for v in torch.utils._pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]
            meta["amp_fx.container"] = any(v.is_floating_point() for v in leaves)
            known += 1
        else:
            is_tensor, is_float = _static_kind(node, gm)
            meta["amp_fx.is_tensor"] = is_tensor
            meta["amp_fx.is_float"] = is_float
            if node.op == "get_attr" and is_tensor:
                attr = gm
                for atom in str(node.target).split("."):
                    attr = getattr(attr, atom)
                meta["amp_fx.orig_dtype"] = attr.dtype
                meta["amp_fx.shape"] = tuple(attr.shape)
    return PassResult(gm, False, {"nodes": len(gm.graph.nodes), "with_example_values": known})
