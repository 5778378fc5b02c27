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
   of the op, derived from the tables (:func:`amp_fx.ir.dtype_rules.rule_value`).  Graph inputs'
   dtypes are unknown: nothing is assumed about them.

Every node gets a :class:`ValueInfo`, its one value record (``meta.VALUE``:
:func:`amp_fx.ir.meta.store_value`; ``meta.is_float(node)``,
``meta.float_dtype(node)``, ``meta.shape(node)``, ... read it).  The result rules of dtype-only mode live in
:mod:`amp_fx.ir.dtype_rules`; :mod:`amp_fx.ir.cast_costs` turns an analysis into the
casts ``insert_casts`` will write and the bytes they move.  How one node is
fake-run is :mod:`amp_fx.ir.fake_calls`; aliasing (``alias_root``,
``mutated_values``, importable from here too) is :mod:`amp_fx.ir.aliasing`.

:func:`analyse` only returns its answer: the pass runner
(:mod:`amp_fx.ir.pass_manager`) decides when it runs and stores it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
import torch.fx as fx
from torch._dispatch.python import enable_python_dispatcher
from torch.fx.node import map_arg
from torch.utils import _pytree as pytree

from amp_fx.ir import meta, op_properties
from amp_fx.graph_ops.casts import amp_cast
from amp_fx.ir.dtype_rules import explicit_dtype, opened_by_hooks, rule_value, widest
from amp_fx.graph_ops.mode_switch import switching_modes
from amp_fx.ir.meta import ValueInfo, may_be_float_tensor
from amp_fx.ir.aliasing import alias_root, mutated_roots, mutated_values
from amp_fx.ir.fake_calls import (Described, call_key, call_on_fakes, changes_transform_levels, examples_do_not_fit,
                                  fetch_attr, quiet_fake_kernels, transform_levels_kept)

__all__ = [
    "ValueInfo", "Analysis", "analyse", "input_target", "arrives_as", "explicit_dtype", "promoting_inputs",
    "may_be_float_tensor", "node_inputs", "alias_root", "mutated_roots", "mutated_values", "eval_mode",
    "placeholder_examples",
]


@dataclass
class Analysis:
    """The answer for one paint: a :class:`ValueInfo` per node, and the nodes that could not be fake-run."""

    values: dict[fx.Node, ValueInfo]
    unknown: dict[str, str]
    fake_mode: bool
    read_as: dict[fx.Node, ValueInfo]  # O2/O3 graph inputs as their readers see them (after the entry cast)
    decisions: dict[fx.Node, str]  # the paint analysed

    @property
    def complete(self) -> bool:
        """Every graph input's value was known: no assumption about inputs changed this answer."""
        return self.fake_mode and all(info.has_value for node, info in self.values.items() if node.op == "placeholder")

    def write(self) -> None:
        """Store this answer on its nodes: the pass runner's to call, for the paint the rewrite will use."""
        for node, info in self.values.items():
            info.write(node)
            if node.op in ("placeholder", "get_attr") and info.dtype is not None:
                meta.ORIG_DTYPE.set(node, info.dtype if meta.DECISION.get(node) != "entry" else meta.ORIG_DTYPE.get(node, info.dtype))



@contextlib.contextmanager
def eval_mode(module: torch.nn.Module) -> Iterator[None]:
    """Run in eval mode and restore every submodule's flag (so analysis updates no statistics)."""
    flags = [(m, m.training) for m in module.modules()]
    with switching_modes():  # amp_fx's own switch: a converted module frozen in train mode does not warn
        module.eval()
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag


# --------------------------------------------------------------------------
# What a node asks of its inputs
# --------------------------------------------------------------------------
def node_inputs(node: fx.Node) -> list[fx.Node]:
    found: list[fx.Node] = []
    map_arg((node.args, node.kwargs), lambda n: found.append(n) if n not in found else None)
    return found


def promoting_inputs(node: fx.Node, values: Mapping[fx.Node, ValueInfo]) -> list[fx.Node]:
    """The floating inputs that decide a promoting op's dtype (0-dim tensors only when alone, as in torch)."""
    inputs = [n for n in node_inputs(node) if may_be_float_tensor(values.get(n))]
    dimensioned = [n for n in inputs if values[n].shape != ()]
    return dimensioned or inputs


def input_target(node: fx.Node, decision: str, low: torch.dtype, values: Mapping[fx.Node, ValueInfo]) -> Optional[torch.dtype]:
    """The dtype ``node`` wants its floating inputs in under ``decision`` (None: as they arrive).

    A node may carry its own low dtype (``meta.LOW_DTYPE``: a model's
    ``torch.autocast(dtype=...)`` region asks for another low dtype there).
    An fp32 node marked ``meta.FUSED`` (``passes/fuse_precision``) runs a
    kernel that computes in fp32 from its low input and fp32 weights, which
    already arrive so: it takes its inputs as they are.
    """
    if decision == "low":
        return node.meta.get(meta.LOW_DTYPE) or low
    if decision == "fp32":
        return None if node.meta.get(meta.FUSED) else torch.float32
    if decision == "promote":
        return widest([values[n].float_dtype for n in dict.fromkeys(promoting_inputs(node, values))])
    return None


def arrives_as(info: ValueInfo, target: Optional[torch.dtype], with_value: bool = False) -> ValueInfo:
    """``info`` as a node with input target ``target`` reads it (float64 and non-floats are never cast).

    ``with_value``: cast the fake value too (a fake kernel runs; only when the op will be fake-run).
    """
    if target is None or not may_be_float_tensor(info) or info.float_dtype == torch.float64:
        return info
    if info.float_dtype == target:
        return info
    fake, has_value = None, False
    if with_value and info.has_value:
        fake, has_value = amp_cast(info.fake, target), True
    if info.container:
        return ValueInfo(False, False, target, container=True, fake=fake, has_value=has_value)
    dtype = target if info.is_float else info.dtype
    return ValueInfo(info.is_tensor, info.is_float, target, dtype, info.shape, fake=fake, has_value=has_value)


# --------------------------------------------------------------------------
# The walk
# --------------------------------------------------------------------------
def _fake_mode_of(examples: Mapping[fx.Node, Any]) -> Any:
    """The FakeTensorMode the example values already belong to (Dynamo's, torch.export's, an earlier conversion's)."""
    for value in examples.values():
        for leaf in pytree.tree_leaves(value):
            mode = getattr(leaf, "fake_mode", None)
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
    previous = {n: meta.value_of(n).fake for n in placeholders
                if getattr(meta.value_of(n), "has_value", False)}
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
        self.decisions: dict[fx.Node, str] = {}
        self.opened: dict[fx.Node, str] = {}  # values a module hook may hand on in another dtype, and why
        self.examples = placeholder_examples(gm, ctx)
        # convert()'s example inputs come from the user (the backend's from Dynamo's own trace of real calls)
        self.user_examples = bool(self.examples) and getattr(ctx, "route", None) != "dynamo"
        self.mode = None
        if self.examples:
            self.mode = _fake_mode_of(self.examples) or getattr(ctx, "fake_mode", None)
            if self.mode is None:
                from torch._subclasses.fake_tensor import FakeTensorMode

                self.mode = FakeTensorMode(allow_non_fake_inputs=True)
                if ctx is not None:
                    ctx.fake_mode = self.mode  # later analyses of this conversion reuse it, and its cached fakes
        cache = getattr(ctx, "analysis_cache", None)
        self.cache: dict = cache if cache is not None else {}

    def _fake(self, value: Any) -> Any:
        """A fake copy of a real tensor (fake ones are kept), so no kernel runs for real; made once per tensor."""
        if isinstance(value, torch.Tensor) and not hasattr(value, "fake_mode"):
            key = ("fake of", id(value), value._version)
            if key not in self.cache:
                # Only metadata matters here: an empty fake tensor of the same layout is made far more
                # cheaply than from_tensor's full copy of the tensor's description.
                try:
                    with self.mode:
                        fake = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)
                except Exception:  # a layout empty_strided cannot make (sparse, quantized): describe it in full
                    fake = self.mode.from_tensor(value, static_shapes=True)
                self.cache[key] = (value, fake)  # holds value: its id stays unique while cached
            return self.cache[key][1]
        return value

    def run(self) -> Analysis:
        guard = self.mode if self.mode is not None else contextlib.nullcontext()
        # symbolic sizes (torch.export's dynamic dimensions) need the Python dispatcher, as export traced with it:
        # without it a meta kernel's expand(SymInt...) fails (BLOOM's alibi.baddbmm)
        symbolic = getattr(self.mode, "shape_env", None) is not None
        dispatcher = enable_python_dispatcher() if symbolic else contextlib.nullcontext()
        with guard, dispatcher, eval_mode(self.gm), torch.autocast("cpu", enabled=False), transform_levels_kept():
            for node in self.gm.graph.nodes:
                info = self._visit(node)
                new = self.repaint(node, info) if self.repaint is not None else None
                if new is not None:
                    self.paint[node] = new
                    info = self._visit(node)
                self.values[node] = info
        return Analysis(self.values, self.unknown, self.mode is not None, self.read_as, self.decisions)

    # -- one node ----------------------------------------------------------
    def _visit(self, node: fx.Node) -> ValueInfo:
        decision = self.paint.get(node) or node.meta.get(meta.DECISION, "follow")
        self.decisions[node] = decision
        info = self._value(node, decision)
        if node.op in ("call_function", "call_method", "call_module"):
            # Out of a module hook boundary, and through what follows it: a dtype known only at run time.
            target = None if node.meta.get(meta.INPLACE) else input_target(node, decision, self.low, self.values)
            info, reason = opened_by_hooks(node, info, target, {n: self.values[n] for n in node_inputs(node)}, self.opened)
            if reason is not None:
                self.opened[node] = reason
            else:
                self.opened.pop(node, None)
        return info

    def _value(self, node: fx.Node, decision: str) -> ValueInfo:
        if node.op == "placeholder":
            return self._placeholder(node, decision)
        if node.op == "get_attr":
            value = fetch_attr(self.gm, str(node.target))
            if isinstance(value, torch.Tensor):
                info = ValueInfo.of(self._fake(value) if self.mode is not None else value)
                if self.mode is None:
                    info.fake, info.has_value = None, False
                return info
            return ValueInfo.non_tensor()
        if node.op == "output":
            return ValueInfo.non_tensor()
        op = node.meta.get(meta.OP)
        if op_properties.of(op).export_check:  # a check torch.export records: no result, no arithmetic
            return ValueInfo.non_tensor()
        if node.meta.get(meta.INPLACE) and node.args and isinstance(node.args[0], fx.Node):
            # Written back into its first input (an fp32 in-place op is computed out of place, then copied back).
            written = self.read_as.get(node.args[0], self.values[node.args[0]])
            return ValueInfo(written.is_tensor, written.is_float, written.float_dtype, written.dtype, written.shape,
                             fake=written.fake, has_value=written.has_value)
        target = input_target(node, decision, self.low, self.values)
        given = {n: self.read_as.get(n, self.values[n]) for n in node_inputs(node)}
        inputs = {n: arrives_as(info, target) for n, info in given.items()}
        if self.mode is not None and all(i.has_value for i in given.values()):
            return self._fake_run(node, given, inputs, target, decision)
        return rule_value(node, decision, inputs, target, self.gm)

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
            self.read_as[node] = arrives_as(info, self.low, with_value=True)
        return info

    def _fake_run(self, node: fx.Node, given: dict[fx.Node, ValueInfo], inputs: dict[fx.Node, ValueInfo],
                  target: Optional[torch.dtype], decision: str) -> ValueInfo:
        """Run the op's fake kernel on its inputs cast as ``target`` asks; memoised per input dtypes."""
        signature = (node, decision, target, tuple((n.name, i.float_dtype, i.dtype) for n, i in inputs.items()))
        if changes_transform_levels(node):
            signature = None  # a vmap/grad level push or pop: run on every walk (amp_fx/ir/fake_calls.py)
        if signature in self.cache:
            cached = self.cache[signature]
            if cached.unknown:
                self.unknown[node.name] = cached.unknown
            return cached
        # The same op on inputs of the same dtypes, shapes and strides gives the same result:
        # a model's repeated layers are fake-run once.
        described = map_arg((node.args, node.kwargs), lambda n: Described(given[n], inputs[n]))
        same_call = call_key(node, *described, target)
        if same_call is not None and same_call in self.cache:
            info = dataclasses.replace(self.cache[same_call])
        else:
            fakes = {n: arrives_as(info, target, with_value=True).fake for n, info in given.items()}
            args, kwargs = map_arg((node.args, node.kwargs), lambda n: fakes[n])
            try:
                with quiet_fake_kernels():
                    result = call_on_fakes(self.gm, node, args, kwargs, target)
                info = ValueInfo.of(result)
            except Exception as error:  # any failure: the node is unknown, the conversion goes on
                reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:200]
                if self.user_examples and self._fails_as_written(node, given, error):
                    raise examples_do_not_fit(node, reason, self.examples) from error
                info = rule_value(node, decision, inputs, target, self.gm)
                info.unknown = reason
            if same_call is not None:
                self.cache[same_call] = info
        if info.unknown:
            self.unknown[node.name] = info.unknown
        if signature is not None:
            self.cache[signature] = info
        return info

    def _fails_as_written(self, node: fx.Node, given: dict[fx.Node, ValueInfo], error: Exception) -> bool:
        """True when ``node`` also fails on its inputs in fp32, with a plain error: the inputs, not the paint, are wrong.

        A missing fake kernel or a data-dependent result raises a subclass of
        RuntimeError (``UnsupportedOperatorException``, ``DataDependentOutputException``):
        those nodes are only unknown.  ``torch._check`` failures (shapes that do not fit) are plain.
        """
        if type(error) not in (RuntimeError, ValueError, IndexError):
            return False
        fakes = {n: arrives_as(info, torch.float32, with_value=True).fake for n, info in given.items()}
        args, kwargs = map_arg((node.args, node.kwargs), lambda n: fakes[n])
        try:
            with quiet_fake_kernels():
                call_on_fakes(self.gm, node, args, kwargs, torch.float32)
        except (RuntimeError, ValueError, IndexError) as again:
            return type(again) is type(error)
        return False


def analyse(gm: fx.GraphModule, ctx: Any = None, paint: Optional[dict] = None, *,
            low: Optional[torch.dtype] = None, assume_inputs: Optional[torch.dtype] = None,
            repaint: Optional[Callable[[fx.Node, ValueInfo], Optional[str]]] = None) -> Analysis:
    """Analyse ``gm`` under ``paint`` (node -> decision; default: the graph's own paint) and return the answer.

    Pure: nothing is written on the nodes or the context (but the context's
    caches of fake values and kernel results).  The pass runner
    (:mod:`amp_fx.ir.pass_manager`) stores the analysis of the paint the
    rewrite will use (:meth:`Analysis.write`, ``ctx.analysis``); a pass may
    analyse hypothetical paints for its cost model.  ``assume_inputs``: a
    dtype to assume for graph inputs of unknown dtype -- for cost models
    only (the min-cut), never for what the graph does.  ``repaint(node,
    info)``: called on each node in order with its answer; a decision it
    returns replaces the node's paint in ``paint`` (which is updated in
    place) and the node is analysed again.
    """
    low = low or (ctx.low if ctx is not None else torch.bfloat16)
    return _Walker(gm, ctx, paint if paint is not None else {}, low, assume_inputs, repaint).run()
