"""Rewrite: pad low-precision GEMMs' K and N to a multiple of 8 so tensor cores engage; nobody sees a padded shape.

fp16/bf16 tensor cores want the inner (K) and output (N) dimensions of a
GEMM in multiples of 8 elements (16 bytes); a vocabulary of 50257 or a
13-channel convolution falls back to slower kernels.  For every low-precision
GEMM the op registry gives a signature (``linear``, ``matmul``/``mm``/``bmm``,
``addmm``/``baddbmm``, convolutions, and custom ops ``amp_fx.register_op`` gave
``gemm=``), whose weight layout says where K and N are:

1. ``can_pad`` (legal): the GEMM runs in the low dtype, its K and N are
   static, it is not a leaf module, grouped or transposed convolution, and K
   or N is not yet aligned.
2. ``should_pad`` (profitable): ``pad_gemm=True`` pads every legal GEMM,
   ``False`` none; ``"auto"`` pads on CUDA only, and only GEMMs with at least
   ``MIN_WORK`` multiply-adds (rows assumed ``ASSUMED_ROWS`` when unknown)
   that grow by at most ``MAX_GROWTH``.
3. K and N are padded with zeros, never M (the batch changes every call and
   padding it rarely pays).  A weight is padded once per forward and the
   padding is folded into its cast: the padded copy *is* the cast copy
   (:func:`pad_cast`).  An activation's K is padded with
   ``torch.constant_pad_nd``; zero rows of the weight meet it, so the result
   is exact.
4. The output is sliced back to N and made contiguous (:func:`unpad`):
   users see the original shape and strides, gradients reach the original
   parameters in their original shapes, ``state_dict()`` is untouched.

Stats list every GEMM of the final graph with its original and padded shape
(also as report lines), the fp8 GEMMs ``fp8_gemms`` made before it included
(left alone: fp8 needs K and N multiples of 16, so they are aligned).  As in inductor's ``pad_mm.py``, legality and profitability are
separate predicates; unlike it, nothing is benchmarked.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx
from torch.fx import Proxy

from amp_fx.ir import gemm_rows, meta, op_properties
from amp_fx.ir.op_keys import is_custom_op
from amp_fx.ir.cast_nodes import cast_source, cast_target, is_inserted_cast
from amp_fx.ir.pass_manager import PassContext, PassResult, amp_pass
from amp_fx.ir.meta import float_dtype

__all__ = ["pad_gemm", "can_pad", "should_pad", "alignment_for", "padded_size", "find_gemm", "Gemm",
           "pad_cast", "unpad", "MIN_WORK", "MAX_GROWTH", "ASSUMED_ROWS"]

logger = logging.getLogger(__name__)  # amp_fx.passes.pad_gemm

MIN_WORK = 1 << 24  # multiply-adds below which padding's extra copies cost more than they gain
MAX_GROWTH = 1.5  # padded K*N over original K*N above which "auto" does not pad
ASSUMED_ROWS = 1024  # rows (M) "auto" assumes when the graph does not say

# --------------------------------------------------------------------------
# Runtime helpers the rewritten graph calls
# --------------------------------------------------------------------------
def _record(fn: Any, args: tuple) -> Proxy:
    """Stay one node when fx re-traces the rewritten graph (unpickling, converting again)."""
    proxy = next(a for a in args if isinstance(a, Proxy))
    return proxy.tracer.create_proxy("call_function", fn, args, {})


def pad_cast(tensor: Any, dtype: Optional[torch.dtype], sizes: tuple) -> Any:
    """``tensor`` cast to ``dtype`` (None: kept) in a zero tensor whose dims ``(dim, size)`` are grown: one copy."""
    if isinstance(tensor, Proxy):
        return _record(pad_cast, (tensor, dtype, sizes))
    shape = list(tensor.shape)
    for dim, size in sizes:
        shape[dim] = size
    out = tensor.new_zeros(shape, dtype=dtype or tensor.dtype)
    region = out
    for dim, _ in sizes:
        region = region.narrow(dim, 0, tensor.shape[dim])
    region.copy_(tensor)  # casts while copying; autograd hands the gradient's region back, cast to tensor's dtype
    return out


def unpad(tensor: Any, dim: int, size: int, channels_last: bool = False) -> Any:
    """The first ``size`` entries of ``dim``, as a contiguous tensor (channels-last where the GEMM's result was)."""
    if isinstance(tensor, Proxy):
        return _record(unpad, (tensor, dim, size, channels_last))
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return tensor.narrow(dim, 0, size).contiguous(memory_format=fmt)


# --------------------------------------------------------------------------
# Which nodes are GEMMs, and their sizes
# --------------------------------------------------------------------------
def alignment_for(dtype: torch.dtype) -> int:
    """Elements per 16 bytes, what tensor cores want K and N to be a multiple of (8 for fp16/bf16)."""
    return 16 // torch.empty((), dtype=dtype).element_size()


def padded_size(size: int, alignment: int) -> int:
    """``size`` rounded up to a multiple of ``alignment``."""
    return int(math.ceil(size / alignment) * alignment)


@dataclass
class Gemm:
    """A GEMM node and what padding needs to know about it."""

    node: fx.Node
    op: str
    act: Any  # the activation (mat1) operand
    weight: Any  # the K x N operand (mat2 / weight)
    bias: Any = None
    layout: str = "KN"  # the weight's layout (op_properties.GemmSig.weight_layout): "KN", "NK" or "conv"
    extra_args: bool = False  # it reads arguments besides activation, weight and bias (fp8 cannot drop them)
    M: Optional[int] = None
    K: Optional[int] = None
    N: Optional[int] = None
    k_dims: tuple = ()  # (act's K dim, weight's K dim), counted from the end
    n_dims: tuple = ()  # (weight's N dim, output's N dim), counted from the end
    grouped: bool = False


def _shape(value: Any) -> Optional[tuple]:
    return meta.shape(value)


def _arg(node: fx.Node, index: int, name: str) -> Any:
    return node.args[index] if len(node.args) > index else node.kwargs.get(name)


def _check_registered_row(op: str, sig: op_properties.GemmSig, node: fx.Node, act: Any, weight: Any,
                          bias: Any) -> None:
    gemm_rows.check_gemm_schema(op, sig)  # registered before torch knew the op: checked now
    module = meta.MODULE_PATH.get(node)
    where = f"{node.name!r}" + (f" in module {module!r}" if module else "") + \
        (f" at {meta.SOURCE.get(node)}" if meta.SOURCE.get(node) else "")
    gemm_rows.check_gemm_shapes(op, sig, where, _shape(act), _shape(weight), _shape(bias), _shape(node))


def find_gemm(node: fx.Node) -> Optional[Gemm]:
    """The :class:`Gemm` view of ``node``, or None when it is no GEMM this pass knows."""
    op = meta.OP.get(node)
    sig = op_properties.of(op).gemm  # where its activation, weight and bias are, and the weight's layout
    if sig is None or node.op not in ("call_function", "call_method"):
        return None
    act, weight, bias = (None if pos is None else _arg(node, pos, name) for pos, name in sig.operands())
    if is_custom_op(op):  # a register_op row: refuse one that does not fit the op's schema or this call's shapes
        _check_registered_row(op, sig, node, act, weight, bias)
    known = {name for _, name in sig.operands()} | set(sig.unit_scalars)
    extra = len(node.args) > sig.arity or any(key not in known for key in node.kwargs)
    gemm = Gemm(node, op, act, weight, bias, layout=sig.weight_layout, extra_args=extra)
    a_shape, w_shape = _shape(act), _shape(weight)
    if sig.weight_layout == "NK":
        if w_shape is not None and len(w_shape) == 2:
            gemm.N, gemm.K = w_shape
            gemm.k_dims, gemm.n_dims = (-1, -1), (-2, -1)
    elif sig.weight_layout == "conv":
        groups = None if sig.groups is None else _arg(node, sig.groups, "groups")
        transposed = sig.transposed is not None and bool(_arg(node, sig.transposed, "transposed"))
        gemm.grouped = (groups not in (None, 1)) or transposed
        if w_shape is not None and len(w_shape) >= 3:
            gemm.N, gemm.K = w_shape[0], w_shape[1]
            channel = -(len(w_shape) - 1)  # counted from the end: batched and unbatched inputs alike
            gemm.k_dims, gemm.n_dims = (channel, channel), (-len(w_shape), channel)
    elif a_shape is not None and w_shape is not None and len(a_shape) >= 2 and len(w_shape) >= 2:
        gemm.K, gemm.N = w_shape[-2], w_shape[-1]
        gemm.k_dims, gemm.n_dims = (-1, -2), (-1, -1)
    if a_shape is not None and isinstance(gemm.K, int) and all(isinstance(size, int) for size in a_shape):
        gemm.M = math.prod(a_shape) // (a_shape[gemm.k_dims[0]] or 1)
        if sig.weight_layout == "conv":
            gemm.M = None  # rows of an implicit GEMM depend on the output's spatial size
    return gemm


def can_pad(gemm: Gemm, low: torch.dtype, alignment: int) -> tuple[bool, str]:
    """Legality: (True, "") when padding ``gemm`` is safe and changes something, else (False, why)."""
    node = gemm.node
    if meta.PADDED.get(node):
        return False, "already padded"
    if meta.DECISION.get(node) == "fp8":  # fp8_gemms made it: _scaled_mm's operands (fp8_rules.ALIGNMENT)
        return False, "fp8 GEMM (fp8_gemms): K and N are multiples of 16 already"
    if float_dtype(node) != low:
        return False, f"runs in {str(float_dtype(node)).replace('torch.', '')}, not the low dtype"
    if gemm.grouped:
        return False, "grouped or transposed convolution"
    operands = [x for x in (gemm.act, gemm.weight, gemm.bias) if x is not None]
    if not isinstance(gemm.act, fx.Node) or not isinstance(gemm.weight, fx.Node) or len(set(operands)) < len(operands):
        return False, "operands are not distinct tensors"
    if not isinstance(gemm.K, int) or not isinstance(gemm.N, int) or gemm.K <= 0 or gemm.N <= 0:
        return False, "K or N not static"
    if gemm.bias is not None and gemm.N % alignment and not _shape(gemm.bias):
        return False, "bias shape unknown"
    if gemm.K % alignment == 0 and gemm.N % alignment == 0:
        return False, "aligned"
    return True, ""


def should_pad(gemm: Gemm, mode: Any, on_cuda: bool, alignment: int) -> tuple[bool, str]:
    """Profitability: pad_gemm=True always, False never, "auto" on CUDA for big enough, modestly growing GEMMs."""
    if mode is False:
        return False, "pad_gemm=False"
    if mode is True:
        return True, ""
    if not on_cuda:
        return False, "pad_gemm='auto' pads on CUDA only"
    k, n = padded_size(gemm.K, alignment), padded_size(gemm.N, alignment)
    if k * n > MAX_GROWTH * gemm.K * gemm.N:
        return False, f"padding grows it more than {MAX_GROWTH}x"
    if (gemm.M or ASSUMED_ROWS) * gemm.K * gemm.N < MIN_WORK:
        return False, "too small to gain from tensor cores"
    return True, ""


# --------------------------------------------------------------------------
# The rewrite
# --------------------------------------------------------------------------
def _annotate(node: fx.Node, like: fx.Node, op: str, shape: Optional[tuple], reason: str) -> None:
    meta.inherit(node, like, float_dtype=float_dtype(like), shape=shape)
    node.meta.update({meta.OP: op, meta.DECISION: "follow", meta.REASON: reason, meta.INSERTED: True, meta.RULE: "inserted"})


def _grown(shape: Optional[tuple], pads: tuple) -> Optional[tuple]:
    if shape is None:
        return None
    grown = list(shape)
    for dim, size, _ in pads:
        grown[dim] = size
    return tuple(grown)


class _Padder:
    """Pads operands, sharing one padded copy per (value, padding) and folding weight pads into their casts."""

    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self.cache: dict[tuple, fx.Node] = {}
        self.folded = self.copies = 0

    def pad(self, value: fx.Node, pads: tuple) -> fx.Node:
        """``value`` grown along ``pads`` = ((dim from the end, new size, old size), ...)."""
        key = (value, pads)
        if key in self.cache:
            return self.cache[key]
        sizes = tuple((dim, size) for dim, size, _ in pads)
        shape = _grown(_shape(value), pads)
        if is_inserted_cast(value) and len(value.users) == 1:
            # The cast (of a weight, mostly) becomes the padded cast: one copy instead of two.
            source, dtype = cast_source(value), cast_target(value)
            with self.graph.inserting_before(value):
                padded = self.graph.call_function(pad_cast, (source, dtype, sizes))
            padded.meta = dict(value.meta)
            meta.note_value(padded, shape=shape, fake=None, has_value=False)  # the cast's fake has the old shape
            meta.OP.set(padded, "pad_cast")
            meta.REASON.set(padded, f"{meta.REASON.get(value, '')}, padded {_shape(value)} -> {shape}")
            value.replace_all_uses_with(padded)
            self.graph.erase_node(value)
            self.folded += 1
        elif meta.PARAM.get(value) or is_inserted_cast(value):
            with self.graph.inserting_after(value):
                padded = self.graph.call_function(pad_cast, (value, None, sizes))
            _annotate(padded, value, "pad_cast", shape, f"inserted: {value.name} padded to {shape} for tensor cores")
            self.copies += 1
        else:
            widths = [0] * (2 * max(-dim for dim, _, _ in pads))
            for dim, size, old in pads:
                widths[2 * (-dim - 1) + 1] = size - old
            with self.graph.inserting_after(value):
                padded = self.graph.call_function(torch.constant_pad_nd, (value, widths))
            _annotate(padded, value, "constant_pad_nd", shape, f"inserted: {value.name} zero-padded for tensor cores")
            self.copies += 1
        self.cache[key] = padded
        return padded


def _rewrite(gemm: Gemm, padder: _Padder, alignment: int) -> tuple[int, int]:
    node, graph = gemm.node, gemm.node.graph
    k, n = padded_size(gemm.K, alignment), padded_size(gemm.N, alignment)
    replace: dict[Any, fx.Node] = {}
    if k != gemm.K:
        replace[gemm.act] = padder.pad(gemm.act, ((gemm.k_dims[0], k, gemm.K),))
    weight_pads = tuple(p for p in ((gemm.n_dims[0], n, gemm.N), (gemm.k_dims[1], k, gemm.K)) if p[1] != p[2])
    replace[gemm.weight] = padder.pad(gemm.weight, tuple(sorted(weight_pads)))
    bias_shape = _shape(gemm.bias)
    if n != gemm.N and isinstance(gemm.bias, fx.Node) and (bias_shape is None or bias_shape[-1] == gemm.N):
        replace[gemm.bias] = padder.pad(gemm.bias, ((-1, n, gemm.N),))
    node.args = tuple(replace.get(a, a) if isinstance(a, fx.Node) else a for a in node.args)
    node.kwargs = {key: replace.get(v, v) if isinstance(v, fx.Node) else v for key, v in node.kwargs.items()}
    original = _shape(node)
    value = getattr(meta.value_of(node), "fake", None)  # the dtype analysis's fake result: its strides
    node.meta.pop("val", None)
    node.meta.pop("example_value", None)  # stale: the GEMM now makes the padded shape
    meta.PADDED.set(node, {"K": (gemm.K, k), "N": (gemm.N, n)})
    grown = ", ".join(f"{name} {old}->{new}" for name, old, new in (("K", gemm.K, k), ("N", gemm.N, n)) if old != new)
    meta.REASON.set(node, f"{meta.REASON.get(node, '')}; {grown} padded for tensor cores")
    if n == gemm.N:
        return k, n
    # The GEMM now makes the padded shape: its one record says so (the fake result had the old one).
    meta.note_value(node, shape=_grown(original, ((gemm.n_dims[1], n, gemm.N),)), fake=None, has_value=False)
    channels_last = isinstance(value, torch.Tensor) and value.dim() == 4 and not value.is_contiguous() \
        and value.is_contiguous(memory_format=torch.channels_last)
    with graph.inserting_after(node):
        sliced = graph.call_function(unpad, (node, gemm.n_dims[1], gemm.N, channels_last))
    _annotate(sliced, node, "unpad", original, f"inserted: {node.name} sliced back to N={gemm.N}")
    node.replace_all_uses_with(sliced, delete_user_cb=lambda user: user is not sliced)
    return k, n


def _describe(gemm: Gemm, padded: Optional[tuple], why: str) -> str:
    rows = "?" if gemm.M is None else gemm.M
    where = f" ({meta.MODULE_PATH.get(gemm.node)})" if meta.MODULE_PATH.get(gemm.node) else ""
    head = f"{gemm.op} {gemm.node.name}{where}: M={rows} K={gemm.K} N={gemm.N}"
    return f"{head} -> K={padded[0]} N={padded[1]}" if padded else f"{head} left alone ({why})"


@amp_pass(kind="rewrite", requires=("meta", "paint"))
def pad_gemm(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Pad the K and N of low-precision GEMMs to ``alignment`` (see module docstring)."""
    mode = ctx.config.pad_gemm
    alignment = alignment_for(ctx.low)
    on_cuda = ctx.device_for(gm) == "cuda"
    padder = _Padder(gm.graph)
    gemms, lines = [], []
    for node in list(gm.graph.nodes):
        gemm = find_gemm(node)
        if gemm is None:
            continue
        legal, why = can_pad(gemm, ctx.low, alignment)
        profitable, why_not = should_pad(gemm, mode, on_cuda, alignment) if legal else (False, why)
        padded = _rewrite(gemm, padder, alignment) if profitable else None
        if padded:
            logger.debug("padded %s: K %s->%s, N %s->%s", node.name, gemm.K, padded[0], gemm.N, padded[1])
        gemms.append({"node": node.name, "op": gemm.op, "module": meta.MODULE_PATH.get(node, ""),
                      "M": gemm.M, "K": gemm.K, "N": gemm.N, "padded": list(padded) if padded else None,
                      "why": "" if padded else why_not})
        lines.append(_describe(gemm, padded, why_not))
    count = sum(1 for g in gemms if g["padded"])
    if mode == "auto" and not on_cuda:
        lines = []  # every CPU conversion would carry these lines; the stats still list the GEMMs
    stats = {"gemms": gemms, "padded": count, "alignment": alignment, "folded_into_casts": padder.folded,
             "pad_copies": padder.copies, "report_lines": lines}
    return PassResult(gm, count > 0, stats)
