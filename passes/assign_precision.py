"""Analysis: paint every node with a precision decision and a human-readable reason.

Decide first, rewrite second: this pass only writes ``meta.DECISION``,
``meta.REASON`` and ``meta.RULE``; ``insert_casts`` reads the paint.

The algorithm, numbered as the DEBUG log lines are:

1. Graph inputs: at O2/O3 floating inputs are cast low at entry ("entry").
2. Casts the model itself writes (``x.float()``, ``.to(dtype)``) are kept ("cast").
3. A policy rule (module name > module type > op) decides, if one matches.
4. Otherwise the level decides: O1 looks the op up in the tables; O2/O3 run
   everything low except normalisation (fp32 when ``keep_batchnorm_fp32``)
   and pure data movement, which follows.  At O2/O3 an op that reads a value
   the model itself widened (``x.float()``) follows it (rule ``model``):
   Apex's O2 never undid the model's own casts.  A tensor the model makes
   in fp32 itself (a factory with ``dtype=torch.float32``, an fp32 trace
   constant) stays fp32, and an op computing from such tensors alone follows
   them (rule ``model``).  GEMMs, norms and leaf modules, which run beside
   their low parameters, stay low.
5. Banned ops raise (or run fp32 with ``allow_banned=True``); unknown ops
   follow, run fp32, or raise, as ``on_unknown_op`` says.  A custom op
   (``torch.library``, named ``"ns::name"``) that no table, policy or
   autocast rule decides and that would follow gets its floating inputs made
   one dtype, the widest, as promote ops do: a custom kernel given mixed
   dtypes (an fp32 weight beside a low activation) would fail, and autocast
   would not cast its inputs either.  One that writes an argument follows
   (a cast copy would take the write).  If one reads a parameter (directly,
   or through casts and views), a warning names it once per conversion with
   the policy line that decides it: a GEMM-like op left undecided keeps its
   weight's fp32 at O1, silently.
6. In-place ops that the tables would cast cannot be cast in place: an
   in-place fp32 op is rewritten out of place later ("fp32 (in-place made
   safe)"), an in-place low op runs in its input's dtype, as autocast does.
7. Graph outputs: cast to ``cast_model_outputs`` when set ("exit").
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.fx as fx
import torch.nn as nn

from amp_fx.frontend import regions

from amp_fx.ir import meta, op_properties, tables
from amp_fx.frontend.declared_precision import declared_precision, policy_target
from amp_fx.errors import AmpWarning, BannedOpError, UnknownOpError
from amp_fx.ir.cast_nodes import written_cast_dtype
from amp_fx.ir.dtype_constants import is_trace_constant
from amp_fx.ir.dtype_rules import explicit_dtype
from amp_fx.ir.op_keys import CAST_OPS, custom_overload, is_custom_op
from amp_fx.ir.pass_manager import PassContext, PassResult, amp_pass

__all__ = ["assign_precision", "DECISION_KEY", "REASON_KEY", "UndecidedCustomOpWarning"]

DECISION_KEY = meta.DECISION  # kept importable from here
REASON_KEY = meta.REASON
logger = logging.getLogger(__name__)  # amp_fx.passes.assign_precision


class UndecidedCustomOpWarning(AmpWarning):
    """A custom op that reads a parameter is in no amp_fx table: its precision is a guess until a policy decides it."""



def _where(node: fx.Node) -> str:
    source = meta.SOURCE.get(node)
    module = meta.MODULE_PATH.get(node) or "<root>"
    return f"node {node.name!r} in module {module!r}" + (f" at {source}" if source else "")


def _level_decision(node: fx.Node, op: str, ctx: PassContext) -> tuple[str, str, str]:
    """(decision, reason, rule) from the level's tables."""
    config = ctx.config
    category = tables.table_of(op)
    if category == "banned":
        if config.allow_banned:
            return "fp32", "banned op allowed in fp32 (allow_banned=True)", "banned"
        raise BannedOpError(f"{tables.BANNED[op]}\n  ({_where(node)})")
    if config.op_mode == "all_low":
        level = config.level
        # Norms that compute statistics over their input (layer/group/rms norm) run fp32 under
        # keep_batchnorm_fp32; batch_norm and instance_norm take low input with fp32 statistics.
        norm = op_properties.of(op).norm
        if norm == "statistics" and config.keep_batchnorm_fp32:
            return "fp32", f"{level}: normalisation kept fp32 (keep_batchnorm_fp32=True)", "level"
        if norm == "input_dtype" and config.keep_batchnorm_fp32:
            return "follow", f"{level}: batch norm follows its input", "level"
        if norm == "input_dtype":
            # Its parameters are low too: CPU kernels refuse an fp32 input beside them.
            return "low", f"{level}: batch norm runs low with its low parameters (keep_batchnorm_fp32=False)", "level"
        if op_properties.of(op).loss and config.keep_losses_fp32:
            return "fp32", f"{level}: loss kept fp32 (keep_losses_fp32=True)", "level"
        if op in tables.DATA_MOVEMENT:
            return "follow", f"{level}: data movement follows its input", "level"
        return "low", f"{level}: whole graph in low precision", "level"
    if category == "unknown":
        mode = config.on_unknown_op
        if mode == "error":
            raise UnknownOpError(
                f"op {op!r} is in no amp_fx table and on_unknown_op='error' ({_where(node)}). "
                f"Decide it with policy={{'op:{op}': 'low' | 'fp32' | 'follow'}} or set on_unknown_op='follow'."
            )
        if mode == "fp32":
            return "fp32", "unknown op: fp32 (on_unknown_op='fp32')", "unknown"
        return "follow", "unknown op: follows its input (on_unknown_op='follow')", "unknown"
    table = tables.all_tables()[category]
    return category, f"{category}: {table[op]}", "table"


def _decide(node: fx.Node, ctx: PassContext) -> tuple[str, str, str]:
    config = ctx.config
    if node.op == "placeholder":
        if meta.PARAM.get(node) is None and config.op_mode == "all_low" and meta.is_float(node) is not False:
            return "entry", f"{config.level}: floating graph inputs cast low at entry", "level"
        return "none", "graph input", "level"
    if node.op == "get_attr":
        return "none", "parameter or buffer" if meta.PARAM.get(node) else "attribute", "level"
    if node.op == "output":
        if config.cast_model_outputs is not None:
            return "exit", f"outputs cast to {str(config.cast_model_outputs).replace('torch.', '')} (cast_model_outputs)", "level"
        return "none", "graph output", "level"
    role = regions.marker_role(node)
    if role is not None:
        return "none", f"the model's {role[1]} region ({role[0]})", "grad-mode" if role[1] == "grad" else "autocast"
    op = meta.OP.get(node) or str(node.target)
    if op_properties.of(op).hook is not None:  # the nodes around a hooked module: before policies, never unknown
        return "follow", "module hook boundary: runs the module's hooks, computes nothing", "hooks"
    if op in CAST_OPS:
        return "cast", "explicit cast", "model"
    if op in tables.EXPORT_CHECKS:
        return "none", "torch.export check: computes nothing, kept true to the rewritten dtypes", "level"
    rule = ctx.policy.decide(op, policy_target(node), meta.MODULE_STACK.get(node) or [])
    if rule is not None:
        if op in tables.BANNED and rule.decision != "fp32" and not config.allow_banned:
            raise BannedOpError(f"{tables.BANNED[op]}\n  ({_where(node)}; {rule.describe()} would run it {rule.decision})")
        return rule.decision, rule.describe(), "policy"
    # custom_fwd(cast_inputs=) / register_autocast rules of opaque calls, as autocast reads them
    declared = declared_precision(node, ctx)
    if declared is not None:
        return declared
    return _level_decision(node, op, ctx)


# -- custom ops no one decided (step 5) -------------------------------------------
def _undecided_custom_op(node: fx.Node, rule: str) -> bool:
    """A custom op whose decision came from no table, policy or autocast rule of its own."""
    op = meta.OP.get(node)
    return is_custom_op(op) and rule in ("unknown", "level", "model") and tables.table_of(op) == "unknown"


def _writes_an_argument(node: fx.Node) -> bool:
    overload = custom_overload(node.target)
    return overload is not None and any(a.alias_info is not None and a.alias_info.is_write
                                        for a in overload._schema.arguments)


def _equalise_inputs(node: fx.Node, decision: str, reason: str, rule: str) -> tuple[str, str, str]:
    """An undecided custom op that would follow: made to run in the widest of its floating inputs.

    One that writes an argument follows whatever the level says: a cast copy would take the write.
    """
    if not _undecided_custom_op(node, rule) or decision not in ("follow", "low", "fp32"):
        return decision, reason, rule
    if _writes_an_argument(node):
        return "follow", f"custom op in no amp_fx table that writes an argument: its inputs are never cast", rule
    if decision != "follow":
        return decision, reason, rule
    return ("promote", "custom op in no amp_fx table: its floating inputs are made one dtype, the widest "
            "(as promote ops do)", rule)


def _weights_read(node: fx.Node, gm: fx.GraphModule) -> list[str]:
    """The parameters ``node`` reads, directly or through casts and data movement (``w.t().to(x.dtype)``)."""
    found: list[str] = []
    seen: set[fx.Node] = set()
    todo = list(node.all_input_nodes)
    while todo:
        source = todo.pop()
        if source in seen:
            continue
        seen.add(source)
        name = meta.PARAM.get(source)
        if name is not None:
            if source.op == "placeholder" or isinstance(_attr(gm, str(source.target)), nn.Parameter):
                found.append(name)
        elif meta.OP.get(source) in CAST_OPS or meta.OP.get(source) in tables.DATA_MOVEMENT:
            todo.extend(source.all_input_nodes)
    return sorted(set(found))


def _attr(gm: fx.GraphModule, target: str) -> object:
    try:
        return gm.get_parameter(target)
    except AttributeError:
        return None


def _warn_undecided(found: dict[str, tuple[fx.Node, list[str]]], ctx: PassContext) -> list[str]:
    """One warning per undecided custom op that reads parameters; the same lines for the report."""
    lines = []
    level = ctx.config.level
    for op, (node, weights) in found.items():
        decision = meta.DECISION.get(node)
        runs = {"promote": "in the widest dtype its inputs arrive in (its fp32 weights keep it fp32)",
                "low": f"low, as {level} runs the whole graph", "follow": "in whatever dtype arrives",
                "fp32": "in fp32"}.get(decision, decision)
        shown = ", ".join(repr(w) for w in weights[:3]) + (f" and {len(weights) - 3} more" if len(weights) > 3 else "")
        line = (f"custom op {op!r} is in no amp_fx table and takes parameter {shown} ({_where(node)}): at {level} it "
                f"runs {runs}. Decide it: policy={{'op:{op}': 'low'}} if it is a GEMM or otherwise safe in low "
                f"precision, 'fp32' to keep it full precision, 'follow' to pass its inputs as they arrive.")
        warnings.warn(line, UndecidedCustomOpWarning, stacklevel=2)
        lines.append(line)
    return lines


def _widening_model_cast(node: fx.Node) -> bool:
    """A cast the model itself wrote to float32/float64 (``x.float()``, ``x.to(torch.float32)``)."""
    return meta.OP.get(node) in CAST_OPS and written_cast_dtype(node) in (torch.float32, torch.float64)


def _asserted_full_precision(node: fx.Node) -> bool:
    """torch.export kept the model's ``x.float()`` on an fp32 ``x`` only as a dtype check: the model asked for fp32."""
    return any(meta.OP.get(u) == "_assert_tensor_metadata" and u.kwargs.get("dtype") in (torch.float32, torch.float64)
               for u in node.users)


# Factories, and the copies of another tensor's shape that take a dtype= (torch.zeros_like(x, dtype=torch.float32)).
_MAKERS = tables.FACTORIES | {"zeros_like", "ones_like", "empty_like", "full_like", "new_zeros", "new_ones", "new_empty",
                              "new_full"}


def _made_full_precision(node: fx.Node, gm: fx.GraphModule) -> bool:
    """A tensor the model makes in float32/float64 itself: a factory called with that ``dtype=``
    (``torch.arange(n, dtype=torch.float32)``), or an fp32 constant the trace froze from forward (symbolic tracing
    evaluates a factory and what computes from it alone: ``exp(arange(...))`` becomes ``_tensor_constant0``)."""
    if node.op == "get_attr":
        if not is_trace_constant(str(node.target)):
            return False
        value = _constant(gm, str(node.target))
        return isinstance(value, torch.Tensor) and value.dtype in (torch.float32, torch.float64)
    return meta.OP.get(node) in _MAKERS and explicit_dtype(node) in (torch.float32, torch.float64)


def _constant(gm: fx.GraphModule, target: str) -> object:
    owner: object = gm
    for atom in target.split("."):
        owner = getattr(owner, atom, None)
    return owner


def _read_in_full_precision(node: fx.Node, full: set) -> bool:
    """Some reader of ``node`` computes in full precision from it (through data movement that follows it)."""
    return any(u in full and (meta.OP.get(u) not in tables.DATA_MOVEMENT or _read_in_full_precision(u, full))
               for u in node.users)


def _moves_only(node: fx.Node) -> bool:
    """Data movement, or a ``.to(device)`` that changes no dtype."""
    op = meta.OP.get(node)
    return op in tables.DATA_MOVEMENT or (op in CAST_OPS and written_cast_dtype(node) is None)


def _read_only_widened(node: fx.Node) -> bool:
    """Every use of ``node`` (through views and device moves) is a cast the model wrote to full precision."""
    users = [u for u in node.users if meta.OP.get(u) not in tables.EXPORT_CHECKS]
    return bool(users) and all(_widening_model_cast(u) or (_moves_only(u) and _read_only_widened(u)) for u in users)


def _respect_model_casts(node: fx.Node, decision: str, reason: str, rule: str, wide: set, made: set,
                         gm: fx.GraphModule, ctx: PassContext) -> tuple[str, str, str]:
    """O2/O3: an op reading a value the model itself widened to fp32 follows it instead of being cast back down.

    The whole-graph "low" of O2/O3 stands for Apex's ``model.half()``: the
    model's own ``x.float()`` still computes in fp32 there (rotary frequencies,
    loss heads).  GEMMs and convolutions still run low, as under autocast.
    Weights the model reads only through such casts stay fp32 (``keep_fp32``).

    A tensor the model makes in fp32 itself (``torch.arange(n, dtype=torch.float32)``, a trace constant
    computed from one) stays fp32, and so do the ops computing from such tensors alone (``exp``, a product
    with a Python number): the frequencies of a sinusoidal timestep embedding.  An op that also reads a
    low value runs low as before, the fp32 tensor cast down where it is read.
    """
    if ctx.config.op_mode != "all_low":
        return decision, reason, rule
    if node.op == "get_attr" and (_read_only_widened(node) or _asserted_full_precision(node)):
        meta.KEEP_FP32.set(node, True)
        wide.add(node)
    if _made_full_precision(node, gm):
        made.add(node)  # a trace constant stays fp32 where a reader computes from it in fp32 (assign_precision's end)
        if node.op != "get_attr" and rule == "level" and decision == "low":
            return "follow", f"{ctx.config.level}: the model makes this tensor in {_dtype_name(node)}", "model"
        return decision, reason, rule
    if _widening_model_cast(node):
        wide.add(node)
        return decision, reason, rule
    if node.op in ("get_attr", "placeholder"):
        return decision, reason, rule
    reads_wide = any(n in wide for n in node.all_input_nodes)
    # torch.export dropped the model's x.float() (x was fp32 when traced) and kept a dtype check: its readers
    # get the fp32 the model asked for.
    reads_asserted = any(n.op not in ("get_attr", "placeholder") and _asserted_full_precision(n) for n in node.all_input_nodes)
    if reads_wide and meta.OP.get(node) in CAST_OPS and written_cast_dtype(node) is None:
        wide.add(node)  # a .to(device) of a full-precision value
        return decision, reason, rule
    # GEMMs, convolutions, norms and leaf modules run with their (low) parameters: they stay low.
    row = op_properties.of(meta.OP.get(node))
    with_params = row.table == "low" or row.norm is not None or node.op == "call_module"
    if reads_asserted and rule == "level" and decision in ("low", "follow") and not with_params:
        decision, reason, rule = "fp32", f"{ctx.config.level}: the model casts this input to full precision", "model"
        wide.add(node)
    elif reads_wide and rule == "level" and decision == "low" and not with_params:
        decision, reason, rule = "follow", f"{ctx.config.level}: follows the model's own cast to full precision", "model"
    if reads_wide and decision == "follow":
        wide.add(node)
    if reads_wide or reads_asserted:
        return decision, reason, rule
    # Reads only tensors the model made in fp32 (no low value, no value of unknown dtype): keeps their fp32.
    floats = [n for n in node.all_input_nodes if meta.is_float(n) is not False or n in made]
    if floats and all(n in made for n in floats):
        if rule == "level" and decision == "low" and not with_params:
            decision, reason, rule = "follow", f"{ctx.config.level}: computes from tensors the model makes in full precision", "model"
        if decision == "follow":
            made.add(node)
    return decision, reason, rule


def _dtype_name(node: fx.Node) -> str:
    return str(explicit_dtype(node)).replace("torch.", "")


@amp_pass(kind="analysis", requires=("meta",), ensures=("paint",), invalidates=("dtypes",))
def assign_precision(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Paint every node with ``meta.DECISION`` / ``meta.REASON`` / ``meta.RULE``."""
    counts: dict[str, int] = {}
    unknown: dict[str, int] = {}
    wide: set[fx.Node] = set()  # values the model widened itself, and what follows them
    made: set[fx.Node] = set()  # tensors the model makes in full precision, and what computes from them alone
    undecided: dict[str, tuple[fx.Node, list[str]]] = {}  # custom op -> (its first node, the parameters they read)
    for node in gm.graph.nodes:
        decision, reason, rule = _equalise_inputs(node, *_respect_model_casts(node, *_decide(node, ctx), wide, made, gm, ctx))
        if meta.INPLACE.get(node) and decision == "low":
            decision, reason = "follow", "in-place op: runs in its input's dtype (autocast does not cast in-place ops)"
        elif meta.INPLACE.get(node) and decision == "fp32":
            reason = f"{reason} (in-place: computed out of place in fp32, written back)"
        meta.DECISION.set(node, decision)
        meta.REASON.set(node, reason)
        meta.RULE.set(node, rule)
        counts[decision] = counts.get(decision, 0) + 1
        if rule == "unknown":
            op = meta.OP.get(node)
            unknown[op] = unknown.get(op, 0) + 1
        if ctx.config.op_mode != "none" and _undecided_custom_op(node, rule):
            weights = _weights_read(node, gm)
            if weights:
                first, seen = undecided.get(meta.OP.get(node), (node, []))
                undecided[meta.OP.get(node)] = (first, sorted(set(seen) | set(weights)))
        logger.debug("step %s: %s -> %s (%s)", "3" if rule == "policy" else "4", node.name, decision, reason)
    for node in made:  # a trace constant some op computes from in full precision stays fp32 (cast_params)
        if node.op == "get_attr" and _read_in_full_precision(node, made | wide):
            meta.KEEP_FP32.set(node, True)
    stats = {"decisions": counts, "unknown_ops": unknown}
    if undecided:
        stats["undecided_custom_ops"] = sorted(undecided)
        stats["report_lines"] = _warn_undecided(undecided, ctx)
    return PassResult(gm, False, stats)
