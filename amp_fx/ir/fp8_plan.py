"""``fp8="auto"``'s plan for one graph: which GEMMs are first / last, a calibration run, and each GEMM's :class:`Choice`.

``fp8_gemms`` calls :func:`plan_auto` once, before it rewrites anything, with
the fp8-capable GEMMs of the graph.  Here:

- **structure**: a GEMM is *last* when a graph output is reached from it
  through no other GEMM with a parameter operand (the head feeding the
  logits / the loss), *first* when no such GEMM is upstream of it;
- **calibration**: the graph, as the earlier passes left it (casts and all),
  runs once on the conversion's ``example_inputs`` without gradients, and
  :mod:`amp_fx.ir.fp8_sensitivity` measures each GEMM's high-precision
  operands under each recipe -- the values its fp8 GEMM would quantize;
- **choice**: :func:`amp_fx.ir.fp8_choice.choose` per GEMM, with M
  ``Fp8Config.tokens``, else the traced rows, else (a dynamic M, as
  torch.export traces Hugging Face models) the rows the calibration saw.

Without example inputs there are no shapes and no values, so no decision:
``recipe="auto"`` is refused with an :class:`~amp_fx.errors.AmpValueError`
naming ``example_inputs``.  A torch.compile backend gets fake inputs: refused too.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.fx as fx

from amp_fx.errors import PACKAGE, AmpNotImplementedError, AmpValueError
from amp_fx.ir import meta
from amp_fx.ir.cast_nodes import cast_source, is_inserted_cast
from amp_fx.ir.fp8_choice import Choice, choose, structural_rule
from amp_fx.ir.fp8_sensitivity import Fp8Sensitivity, capture_sensitivity
from amp_fx.ir.pass_manager import PassContext

__all__ = ["plan_auto", "high_precision", "is_weight"]


def high_precision(value: Any) -> Any:
    """The value an fp8 GEMM quantizes: the source of a cast ``insert_casts`` wrote for it, else the value."""
    if isinstance(value, fx.Node) and is_inserted_cast(value) and cast_source(value) is not None:
        return cast_source(value)
    return value


def is_weight(value: Any) -> bool:
    """A 2-D parameter (or buffer), possibly through its inserted cast."""
    source = high_precision(value)
    shape = meta.shape(value)
    return isinstance(source, fx.Node) and meta.PARAM.get(source) is not None and shape is not None and len(shape) == 2


def _reaches(start: fx.Node, stops: set, forward: bool) -> bool:
    """Whether a walk from ``start`` (users if ``forward``, else inputs) meets an output (forward) or a stop (back)."""
    seen, todo = {start}, [start]
    while todo:
        node = todo.pop()
        for nxt in (node.users if forward else node.all_input_nodes):
            if nxt in seen:
                continue
            seen.add(nxt)
            if forward and nxt.op == "output":
                return True
            if nxt in stops:
                if not forward:
                    return True
                continue  # forward: another GEMM stands between
            todo.append(nxt)
    return False


def _placeholder_values(gm: fx.GraphModule, ctx: PassContext) -> list:
    """One value per placeholder: the positional example inputs, then keyword ones by name, then defaults."""
    positional = list(ctx.example_inputs or ())
    keywords = dict(ctx.example_kwarg_inputs or {})
    values = []
    for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        name = str(node.target).lstrip("*")
        if i < len(positional):
            values.append(positional[i])
        elif name in keywords:
            values.append(keywords[name])
        else:
            values.append(node.args[0] if node.args else None)
    return values


def _refuse_without_inputs(ctx: PassContext) -> None:
    if ctx.route == "dynamo":
        raise AmpNotImplementedError(
            "fp8 recipe='auto' calibrates on real example inputs, which a torch.compile backend does not get: "
            f"convert first, gm = {PACKAGE}.convert(model, 'O1', example_inputs=(x,), fp8='auto'), and compile gm; "
            "or pass a recipe ('tensorwise', 'rowwise', 'rowwise_with_gw_hp') to the backend")
    if not ctx.example_inputs and not ctx.example_kwarg_inputs:
        raise AmpValueError(
            "fp8 recipe='auto' chooses each GEMM's format from its M, K, N and a calibration on example inputs, "
            f"and got none: pass example_inputs=(x,) (or example_kwarg_inputs=) to {PACKAGE}.convert; without "
            "them pick a recipe yourself (fp8='tensorwise', 'rowwise' or 'rowwise_with_gw_hp')")


def plan_auto(gm: fx.GraphModule, ctx: PassContext, gemms: list) -> dict[fx.Node, Choice]:
    """Each weighted GEMM's :class:`Choice` under the conversion's auto :class:`Fp8Config`; ``gemms`` are the fp8 pass's GEMM records."""
    _refuse_without_inputs(ctx)
    config = ctx.config.fp8
    weighted = [g for g in gemms if is_weight(g.weight)]
    stops = {g.node for g in weighted}
    targets = {g.node: (high_precision(g.act), high_precision(g.weight), g.layout == "NK") for g in weighted}
    try:
        measured = capture_sensitivity(gm, targets, _placeholder_values(gm, ctx))
    except Exception as exc:  # noqa: BLE001 -- any failure of the run is the user's to see, with the way out
        raise AmpValueError(
            f"fp8 recipe='auto' could not run the graph on example_inputs to calibrate ({type(exc).__name__}: "
            f"{exc}); check the example inputs match the model, or pick a recipe (fp8='tensorwise')") from exc
    plan = {}
    for gemm in weighted:
        node = gemm.node
        sensitivity: Optional[Fp8Sensitivity] = measured.get(node.name)
        # tokens= first; else the traced rows; else (dynamic shapes: torch.export's symbolic M) the calibration's rows
        M = config.tokens or gemm.M or (sensitivity.rows if sensitivity is not None else None)
        if M is None or not isinstance(gemm.K, int) or not isinstance(gemm.N, int):
            plan[node] = Choice(None, "no_shape", "M, K or N unknown from the example inputs: no prediction")
            continue
        if sensitivity is None:
            plan[node] = Choice(None, "not_measured", "the calibration run did not reach it: no measured error")
            continue
        structural = structural_rule(first=not _reaches(node, stops - {node}, forward=False),
                                     last=_reaches(node, stops - {node}, forward=True),
                                     module_path=meta.MODULE_PATH.get(node) or node.name, N=gemm.N, K=gemm.K,
                                     config=config)
        errors = {recipe: sensitivity.of(recipe) for recipe in sensitivity.errors}
        choice = choose(M, gemm.K, gemm.N, errors, config.profile, config, structural)
        choice.calibrated_rows = sensitivity.rows
        choice.operand_errors = sensitivity.errors
        plan[node] = choice
    return plan
