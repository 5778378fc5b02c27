"""The metadata schema: every ``node.meta`` key that amp_fx's passes, report and views share.

A pass reads and writes these names, never string literals, so the schema is
visible in one place.  Who writes each key:

==================  ===========================  ============================================
key                 written by                   holds
==================  ===========================  ============================================
``OP``              propagate_meta               canonical op name (``"linear"``)
``INPLACE``         propagate_meta               the op writes into its first input
``MODULE_PATH``     propagate_meta               innermost enclosing module's qualified name
``MODULE_STACK``    propagate_meta               [(qualified name, type)], innermost first
``SOURCE``          propagate_meta               ``"file:line in fn: code"`` of the user line
``PARAM``           propagate_meta               FQN when the node is a parameter or buffer
``DECISION``        assign_precision (+ repaint) ``low | fp32 | promote | follow | cast | ...``
``REASON``          assign_precision (+ repaint) one line a person reads in the report
``RULE``            assign_precision (+ repaint) ``table | policy | level | min-cut | ...``
``LOW_DTYPE``       region passes                this node's own low dtype (``autocast(dtype=)``)
``VALUE``           the dtype analysis           :class:`amp_fx.ir.analysis.ValueInfo`
``IS_TENSOR``       the dtype analysis           True / False / None (unknown)
``IS_FLOAT``        the dtype analysis           True / False / None (unknown)
``FLOAT_DTYPE``     the dtype analysis           dtype the value has *if* it is floating
``SHAPE``           the dtype analysis           tuple of sizes, when known
``CONTAINER``       the dtype analysis           a tuple/list that holds floating tensors
``ORIG_DTYPE``      the dtype analysis           a graph input's or weight's own dtype
``UNKNOWN``         the dtype analysis           why the node could not be fake-run
``INSERTED``        insert_casts, pad_gemm        the node was written by amp_fx
``CAST_OF``         insert_casts                 (source name, source dtype, target dtype)
``WEIGHT_CAST``     insert_casts                 the cast reads a parameter
``PLACED_FROM``     minimize_casts               the paint before the min-cut moved the node
``PADDED``          pad_gemm                     how a GEMM was padded
``FUSED``           fuse_precision               an fp32 node runs as a fused mixed-dtype kernel
==================  ===========================  ============================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

__all__ = [
    "OP", "INPLACE", "MODULE_PATH", "MODULE_STACK", "SOURCE", "PARAM", "DECISION", "REASON", "RULE", "LOW_DTYPE",
    "VALUE", "IS_TENSOR", "IS_FLOAT", "FLOAT_DTYPE", "SHAPE", "CONTAINER", "ORIG_DTYPE", "UNKNOWN",
    "INSERTED", "CAST_OF", "WEIGHT_CAST", "PLACED_FROM", "PADDED", "FUSED",
    "float_dtype", "example_value", "ValueInfo", "may_be_float_tensor",
]

OP = "amp_fx.op"
INPLACE = "amp_fx.inplace"
MODULE_PATH = "amp_fx.module_path"
MODULE_STACK = "amp_fx.module_stack"
SOURCE = "amp_fx.source"
PARAM = "amp_fx.param"
DECISION = "amp_fx.decision"
REASON = "amp_fx.reason"
RULE = "amp_fx.rule"
LOW_DTYPE = "amp_fx.low_dtype"
VALUE = "amp_fx.value"
IS_TENSOR = "amp_fx.is_tensor"
IS_FLOAT = "amp_fx.is_float"
FLOAT_DTYPE = "amp_fx.float_dtype"
SHAPE = "amp_fx.shape"
CONTAINER = "amp_fx.container"
ORIG_DTYPE = "amp_fx.orig_dtype"
UNKNOWN = "amp_fx.unknown"
INSERTED = "amp_fx.inserted"
CAST_OF = "amp_fx.cast_of"
WEIGHT_CAST = "amp_fx.weight_cast"
PLACED_FROM = "amp_fx.placed_from"
PADDED = "amp_fx.padded"
FUSED = "amp_fx.fused"


def float_dtype(node: Any) -> Optional[torch.dtype]:
    """The dtype ``node``'s value has in the rewritten program if it is floating, or None when unknown."""
    return node.meta.get(FLOAT_DTYPE) if isinstance(node, fx.Node) else None


def example_value(node: fx.Node) -> Any:
    """The example/fake value that torch.export or Dynamo recorded on ``node`` (original program)."""
    if "val" in node.meta:
        return node.meta["val"]
    return node.meta.get("example_value")


@dataclass
class ValueInfo:
    """What one node's value is in the rewritten program.

    ``is_tensor`` / ``is_float``: True, False or None (unknown).
    ``float_dtype``: the dtype the value has if it is floating (None: unknown).
    ``dtype``: the tensor's dtype whatever it is, when known (int64 labels too).
    ``shape``: sizes when known.  ``container``: a tuple/list holding floating
    tensors.  ``unknown``: why the node could not be fake-run.
    """

    is_tensor: Optional[bool] = None
    is_float: Optional[bool] = None
    float_dtype: Optional[torch.dtype] = None
    dtype: Optional[torch.dtype] = None
    shape: Optional[tuple] = None
    container: bool = False
    unknown: Optional[str] = None
    fake: Any = None
    has_value: bool = False  # ``fake`` holds the value (a fake tensor, or a Python value such as None or 3)

    @classmethod
    def of(cls, value: Any) -> "ValueInfo":
        """Read a (fake or real) value."""
        if isinstance(value, torch.Tensor):
            floating = value.is_floating_point()
            return cls(True, floating, value.dtype if floating else None, value.dtype, tuple(value.shape), fake=value, has_value=True)
        leaves = [v for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]
        floats = [v.dtype for v in leaves if v.is_floating_point()]
        widest = None
        for dtype in floats:
            widest = dtype if widest is None else torch.promote_types(widest, dtype)
        return cls(False, False, widest, container=bool(floats), fake=value, has_value=True)

    @classmethod
    def non_tensor(cls) -> "ValueInfo":
        return cls(False, False)

    def write(self, node: fx.Node) -> None:
        """Store this answer on ``node`` (the flat keys every reader uses)."""
        m = node.meta
        m[VALUE] = self
        m[IS_TENSOR] = self.is_tensor
        m[IS_FLOAT] = self.is_float
        m[FLOAT_DTYPE] = self.float_dtype
        m[CONTAINER] = self.container
        if self.shape is not None:
            m[SHAPE] = self.shape
        else:
            m.pop(SHAPE, None)
        if self.unknown:
            m[UNKNOWN] = self.unknown
        else:
            m.pop(UNKNOWN, None)


def may_be_float_tensor(info: Optional[ValueInfo]) -> bool:
    """True unless the value is known to hold no floating tensor (casts skip it then); containers of floats count."""
    return info is not None and (info.container or (info.is_tensor is not False and info.is_float is not False))
