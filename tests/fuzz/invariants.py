"""The invariants of DESIGN.md, checked on one model at one level and dtype.

Shared by the property-based tests (``test_fuzz_convert.py``) and the plain
regression tests the fuzzer's findings became (``test_fuzz_regressions.py``).
:func:`check_model` converts a model at O0-O3 and asserts, for each level:

- the graph lints, and ``convert`` left the model unchanged;
- O0 is bit-identical to the model, in outputs and gradients;
- every report decision is what the op tables (O1) or the level (O2/O3) say;
- at run time every op reads what its decision promises (low ops low,
  fp32 ops fp32, promote ops one dtype), float64 values are never cast, and
  at O1 every GEMM dispatches in the dtype ``torch.autocast`` gives it;
- one cast per (value, dtype), each parameter cast at most once, no cast of a
  cast, and (with example inputs) no cast to a tensor's own dtype;
- integer and bool tensors are never cast (counted under a dispatch mode
  against the fp32 model's own casts);
- every dtype and shape the dtype analysis predicted is what ran
  (``fuzz/predictions.py``'s ``check_predictions``);
- converting again, or re-running the pipeline on the result, changes nothing;
- outputs are within tolerance of the fp32 model, integer outputs equal;
- every parameter that gets a gradient in the fp32 model gets one.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import amp_fx
from amp_fx.ir import tables
from amp_fx.ir.cast_nodes import cast_source, cast_target, is_inserted_cast
from amp_fx.errors import UnsupportedConstructError
from amp_fx.ir.op_keys import CAST_OPS
from amp_fx.ir.pass_manager import PassContext
from amp_fx.converter.pipeline import rewrite_graph
from fuzz.predictions import Recorder, check_predictions

__all__ = ["LEVELS", "LOW_DTYPES", "DispatchProbe", "Reference", "reference_run", "check_conversion", "check_model", "tolerance"]

LEVELS = ("O0", "O1", "O2", "O3")
LOW_DTYPES = (torch.bfloat16, torch.float16)
_STAT_NORMS = frozenset({"layer_norm", "group_norm", "rms_norm"})
_FOLLOWING_NORMS = frozenset({"batch_norm", "instance_norm"})


def tolerance(level: str, dtype: torch.dtype) -> float:
    """Largest |converted - fp32| allowed, as a fraction of max(1, max |fp32 output|)."""
    if level == "O0":
        return 0.0
    low_eps = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}[dtype]
    # A handful of ops in a chain, each rounding its result; O2/O3 round parameters too.
    return low_eps * (24 if level == "O1" else 40)


# ATen GEMMs and convolutions: what every LOW GEMM of the vocabulary dispatches to.
_ATEN_GEMMS = frozenset({"mm", "addmm", "bmm", "baddbmm", "convolution", "_convolution", "mv", "addmv", "dot"})


class DispatchProbe(TorchDispatchMode):
    """Counts ``_to_copy`` calls by the kind of tensor they read, and lists each GEMM's result dtype."""

    def __init__(self):
        super().__init__()
        self.counts = {"non_float": 0, "float64": 0}
        self.gemms: list[tuple[str, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name == "_to_copy" and args and isinstance(args[0], torch.Tensor):
            source = args[0]
            if not source.is_floating_point():
                self.counts["non_float"] += 1
            elif source.dtype == torch.float64:
                self.counts["float64"] += 1
        out = func(*args, **(kwargs or {}))
        if name in _ATEN_GEMMS and isinstance(out, torch.Tensor):
            self.gemms.append((name, out.dtype))
        return out


def _leaves(out: Any) -> list:
    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]


def _loss(out: Any) -> Optional[torch.Tensor]:
    """A loss over every float output, weighted so no output's gradient vanishes by symmetry."""
    terms = []
    for t in _leaves(out):
        if t.is_floating_point() and t.requires_grad:
            weights = torch.linspace(-1.0, 2.0, t.numel(), dtype=torch.float64).view(t.shape)
            terms.append((t.double() * weights).sum())
    return sum(terms) if terms else None


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in module.named_parameters() if p.grad is not None}


@dataclass
class Reference:
    """The fp32 model's run: outputs, casts it made itself, and gradients (when its backward works)."""

    outputs: list[torch.Tensor]
    casts: dict[str, int]
    grads: Optional[dict[str, torch.Tensor]]  # None: the model's own backward fails (in-place ops)


def _backward(module: torch.nn.Module, out: Any) -> Optional[dict[str, torch.Tensor]]:
    module.zero_grad(set_to_none=True)
    loss = _loss(out)
    if loss is None:
        return {}
    loss.backward()
    grads = _grads(module)
    module.zero_grad(set_to_none=True)
    return grads


def reference_run(model: torch.nn.Module, make_inputs: Callable[[], tuple]) -> Reference:
    """Run the fp32 model once, recording what the checks compare against."""
    with DispatchProbe() as counter:
        out = model(*make_inputs())
    try:
        grads = _backward(model, out)
    except RuntimeError as error:  # the model itself modifies a value its backward needs
        if "inplace" not in str(error):
            raise
        grads = None
        model.zero_grad(set_to_none=True)
    return Reference([t.detach() for t in _leaves(out)], dict(counter.counts), grads)


def _alias_root(node: fx.Node) -> fx.Node:
    """The value ``node`` may share memory with: walk back through views, model casts and in-place ops."""
    while node.op in ("call_function", "call_method") and node.args and isinstance(node.args[0], fx.Node):
        op = node.meta.get("amp_fx.op")
        if not (op in tables.DATA_MOVEMENT or op in CAST_OPS or node.meta.get("amp_fx.inplace") or op == "copy"):
            break
        node = node.args[0]
    return node


def _expected_decision(op: str, inplace: bool, config: Any) -> Optional[str]:
    """The decision DESIGN.md's tables and levels give ``op`` (None: not checked)."""
    if op in CAST_OPS:
        return "cast"
    if config.op_mode == "tables":
        category = tables.table_of(op)
        decision = {"low": "low", "fp32": "fp32", "promote": "promote"}.get(category, "follow")
    elif op in _STAT_NORMS:
        decision = "fp32" if config.keep_batchnorm_fp32 else "low"
    elif op in _FOLLOWING_NORMS:
        decision = "follow" if config.keep_batchnorm_fp32 else "low"  # with its parameters
    elif op in tables.LOSSES and config.keep_losses_fp32:
        decision = "fp32"  # O2 keeps losses fp32, as it keeps norms
    elif op in tables.DATA_MOVEMENT:
        decision = "follow"
    else:
        decision = "low"
    if inplace and decision == "low":
        return "follow"  # autocast does not cast in-place ops either
    return decision


def _check_structure(gm: fx.GraphModule, level: str) -> None:
    casts = [n for n in gm.graph.nodes if is_inserted_cast(n)]
    if level == "O0":
        assert not casts, "O0 inserted casts"
        return
    mutated = {_alias_root(n.args[0]) for n in gm.graph.nodes
               if n.meta.get("amp_fx.inplace") and n.args and isinstance(n.args[0], fx.Node)}
    seen: dict[tuple, fx.Node] = {}
    param_casts: dict[tuple, fx.Node] = {}
    for cast in casts:
        source = cast_source(cast)
        # Around an in-place write a cast of a cast may be the only copy of the value before the write.
        assert not is_inserted_cast(source) or _alias_root(source) in mutated, f"cast chain: {cast.name} casts the cast {source.name}"
        key = (source, cast_target(cast))
        if key in seen:
            assert _alias_root(source) in mutated, f"{cast.name} and {seen[key].name} both cast {source.name}"
        seen[key] = cast
        root = _alias_root(source)
        if root.op == "get_attr":
            pkey = (root.target, cast_target(cast))
            assert pkey not in param_casts, f"parameter {root.target} cast twice ({param_casts[pkey].name}, {cast.name})"
            param_casts[pkey] = cast


def _check_report(gm: Any, level: str) -> None:
    config = gm.amp_config
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module") or node.meta.get("amp_fx.inserted"):
            continue
        op = node.meta.get("amp_fx.op")
        record = gm.amp_report.node(node.name)
        if level == "O0" or op is None:
            continue
        assert record.decision == node.meta.get("amp_fx.decision")
        expected = _expected_decision(op, bool(node.meta.get("amp_fx.inplace")), config)
        if record.rule == "model" and record.decision in ("follow", "fp32"):  # O2/O3: the model's own x.float()
            assert expected in ("low", "follow") and op not in tables.LOW, f"{node.name} ({op}) followed a model cast"
            continue
        if record.rule == "min-cut" and record.decision != expected:  # minimize_casts may move a FOLLOW op to either side
            assert expected == "follow" and record.decision in ("low", "fp32"), f"{node.name} ({op}) moved by min-cut"
            continue
        assert record.decision == expected, f"{node.name} ({op}): decision {record.decision}, tables say {expected}"


def _check_runtime_dtypes(gm: fx.GraphModule, recorder: Recorder, low: torch.dtype, level: str,
                          exact_inputs: bool) -> None:
    wide = torch.float64
    for node in gm.graph.nodes:
        if node.name not in recorder.inputs:
            continue
        seen = recorder.inputs[node.name]
        if is_inserted_cast(node):
            source = recorder.sources[node.name]
            # (amp_cast of a value of unknown dtype may meet float64 at run time: it returns it as it is.)
            assert source != wide or recorder.result[node.name] == wide, f"{node.name} casts a float64 value"
            if exact_inputs and source is not None and source.is_floating_point:
                assert source != cast_target(node), f"{node.name} casts {source} to its own dtype"
            continue
        if node.meta.get("amp_fx.inserted") or level == "O0":
            continue
        decision = node.meta.get("amp_fx.decision")
        if decision == "low":
            assert set(seen) <= {low, wide}, f"{node.name} ({node.meta.get('amp_fx.op')}) is low but reads {seen}"
        elif decision == "fp32":
            # A fused norm (passes/fuse_precision) computes in fp32 from its low input and fp32 weights.
            allowed = {torch.float32, wide} | ({low} if node.meta.get("amp_fx.fused") else set())
            assert set(seen) <= allowed, f"{node.name} ({node.meta.get('amp_fx.op')}) is fp32 but reads {seen}"
        elif decision == "promote":
            assert len(set(seen)) <= 1, f"{node.name} ({node.meta.get('amp_fx.op')}) promotes but reads {seen}"


def _check_against_autocast(model: torch.nn.Module, probe: DispatchProbe, make_inputs: Callable, dtype: torch.dtype) -> None:
    """Every GEMM the O1 module dispatches has the dtype the same GEMM has under torch.autocast, in order."""
    try:
        with torch.autocast("cpu", dtype=dtype), DispatchProbe() as under:
            model(*make_inputs())
    except RuntimeError as error:  # e.g. stack over bf16 and fp32 under fp16 autocast: no opinion to compare
        if "autocast" not in str(error):
            raise
        return
    assert probe.gemms == under.gemms, f"GEMM dtypes {probe.gemms}, under autocast {under.gemms}"


def _check_outputs(out: Any, ref: Reference, level: str, dtype: torch.dtype, config: Any) -> None:
    leaves = _leaves(out)
    assert len(leaves) == len(ref.outputs)
    tol = tolerance(level, dtype)
    for got, want in zip(leaves, ref.outputs):
        assert got.shape == want.shape
        if not want.is_floating_point():
            assert got.dtype == want.dtype and torch.equal(got, want), "an integer or bool output changed"
            continue
        if level == "O0":
            assert got.dtype == want.dtype and torch.equal(got, want), "O0 is not bit-identical"
            continue
        if config.cast_model_outputs is not None:
            expected = want.dtype if want.dtype == torch.float64 else config.cast_model_outputs
            assert got.dtype == expected, f"output dtype {got.dtype}, expected {expected}"
        if want.dtype == torch.float64:
            assert got.dtype == torch.float64, "a float64 output lost its precision"
        finite = torch.isfinite(want)
        assert torch.equal(torch.isfinite(got), finite), "converted output has other non-finite values than fp32"
        scale = max(1.0, want[finite].abs().max().item()) if finite.any() else 1.0
        error = (got.double() - want.double())[finite].abs().max().item() if finite.any() else 0.0
        assert error <= tol * scale, f"{level} {dtype}: |error| {error:.4g} > {tol * scale:.4g}"


def _check_gradients(gm: torch.nn.Module, out: Any, ref: Reference, level: str) -> None:
    if ref.grads is None:
        return
    grads = _backward(gm, out)
    for name, want in ref.grads.items():
        got = grads.get(name)
        assert got is not None, f"no gradient reaches {name} at {level}"
        if level == "O0":
            assert torch.equal(got, want), f"O0 gradient of {name} differs"
        elif torch.isfinite(want).all():
            assert torch.isfinite(got).all(), f"non-finite gradient for {name} at {level}"


def _check_idempotent(gm: Any, level: str, dtype: torch.dtype) -> None:
    again = amp_fx.convert(gm, level, dtype=dtype)
    assert again.code == gm.code
    if level in ("O0", "O3"):  # O3 runs O2's passes
        return
    # A fresh GraphModule over a copy of the graph: the parameters are shared, and left alone (own_params=False).
    fresh = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    rerun, report = rewrite_graph(fresh, PassContext(config=gm.amp_config), own_params=False)
    assert rerun.code == gm.code, "a second run changed the code"
    if level == "O1":
        # (At O2/O3 an entry cast that fold_casts read through is made again and folded again.)
        assert report.passes["insert_casts"]["casts_inserted"] == 0, "a second run inserted casts"


def check_conversion(model: torch.nn.Module, make_inputs: Callable[[], tuple], level: str, dtype: torch.dtype,
                     ref: Reference, *, example_inputs: bool = False) -> Any:
    """Convert ``model`` at ``level``/``dtype`` and assert every invariant (module docstring)."""
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    kwargs = {"example_inputs": make_inputs()} if example_inputs else {}
    try:
        gm = amp_fx.convert(model, level, dtype=dtype, **kwargs)
    except UnsupportedConstructError as error:
        # O2/O3 cast inputs at entry: a forward that writes into its input is refused, never silently cut off.
        assert level in ("O2", "O3") and error.construct == "in-place write into a graph input", error
        inputs = make_inputs()
        snapshot = [t.clone() for t in inputs]
        model(*inputs)
        assert any(not torch.equal(a, b) for a, b in zip(inputs, snapshot)), "refused, but the model writes no input"
        return None
    after = model.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items()), "convert changed the model"
    gm.graph.lint()
    _check_structure(gm, level)
    _check_report(gm, level)
    recorder = Recorder(gm)
    recorder.run(*make_inputs())
    _check_runtime_dtypes(gm, recorder, dtype, level, exact_inputs=example_inputs)
    check_predictions(gm, recorder, exact=example_inputs)
    with DispatchProbe() as counter:
        out = gm(*make_inputs())
    if level == "O1":
        _check_against_autocast(model, counter, make_inputs, dtype)
    assert counter.counts["non_float"] == ref.casts["non_float"], "an integer or bool tensor was cast"
    assert counter.counts["float64"] == ref.casts["float64"], "a float64 tensor was cast"
    _check_outputs(out, ref, level, dtype, gm.amp_config)
    _check_gradients(gm, out, ref, level)
    _check_idempotent(gm, level, dtype)
    return gm


def check_model(build: Callable[[], torch.nn.Module], make_inputs: Callable[[], tuple], *,
                levels: tuple = LEVELS, dtypes: tuple = LOW_DTYPES, example_inputs: bool = False) -> None:
    """:func:`check_conversion` at every level and dtype against one fp32 run.

    The model stays fit to be the reference throughout: ``convert`` never
    changes it, and running a converted module only updates batch-norm
    statistics, which training-mode outputs do not read.
    """
    model = build()
    ref = reference_run(model, make_inputs)
    for dtype in dtypes:
        for level in levels:
            check_conversion(model, make_inputs, level, dtype, ref, example_inputs=example_inputs)
