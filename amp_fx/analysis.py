"""The one dtype analysis: each value's dtype, shape and aliasing in the *rewritten* program.

Autocast decides at every dispatch; amp_fx decides ahead of time, and this
module is where it learns what every value will be once the casts are in.
Nothing else in amp_fx models dtypes: ``insert_casts``, ``minimize_casts``,
``pad_gemm``, the report and the views all read this answer.

The algorithm, one walk over the graph in order:

1. Read the node's paint (``amp_fx.decision``) and work out the dtype each of
   its floating inputs arrives in after ``insert_casts``
   (:func:`input_target`): ``low`` and ``fp32`` cast them, ``promote`` casts
   them to the widest among them, anything else leaves them as they are.
   float64 is never cast, as under autocast.
2. Fake mode (example inputs given, or a graph from Dynamo / torch.export):
   cast the inputs' fake values to those dtypes and run the op's fake/meta
   kernel.  The output's dtype and shape are read off the result.  A program
   that is legal under ``torch.autocast`` is therefore legal here by
   construction: low inputs into fp32 modules, promote-list ops with mixed
   dtypes, RNNs fed bf16.  The *original* program is never replayed.
3. A node that cannot be fake-run (a data-dependent result such as
   ``torch.equal``, no meta kernel, an opaque custom op) is recorded as
   unknown, with the reason; the walk goes on, and its readers fall back to
   step 4 (their casts are then guarded at run time by ``amp_cast``).
4. Dtype-only mode (no example inputs, or an unknown input): the result rule
   of the op, derived from the tables (:func:`_rule_value`).  Graph inputs'
   dtypes are unknown: nothing is assumed about them.

Every node gets a :class:`ValueInfo` under ``meta.VALUE`` and the flat keys
of :mod:`amp_fx.meta` (``IS_TENSOR``, ``IS_FLOAT``, ``FLOAT_DTYPE``,
``SHAPE``, ``CONTAINER``).  :func:`planned_casts` turns an analysis into the
casts ``insert_casts`` will write and the bytes they move, so the min-cut can
compare paints without rewriting a copy of the graph.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
import torch.fx as fx
from torch.fx.node import map_arg
from torch.utils import _pytree as pytree

from amp_fx import meta, tables
from amp_fx.casts import amp_cast, amp_promote
from amp_fx.op_keys import CAST_OPS

__all__ = [
    "ValueInfo", "Analysis", "analyse", "input_target", "arrives_as", "explicit_dtype", "promoting_inputs", "may_be_float_tensor",
    "alias_root", "mutated_roots", "mutated_values", "numel_estimates", "planned_casts", "cast_bytes",
    "eval_mode", "placeholder_examples", "ELEMENT_SIZE", "FALLBACK_NUMEL", "ALIASING_OPS", "CHECK_OPS",
]

ELEMENT_SIZE = {torch.float16: 2, torch.bfloat16: 2, torch.float32: 4, torch.float64: 8}
FALLBACK_NUMEL = 4096  # elements of a graph input whose shape is unknown (cost estimates only)

# Ops whose result may share memory with their first input: views, and casts
# (a cast to the dtype a tensor already has returns the tensor itself).
ALIASING_OPS = tables.DATA_MOVEMENT | CAST_OPS
# Checks that torch.export records: no result, no arithmetic; kept true to the rewrite by insert_casts.
CHECK_OPS = tables.EXPORT_CHECKS

# -- result rules for dtype-only mode, all derived from the tables ----------
# Ops whose tensor result is floating whatever arrives (GEMMs, exp, softmax, losses).
_FLOAT_RESULT = (frozenset(tables.LOW) | frozenset(tables.FP32)) - {"sum", "prod", "cumsum", "cumprod", "pow"}
# Ops whose result is never floating, or is not a tensor at all.
_NON_FLOAT_RESULT = frozenset({
    "eq", "ne", "lt", "le", "gt", "ge", "isfinite", "isnan", "isinf", "logical_and", "logical_or", "logical_not",
    "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not", "argmax", "argmin", "any", "all", "one_hot", "equal",
    "nonzero", "searchsorted", "bucketize",
})
_NON_TENSOR_RESULT = frozenset({"size", "dim", "numel", "ndimension", "nelement", "stride", "is_floating_point",
                                "item", "tolist", "getattr", "equal", "is_contiguous", "data_ptr"})
_NON_TENSOR_ATTRS = frozenset({"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "is_sparse", "layout"})
# Ops that return several tensors (their items are read with getitem).
_TUPLE_RESULT = frozenset({"split", "chunk", "unbind", "split_with_sizes", "topk", "sort", "var_mean", "std_mean",
                           "lstm", "gru", "rnn_tanh", "rnn_relu", "native_dropout", "max_pool2d_with_indices",
                           "multi_head_attention"})
# Data movement keeps its first input's dtype (an index or shape tensor takes no part; F.embedding's data is its 2nd input).
_KEEPS_FIRST_DTYPE = tables.DATA_MOVEMENT - {"embedding", "embedding_bag", "one_hot"}
_NAMED_CASTS = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16, "double": torch.float64}
_NON_FLOAT_CASTS = frozenset({"long", "int", "bool", "short", "byte", "char"})
# Ops whose result is larger than their input by a factor read off literal arguments (cost estimates).
_GROWING = frozenset({"repeat", "tile", "repeat_interleave", "expand"})


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
        m[meta.VALUE] = self
        m[meta.IS_TENSOR] = self.is_tensor
        m[meta.IS_FLOAT] = self.is_float
        m[meta.FLOAT_DTYPE] = self.float_dtype
        m[meta.CONTAINER] = self.container
        if self.shape is not None:
            m[meta.SHAPE] = self.shape
        else:
            m.pop(meta.SHAPE, None)
        if self.unknown:
            m[meta.UNKNOWN] = self.unknown
        else:
            m.pop(meta.UNKNOWN, None)


@dataclass
class Analysis:
    """The answer for one paint: a :class:`ValueInfo` per node, and the nodes that could not be fake-run."""

    values: dict[fx.Node, ValueInfo]
    unknown: dict[str, str]
    fake_mode: bool
    read_as: dict[fx.Node, ValueInfo]  # O2/O3 graph inputs as their readers see them (after the entry cast)

    def __getitem__(self, node: fx.Node) -> ValueInfo:
        return self.values[node]

    def float_dtype(self, node: Any) -> Optional[torch.dtype]:
        info = self.values.get(node) if isinstance(node, fx.Node) else None
        return info.float_dtype if info is not None else None


@contextlib.contextmanager
def eval_mode(module: torch.nn.Module) -> Iterator[None]:
    """Run in eval mode and restore every submodule's flag (so analysis updates no statistics)."""
    flags = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag


# --------------------------------------------------------------------------
# What a node asks of its inputs
# --------------------------------------------------------------------------
def may_be_float_tensor(info: Optional[ValueInfo]) -> bool:
    """True unless the value is known to hold no floating tensor (casts skip it then); containers of floats count."""
    return info is not None and (info.container or (info.is_tensor is not False and info.is_float is not False))


def _node_inputs(node: fx.Node) -> list[fx.Node]:
    found: list[fx.Node] = []
    map_arg((node.args, node.kwargs), lambda n: found.append(n) if n not in found else None)
    return found


def promoting_inputs(node: fx.Node, values: Mapping[fx.Node, ValueInfo]) -> list[fx.Node]:
    """The floating inputs that decide a promoting op's dtype (0-dim tensors only when alone, as in torch)."""
    inputs = [n for n in _node_inputs(node) if may_be_float_tensor(values.get(n))]
    dimensioned = [n for n in inputs if values[n].shape != ()]
    return dimensioned or inputs


def _widest(dtypes: list[Optional[torch.dtype]]) -> Optional[torch.dtype]:
    if not dtypes or any(d is None for d in dtypes):
        return None
    result = dtypes[0]
    for d in dtypes[1:]:
        result = torch.promote_types(result, d)
    return result


def explicit_dtype(node: fx.Node) -> Optional[torch.dtype]:
    """A floating ``dtype=`` keyword the op was called with (``softmax(x, -1, dtype=torch.float32)``)."""
    dtype = node.kwargs.get("dtype")
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def input_target(node: fx.Node, decision: str, low: torch.dtype, values: Mapping[fx.Node, ValueInfo]) -> Optional[torch.dtype]:
    """The dtype ``node`` wants its floating inputs in under ``decision`` (None: as they arrive).

    A node may carry its own low dtype (``meta.LOW_DTYPE``: a model's
    ``torch.autocast(dtype=...)`` region asks for another low dtype there).
    """
    if decision == "low":
        return node.meta.get(meta.LOW_DTYPE) or low
    if decision == "fp32":
        return torch.float32
    if decision == "promote":
        return _widest([values[n].float_dtype for n in dict.fromkeys(promoting_inputs(node, values))])
    return None


def arrives_as(info: ValueInfo, target: Optional[torch.dtype]) -> ValueInfo:
    """``info`` as a node with input target ``target`` reads it (float64 and non-floats are never cast)."""
    if target is None or not may_be_float_tensor(info) or info.float_dtype == torch.float64:
        return info
    if info.float_dtype == target:
        return info
    if info.container:
        fake = amp_cast(info.fake, target) if info.fake is not None else None
        return ValueInfo(False, False, target, container=True, fake=fake, has_value=info.has_value)
    fake = info.fake.to(target) if isinstance(info.fake, torch.Tensor) and info.is_float else info.fake
    dtype = target if info.is_float else info.dtype
    return ValueInfo(info.is_tensor, info.is_float, target, dtype, info.shape, fake=fake, has_value=info.has_value)


# --------------------------------------------------------------------------
# The walk
# --------------------------------------------------------------------------
def _graph_fake_mode(graph: fx.Graph) -> Any:
    for node in graph.nodes:
        mode = getattr(meta.example_value(node), "fake_mode", None)
        if mode is not None:
            return mode
    return None


def placeholder_examples(gm: fx.GraphModule, ctx: Any) -> dict[fx.Node, Any]:
    """Each placeholder's example value: Dynamo's/export's own, or the example inputs bound by position and name."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    recorded = {n: meta.example_value(n) for n in placeholders if meta.example_value(n) is not None}
    if recorded:
        return recorded
    # A graph converted before (re-run on its own output) keeps what its example inputs told.
    previous = {n: n.meta[meta.VALUE].fake for n in placeholders
                if getattr(n.meta.get(meta.VALUE), "has_value", False)}
    if previous and (ctx is None or (ctx.example_inputs is None and not ctx.example_kwarg_inputs)):
        return previous
    if ctx is None or (ctx.example_inputs is None and not ctx.example_kwarg_inputs):
        return {}
    args = list(ctx.example_inputs or ())
    kwargs = dict(ctx.example_kwarg_inputs or {})
    bound: dict[fx.Node, Any] = {}
    for index, node in enumerate(placeholders):
        if index < len(args):
            bound[node] = args[index]
        elif str(node.target) in kwargs:
            bound[node] = kwargs[str(node.target)]
        else:
            bound[node] = node.args[0] if node.args else None  # the parameter's default
    return bound


class _Walker:
    """Runs the analysis walk for one paint (see the module docstring)."""

    def __init__(self, gm: fx.GraphModule, ctx: Any, paint: dict, low: torch.dtype,
                 assume_inputs: Optional[torch.dtype], repaint: Optional[Callable[[fx.Node, ValueInfo], Optional[str]]]):
        self.gm = gm
        self.ctx = ctx
        self.paint = paint
        self.repaint = repaint
        self.low = low
        self.assume_inputs = assume_inputs
        self.values: dict[fx.Node, ValueInfo] = {}
        self.unknown: dict[str, str] = {}
        self.read_as: dict[fx.Node, ValueInfo] = {}  # entry-cast inputs, as their readers see them
        self.examples = placeholder_examples(gm, ctx)
        self.mode = None
        if self.examples:
            from torch._subclasses.fake_tensor import FakeTensorMode

            self.mode = _graph_fake_mode(gm.graph) or FakeTensorMode(allow_non_fake_inputs=True)
        cache = getattr(ctx, "analysis_cache", None)
        self.cache: dict = cache if cache is not None else {}

    def _fake(self, value: Any) -> Any:
        """A fake copy of a real tensor (fake ones are kept), so no kernel runs for real."""
        if isinstance(value, torch.Tensor) and not hasattr(value, "fake_mode"):
            return self.mode.from_tensor(value, static_shapes=True)
        return value

    def run(self) -> Analysis:
        guard = self.mode if self.mode is not None else contextlib.nullcontext()
        with guard, eval_mode(self.gm), torch.autocast("cpu", enabled=False):
            for node in self.gm.graph.nodes:
                info = self._visit(node)
                new = self.repaint(node, info) if self.repaint is not None else None
                if new is not None:
                    self.paint[node] = new
                    info = self._visit(node)
                self.values[node] = info
        return Analysis(self.values, self.unknown, self.mode is not None, self.read_as)

    # -- one node ----------------------------------------------------------
    def _visit(self, node: fx.Node) -> ValueInfo:
        decision = self.paint.get(node) or node.meta.get(meta.DECISION, "follow")
        if node.op == "placeholder":
            return self._placeholder(node, decision)
        if node.op == "get_attr":
            value = _fetch_attr(self.gm, str(node.target))
            if isinstance(value, torch.Tensor):
                info = ValueInfo.of(self._fake(value) if self.mode is not None else value)
                if self.mode is None:
                    info.fake, info.has_value = None, False
                return info
            return ValueInfo.non_tensor()
        if node.op == "output":
            return ValueInfo.non_tensor()
        op = node.meta.get(meta.OP)
        if op in CHECK_OPS:
            return ValueInfo.non_tensor()
        if node.meta.get(meta.INPLACE) and node.args and isinstance(node.args[0], fx.Node):
            # Written back into its first input (an fp32 in-place op is computed out of place, then copied back).
            written = self.read_as.get(node.args[0], self.values[node.args[0]])
            return ValueInfo(written.is_tensor, written.is_float, written.float_dtype, written.dtype, written.shape,
                             fake=written.fake, has_value=written.has_value)
        target = input_target(node, decision, self.low, self.values)
        inputs = {n: arrives_as(self.read_as.get(n, self.values[n]), target) for n in _node_inputs(node)}
        if self.mode is not None and all(i.has_value for i in inputs.values()):
            info = self._fake_run(node, inputs, target, decision)
            if info is not None:
                return info
        return _rule_value(node, decision, inputs, target, self.gm)

    def _placeholder(self, node: fx.Node, decision: str) -> ValueInfo:
        if node in self.examples:
            value = pytree.tree_map(self._fake, self.examples[node])
            info = ValueInfo.of(value)
        elif self.assume_inputs is not None:
            info = ValueInfo(None, None, self.assume_inputs)  # for cost models only: nothing is assumed at run time
        else:
            info = ValueInfo()
        if decision == "entry" and info.is_float is not False:
            # O2/O3: every reader sees the entry cast, never the raw input.
            self.read_as[node] = arrives_as(info, self.low)
        return info

    def _fake_run(self, node: fx.Node, inputs: dict[fx.Node, ValueInfo], target: Optional[torch.dtype], decision: str) -> Optional[ValueInfo]:
        signature = (node, decision, target, tuple((n.name, i.float_dtype, i.dtype) for n, i in inputs.items()))
        if signature in self.cache:
            cached = self.cache[signature]
            if cached.unknown:
                self.unknown[node.name] = cached.unknown
            return cached
        args, kwargs = map_arg((node.args, node.kwargs), lambda n: inputs[n].fake)
        try:
            result = _call(self.gm, node, args, kwargs, target)
            info = ValueInfo.of(result)
        except Exception as error:  # any failure: the node is unknown, the conversion goes on
            reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:200]
            self.unknown[node.name] = reason
            info = _rule_value(node, decision, inputs, target, self.gm)
            info.unknown = reason
        self.cache[signature] = info
        return info


def _fetch_attr(gm: fx.GraphModule, target: str) -> Any:
    value: Any = gm
    for atom in target.split("."):
        value = getattr(value, atom, None)
    return value


def _call(gm: fx.GraphModule, node: fx.Node, args: tuple, kwargs: dict, target: Optional[torch.dtype]) -> Any:
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


def _cast_target(node: fx.Node, inputs: Mapping[fx.Node, ValueInfo]) -> tuple[bool, Optional[torch.dtype]]:
    """(is a float cast, its target) for a cast the model wrote; (False, None) for a cast to a non-float dtype."""
    op = node.meta.get(meta.OP)
    if op in _NAMED_CASTS:
        return True, _NAMED_CASTS[op]
    if node.target is amp_cast:
        return True, node.args[1] if len(node.args) > 1 else node.kwargs.get("dtype")
    if node.target is amp_promote:
        return True, None  # the widest of its inputs, known only at run time
    for arg in list(node.args[1:]) + list(node.kwargs.values()):
        if isinstance(arg, torch.dtype):
            return arg.is_floating_point, arg if arg.is_floating_point else None
        if isinstance(arg, fx.Node) and arg in inputs:  # .to(other) / .type_as(other)
            info = inputs[arg]
            return info.is_float is not False, info.float_dtype
    return True, None


def _rule_value(node: fx.Node, decision: str, inputs: Mapping[fx.Node, ValueInfo], target: Optional[torch.dtype],
                gm: fx.GraphModule) -> ValueInfo:
    """Dtype-only mode: the op's result rule (see the module docstring, step 4)."""
    op = node.meta.get(meta.OP)
    if op in _NON_TENSOR_RESULT or (node.op == "call_method" and node.target in _NON_TENSOR_RESULT):
        return ValueInfo.non_tensor()
    if node.op == "call_function" and node.target is getattr and len(node.args) > 1 and node.args[1] in _NON_TENSOR_ATTRS:
        return ValueInfo.non_tensor()
    if node.op == "call_method" and node.target in _NON_FLOAT_CASTS:
        return ValueInfo(True, False)
    first = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    first_info = inputs.get(first) if first is not None else None
    if op == "getitem" and first_info is not None and (first_info.container or first_info.is_tensor is None):
        # An item of a tuple of tensors (chunk, LSTM outputs): its dtype flows through.
        if first_info.container:
            return ValueInfo(None, None, first_info.float_dtype)
        return ValueInfo()
    if op in _TUPLE_RESULT and first_info is not None and first_info.is_float is not False and first_info.float_dtype:
        return ValueInfo(False, False, first_info.float_dtype if target is None else target, container=True)
    complex_in = next((i.dtype for i in inputs.values() if i.dtype is not None and i.dtype.is_complex), None)
    if complex_in is not None:
        # ``h * phase`` with a complex phase is complex: never a float, never cast.
        return ValueInfo(True, False, None, complex_in)
    if op in _NON_FLOAT_RESULT:
        return ValueInfo(None, False)
    if decision == "cast" or op in CAST_OPS:
        is_float_cast, dtype = _cast_target(node, inputs)
        if not is_float_cast:
            return ValueInfo(True, False)
        if dtype is not None:
            source = first_info
            known = source is not None and source.is_float is True
            return ValueInfo(True if known else None, True if known else None, dtype, shape=source.shape if source else None)
    explicit = explicit_dtype(node)
    if explicit is not None:
        return ValueInfo(True, True, explicit)
    reads_float64 = any(i.float_dtype == torch.float64 for i in inputs.values() if may_be_float_tensor(i))
    if decision in ("low", "fp32") and target is not None and not reads_float64:
        if op in _FLOAT_RESULT:
            return ValueInfo(True, True, target)
        if node.op == "call_module":
            return ValueInfo(None, None, target)
    if op in _KEEPS_FIRST_DTYPE and first_info is not None and first_info.is_tensor is not False and not first_info.container:
        return ValueInfo(first_info.is_tensor, first_info.is_float, first_info.float_dtype, first_info.dtype)
    if op == "embedding" and len(node.args) > 1 and isinstance(node.args[1], fx.Node):
        weight = inputs[node.args[1]]
        return ValueInfo(True if weight.is_float else None, weight.is_float, weight.float_dtype)
    floats = [i for n, i in inputs.items() if may_be_float_tensor(i)]
    dimensioned = [i for i in floats if i.shape != ()]
    deciding = dimensioned or floats
    if not deciding:
        if inputs and any(i.container for i in inputs.values()):
            return ValueInfo(None, None, _widest([i.float_dtype for i in inputs.values() if i.container]))
        # Factories (torch.zeros(x.size())) make the default dtype when they make floats.
        if all(i.is_tensor is False for i in inputs.values()):
            return ValueInfo(None, None, torch.get_default_dtype())
        return ValueInfo()
    is_float = True if (first_info is not None and first_info.is_float is True and op in tables.FOLLOW) or \
        (op in _FLOAT_RESULT) else None
    return ValueInfo(True if is_float else None, is_float, _widest([i.float_dtype for i in deciding]))


def analyse(gm: fx.GraphModule, ctx: Any = None, paint: Optional[dict] = None, *,
            low: Optional[torch.dtype] = None, store: bool = True, assume_inputs: Optional[torch.dtype] = None,
            repaint: Optional[Callable[[fx.Node, ValueInfo], Optional[str]]] = None) -> Analysis:
    """Analyse ``gm`` under ``paint`` (node -> decision; default: the graph's own paint).

    ``store``: write the answer on the nodes (the analysis of the paint the
    rewrite will use).  ``assume_inputs``: a dtype to assume for graph inputs
    of unknown dtype -- for cost models only (the min-cut), never for what the
    graph does.  ``repaint(node, info)``: called on each node in order with
    its answer; a decision it returns replaces the node's paint in ``paint``
    (which is updated in place) and the node is analysed again.
    """
    low = low or (ctx.low if ctx is not None else torch.bfloat16)
    analysis = _Walker(gm, ctx, paint if paint is not None else {}, low, assume_inputs, repaint).run()
    if store:
        for node, info in analysis.values.items():
            info.write(node)
            if node.op in ("placeholder", "get_attr") and info.dtype is not None:
                node.meta[meta.ORIG_DTYPE] = info.dtype if node.meta.get(meta.DECISION) != "entry" else node.meta.get(meta.ORIG_DTYPE, info.dtype)
    return analysis


# --------------------------------------------------------------------------
# Aliasing
# --------------------------------------------------------------------------
def alias_root(node: fx.Node) -> fx.Node:
    """The value ``node`` may share memory with, walking back through views, casts and in-place ops.

    Over-approximating (``index_select`` copies) only costs a cast; missing an
    alias would read stale values.
    """
    while node.op in ("call_function", "call_method") and node.args and isinstance(node.args[0], fx.Node):
        op = node.meta.get(meta.OP)
        if not (op in ALIASING_OPS or node.meta.get(meta.INPLACE)):
            break
        node = node.args[0]
    return node


def mutated_roots(graph: fx.Graph) -> set[fx.Node]:
    """Alias roots of the values some in-place op writes into: their casts must not be shared across the write."""
    return {alias_root(n.args[0]) for n in graph.nodes
            if n.meta.get(meta.INPLACE) and n.args and isinstance(n.args[0], fx.Node)}


def mutated_values(graph: fx.Graph) -> set[fx.Node]:
    """Every value an in-place op writes, with everything that may alias it (views up and down)."""
    found = {n.args[0] for n in graph.nodes if n.meta.get(meta.INPLACE) and n.args and isinstance(n.args[0], fx.Node)}
    todo = list(found)
    while todo:
        node = todo.pop()
        linked = [u for u in node.users if u.meta.get(meta.OP) in ALIASING_OPS and u.args and u.args[0] is node]
        if node.meta.get(meta.OP) in ALIASING_OPS and node.args and isinstance(node.args[0], fx.Node):
            linked.append(node.args[0])
        for other in linked:
            if other not in found:
                found.add(other)
                todo.append(other)
    return found


# --------------------------------------------------------------------------
# Sizes and the casts a paint implies
# --------------------------------------------------------------------------
def _growth(node: fx.Node) -> int:
    """How many times larger than its input a repeat-like op's result is, from literal arguments (1 if unknown)."""
    op = node.meta.get(meta.OP)
    if op not in _GROWING:
        return 1
    sizes = [a for a in node.args[1:] if isinstance(a, int)]
    if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)):
        sizes = [a for a in node.args[1] if isinstance(a, int)]
    if op == "expand":
        return 2 if sizes else 1  # the input's shape is unknown: only "larger"
    return max(1, math.prod(sizes)) if sizes else 1


def numel_estimates(graph: fx.Graph) -> dict[fx.Node, int]:
    """Elements per value: from shapes where known; otherwise a graph input counts ``FALLBACK_NUMEL``
    and an op's result as much as its largest input (times a repeat's literal factor)."""
    numel: dict[fx.Node, int] = {}
    for node in graph.nodes:
        shape = node.meta.get(meta.SHAPE)
        inputs = [numel[n] for n in _node_inputs(node) if n in numel]
        if shape is not None and all(isinstance(size, int) for size in shape):  # a SymInt would add a guard
            numel[node] = math.prod(shape)
        elif inputs and node.op not in ("placeholder", "get_attr"):
            numel[node] = max(inputs) * _growth(node)
        else:
            numel[node] = FALLBACK_NUMEL
    return numel


def cast_bytes(node: fx.Node) -> Optional[int]:
    """Bytes an inserted cast node reads plus writes, from shape metadata (None without shapes)."""
    shape = node.meta.get(meta.SHAPE)
    _, source_dtype, target = node.meta.get(meta.CAST_OF, (None, None, None))
    if shape is None or target is None or not all(isinstance(s, int) for s in shape):
        return None
    # An unknown source dtype is counted as fp32: the cast exists because it differs.
    return math.prod(shape) * (ELEMENT_SIZE.get(source_dtype, 4) + ELEMENT_SIZE.get(target, 2))


def _widening_model_cast(node: fx.Node, values: Mapping[fx.Node, ValueInfo]) -> Optional[fx.Node]:
    """The value a cast the model wrote widens (``x.float()`` on a low x), which a later cast reads through."""
    if node.meta.get(meta.DECISION) != "cast" or node.meta.get(meta.INSERTED) or not node.args:
        return None
    source = node.args[0]
    target = values[node].float_dtype
    if not isinstance(source, fx.Node) or target not in (torch.float32, torch.float64):
        return None
    info = values.get(source)
    return source if info is not None and info.is_float is True and info.float_dtype != torch.float64 else None


def planned_casts(gm: fx.GraphModule, analysis: Analysis, paint: Mapping[fx.Node, str], low: torch.dtype,
                  output_dtype: Optional[torch.dtype]) -> dict[tuple[fx.Node, torch.dtype], int]:
    """The casts ``insert_casts`` (then ``fold_casts``) writes under ``paint``, one per (value, dtype), with their bytes.

    Sizes come from :func:`numel_estimates`.  A cast that reads a widening
    cast the model wrote reads through it, as ``fold_casts`` does.
    """
    values = analysis.values
    numel = numel_estimates(gm.graph)
    casts: dict[tuple[fx.Node, torch.dtype], int] = {}

    def want(value: fx.Node, dtype: Optional[torch.dtype]) -> None:
        info = analysis.read_as.get(value, values.get(value))
        if dtype is None or not may_be_float_tensor(info) or info.float_dtype == torch.float64:
            return
        through = _widening_model_cast(value, values)
        if through is not None:
            value, info = through, values[through]
        if info.float_dtype == dtype:
            return
        source_size = ELEMENT_SIZE.get(info.float_dtype, 4)
        casts[(value, dtype)] = numel.get(value, FALLBACK_NUMEL) * (source_size + ELEMENT_SIZE.get(dtype, 2))

    for node in gm.graph.nodes:
        decision = paint.get(node) or node.meta.get(meta.DECISION, "follow")
        if node.op == "placeholder":
            if node in analysis.read_as and values[node].float_dtype != low:
                source_size = ELEMENT_SIZE.get(values[node].float_dtype, 4)
                casts[(node, low)] = numel.get(node, FALLBACK_NUMEL) * (source_size + ELEMENT_SIZE[low])
            continue
        if node.op == "output":
            if decision == "exit":
                map_arg(node.args, lambda n: want(n, output_dtype))
            continue
        if node.op == "get_attr" or node.meta.get(meta.INPLACE):
            continue
        target = input_target(node, decision, low, values)
        if target is None:
            continue
        for value in _node_inputs(node):
            want(value, target)
        if node.op == "call_module":
            module = gm.get_submodule(str(node.target))
            for name, p in module.named_parameters():
                if p.is_floating_point() and p.dtype not in (target, torch.float64):
                    casts[(f"{node.target}.{name}", target)] = p.numel() * (ELEMENT_SIZE.get(p.dtype, 4) + ELEMENT_SIZE.get(target, 2))
    return casts
