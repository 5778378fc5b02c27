"""Rewrite: eligible low GEMMs become scaled fp8 GEMMs (after the casts are final).

fp8 is a decision like ``low``: a GEMM that may (``can_fp8``) and should
(``should_fp8``) run in fp8 becomes one call of
:func:`amp_fx.graph_ops.fp8_ops.fp8_linear` / ``fp8_matmul`` (e4m3 operands
forward, grad_output e5m2 backward, per the recipe of
:class:`amp_fx.ir.fp8_rules.Fp8Config`).  ``passes/paint_fp8.py`` has already
painted a policy's ``"fp8"`` nodes low, so casts, their placement and the dtype
analysis saw plain low GEMMs.  Here, for every GEMM whose registry row says fp8
   (``linear``, ``matmul``, ``mm``, ``addmm``, registered custom GEMMs) the policy decides first (``"fp8"`` forces a legal GEMM,
   any other decision keeps it out), then ``can_fp8`` and ``should_fp8``.  An fp8
   GEMM reads its activation and weight in their own precision -- the casts to
   the low dtype that ``insert_casts`` wrote for it are bypassed (and dropped
   when nothing else reads them), so an fp32 weight is quantized from fp32, as
   torchao quantizes it -- and returns the low dtype, so everything downstream
   is as the analysis said.  A bias is added after it, in the low dtype
   (torchao's ``output + bias.to(output.dtype)``).  Each fp8 GEMM owns an
   :class:`~amp_fx.graph_ops.fp8_ops.Fp8GemmState` under ``amp_fx_fp8.<name>``
   (the scales it used; delayed scaling's amax history, in ``state_dict``).

K and N come from the weight's shape (a ``matmul`` without example inputs too).
The node keeps its name and gets decision ``"fp8"``; whenever fp8 was asked
(``fp8=`` or a policy's ``"fp8"``) the stats list every GEMM with its decision
and why (also as report lines), a GEMM a policy forced but could not make fp8
says so in its reason, and the last line counts them (``2 of 3 GEMMs fp8``)
with the share of GEMM FLOPs that run in fp8.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import re
import warnings
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn as nn

from amp_fx.errors import PACKAGE, AmpNotImplementedError, AmpTypeError, AmpValueError
from amp_fx.frontend.declared_precision import policy_target
from amp_fx.graph_ops.fp8_ops import Fp8GemmState, Fp8Group, Fp8Spec, fp8_linear, fp8_matmul
from amp_fx.ir import meta, op_properties
from amp_fx.ir.cast_nodes import is_inserted_cast
from amp_fx.ir.fp8_choice import Choice
from amp_fx.ir.fp8_cost import DEVICES, FORMATS, layer_seconds
from amp_fx.ir.fp8_rules import Fp8Config, Fp8NothingConvertedWarning, can_fp8, should_fp8
from amp_fx.ir.pass_manager import PassContext, PassResult, amp_pass
from amp_fx.ir.fp8_plan import high_precision as _high_precision, is_weight as _is_weight, plan_auto
from amp_fx.passes.pad_gemm import Gemm, find_gemm

__all__ = ["fp8_gemms", "STATE_ROOT", "fp8_states", "fp8_group", "fp8_sync"]

logger = logging.getLogger(__name__)  # amp_fx.passes.fp8_gemms

STATE_ROOT = "amp_fx_fp8"  # the submodule holding every fp8 GEMM's Fp8GemmState
_DEFAULT = Fp8Config()  # the recipe a policy's "fp8" uses when convert() was given no fp8=


def fp8_states(module: nn.Module) -> dict[str, Fp8GemmState]:
    """Each fp8 GEMM's state in a converted module, by name (empty when none)."""
    root = getattr(module, STATE_ROOT, None)
    return dict(root.named_children()) if isinstance(root, nn.Module) else {}


def fp8_group(module: nn.Module) -> Optional[Fp8Group]:
    """The :class:`Fp8Group` of a converted module's fp8 GEMMs (None when it has none)."""
    root = getattr(module, STATE_ROOT, None)
    return getattr(root, "group", None) if isinstance(root, nn.Module) else None


class _StepSync:
    """The handle ``fp8_sync(gm, optimizer)`` returns: ``remove()`` drops the hook and syncs at the next forward again."""

    def __init__(self, group: Fp8Group, hook: Any):
        self.group, self.hook = group, hook

    def remove(self) -> None:
        self.hook.remove()
        self.group.on_step = False


def fp8_sync(module: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> Any:
    """Update delayed scaling's amax histories and scales now: one ``all_reduce`` over every fp8 GEMM of ``module``.

    Without ``optimizer``: syncs now and returns whether it communicated
    (False without a process group of more than one rank).  Every rank must
    call it at the same point.  Call it before reading or saving the state
    under ``torch.distributed`` (between a backward and the next forward the
    newest history entries are still each rank's own).

    With ``optimizer``: syncs after every ``optimizer.step()`` instead of at
    the next forward, so the micro-batches of a gradient-accumulation step
    share one set of scales and one all_reduce per step; alone, too, the
    scales then change once per optimizer step.  Returns a handle whose
    ``remove()`` goes back to syncing at the next forward.
    """
    group = fp8_group(module)
    if group is None:
        raise AmpValueError(f"{type(module).__name__} has no fp8 GEMMs: fp8_sync takes what "
                            f"{PACKAGE}.convert(model, fp8='delayed') returned")
    if optimizer is None:
        return group.sync()
    if not callable(getattr(optimizer, "register_step_post_hook", None)):
        raise AmpTypeError(f"fp8_sync(module, optimizer) needs a torch.optim.Optimizer (it hooks its step), got "
                           f"{type(optimizer).__name__}; or call amp_fx.fp8_sync(module) after each step yourself")
    group.sync()  # what the last forward recorded, before the hook takes over
    group.on_step = True
    return _StepSync(group, optimizer.register_step_post_hook(lambda *_: group.sync()))


# --------------------------------------------------------------------------
# The rewrite
# --------------------------------------------------------------------------
def _with_weight_sizes(gemm: Gemm) -> Gemm:
    """``gemm`` with K and N read off its 2-D parameter operand where the activation's shape is unknown.

    ``find_gemm`` needs both operands' shapes for a ``matmul`` / ``mm`` / ``addmm``; without
    example inputs only the parameter's is known, and it alone fixes K and N (``x @ W``: W is K x N).
    """
    if gemm.layout == "KN" and gemm.K is None and _is_weight(gemm.weight):
        gemm.K, gemm.N = meta.shape(gemm.weight)
    return gemm


def _policy_decision(node: fx.Node, ctx: PassContext) -> Optional[Any]:
    return ctx.policy.decide(meta.OP.get(node), policy_target(node), meta.MODULE_STACK.get(node) or [])


def _decide(gemm: Gemm, ctx: PassContext, choice: Optional[Choice]) -> tuple[Optional[Fp8Config], str, str]:
    """(the recipe, why, rule) for an fp8 GEMM; (None, why not, the rule that kept it) otherwise.

    The policy first, then legality, then size (``size_rule``) or, under ``recipe="auto"``, its :class:`Choice`.
    """
    node = gemm.node
    rule = _policy_decision(node, ctx)
    act_shape = meta.shape(gemm.act)
    sig = op_properties.of(gemm.op).gemm
    scaled = gemm.extra_args or any(node.kwargs.get(k, 1) != 1 for k in sig.unit_scalars)
    legal, why = can_fp8(gemm.op, decision=meta.DECISION.get(node), K=gemm.K, N=gemm.N,
                         act_dims=None if act_shape is None else len(act_shape), weight_is_param=_is_weight(gemm.weight),
                         scaled=scaled)
    config = ctx.config.fp8
    if _asks_fp8(rule):
        if not legal:
            return None, f"{rule.describe()}, but {why}", "legality"
        return _forced(config, choice), rule.describe(), "policy"
    if rule is not None:
        return None, f"{rule.describe()} keeps it out of fp8", "policy"
    if config is None:
        return None, "fp8 not asked for it (no fp8=, and no policy 'fp8' covers it)", "not_asked"
    if not legal:
        return None, why, "legality"
    if config.auto:
        if choice is None or choice.recipe is None:
            return None, choice.why if choice else "not planned", choice.rule if choice else "not_measured"
        return dataclasses.replace(config, recipe=choice.recipe), choice.why, "auto"
    worth_it, why_not = should_fp8(gemm.K, gemm.N, config)
    return (config, f"K={gemm.K} N={gemm.N} eligible", "size_rule") if worth_it else (None, why_not, "size_rule")


def _forced(config: Optional[Fp8Config], choice: Optional[Choice]) -> Fp8Config:
    """The recipe of a GEMM a policy's ``"fp8"`` forces: the config's; under auto its choice, else its least-error recipe."""
    if config is None:
        return _DEFAULT
    if not config.auto:
        return config
    if choice is not None and choice.recipe is not None:
        return dataclasses.replace(config, recipe=choice.recipe)
    errors = choice.errors if choice is not None else {}
    recipe = min(config.choices, key=lambda r: errors.get(r, float("inf"))) if errors else config.choices[0]
    return dataclasses.replace(config, recipe=recipe)


def _asks_fp8(rule: Optional[Any]) -> bool:
    return rule is not None and rule.decision == "fp8"


def _state_name(node: fx.Node, taken: set) -> str:
    base = re.sub(r"\W", "_", meta.MODULE_PATH.get(node) or node.name) or node.name
    name, i = base, 1
    while name in taken:
        name, i = f"{base}_{i}", i + 1
    taken.add(name)
    return name


def _annotate(node: fx.Node, like: fx.Node, op: str, reason: str, **value: Any) -> None:
    meta.inherit(node, like, float_dtype=value.pop("float_dtype", None), shape=value.pop("shape", None))
    node.meta.update({meta.OP: op, meta.DECISION: value.pop("decision", "follow"), meta.REASON: reason,
                      meta.INSERTED: True, meta.RULE: "inserted"})
    if value:
        meta.note_value(node, **value)


def _add_state(gm: fx.GraphModule, gemm: Gemm, config: Fp8Config, taken: set) -> tuple[str, fx.Node]:
    """Give ``gemm`` an :class:`Fp8GemmState` under ``amp_fx_fp8.<name>`` and a node that reads it."""
    node = gemm.node
    root = getattr(gm, STATE_ROOT, None)
    if root is None:
        root = nn.Module()
        gm.add_module(STATE_ROOT, root)
    if getattr(root, "group", None) is None:
        root.group = Fp8Group()  # a plain attribute: the GEMMs' shared history update, no state of its own
    name = _state_name(node, taken)
    weight = _high_precision(gemm.weight)
    state = Fp8GemmState(delayed=config.recipe == "delayed", history_len=config.history_len)
    state.group = root.group
    root.group.states.append(state)
    device = getattr(meta.example_value(weight), "device", None) or _param_device(gm, weight)
    root.add_module(name, state.to(device) if device is not None else state)
    with node.graph.inserting_before(node):
        state_node = node.graph.get_attr(f"{STATE_ROOT}.{name}")
    _annotate(state_node, node, "fp8_state", f"inserted: fp8 state of {node.name} (scales, amax history)",
              decision="none", is_tensor=False, is_float=False)
    return name, state_node


def _rewrite(gm: fx.GraphModule, gemm: Gemm, config: Fp8Config, why: str, ctx: PassContext, taken: set) -> Optional[str]:
    """Make ``gemm`` an fp8 GEMM in place; return its state's name (None under Dynamo: a graph there holds no state)."""
    node, graph = gemm.node, gemm.node.graph
    weight = _high_precision(gemm.weight)
    if ctx.route == "dynamo":
        # Dynamo hands over parameters and buffers as graph inputs: a buffer added here would be no input of its.
        if config.recipe == "delayed":
            raise AmpNotImplementedError(
                "fp8 recipe 'delayed' keeps its amax history in module buffers, which a torch.compile backend cannot "
                "add to the model. Convert first and compile the result: torch.compile(amp_fx.convert(model, fp8="
                "'delayed'), backend='inductor') compiles everything but the delayed GEMMs, which run eagerly (one "
                "graph break each); or use fp8='tensorwise' / 'rowwise' here, which compile whole.")
        name, state_node = None, None
    else:
        name, state_node = _add_state(gm, gemm, config, taken)
    spec = Fp8Spec(config.recipe, meta.LOW_DTYPE.get(node) or ctx.low, config.emulate, config.amax_compute, config.margin)
    if name is not None:
        # Known before the first call: a sync of amaxes loaded from a checkpoint needs the recipe's margin.
        getattr(gm, STATE_ROOT).get_submodule(name).spec = spec
    operands = [gemm.act, gemm.weight]
    node.target = fp8_linear if gemm.layout == "NK" else fp8_matmul  # x @ W.T, or x @ W
    node.args, node.kwargs = (_high_precision(gemm.act), weight, spec, state_node), {}
    meta.OP.set(node, node.target.__name__)
    meta.DECISION.set(node, "fp8")
    meta.RULE.set(node, "fp8")
    meta.REASON.set(node, f"fp8 {config.describe()}: {why}")
    if gemm.bias is not None:
        with graph.inserting_after(node):
            biased = graph.call_function(operator.add, (node, gemm.bias))
        _annotate(biased, node, "add", f"inserted: bias of fp8 GEMM {node.name}, added in the low dtype",
                  float_dtype=meta.float_dtype(node), shape=meta.shape(node))
        node.replace_all_uses_with(biased, delete_user_cb=lambda user: user is not biased)
    for value in operands:  # a cast no one reads now
        if isinstance(value, fx.Node) and is_inserted_cast(value) and not value.users:
            graph.erase_node(value)
    return name


def _param_device(gm: fx.GraphModule, node: fx.Node) -> Optional[torch.device]:
    """The device of the parameter or buffer a ``get_attr`` node reads (None for anything else)."""
    if node.op != "get_attr":
        return None
    for lookup in (gm.get_parameter, gm.get_buffer):
        try:
            return lookup(str(node.target)).device
        except AttributeError:
            continue
    return None


def _flops(gemm: Gemm) -> Optional[int]:
    return None if gemm.M is None or gemm.K is None or gemm.N is None else 2 * gemm.M * gemm.K * gemm.N


def _seconds(gemm: Gemm, M: Optional[int], config: Optional[Fp8Config]) -> dict[str, float]:
    """The roofline model's seconds of the GEMM's three training GEMMs per format (empty when M, K or N is unknown)."""
    if not all(isinstance(v, int) and v > 0 for v in (M, gemm.K, gemm.N)):
        return {}
    profile = config.profile if config is not None else DEVICES["h100"]
    return {fmt: layer_seconds(fmt, M, gemm.K, gemm.N, profile) for fmt in FORMATS}


# The option that changes what each rule keeps out of fp8 (the warning of a request that converted nothing names it).
_CHANGE = {
    "size_rule": "Fp8Config(size_rule='all') takes every legal GEMM (or recipe='auto' decides by shape and error)",
    "min_gain": "a lower Fp8Config(min_gain=...), tokens= for the real batch, or a device profile with more headroom",
    "error_budget": "a larger Fp8Config(error_budget=...)",
    "keep_first": "Fp8Config(keep_first=False)",
    "keep_last": "Fp8Config(keep_last=False)",
    "keep_routers": "Fp8Config(keep_routers=False)",
    "legality": "no option: fp8 needs K and N multiples of 16, a 2-D parameter operand, a GEMM painted low",
    "policy": "the policy rule that covers them",
    "not_asked": "fp8= for the whole model, or a policy 'fp8' that covers them",
    "not_measured": "example inputs that reach them",
    "no_shape": "example inputs with static shapes",
}


def _warn_nothing_converted(gemms: list[dict], config: Optional[Fp8Config]) -> None:
    """fp8 was asked for and nothing converted: say which rule kept how many GEMMs, and the option that changes it."""
    by_rule: dict[str, list[dict]] = {}
    for row in gemms:
        by_rule.setdefault(row["rule"], []).append(row)
    parts = [f"{len(rows)} by {rule} ({rows[0]['why']}; change: {_CHANGE.get(rule, 'see docs/fp8.md')})"
             for rule, rows in sorted(by_rule.items(), key=lambda item: -len(item[1]))]
    recipe = f"recipe {config.recipe}" if config is not None else "by a policy 'fp8'"
    warnings.warn(f"fp8 was asked for ({recipe}) but none of the {len(gemms)} GEMMs was converted; kept: "
                  + "; ".join(parts) + f". {PACKAGE}.explain(gm) shows each GEMM", Fp8NothingConvertedWarning, stacklevel=2)


@amp_pass(kind="rewrite", requires=("meta", "paint"))
def fp8_gemms(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Rewrite each low GEMM the policy, ``can_fp8`` and ``should_fp8`` (or ``recipe="auto"``) choose into a scaled fp8 GEMM."""
    gemms, lines, taken = [], [], set(fp8_states(gm))
    total_flops = fp8_flops = 0
    config = ctx.config.fp8
    asked = config is not None  # or a policy's "fp8" covers a GEMM (below)
    low = str(ctx.low).replace("torch.", "")
    found = []
    for node in list(gm.graph.nodes):
        gemm = find_gemm(node)
        if gemm is None or meta.DECISION.get(node) == "fp8":  # none, or one this pass made fp8 already
            continue
        flops = _flops(gemm)
        total_flops += flops or 0
        if op_properties.of(gemm.op).fp8:
            found.append((_with_weight_sizes(gemm), flops))
    plan = plan_auto(gm, ctx, [g for g, _ in found]) if config is not None and config.auto and found else {}
    for gemm, flops in found:
        node = gemm.node
        forced = _asks_fp8(_policy_decision(node, ctx))
        asked = asked or forced
        choice = plan.get(node)
        chosen, why, rule = _decide(gemm, ctx, choice)
        state = _rewrite(gm, gemm, chosen, why, ctx, taken) if chosen is not None else None
        if chosen is not None:
            fp8_flops += flops or 0
            logger.debug("fp8 %s (%s): %s", node.name, chosen.recipe, why)
        elif forced:
            # A policy's "fp8" painted it low "its GEMMs fp8": its row must not claim fp8 it does not run.
            meta.REASON.set(node, f"{why}: runs {low}, not fp8")
        where = f" ({meta.MODULE_PATH.get(node)})" if meta.MODULE_PATH.get(node) else ""
        M = choice.M if choice is not None and choice.M else gemm.M
        head = f"{gemm.op} {node.name}{where}: M={'?' if M is None else M} K={gemm.K} N={gemm.N}"
        lines.append(f"{head} -> fp8 {chosen.recipe} ({why})" if chosen else f"{head} kept {low} ({why})")
        gemms.append({"node": node.name, "op": gemm.op, "module": meta.MODULE_PATH.get(node, ""), "M": M,
                      "K": gemm.K, "N": gemm.N, "flops": flops, "fp8": chosen is not None,
                      "recipe": chosen.recipe if chosen else None, "why": why, "rule": rule, "state": state,
                      "seconds": choice.seconds if choice is not None and choice.seconds else _seconds(gemm, M, config),
                      "errors": dict(choice.errors) if choice is not None else {},
                      "operand_errors": dict(choice.operand_errors) if choice is not None else {},
                      "calibrated_rows": choice.calibrated_rows if choice is not None else None})
    count = sum(1 for g in gemms if g["fp8"])
    if not asked:
        lines = []  # a conversion that asked for no fp8 (by fp8= or a policy) carries no fp8 lines
    share = fp8_flops / total_flops if total_flops else None
    if asked:
        lines.append(f"{count} of {len(gemms)} GEMMs fp8" + (f", {share:.1%} of GEMM FLOPs" if share is not None else ""))
        if count == 0 and gemms:
            _warn_nothing_converted(gemms, config)
    stats = {"gemms": gemms, "fp8": count, "asked": asked, "candidates": len(gemms), "fp8_flops": fp8_flops,
             "gemm_flops": total_flops, "fp8_flop_share": share, "report_lines": lines,
             "device": config.profile.name if config is not None else "h100", "auto": bool(config and config.auto)}
    return PassResult(gm, count > 0, stats)
