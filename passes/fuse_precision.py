"""Rewrite: run fp32 norms as mixed-dtype kernels where the kernel keeps fp32 precision without the casts.

An fp32 decision normally costs a cast of the low input up, the fp32 op, and
a cast of its result back down for the low ops that read it.  Some CPU
kernels take a low-precision input with fp32 weights, compute their
statistics and affine transform in fp32, and round once to the input's dtype.
Where every reader of the result wants it low anyway, that is the cast form
rounded where the cast back would round it: the same values, without two
cast kernels forward and two backward.

A node is fused when (checked on the dtype analysis of the final paint):

1. its decision is ``fp32`` and its op has a verified fused form on this
   device (:data:`FUSED_FORMS`; CPU only: no CUDA kernel was verified);
2. its first input arrives in a low dtype, every other floating input (and a
   leaf module's parameters and buffers) is fp32;
3. every reader takes the result in that same low dtype (a ``low`` decision
   of that dtype, or a view, ``relu`` or max pooling -- exact ops, which
   commute with rounding -- whose readers do): a reader that would compute
   with an fp32 result keeps the cast form, since fusing would round its input.

The node keeps its ``fp32`` decision (the report shows it with a "fused"
reason) and is marked ``meta.FUSED``; :func:`amp_fx.ir.analysis.input_target`
then asks for its inputs as they arrive, and the pass runner runs the
analysis again (the pass ensures ``"dtypes"``) so every reader sees the low
result.  ``insert_casts`` writes no cast for it.  The marks are paint, and
the pass says so (``repainted``); ``modified`` says only whether the code
changed (a ``layer_norm`` call retargeted).

Which forms: each was measured against the cast form (``tests/passes/
test_fuse_precision.py``): output within 1 low-dtype ulp, and input, weight
and bias gradients as precise as the cast form's against fp64.  Affine
``group_norm`` and ``instance_norm`` run CPU's mixed-dtype kernel as it is.
``layer_norm`` (bf16 only) is *retargeted* to :func:`amp_fx.graph_ops.fused_norms.
layer_norm_fp32_stats`: CPU's mixed-dtype forward and input gradient, but
the weight and bias gradients from the fp32 kernel on the saved low input,
since CPU's own mixed-dtype backward accumulates them in the low dtype
(far less precise than the cast form).
It runs under torch.func (``grad``, ``vmap``; see that module).  Only the
``F.layer_norm`` / ``torch.layer_norm`` call forms are retargeted (symbolic
tracing and Dynamo both give them); a leaf ``nn.LayerNorm`` module and
torch.export's aten ``layer_norm`` / ``native_layer_norm`` keep the cast
form.  Not fused: norms without weight and bias other than layer_norm (CPU's
all-low kernel computes their input gradient in the low dtype, less precise
than the cast form) and ``batch_norm`` (likewise).  ``softmax``/``log_softmax``/
``sum``/``mean``/``cumsum`` with ``dtype=torch.float32`` cast their input
inside the op on CPU (the same kernel as amp_fx's cast), and CPU losses on
bf16 logits accumulate and return in bf16: neither saves anything without
losing precision on CPU.  The measured errors and times behind each choice
are in docs/performance.md ("Fused norms", "Which forms, and why only these").
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from amp_fx.ir import meta, op_properties
from amp_fx.graph_ops.fused_norms import layer_norm_fp32_stats
from amp_fx.ir.analysis import analyse, input_target, node_inputs
from amp_fx.ir.pass_manager import PassContext, PassResult, amp_pass

__all__ = ["fuse_precision", "FUSED_FORMS"]

_LOW = (torch.bfloat16, torch.float16)
# op -> its fused form (device types with a verified kernel, what the report says it does): the op registry's
# ``fused_form`` of each op, re-exported under the name readers of this pass know.
FUSED_FORMS = op_properties.FUSED_FORMS
_AFFINE_LAYER_NORM = "layer_norm with fp32 statistics and fp32 weight/bias gradients"
_PLAIN_LAYER_NORM = "layer_norm without weight and bias, with fp32 statistics and an fp32 backward"
# The call forms of layer_norm that can run as layer_norm_fp32_stats are its fused form's ``calls`` (F.layer_norm's
# signature; torch.layer_norm's extra cudnn_enable is dropped).  Reverted, a node goes back to torch.layer_norm,
# which takes every call either spelling can make.


def _device_types(gm: fx.GraphModule, node: fx.Node) -> set[str]:
    """Device types of every tensor ``node`` reads whose value the conversion knows (fakes, parameters)."""
    found: set[str] = set()
    for value in node_inputs(node):
        fake = getattr(meta.value_of(value), "fake", None)
        if isinstance(fake, torch.Tensor):
            found.add(fake.device.type)
        elif value.op == "get_attr":
            attr = _attr(gm, str(value.target))
            if isinstance(attr, torch.Tensor):
                found.add(attr.device.type)
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        found |= {t.device.type for t in (*module.parameters(), *module.buffers())}
    if not found:  # nothing it reads is known (no example inputs, no weights): where the model's tensors live
        found = {t.device.type for t in (*gm.parameters(), *gm.buffers())}
    return found


def _attr(gm: fx.GraphModule, target: str) -> object:
    value: object = gm
    for atom in target.split("."):
        value = getattr(value, atom, None)
    return value


def _weights_fp32(gm: fx.GraphModule, node: fx.Node, first: fx.Node, values: dict) -> bool:
    """Every floating input but the first, and a leaf module's parameters and buffers, are known fp32 tensors."""
    for value in node_inputs(node):
        if value is first:
            continue
        info = values.get(value)
        if info is None or (info.is_float is not False and info.float_dtype != torch.float32) or info.container:
            return False
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        tensors = [t for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)) if t.is_floating_point()]
        if any(t.dtype != torch.float32 for t in tensors):
            return False
    return True


def _has_affine(gm: fx.GraphModule, node: fx.Node) -> bool:
    """True when a norm has a weight or bias."""
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        return any(True for _ in module.parameters(recurse=False))
    w, b = op_properties.of(node.meta.get(meta.OP)).weight_bias_args or (2, 3)  # F.layer_norm's positions
    weight = node.args[w] if len(node.args) > w else node.kwargs.get("weight")
    bias = node.args[b] if len(node.args) > b else node.kwargs.get("bias")
    return weight is not None or bias is not None


def _retargetable(node: fx.Node) -> bool:
    """A call whose fused form points it at a precise function (layer_norm's at :func:`layer_norm_fp32_stats`)."""
    form = op_properties.of(node.meta.get(meta.OP)).fused_form
    return form is not None and form.retarget is not None and node.op == "call_function" and node.target in form.calls


def _retarget(node: fx.Node, fused: bool) -> bool:
    """Point an affine layer_norm call at the precise fused function (or, no longer fused, back); True if it changed."""
    want = layer_norm_fp32_stats if fused else torch.layer_norm
    if node.target is want or (not fused and node.target is not layer_norm_fp32_stats):
        return False
    if fused:
        node.args = node.args[:5]
        node.kwargs = {k: v for k, v in node.kwargs.items() if k != "cudnn_enable"}
    node.target = want
    return True


def _fusable(gm: fx.GraphModule, node: fx.Node, ctx: PassContext, values: dict) -> Optional[torch.dtype]:
    """The low dtype ``node`` would run its fused form in, or None (see the module docstring)."""
    op = node.meta.get(meta.OP)
    form = op_properties.of(op).fused_form
    if node.meta.get(meta.DECISION) != "fp32" or form is None or node.meta.get(meta.INPLACE):
        return None
    if node.op not in ("call_function", "call_method", "call_module") or not node.args:
        return None
    first = node.args[0]
    info = values.get(first) if isinstance(first, fx.Node) else None
    if info is None or info.container or info.is_tensor is False or info.float_dtype not in _LOW:
        return None
    low = info.float_dtype
    devices = _device_types(gm, node)
    if not devices or not devices <= form.devices:
        return None
    if not _weights_fp32(gm, node, first, values) or not node.users:
        return None
    if low not in form.dtypes:
        return None  # layer_norm's fp16 form differs from the cast form (op_properties: FUSED_FORMS)
    if form.retarget is not None:
        if not _retargetable(node):
            return None  # a leaf module or an aten form: CPU's own mixed backward would round dx, dw, db low
    elif form.affine_only and not _has_affine(gm, node):
        # Without weight and bias CPU's mixed backward computes the input gradient in the low dtype:
        # a larger error against fp64 than the cast form's (docs/performance.md, "Fused norms").
        return None
    return low if _read_low(node, low, ctx, values, gm) else None


def _passes_through(user: fx.Node, value: fx.Node, gm: fx.GraphModule, values: dict) -> bool:
    """``user`` follows ``value`` through an op that commutes with rounding, reading no other floating tensor.

    A fused norm's result may pass through such an op on its way to a low reader: relu(round(y)) is
    what the cast form's round(relu(y)) gives, and so is relu's backward.  The op registry says which
    ops are exact under rounding, forward and backward (:func:`~amp_fx.ir.op_properties.exact_under_rounding_at`;
    not relu6/clamp, whose backward masks at a bound rounding can cross, nor expand/gathers, whose
    backward sums).  Max pooling passes too, as it always did (``routes``: test_fused_through_relu_and_max_pool),
    though a tie that rounding makes can route a window's gradient to another element.
    """
    if not op_properties.exact_under_rounding_at(user, routes=True):
        return False
    if user.meta.get(meta.DECISION, "follow") != "follow":
        return False
    if user.meta.get(meta.INPLACE) or not user.args or user.args[0] is not value:
        return False
    if user.op == "call_module":
        module = gm.get_submodule(str(user.target))
        if any(True for _ in (*module.parameters(), *module.buffers())):
            return False
    elif user.op not in ("call_function", "call_method"):
        return False
    return not any(n is not value and values.get(n) is not None and values[n].is_float is not False for n in node_inputs(user))


def _read_low(value: fx.Node, low: torch.dtype, ctx: PassContext, values: dict, gm: fx.GraphModule) -> bool:
    """Every reader of ``value`` takes it in ``low``: a ``low`` op, a shape query, or a view or exact op
    (relu, max pooling) whose readers do."""
    for user in value.users:
        decision = user.meta.get(meta.DECISION, "follow")
        if decision == "low" and input_target(user, decision, ctx.low, values) == low:
            continue
        info = values.get(user)
        if info is not None and info.is_tensor is False and not info.container and user.op != "output":
            continue  # x.size(), x.shape: no arithmetic on the values
        if _passes_through(user, value, gm, values) and _read_low(user, low, ctx, values, gm):
            continue
        return False
    return True


@amp_pass(kind="rewrite", requires=("meta", "paint", "dtypes"), ensures=("dtypes",))
def fuse_precision(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Mark fp32 norms whose fused mixed-dtype kernel keeps their precision (see module docstring)."""
    graph = gm.graph
    if any(node.meta.get(meta.INSERTED) for node in graph.nodes):
        return PassResult(gm, False, {"skipped": "the graph already has its casts (fuse_precision runs before insert_casts)"})
    # Decide afresh: a mark left by an earlier run is not evidence.
    stale = [node for node in graph.nodes if node.meta.pop(meta.FUSED, None)]
    # The stored analysis (the runner's: "dtypes" is required) saw those marks: without them, decide on the
    # analysis of the graph as it now is (computed, not stored; the runner stores the final one).
    values = analyse(gm, ctx).values if stale else {n: meta.value_of(n) for n in graph.nodes}
    enabled = getattr(ctx.config, "fuse_precision", True)
    fused: list[str] = []
    retargeted = False
    for node in graph.nodes:
        low = _fusable(gm, node, ctx, values) if enabled else None
        precise_layer_norm = _retargetable(node)
        if precise_layer_norm:
            retargeted |= _retarget(node, low is not None)
        if low is None:
            continue
        name = str(low).replace("torch.", "")
        if precise_layer_norm:
            node.meta[meta.FUSED] = _AFFINE_LAYER_NORM if _has_affine(gm, node) else _PLAIN_LAYER_NORM
        else:
            node.meta[meta.FUSED] = op_properties.of(node.meta[meta.OP]).fused_form.description
        reason = node.meta.get(meta.REASON, "fp32").split("; fused")[0]  # an earlier run's words are not kept twice
        node.meta[meta.REASON] = (f"{reason}; fused ({node.meta[meta.FUSED]}): computes in fp32 from its {name} input and fp32 weights, "
                                  f"rounding once to {name} as the cast back would (no casts)")
        fused.append(node.name)
    # Readers see the low result: the runner analyses again ("dtypes" is ensured) when the marks changed.
    repainted = {node.name for node in stale} != set(fused)
    if not enabled:
        return PassResult(gm, retargeted, {"fused": 0, "skipped": "fuse_precision=False"}, repainted=repainted)
    stats = {"fused": len(fused)}
    if fused:
        stats["report_lines"] = [f"{len(fused)} fp32 norm(s) fused (low input, fp32 weights, no casts): {', '.join(fused[:8])}"
                                 + (f" and {len(fused) - 8} more" if len(fused) > 8 else "")]
    # Marks and reasons are metadata: the code changes here only where an affine layer_norm call is
    # retargeted (or reverted); otherwise only when insert_casts writes (fewer) casts.
    return PassResult(gm, retargeted, stats, repainted=repainted)
