"""Refuse a Dynamo graph that runs torch.func's autograd transforms inline: a cast could cut what they differentiate.

Dynamo traces ``torch.func.grad`` (and ``vjp``, ``jacrev``, ``hessian``,
``jvp``) into the graph: ``_grad_increment_nesting()``, ``_wrap_for_grad``,
then ``_set_tensor_requires_grad(x)``, which marks the wrapped input as
requiring grad *in place*, the function's ops, ``_autograd_grad`` and
``_grad_decrement_nesting()``.  A cast amp_fx writes right after the input
is made (before the in-place mark) reads a tensor that autograd does not
track: the transform's gradient is silently zero, and the result escapes
as a ``GradTrackingTensor``.  Measured on ``torch.func.grad(lambda t:
t.sum() * 3)(h)``, whose ``sum`` the tables keep fp32.  ``torch.vmap``
(Mamba's scan) has no such mark and is converted (see
:mod:`amp_fx.ir.fake_calls` for its level stack).
"""

from __future__ import annotations

from typing import Optional

import torch.fx as fx

from amp_fx.errors import UnsupportedConstructError
from amp_fx.frontend.tracing import user_frame

__all__ = ["refuse_autograd_transforms"]

# The level pushes of functorch's autograd transforms, as Dynamo writes them.
_AUTOGRAD_PUSHES = {"_grad_increment_nesting": "torch.func.grad / vjp / jacrev / hessian",
                    "_jvp_increment_nesting": "torch.func.jvp / jacfwd"}


def _where(node: fx.Node) -> Optional[str]:
    """The user's source line of the transform: the first node after the push that has one."""
    current: Optional[fx.Node] = node
    for _ in range(64):
        if current is None or current.op == "output":
            return None
        where = user_frame(current.meta.get("stack_trace"))
        if where:
            return where
        current = current.next
    return None


def refuse_autograd_transforms(gm: fx.GraphModule) -> None:
    """Raise UnsupportedConstructError when ``gm`` (or a body it calls) runs a torch.func autograd transform inline."""
    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        for node in module.graph.nodes:
            name = getattr(node.target, "__name__", "") if node.op == "call_function" else ""
            if name not in _AUTOGRAD_PUSHES:
                continue
            where = _where(node) or "an unknown source line"
            raise UnsupportedConstructError(
                f"the graph Dynamo captured runs {_AUTOGRAD_PUSHES[name]} inline, at {where}. functorch marks the "
                "transform's inputs as requiring grad in place, after making them, and a cast amp_fx writes may read "
                "an input before that mark: what the transform differentiates would be cut off (a gradient of zero), "
                "so amp_fx refuses rather than change what the model computes. Fix: keep the transform out of the "
                "compiled graph (decorate the function that calls it with @torch.compiler.disable; it then runs "
                "eagerly, under torch.autocast if you want it in low precision), or compile this model with "
                "level='O0'.", construct=_AUTOGRAD_PUSHES[name], where=where)
