"""Calibration: run real batches in fp32 and low precision, and pin to fp32 the nodes low precision cannot hold.

``amp_fx.calibrate(model, batches, "O1", dtype=torch.float16)`` converts the
model, then runs every batch through the converted graph and its fp32 twin
(:class:`amp_fx.inspection.twin_run.TwinRun`) node by node, in eval mode, and measures
for each node:

* the largest magnitude its value reaches in fp32 -- a node whose value is
  stored in the low dtype and comes within ``range_fraction`` of that dtype's
  largest finite value (or whose low value turns inf/NaN while fp32's does
  not) is *out of range*.  Only the first such node on a path is moved:
  the nodes after it are out of range only because it is.  When the value
  that overflowed is a cast amp_fx inserted, the ops that asked for it are
  moved;
* its *local* relative error: the op run in low precision on the fp32 twin's
  inputs rounded as the converted graph rounds them, against the op run in
  fp32 on the unrounded inputs.  A node whose error exceeds both
  ``error_factor`` times the median over all low-precision compute ops and
  ``error_floor`` (default 4 x the dtype's epsilon) is *inaccurate*.

Each flagged node is pinned with the narrowest policy rule that covers it
(its innermost module, an enclosing module, or its op -- whichever pins the
fewest other ops), the model is converted again with those rules, and the
measurement repeats until nothing new is flagged (``max_rounds``).  Every
node that moved to fp32 carries the measurement in its report reason; the
full result is ``converted.amp_calibration``.
"""

from __future__ import annotations

import inspect

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Optional, Union

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.node import map_arg

from amp_fx.ir import meta, tables
from amp_fx.converter.api import convert
from amp_fx.converter.graph_module import AmpGraphModule
from amp_fx.inspection.overflow_report import pin_targets
from amp_fx.inspection.twin_run import TwinRun
from amp_fx.inspection.values import LOW_DTYPES, float_tensors, max_abs, nonfinite_count, plain_containers, value_dtype
from amp_fx.ir.policy import Policy
from amp_fx.passes.propagate_meta import eval_mode
from amp_fx.errors import PACKAGE, AmpValueError, unknown_options_error

__all__ = ["calibrate", "CalibrationResult", "Finding"]

_CALLS = ("call_function", "call_method", "call_module")


@dataclass
class Finding:
    """One node calibration moved to fp32, with what was measured."""

    node: str
    op: Optional[str]
    module: str
    kind: str  # "range" or "error"
    value: float  # max |x| in fp32 (range) or local relative error (error)
    threshold: float
    detail: str
    rule: dict[str, str] = field(default_factory=dict)


@dataclass
class CalibrationResult:
    """What calibration measured and changed (``converted.amp_calibration``)."""

    findings: list[Finding]
    collateral: dict[str, str]  # node pinned along with a finding -> that finding's node
    policy: dict[str, str]  # the rules calibration added (reusable as convert(policy=...))
    rounds: int
    batches: int
    notes: list[str] = field(default_factory=list)

    @property
    def moved(self) -> list[str]:
        """Names of the nodes calibration moved to fp32 (findings first, then those pinned with them)."""
        return [f.node for f in self.findings] + list(self.collateral)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return asdict(self)

    def __str__(self) -> str:
        lines = [f"amp_fx calibration: {self.batches} batches, {self.rounds} rounds, {len(self.findings)} nodes moved to fp32"]
        for f in self.findings:
            lines.append(f"  {f.node} ({f.op}, module {f.module or '<root>'!r}): {f.detail}; rule {f.rule}")
        for node, owner in self.collateral.items():
            lines.append(f"  {node}: pinned with {owner} by the same rule")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


@dataclass
class _Stats:
    max_abs: float = 0.0  # largest |x| of the fp32 twin's value
    broke: bool = False  # low value held inf/NaN while the twin's did not
    low: bool = False  # the converted graph stores this value in a low dtype
    error: Optional[float] = None  # local relative error (low-precision compute ops only)




def _relative_error(low: Any, ref: Any) -> float:
    lows, refs = float_tensors(low), float_tensors(ref)
    if not refs or len(lows) != len(refs):
        return 0.0
    num = den = 0.0
    for a, b in zip(lows, refs):
        if not torch.isfinite(a).all():
            return float("inf")
        num += float((a.double() - b.double()).pow(2).sum())
        den += float(b.double().pow(2).sum())
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return (num / den) ** 0.5


def _measures_error(node: fx.Node, low: Any) -> bool:
    return (not meta.INSERTED.get(node) and meta.DECISION.get(node) in ("low", "follow", "promote")
            and meta.OP.get(node) not in tables.DATA_MOVEMENT and value_dtype(low) in LOW_DTYPES)


def _local_error(run: TwinRun, node: fx.Node, twin: Any) -> float:
    """The op in low precision on the twin's inputs rounded as the graph rounds them, against the twin's output."""
    def rounded(arg: fx.Node) -> Any:
        low, ref = run.low.env[arg], run.twin.env[arg]
        if isinstance(low, torch.Tensor) and isinstance(ref, torch.Tensor) and low.is_floating_point() and ref.is_floating_point():
            return ref.to(low.dtype)
        return low

    args, kwargs = plain_containers(map_arg(node.args, rounded)), plain_containers(map_arg(node.kwargs, rounded))
    return _relative_error(getattr(run.low, node.op)(node.target, args, kwargs), twin)


def _measure(gm: fx.GraphModule, batches: list[tuple]) -> dict[str, _Stats]:
    stats: dict[str, _Stats] = {}
    with eval_mode(gm), torch.no_grad():
        for batch in batches:
            run = TwinRun(gm, batch)
            for node, low, twin in run.steps():
                if node.op not in _CALLS:
                    continue
                s = stats.setdefault(node.name, _Stats())
                s.low |= value_dtype(low) in LOW_DTYPES
                s.max_abs = max(s.max_abs, max_abs(twin))
                s.broke |= nonfinite_count(low) > 0 and nonfinite_count(twin) == 0
                if _measures_error(node, low):
                    s.error = max(s.error or 0.0, _local_error(run, node, twin))
    return stats


def _finding(node: fx.Node, kind: str, value: float, threshold: float, detail: str) -> Finding:
    return Finding(node.name, meta.OP.get(node), meta.MODULE_PATH.get(node) or "", kind, value, threshold, detail)


def _flag(gm: fx.GraphModule, stats: dict[str, _Stats], *, range_fraction: float, error_factor: float,
          error_floor: Optional[float], done: set[str]) -> list[Finding]:
    low_dtype = gm.amp_config.low_dtype
    name = str(low_dtype).replace("torch.", "")
    limit = range_fraction * float(torch.finfo(low_dtype).max)

    def out_of_range(node: fx.Node) -> bool:
        s = stats.get(node.name)
        return s is not None and (s.broke or (s.low and s.max_abs >= limit))

    found: dict[str, Finding] = {}
    for node in gm.graph.nodes:
        # Only the first node on a path: the ones after it overflow because it did.
        if not out_of_range(node) or any(out_of_range(i) for i in node.all_input_nodes) or not stats[node.name].low:
            continue
        s = stats[node.name]
        for target in pin_targets(node):
            if target.name in done or target.name in found or meta.DECISION.get(target) == "fp32":
                continue
            where = "" if target is node else f" (its input {node.name}, cast to {name})"
            if s.max_abs >= limit:
                detail = f"max |x| {s.max_abs:.4g} in fp32{where}, above {range_fraction:g} x {name} max = {limit:.4g}"
            else:
                detail = f"{name} value{where} held inf/NaN where fp32 did not (max |x| {s.max_abs:.4g})"
            found[target.name] = _finding(target, "range", s.max_abs, limit, detail)
    errors = {n: s.error for n, s in stats.items() if s.error is not None}
    if errors:
        median = statistics.median(errors.values())
        floor = error_floor if error_floor is not None else 4 * float(torch.finfo(low_dtype).eps)
        bar = max(error_factor * median, floor)
        nodes = {n.name: n for n in gm.graph.nodes}
        for node_name, error in errors.items():
            if error > bar and node_name not in done and node_name not in found:
                detail = (f"relative error {error:.3g} against fp32, above {bar:.3g} "
                          f"(max of {error_factor:g} x the median {median:.3g} of {len(errors)} low-precision ops, and {floor:.3g})")
                found[node_name] = _finding(nodes[node_name], "error", error, bar, detail)
                _pin_rounding_inputs(nodes[node_name], stats, found, done, error, bar)
    return list(found.values())


def _pin_rounding_inputs(node: fx.Node, stats: dict[str, _Stats], found: dict[str, Finding], done: set[str],
                         error: float, bar: float) -> None:
    """Flag the follow ops that store ``node``'s inputs low: an op pinned to fp32 is only as exact as what it reads."""
    pending = list(node.all_input_nodes)
    while pending:
        source = pending.pop()
        s = stats.get(source.name)
        if (meta.INSERTED.get(source) or meta.DECISION.get(source) not in ("follow", "promote")
                or s is None or not s.low or source.name in found or source.name in done):
            continue
        detail = f"feeds {node.name} (relative error {error:.3g} against fp32, above {bar:.3g}) a low-precision value"
        found[source.name] = _finding(source, "error", error, bar, detail)
        pending.extend(source.all_input_nodes)


def _covers(key: str, node: fx.Node) -> bool:
    rule = Policy.from_dict({key: "fp32"})
    return rule.decide(meta.OP.get(node), node.target, meta.MODULE_STACK.get(node) or []) is not None


def _choose_rule(gm: fx.GraphModule, target: fx.Node, flagged: set[str]) -> dict[str, str]:
    """The policy rule covering ``target`` that pins the fewest other ops (compute ops count before data movement)."""
    stack = meta.MODULE_STACK.get(target) or []
    candidates = [f"module:{path}" for path, _ in stack if path] + [f"op:{meta.OP.get(target) or target.target}"]
    others = [n for n in gm.graph.nodes if n.op in _CALLS and not meta.INSERTED.get(n)
              and n.name not in flagged and meta.DECISION.get(n) not in ("fp32", "cast")]
    best, best_cost = candidates[0], None
    for key in candidates:
        extra = [n for n in others if _covers(key, n)]
        cost = (sum(1 for n in extra if meta.OP.get(n) not in tables.DATA_MOVEMENT), len(extra))
        if best_cost is None or cost < best_cost:
            best, best_cost = key, cost
    return {best: "fp32"}


def _as_batch(batch: Any) -> tuple:
    return tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)


def _check_convert_keywords(convert_kwargs: dict) -> None:
    """Refuse a keyword neither calibrate nor convert takes, listing both (calibrate's own first)."""
    from amp_fx.converter.api import convert

    own = [name for name in inspect.signature(calibrate).parameters if name not in ("model", "batches", "convert_kwargs")]
    taken = set(inspect.signature(convert).parameters) - {"model", "level"}
    unknown = set(convert_kwargs) - taken - set(own)
    if unknown:
        raise unknown_options_error(unknown, [*own, *sorted(taken - set(own))], f"{PACKAGE}.calibrate")


def calibrate(
    model: nn.Module,
    batches: Iterable[Any],
    level: str = "O1",
    *,
    dtype: Union[None, str, torch.dtype] = None,
    policy: Union[None, Policy, dict] = None,
    example_inputs: Optional[tuple] = None,
    range_fraction: float = 0.25,
    error_factor: float = 10.0,
    error_floor: Optional[float] = None,
    max_rounds: int = 3,
    **convert_kwargs: Any,
) -> AmpGraphModule:
    """Convert ``model`` at ``level``, then move to fp32 the nodes that the batches show low precision cannot hold.

    Args:
        batches: a few representative batches; each a tensor or a tuple of
            the model's positional inputs.
        range_fraction: a value stored low whose fp32 magnitude reaches this
            fraction of the low dtype's largest finite value is moved.
        error_factor / error_floor: a compute op whose local relative error
            exceeds both ``error_factor`` x the median of its peers and
            ``error_floor`` (default 4 x the low dtype's epsilon) is moved.
        max_rounds: measure, pin, reconvert at most this many times.
        policy, example_inputs (default: the first batch) and other keywords
        go to :func:`amp_fx.convert`.

    Returns the converted module; ``result.amp_calibration`` is a
    :class:`CalibrationResult` and each moved node's report reason says what
    was measured.  ``result.amp_calibration.policy`` reproduces the result
    with a plain ``amp_fx.convert(..., policy=...)``.
    """
    _check_convert_keywords(convert_kwargs)
    batches = [_as_batch(b) for b in batches]
    if not batches:
        raise AmpValueError("calibrate needs at least one batch of inputs")
    if not 0 < range_fraction <= 1:
        raise AmpValueError(f"range_fraction must be in (0, 1], got {range_fraction!r}")
    user_rules = list(Policy.coerce(policy).rules)
    added: dict[str, str] = {}
    examples = tuple(example_inputs) if example_inputs is not None else _as_batch(batches[0])

    def build() -> AmpGraphModule:
        rules = Policy(list(user_rules) + Policy.from_dict(added).rules)
        return convert(model, level, dtype=dtype, example_inputs=examples, policy=rules, **convert_kwargs)

    plain = gm = build()
    findings: list[Finding] = []
    notes: list[str] = []
    rounds = 0
    for rounds in range(1, max_rounds + 1):
        new = _flag(gm, _measure(gm, batches), range_fraction=range_fraction, error_factor=error_factor,
                    error_floor=error_floor, done={f.node for f in findings})
        if not new:
            break
        flagged = {f.node for f in findings + new}
        nodes = {n.name: n for n in gm.graph.nodes}
        for finding in new:
            if not any(_covers(key, nodes[finding.node]) for key in added):
                finding.rule = _choose_rule(gm, nodes[finding.node], flagged)
                added.update(finding.rule)
        findings += new
        gm = build()
    else:
        notes.append(f"stopped after max_rounds={max_rounds}: the last conversion was not measured again")
    result = CalibrationResult(findings, {}, dict(added), rounds, len(batches), notes)
    _annotate(gm, plain, result)
    return gm


def _annotate(gm: AmpGraphModule, plain: AmpGraphModule, result: CalibrationResult) -> None:
    """Write the measurement into the reason of every node calibration moved to fp32."""
    before = {n.name: meta.DECISION.get(n) for n in plain.graph.nodes if not meta.INSERTED.get(n)}
    by_node = {f.node: f for f in result.findings}
    for node in gm.graph.nodes:
        if meta.INSERTED.get(node) or meta.DECISION.get(node) != "fp32" or before.get(node.name) in (None, "fp32"):
            continue
        finding = by_node.get(node.name)
        rule = next((key for key in result.policy if _covers(key, node)), None)
        if finding is not None:
            reason = f"calibration: {finding.detail}; pinned by {rule!r}"
            if not finding.rule and rule:
                finding.rule = {rule: "fp32"}
        else:
            owner = next((f.node for f in result.findings if rule in f.rule), "?")
            result.collateral[node.name] = owner
            reason = f"calibration: pinned with {owner} by {rule!r} (policy rules pin whole modules or ops)"
        meta.REASON.set(node, reason)
        meta.RULE.set(node, "calibration")
        record = gm.amp_report.node(node.name)
        record.reason, record.rule = reason, "calibration"
    moved = result.moved
    gm.amp_report.notes.append(
        f"calibrated on {result.batches} batches: {len(moved)} node(s) moved to fp32"
        + (f" ({', '.join(moved)}); policy {result.policy}" if moved else ""))
    gm.amp_calibration = result
