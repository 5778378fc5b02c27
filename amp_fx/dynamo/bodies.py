"""Convert the bodies of higher-order ops in a Dynamo graph: checkpointed regions, grad-mode regions, subgraphs.

Dynamo keeps ``torch.utils.checkpoint`` (``tag_activation_checkpoint``),
``torch.compiler.nested_compile_region`` (``invoke_subgraph``), grad-mode
regions (``wrap_with_set_grad_enabled``) and plain ``wrap`` as one node that
calls a body ``GraphModule``.  The body is where the GEMMs are; left alone it
would run entirely in fp32 (HF Llama with gradient checkpointing ran 55 of 58
``mm`` in fp32).  The higher-order op itself must stay, or checkpointing
stops saving memory.

So each body is converted on its own, with the same configuration and
policy, innermost bodies first, and its *interface* is kept as Dynamo
recorded it: every floating input is brought to the dtype the body was
traced with on entry, every floating output back to its recorded dtype on
exit.  The analysis of the body and of the enclosing graph then agree on
every value that crosses the boundary, whichever order they ran in; where
the dtype already matches, ``Tensor.to`` returns its input and costs nothing.
Recomputation under checkpointing replays the converted body, so it is
bitwise equal to the first forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch
import torch.fx as fx

from amp_fx.ir import meta

__all__ = ["BODY_OPS", "RegionCall", "region_calls", "convert_bodies", "describe_region_nodes"]

# Higher-order ops whose body runs exactly as written, once per call: safe to convert.
# (autograd_function_apply is absent on purpose: its backward body must match its forward.)
BODY_OPS = frozenset({"tag_activation_checkpoint", "wrap_with_set_grad_enabled", "invoke_subgraph", "wrap"})


@dataclass
class RegionCall:
    """One call of a higher-order op: the op's name, the body's attribute name, the operands it passes."""

    node: fx.Node
    op: str
    body_name: str
    operands: list[Any]


def _hop_name(node: fx.Node) -> Optional[str]:
    if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
        return None
    return node.target.name()


def region_calls(gm: fx.GraphModule) -> list[RegionCall]:
    """The calls in ``gm`` of the higher-order ops in :data:`BODY_OPS`, in graph order."""
    calls = []
    for node in gm.graph.nodes:
        name = _hop_name(node)
        if name not in BODY_OPS:
            continue
        for index, arg in enumerate(node.args):
            if isinstance(arg, fx.Node) and arg.op == "get_attr" and isinstance(getattr(gm, str(arg.target), None), fx.GraphModule):
                # invoke_subgraph passes an identifier string before its operands.
                operands = [a for a in node.args[index + 1:] if not isinstance(a, str)]
                calls.append(RegionCall(node, name, str(arg.target), operands))
                break
    return calls


def _value(node: fx.Node) -> Any:
    return node.meta.get("example_value", node.meta.get("val"))


def _floating_dtype(value: Any) -> Optional[torch.dtype]:
    return value.dtype if isinstance(value, torch.Tensor) and value.is_floating_point() else None


def _interface_dtypes(body: fx.GraphModule) -> tuple[dict[str, torch.dtype], list[Optional[torch.dtype]]]:
    """The floating dtypes Dynamo recorded for the body's inputs (by name) and outputs (by position)."""
    inputs = {n.name: d for n in body.graph.nodes if n.op == "placeholder" and (d := _floating_dtype(_value(n))) is not None}
    output = next(n for n in body.graph.nodes if n.op == "output")
    results = output.args[0]
    results = list(results) if isinstance(results, (tuple, list)) else [results]
    outputs = [_floating_dtype(_value(v)) if isinstance(v, fx.Node) else None for v in results]
    return inputs, outputs


def _seal_interface(body: fx.GraphModule, inputs: Mapping[str, torch.dtype], outputs: list[Optional[torch.dtype]]) -> tuple[int, int]:
    """Cast the body's floating inputs and outputs to the recorded dtypes; return (entry, exit) casts added."""
    graph = body.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    entries = 0
    anchor = placeholders[-1] if placeholders else None
    for placeholder in placeholders:
        dtype = inputs.get(placeholder.name)
        if dtype is None or not placeholder.users:
            continue
        with graph.inserting_after(anchor):
            cast = graph.call_method("to", (placeholder, dtype))
        cast.meta.update({meta.INSERTED: True, meta.REGION_SEAL: "entry"})
        placeholder.replace_all_uses_with(cast, delete_user_cb=lambda user: user is not cast)
        anchor = cast
        entries += 1
    output = next(n for n in graph.nodes if n.op == "output")
    exits = 0

    def seal(value: Any, dtype: Optional[torch.dtype]) -> Any:
        nonlocal exits
        if not isinstance(value, fx.Node) or dtype is None:
            return value
        with graph.inserting_before(output):
            cast = graph.call_method("to", (value, dtype))
        cast.meta.update({meta.INSERTED: True, meta.REGION_SEAL: "exit"})
        exits += 1
        return cast

    results = output.args[0]
    if isinstance(results, (tuple, list)):
        output.args = (type(results)(seal(v, d) for v, d in zip(results, outputs)),)
    else:
        output.args = (seal(results, outputs[0]),)
    graph.lint()
    body.recompile()
    return entries, exits


def _body_params(body: fx.GraphModule, calls: list[RegionCall], outer_params: Mapping[str, str]) -> dict[str, str]:
    """Name the body's placeholders that receive weights, from the operands every call passes."""
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    names: dict[str, str] = {}
    for position, placeholder in enumerate(placeholders):
        seen = {outer_params.get(c.operands[position].name) if position < len(c.operands) and isinstance(c.operands[position], fx.Node) else None
                for c in calls}
        # A shared body (invoke_subgraph) called with different layers' weights names none of them.
        if len(seen) == 1 and None not in seen:
            names[placeholder.name] = seen.pop()
    return names


# (body, placeholder_params, qualified name) -> (converted body, its report)
ConvertOne = Callable[[fx.GraphModule, dict, str], tuple[fx.GraphModule, Any]]


def convert_bodies(gm: fx.GraphModule, outer_params: Mapping[str, str], convert_one: ConvertOne, prefix: str = "") -> list[tuple[str, str, fx.GraphModule, Any]]:
    """Convert every body that ``gm`` calls through a :data:`BODY_OPS` op, innermost first.

    ``convert_one(body, placeholder_params, name)`` runs the pipeline on one
    body graph and returns it with its report; the body's interface is sealed after
    it (so refresh example values after this function, not in it).  Returns ``(qualified body name, op,
    body, report)`` for each body, in the order converted.  ``gm`` keeps its
    higher-order op nodes; only the bodies change.
    """
    by_body: dict[str, list[RegionCall]] = {}
    for call in region_calls(gm):
        by_body.setdefault(call.body_name, []).append(call)
    done = []
    for body_name, calls in by_body.items():
        body = getattr(gm, body_name)
        if getattr(body, "_amp_fx_body_converted", False):
            continue
        params = _body_params(body, calls, outer_params)
        qualified = f"{prefix}{body_name}"
        done.extend(convert_bodies(body, params, convert_one, prefix=qualified + "."))
        inputs, outputs = _interface_dtypes(body)
        converted, report = convert_one(body, params, qualified)
        if converted is not body:
            setattr(gm, body_name, converted)
            body = converted
        entries, exits = _seal_interface(body, inputs, outputs)
        report.notes.append(
            f"body of {calls[0].op} ({len(calls)} call(s)): inputs and outputs kept at their traced dtypes "
            f"({entries} entry / {exits} exit guards, free where the dtype already matches)"
        )
        body._amp_fx_body_converted = True
        done.append((qualified, calls[0].op, body, report))
    return done


def describe_region_nodes(report: Any) -> int:
    """Say in ``report`` that each higher-order op node was kept whole and its body converted; return how many."""
    count = 0
    for record in report.nodes:
        if record.op in BODY_OPS and not record.inserted:
            record.rule = "region"
            record.reason = f"{record.op} kept whole (its body is converted on its own, interface dtypes kept)"
            count += 1
    return count
