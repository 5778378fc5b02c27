"""Analysis: annotate every node with its op, module scope, source line and what its example value says.

Writes ``node.meta`` keys (names in :mod:`amp_fx.ir.meta`):

- ``OP`` / ``INPLACE``: canonical op name and in-place flag
- ``MODULE_PATH`` / ``MODULE_STACK``: enclosing modules, innermost first
- ``SOURCE``: the user source line that created the node
- ``PARAM``: the FQN when the node is a parameter or buffer
- ``VALUE`` (tensor-ness, floatness, shape) and ``ORIG_DTYPE``: a first answer,
  read off the example values Dynamo or torch.export recorded and off the
  example inputs bound to the graph inputs (floatness and shapes do not
  depend on precision); the dtype analysis (:mod:`amp_fx.ir.analysis`, after the
  paint) gives the final answer for the rewritten program.

The original program is never replayed: with low-precision inputs it may be
illegal without the casts AMP adds.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx as fx

from amp_fx.ir import meta
from amp_fx.ir.analysis import ValueInfo, eval_mode, placeholder_examples
from amp_fx.ir.meta import example_value
from amp_fx.ir.op_keys import canonical_op, is_inplace
from amp_fx.ir.pass_manager import PassContext, PassResult, amp_pass
from amp_fx.frontend.tracing import module_stack_of, user_frame

__all__ = ["propagate_meta", "example_value", "eval_mode"]


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


@amp_pass(kind="analysis", ensures=("meta",))
def propagate_meta(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Annotate every node (see module docstring); never changes the graph."""
    bound = placeholder_examples(gm, ctx)
    known = 0
    for node in gm.graph.nodes:
        m = node.meta
        m[meta.OP] = canonical_op(node, gm)
        m[meta.INPLACE] = is_inplace(node, gm) if node.op.startswith("call") else False
        stack = module_stack_of(node)
        param = _param_name(node, gm, ctx)
        if param is not None:
            m[meta.PARAM] = param
            owner = param.rpartition(".")[0]
            stack = stack or [(owner, None)]
        m[meta.MODULE_STACK] = stack
        m[meta.MODULE_PATH] = stack[0][0] if stack else ""
        m[meta.SOURCE] = user_frame(m.get("stack_trace"))
        value = bound.get(node, example_value(node))
        if node.op == "get_attr":
            value = _attr(gm, str(node.target))
        if value is not None and node.op != "output":
            info = ValueInfo.of(value)
            # A first answer; what an earlier analysis said of the dtype stays until the analysis runs again.
            sizes = {"shape": info.shape} if info.shape is not None else {}
            meta.note_value(node, is_tensor=info.is_tensor, is_float=info.is_float, container=info.container, **sizes)
            if info.dtype is not None:
                meta.ORIG_DTYPE.set(node, info.dtype)
            known += 1
        else:
            flags = (False, False) if node.op == "output" else (None, None)
            meta.note_value(node, is_tensor=flags[0], is_float=flags[1])
    return PassResult(gm, False, {"nodes": len(gm.graph.nodes), "with_example_values": known})


def _attr(gm: fx.GraphModule, target: str) -> Any:
    value: Any = gm
    for atom in target.split("."):
        value = getattr(value, atom, None)
    return value
