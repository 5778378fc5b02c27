"""The metadata schema: every ``node.meta`` key amp_fx writes, its typed accessor, the value record and the inheritance rule.

This module is the only place that spells a key.  Each key is a :class:`Key`:
the string itself (so ``node.meta[DECISION]`` and a pickled graph's
``node.meta["amp_fx.decision"]`` are the same entry) with typed ``get`` /
``set`` / ``pop`` / ``on``.  Who writes each key:

======================  ==============================  ==========================================
key                     written by                      holds
======================  ==============================  ==========================================
what a node *is*
``OP``                  propagate_meta                  canonical op name (``"linear"``)
``INPLACE``             propagate_meta                  the op writes into its first input
``MODULE_PATH``         propagate_meta                  innermost enclosing module's qualified name
``MODULE_STACK``        propagate_meta                  [(qualified name, type)], innermost first
``SOURCE``              propagate_meta                  ``"file:line in fn: code"`` of the user line
``PARAM``               propagate_meta                  FQN when the node is a parameter or buffer
``TRAINING_FLAG``       frontend/train_flags            the module path whose ``training`` it reads
``CHECKPOINT``          frontend/checkpoint_regions     the checkpointed region's number
``CHECKPOINT_OPTIONS``  frontend/checkpoint_regions     (checkpoint kwargs, user source line)
``TRACE_NOTES``         frontend/trace_guards           (output node) notes for the report
what it *should be*
``DECISION``            assign_precision (+ repaints)   ``low | fp32 | promote | follow | cast | ...``
``REASON``              assign_precision (+ repaints)   one line a person reads in the report
``RULE``                assign_precision (+ repaints)   ``table | policy | level | min-cut | ...``
``LOW_DTYPE``           honour_autocast_regions         this node's own low dtype (``autocast(dtype=)``)
``REGION``              honour_autocast_regions         the regions the node was painted for
``GRAD_READ``           frontend/regions                a read made by ``separate_grad_reads``
``KEEP_FP32``           assign_precision, regions       the weight stays fp32 (``cast_params``)
``PLACED_FROM``         minimize_casts                  the paint before the min-cut moved the node
``FUSED``               fuse_precision                  an fp32 node runs as a fused mixed-dtype kernel
what it *will be*
``VALUE``               propagate_meta, the analysis    the value record, a :class:`ValueInfo`
``ORIG_DTYPE``          propagate_meta, the analysis    a graph input's or weight's own dtype
what a rewrite *wrote*
``INSERTED``            insert_casts, pad_gemm, ...     the node was written by amp_fx
``CAST_OF``             insert_casts                    (source name, source dtype, target dtype)
``WEIGHT_CAST``         insert_casts                    the cast reads a parameter
``PADDED``              pad_gemm                        how a GEMM was padded
``REGION_SEAL``         dynamo/bodies                   ``entry`` / ``exit`` cast of a region body
======================  ==============================  ==========================================

One record per value: ``VALUE`` holds the :class:`ValueInfo`, and
:func:`is_tensor`, :func:`is_float`, :func:`float_dtype`, :func:`shape`,
:func:`container` and :func:`unknown` read it, so no copy can disagree.
``propagate_meta`` writes a first record off the trace; the dtype analysis
replaces it with its answer (:func:`store_value`, read back by
:func:`value_of`); a rewrite that changes a value updates the record
(:func:`note_value`).  A node amp_fx writes takes what it inherits from the
value it stands for by one rule, :func:`inherit`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Generic, Optional, TypeVar

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

__all__ = [
    "Key",
    "OP", "INPLACE", "MODULE_PATH", "MODULE_STACK", "SOURCE", "PARAM", "TRAINING_FLAG", "CHECKPOINT",
    "CHECKPOINT_OPTIONS", "TRACE_NOTES",
    "DECISION", "REASON", "RULE", "LOW_DTYPE", "REGION", "GRAD_READ", "KEEP_FP32", "PLACED_FROM", "FUSED",
    "VALUE", "ORIG_DTYPE",
    "INSERTED", "CAST_OF", "WEIGHT_CAST", "PADDED", "REGION_SEAL",
    "ValueInfo", "value_of", "store_value", "note_value", "is_tensor", "is_float", "float_dtype", "shape",
    "container", "unknown", "may_be_float_tensor", "example_value", "inherit",
]

T = TypeVar("T")


class Key(str, Generic[T]):
    """One ``node.meta`` key: the key string itself, with typed access.

    ``get(node, default)`` reads, ``set(node, value)`` writes, ``pop(node)``
    removes (returning the value, or None), ``on(node)`` says whether the node
    carries the key.  The dict holds the plain string, as before there were
    accessors, so pickled graphs and ``node.meta["amp_fx..."]`` readers agree.
    """

    __slots__ = ()

    def get(self, node: fx.Node, default: Any = None) -> T:
        return node.meta.get(self, default)

    def set(self, node: fx.Node, value: T) -> None:
        node.meta[str(self)] = value

    def pop(self, node: fx.Node) -> Optional[T]:
        return node.meta.pop(self, None)

    def on(self, node: fx.Node) -> bool:
        return self in node.meta


# What a node is.
OP: Key[str] = Key("amp_fx.op")
INPLACE: Key[bool] = Key("amp_fx.inplace")
MODULE_PATH: Key[str] = Key("amp_fx.module_path")
MODULE_STACK: Key[list] = Key("amp_fx.module_stack")
SOURCE: Key[Optional[str]] = Key("amp_fx.source")
PARAM: Key[str] = Key("amp_fx.param")
TRAINING_FLAG: Key[str] = Key("amp_fx.training_flag")
CHECKPOINT: Key[int] = Key("amp_fx.checkpoint")
CHECKPOINT_OPTIONS: Key[tuple] = Key("amp_fx.checkpoint_options")
TRACE_NOTES: Key[list] = Key("amp_fx.trace_notes")
# What it should be.
DECISION: Key[str] = Key("amp_fx.decision")
REASON: Key[str] = Key("amp_fx.reason")
RULE: Key[str] = Key("amp_fx.rule")
LOW_DTYPE: Key[torch.dtype] = Key("amp_fx.low_dtype")
REGION: Key[tuple] = Key("amp_fx.region")
GRAD_READ: Key[bool] = Key("amp_fx.grad_read")
KEEP_FP32: Key[bool] = Key("amp_fx.keep_fp32")
PLACED_FROM: Key[tuple] = Key("amp_fx.placed_from")
FUSED: Key[str] = Key("amp_fx.fused")
# What it will be.
VALUE: Key["ValueInfo"] = Key("amp_fx.value")
ORIG_DTYPE: Key[torch.dtype] = Key("amp_fx.orig_dtype")
# What a rewrite wrote.
INSERTED: Key[bool] = Key("amp_fx.inserted")
CAST_OF: Key[tuple] = Key("amp_fx.cast_of")
WEIGHT_CAST: Key[bool] = Key("amp_fx.weight_cast")
PADDED: Key[dict] = Key("amp_fx.padded")
REGION_SEAL: Key[str] = Key("amp_fx.region_seal")

# torch's own keys a new node inherits: where in the user's code it was made, and the recorded example value.
_TORCH_PLACE = ("stack_trace", "nn_module_stack")
_TORCH_VALUE = ("val", "example_value")


@dataclass
class ValueInfo:
    """What one node's value is in the rewritten program.

    ``is_tensor`` / ``is_float``: True, False or None (unknown).
    ``float_dtype``: the dtype the value has if it is floating (None: unknown).
    ``dtype``: the tensor's dtype whatever it is, when known (int64 labels too).
    ``shape``: sizes when known.  ``container``: a tuple/list holding floating
    tensors.  ``unknown``: why the node could not be fake-run.  ``analysed``:
    the dtype analysis's answer (False: a first record read off the trace, or
    written with a new node before the analysis saw it).
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
    analysed: bool = dataclasses.field(default=False, compare=False, repr=False)

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
        """Store this as the analysis's answer for ``node`` (:func:`store_value`)."""
        store_value(node, self)


# --------------------------------------------------------------------------
# The value record
# --------------------------------------------------------------------------
def _record(node: Any) -> Optional[ValueInfo]:
    return node.meta.get(VALUE) if isinstance(node, fx.Node) else None


def value_of(node: Any) -> Optional[ValueInfo]:
    """The dtype analysis's answer for ``node``, or None (not analysed yet, or written since without one)."""
    info = _record(node)
    return info if info is not None and info.analysed else None


def store_value(node: fx.Node, info: ValueInfo) -> None:
    """Record ``info`` as the dtype analysis's answer for ``node`` (replacing any earlier record)."""
    info.analysed = True  # an answer of the analysis, shared or not, is the analysis's answer everywhere
    node.meta[str(VALUE)] = info


def note_value(node: fx.Node, **facts: Any) -> ValueInfo:
    """Change some facts of ``node``'s value (``shape=``, ``float_dtype=``, ...) and keep the others.

    For a first answer off the trace and for a rewrite that changes what a
    node makes (a padded GEMM's shape, a cast folded away): the record is
    replaced by a copy (an analysis holding the old one keeps it) and stays
    the analysis's answer if it was one.  Returns the new record.
    """
    old = _record(node)
    info = dataclasses.replace(old, **facts) if old is not None else ValueInfo(**facts)
    node.meta[str(VALUE)] = info
    return info


def is_tensor(node: Any) -> Optional[bool]:
    """True / False / None (unknown): ``node``'s value is a tensor."""
    info = _record(node)
    return None if info is None else info.is_tensor


def is_float(node: Any) -> Optional[bool]:
    """True / False / None (unknown): ``node``'s value is a floating tensor."""
    info = _record(node)
    return None if info is None else info.is_float


def float_dtype(node: Any) -> Optional[torch.dtype]:
    """The dtype ``node``'s value has in the rewritten program if it is floating, or None when unknown."""
    info = _record(node)
    return None if info is None else info.float_dtype


def shape(node: Any) -> Optional[tuple]:
    """The sizes of ``node``'s value when known."""
    info = _record(node)
    return None if info is None else info.shape


def container(node: Any) -> bool:
    """``node``'s value is a tuple/list holding floating tensors."""
    info = _record(node)
    return info is not None and info.container


def unknown(node: Any) -> Optional[str]:
    """Why the analysis could not fake-run ``node``, or None."""
    info = _record(node)
    return (info.unknown or None) if info is not None else None


def may_be_float_tensor(info: Optional[ValueInfo]) -> bool:
    """True unless the value is known to hold no floating tensor (casts skip it then); containers of floats count."""
    return info is not None and (info.container or (info.is_tensor is not False and info.is_float is not False))


def example_value(node: fx.Node) -> Any:
    """The example/fake value that torch.export or Dynamo recorded on ``node`` (original program)."""
    if "val" in node.meta:
        return node.meta["val"]
    return node.meta.get("example_value")


# --------------------------------------------------------------------------
# What a new node inherits
# --------------------------------------------------------------------------
_SAME = object()


def inherit(node: fx.Node, source: fx.Node, *, float_dtype: Optional[torch.dtype] = None, shape: Any = _SAME,
            same_value: bool = False) -> None:
    """Give ``node``, a node amp_fx writes for ``source``'s value, what it inherits from ``source`` (the one rule).

    - Its place: module path and stack, user source line, torch's
      ``stack_trace`` / ``nn_module_stack``.  It sits where ``source`` sits in
      the model, so the report and error messages point at the user's line.
    - A first value record (not the analysis's answer: that is the
      analysis's business): ``source``'s tensor-ness, floatness and, unless
      ``shape`` is given, shape; its floating dtype is ``float_dtype``, what
      the caller knows the new node makes (a cast: its target; None: only the
      analysis can tell).
    - ``same_value=True`` (a read of the very tensor, ``x.view_as(x)``): also
      what the trace recorded of the original value (``ORIG_DTYPE``, torch's
      ``val`` / ``example_value``).

    Op, paint and ``INSERTED`` are the caller's to write.
    """
    copied = (MODULE_PATH, MODULE_STACK, SOURCE, *_TORCH_PLACE) + ((ORIG_DTYPE, *_TORCH_VALUE) if same_value else ())
    for key in copied:
        if key in source.meta:
            node.meta[str(key)] = source.meta[key]
    record = _record(source)
    sizes = (record.shape if record is not None else None) if shape is _SAME else shape
    node.meta[str(VALUE)] = ValueInfo(is_tensor(source), is_float(source), float_dtype, shape=sizes)
