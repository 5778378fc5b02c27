"""The pass contract and the small runner that applies a pipeline of passes.

Every pass is ``fn(gm, ctx) -> PassResult`` and declares its contract with
:func:`amp_pass` (torch.fx's ``PassBase.requires`` / ``ensures`` and
``PassManager`` are the model).  Its **kind** says what it may change and
what its ``modified`` means:

============  ===============================================  ==========================================
kind          changes                                          ``modified``
============  ===============================================  ==========================================
``analysis``  node metadata it owns; never the graph           always False
``repaint``   the paint (decisions, reasons); never the graph  the paint changed
``rewrite``   the graph module: its code or its parameters     the code or a parameter's dtype changed
                                                               (``repainted``: the paint changed too)
============  ===============================================  ==========================================

It **requires**, **ensures** and **invalidates** named properties of the
graph (:data:`amp_fx.ir.pass_checks.PROPERTIES`): ``"meta"`` (every node says
what it is), ``"paint"`` (every node carries a decision) and ``"dtypes"``
(every node carries the dtype analysis's answer for the current graph and
paint).  The runner owns ``"dtypes"``: it runs the analysis
(:func:`amp_fx.ir.analysis.analyse`, which only returns its answer) when a
pass requires it and it does not hold, and again after a pass that ensures it
and changed something -- storing the pass's own analysis of its final paint
instead when the pass handed one over (``PassResult.analysis``) and it is of
that paint.  It stores the answer on the nodes and as ``ctx.analysis``.  No
pass stores an analysis; a pass may compute hypothetical ones (cost models).

For each pass the runner (:func:`run_pass`; calling a declared pass runs it,
as ``PassBase.__call__`` runs requires, call and ensures) refuses a pass whose
required property does not hold, naming both; runs it, turning any failure
into a :class:`PassError` that names the pass (amp_fx's own errors, which
name their fix, pass through); checks what it reported
(:class:`amp_fx.ir.pass_checks.GraphState`: an analysis reports no change; a
pass reporting no graph change keeps the node count, and with ``ctx.verify``
its whole graph and paint); drops the properties it invalidates, re-runs the
analysis it ensures, and checks what it ensures (a property it neither ensures
nor invalidates is taken to be kept); and lints a changed graph.  :func:`run_passes` applies a
list, logs ``after <pass>`` at DEBUG on the ``passes.<pass>`` logger, dumps
the code before/after each pass to ``$AMP_FX_DEBUG_DIR`` if set, records each
pass's stats in ``ctx.stats`` and recompiles once at the end.
"""

from __future__ import annotations

import functools
import logging
import os
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx

from amp_fx.errors import PACKAGE, AmpError, AmpValueError
from amp_fx.ir import meta
from amp_fx.ir.analysis import analyse
from amp_fx.ir.config import AmpConfig
from amp_fx.ir.devices import device_type_of
from amp_fx.ir.pass_checks import PROPERTIES, GraphState, first_lacking
from amp_fx.ir.policy import Policy

__all__ = ["PassContext", "PassResult", "PassError", "PassSpec", "PASS_KINDS", "amp_pass", "spec_of",
           "run_pass", "run_passes", "AmpPass"]

logger = logging.getLogger(PACKAGE)

PASS_KINDS = ("analysis", "repaint", "rewrite")


@dataclass
class PassContext:
    """What every pass may read: the config, the policy, example inputs, the device, and per-pass stats."""

    config: AmpConfig
    policy: Policy = field(default_factory=Policy)
    example_inputs: Optional[tuple] = None
    example_kwarg_inputs: Optional[dict] = None
    route: str = "symbolic_trace"
    # The device type of the graph's floating tensors ("cpu", "cuda", ...), decided once by
    # amp_fx.ir.devices.device_type_of: convert() and the backend fill it; passes read it through device_for().
    device_type: Optional[str] = None
    # The module parameters of a Dynamo graph arrive as placeholders; the
    # backend fills this with placeholder name -> parameter FQN (the weight's name in reports).
    placeholder_params: dict[str, str] = field(default_factory=dict)
    # State-dict key -> dtype before cast_params lowered it; convert() hands it to the module's state_dict hook.
    source_dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    stats: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Fake-kernel results of the dtype analysis, keyed by node and input dtypes:
    # analysing another paint re-runs only the nodes whose inputs changed.
    analysis_cache: dict = field(default_factory=dict)
    # The one FakeTensorMode of this conversion's analyses (cached fake values must not mix modes).
    fake_mode: Any = None
    # The dtype analysis the runner stored on the nodes last (amp_fx.ir.analysis.Analysis).
    analysis: Any = None
    # Compare each pass's whole graph and paint before and after, to check what it reports (O(nodes) a pass).
    verify: bool = field(default_factory=lambda: bool(os.environ.get("AMP_FX_VERIFY_PASSES")))
    # The properties the runner knows to hold, per graph (a context reused on another graph starts afresh).
    _held: Any = field(default_factory=weakref.WeakKeyDictionary, repr=False, compare=False)

    def device_for(self, gm: Optional[fx.GraphModule]) -> str:
        """``device_type``; when no caller decided it (a pass run on its own), decided now from ``gm``, once."""
        if self.device_type is None:
            examples = list(self.example_inputs or ()) + list((self.example_kwarg_inputs or {}).values())
            self.device_type = device_type_of(gm, examples)
        return self.device_type

    def held(self, graph: fx.Graph) -> set[str]:
        """The properties the runner knows to hold on ``graph`` (a live set: the runner updates it)."""
        return self._held.setdefault(graph, set())

    @property
    def low(self) -> torch.dtype:
        """The low-precision dtype of this conversion."""
        return self.config.low_dtype


@dataclass
class PassResult:
    """What a pass returns: the (possibly same) module, whether it changed (as its kind means it), and its stats.

    ``repainted``: a rewrite also changed the paint (fuse_precision's fused
    marks).  ``analysis``: the dtype analysis of the pass's final paint, when
    it computed one anyway; the runner stores it instead of running the
    analysis again (after checking it is of that paint).
    """

    graph_module: fx.GraphModule
    modified: bool
    stats: dict[str, Any] = field(default_factory=dict)
    repainted: bool = False
    analysis: Any = None


AmpPass = Callable[[fx.GraphModule, PassContext], PassResult]


class PassError(AmpError, RuntimeError):
    """A pass failed, or broke its contract; the message names the pass."""


@dataclass(frozen=True)
class PassSpec:
    """A pass's declared contract (see the module docstring)."""

    kind: str
    requires: tuple[str, ...] = ()
    ensures: tuple[str, ...] = ()
    invalidates: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in PASS_KINDS:
            raise AmpValueError(f"pass kind {self.kind!r}: expected one of {PASS_KINDS}")
        unknown = sorted(set(self.requires + self.ensures + self.invalidates) - set(PROPERTIES))
        if unknown:
            raise AmpValueError(f"unknown pass properties {unknown}: expected some of {sorted(PROPERTIES)}")


def amp_pass(*, kind: str, requires: Sequence[str] = (), ensures: Sequence[str] = (),
             invalidates: Sequence[str] = ()) -> Callable[[Callable], AmpPass]:
    """Declare a pass's contract: ``@amp_pass(kind="rewrite", requires=("paint", "dtypes"))``.

    The declared pass keeps its name and docstring; calling it runs it
    through :func:`run_pass` (the contract checked), and ``spec_of`` reads
    the declaration back.
    """
    spec = PassSpec(kind, tuple(requires), tuple(ensures), tuple(invalidates))

    def declare(body: Callable) -> AmpPass:
        @functools.wraps(body)
        def declared(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
            return run_pass(declared, gm, ctx)

        declared.spec = spec  # type: ignore[attr-defined]
        declared.body = body  # type: ignore[attr-defined]
        return declared

    return declare


def spec_of(pass_fn: Callable) -> Optional[PassSpec]:
    """The contract ``pass_fn`` declared with :func:`amp_pass`, or None."""
    return getattr(pass_fn, "spec", None) if callable(getattr(pass_fn, "body", None)) else None


def _name(pass_fn: Callable) -> str:
    return getattr(pass_fn, "__name__", repr(pass_fn))


def _refuse(name: str, why: str) -> PassError:
    return PassError(f"amp_fx pass {name!r} {why}")


# --------------------------------------------------------------------------
# The dtype analysis: the runner's to run and store
# --------------------------------------------------------------------------
def _answers_for(analysis: Any, gm: fx.GraphModule) -> bool:
    """``analysis`` is of ``gm``'s current paint, and assumed nothing about graph inputs."""
    if analysis is None or not analysis.complete:
        return False
    return all(analysis.decisions.get(node) == node.meta.get(meta.DECISION, "follow") for node in gm.graph.nodes)


def _establish_dtypes(gm: fx.GraphModule, ctx: PassContext, offered: Any = None) -> None:
    """Store the dtype analysis of ``gm``'s current graph and paint: ``offered`` when it is that, else a new one."""
    analysis = offered if _answers_for(offered, gm) else analyse(gm, ctx)
    analysis.write()
    ctx.analysis = analysis
    ctx.held(gm.graph).add("dtypes")


def _require(name: str, prop: str, gm: fx.GraphModule, ctx: PassContext) -> None:
    held = ctx.held(gm.graph)
    if prop in held:
        return
    if prop == "dtypes":
        _establish_dtypes(gm, ctx)
        return
    lacking = first_lacking(prop, gm.graph)
    if lacking is not None:
        raise _refuse(name, f"requires {prop!r} ({PROPERTIES[prop].says}), which does not hold: node {lacking.name!r} "
                      f"lacks it. Run {PROPERTIES[prop].established_by} first (build_pipeline's order).")
    held.add(prop)


# --------------------------------------------------------------------------
# One pass
# --------------------------------------------------------------------------
def _check_report(name: str, spec: PassSpec, result: PassResult, before: GraphState) -> None:
    """What the pass reported is what it did, as far as ``before`` can tell (see amp_fx.ir.pass_checks)."""
    gm = result.graph_module
    if spec.kind == "analysis" and (result.modified or result.repainted):
        raise _refuse(name, "is an analysis but reported modified=True: an analysis changes neither the graph nor "
                      "the paint (declare it a repaint or a rewrite)")
    if spec.kind != "rewrite" or not result.modified:
        change = before.graph_change(gm)
        if change is not None:
            claim = "reported modified=False" if spec.kind == "rewrite" else f"is {'an' if spec.kind == 'analysis' else 'a'} {spec.kind}"
            raise _refuse(name, f"{claim}, yet {change}")
    if spec.kind != "analysis" and not (result.modified or result.repainted):
        change = before.paint_change(gm)
        if change is not None:
            raise _refuse(name, f"reported no change, yet {change}")


def _settle(name: str, spec: PassSpec, result: PassResult, ctx: PassContext) -> None:
    """After the pass: drop what it invalidated, re-run the analysis it ensures, check what it ensures, lint."""
    gm = result.graph_module
    held = ctx.held(gm.graph)
    # An analysis writes what it owns on every run; a repaint or rewrite says whether it changed anything.
    changed = spec.kind == "analysis" or result.modified or result.repainted
    if changed:
        held.difference_update(spec.invalidates)
        if "dtypes" in spec.ensures:
            held.discard("dtypes")
    for prop in spec.ensures:
        if prop == "dtypes":
            if "dtypes" not in held:
                _establish_dtypes(gm, ctx, result.analysis)
            continue
        if changed or prop not in held:
            lacking = first_lacking(prop, gm.graph)
            if lacking is not None:
                raise _refuse(name, f"ensures {prop!r} ({PROPERTIES[prop].says}), yet node {lacking.name!r} lacks it")
            held.add(prop)
    if spec.kind == "rewrite" and result.modified:
        gm.graph.lint()


def run_pass(pass_fn: AmpPass, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Run one declared pass on ``gm`` under its contract (see the module docstring); return its result."""
    name = _name(pass_fn)
    spec = spec_of(pass_fn)
    if spec is None:
        raise _refuse(name, f"declares no contract: declare it with @amp_pass(kind=..., requires=..., ensures=...) "
                      f"from {PACKAGE}.ir.pass_manager")
    try:
        for prop in spec.requires:
            _require(name, prop, gm, ctx)
        before = GraphState(gm, ctx.verify)
        result = pass_fn.body(gm, ctx)  # type: ignore[attr-defined]
        if result.graph_module is not gm:  # a pass that made a new module hands over what held on the old one
            ctx.held(result.graph_module.graph).update(ctx.held(gm.graph))
        _check_report(name, spec, result, before)
        _settle(name, spec, result, ctx)
    except (AmpError, Warning):  # PassError included: already names its pass; a warning made an error by the
        raise                    # user's filter stays that warning, so `except amp_fx.AmpWarning` catches it
    except Exception as error:
        raise PassError(f"amp_fx pass {name!r} failed: {type(error).__name__}: {error}") from error
    return result


# --------------------------------------------------------------------------
# A pipeline
# --------------------------------------------------------------------------
def _dump(gm: fx.GraphModule, pass_name: str, stage: str, index: int) -> None:
    directory = os.environ.get("AMP_FX_DEBUG_DIR")
    if not directory:
        return
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{index:02d}_{pass_name}_{stage}.py")
    with open(path, "w") as handle:
        handle.write(gm.code)


def run_passes(gm: fx.GraphModule, ctx: PassContext, passes: Sequence[AmpPass], *,
               recompile: bool = True, first_index: int = 0) -> fx.GraphModule:
    """Apply ``passes`` in order under their contracts, recording each one's stats; return the final module.

    ``recompile=False``: recompile at the end only if a pass changed the graph
    (the caller hands over a compiled module).  ``first_index`` numbers the
    ``$AMP_FX_DEBUG_DIR`` dumps of a run that continues an earlier one.
    """
    ctx.device_for(gm)  # decided before the first pass rewrites the graph it is read from
    rewritten = False
    for index, pass_fn in enumerate(passes, start=first_index):
        name = _name(pass_fn)
        _dump(gm, name, "before", index)
        start = time.perf_counter()
        result = run_pass(pass_fn, gm, ctx)
        gm = result.graph_module
        graph_changed = result.modified and spec_of(pass_fn).kind == "rewrite"
        rewritten |= graph_changed
        # Regenerating Python code is the costly part of a pass on a large graph: only when someone reads it before the end.
        if graph_changed and os.environ.get("AMP_FX_DEBUG_DIR"):
            gm.recompile()
        stats = dict(result.stats, modified=result.modified, seconds=round(time.perf_counter() - start, 6))
        ctx.stats[name] = stats
        logging.getLogger(f"{PACKAGE}.passes.{name}").debug("after %s: %s", name, stats)
        _dump(gm, name, "after", index)
    if recompile or rewritten:
        gm.recompile()
    return gm
