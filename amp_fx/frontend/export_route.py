"""Trace a model with ``torch.export`` for ``convert()``: constants bound, caches off, batch and sequence dynamic.

What a user passes as example keyword inputs is split in two:

- tensors become the graph's inputs;
- everything else (``use_cache=False``, ``return_dict=True``, ``output_attentions=False``)
  is a *constant*: bound into the traced forward, so the converted module
  neither needs nor accepts it again.

Hugging Face models build a key/value cache by default, which torch.export
cannot return.  A model whose config has ``use_cache`` and whose forward
takes it is traced with ``use_cache=False`` unless the user said otherwise:
the converted graph is for training and scoring (loss, logits); generation
goes through ``generate`` (see :mod:`amp_fx.frontend.hf`).

Shapes: without ``dynamic_shapes=`` the first dimension of every tensor input
(the batch) and the second dimension of every input that shares a token
input's length (the sequences: an encoder-decoder's ``input_ids`` and
``decoder_input_ids``/``labels`` each have their own) are ``Dim.AUTO``:
dynamic unless the model fixes them, in which case export keeps them static
instead of failing, with a warning and a report note.  :func:`shape_notes`
says which dimensions ended up dynamic.  A call with another size where one
is static raises :class:`~amp_fx.errors.AmpValueError` naming the input, the
dimension and the fix; a ``dynamic_shapes=`` the model contradicts is refused
at conversion (:mod:`amp_fx.frontend.export_shapes`).

Custom ``torch.autograd.Function`` calls stay one node each, forward and
backward the Function's, as on the symbolic route
(:mod:`amp_fx.frontend.opaque_calls`).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import warnings
from typing import Any, Mapping, Optional

import torch
import torch.fx as fx
import torch.nn as nn
from torch.export import Dim

from amp_fx.frontend import export_shapes
from amp_fx.frontend.opaque_calls import keeping_function_calls
from amp_fx.errors import AmpWarning

__all__ = ["split_constants", "default_dynamic_shapes", "export_module", "shape_notes", "StaticShapeWarning"]


class StaticShapeWarning(AmpWarning):
    """torch.export kept static a dimension amp_fx asked to keep dynamic: the converted module takes only that size."""


def _forward_parameters(model: nn.Module) -> tuple[set[str], bool]:
    """(names of forward's parameters, whether it takes **kwargs)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return set(), True
    return set(params), any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def split_constants(model: nn.Module, kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split keyword inputs into (tensors, constants); add ``use_cache=False`` for a model that would build a cache."""
    tensors = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    constants = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
    names, var_kw = _forward_parameters(model)
    config = getattr(model, "config", None)
    if "use_cache" not in kwargs and getattr(config, "use_cache", None) is not None and ("use_cache" in names or var_kw):
        constants["use_cache"] = False
    return tensors, constants


def default_dynamic_shapes(model: nn.Module, args: tuple, kwargs: Mapping[str, torch.Tensor]) -> Optional[dict]:
    """``Dim.AUTO`` for the batch dimension of every tensor and the sequence dimension of token-length inputs.

    The sequence lengths are the second dimensions of the integer tensors
    with two or more dimensions (``input_ids``; an encoder-decoder's
    ``decoder_input_ids`` and ``labels`` too, whatever their length); any
    input with one of those sizes there (``attention_mask``,
    ``inputs_embeds``) gets it too.  Each ``Dim.AUTO`` is its own size:
    torch.export ties two only where the model requires it.
    Returns torch.export's ``dynamic_shapes`` keyed by forward's argument
    names, or None when there is no tensor input.
    """
    tensors = [v for v in list(args) + list(kwargs.values()) if isinstance(v, torch.Tensor)]
    if not tensors:
        return None
    lengths = {t.shape[1] for t in tensors if t.dim() >= 2 and not t.is_floating_point() and not t.is_complex()}
    batch = tensors[0].shape[0] if tensors[0].dim() else None

    def spec(value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return None
        dims = {}
        if value.shape[0] == batch:
            dims[0] = Dim.AUTO
        if value.dim() >= 2 and value.shape[1] in lengths:
            dims[1] = Dim.AUTO
        return dims or None

    try:
        positional = [name for name, p in inspect.signature(model.forward).parameters.items()
                      if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        positional = []
    if len(positional) < len(args):
        return None  # *args forward: leave shapes static rather than guess the names
    shapes = {positional[i]: spec(a) for i, a in enumerate(args)}
    shapes.update({k: spec(v) for k, v in kwargs.items()})
    return shapes


def _bound(model: nn.Module, constants: Mapping[str, Any], tensors: Mapping[str, Any] = ()) -> nn.Module:
    """A shallow copy of ``model`` whose forward supplies ``constants`` itself and names every keyword input.

    The copy shares the model's submodules, parameters and buffers (the same
    dicts), so export names every weight exactly as the model does; the
    model itself is not touched.  A keyword input that forward takes through
    ``**kwargs`` (peft's ``PeftModel.forward(*args, **kwargs)``) becomes a
    keyword-only parameter of the copy's signature: torch.export matches
    ``dynamic_shapes`` against forward's named parameters, and cannot match
    them inside ``**kwargs``.
    """
    forward = model.forward
    try:
        signature: Optional[inspect.Signature] = inspect.signature(forward)
    except (TypeError, ValueError):
        signature = None
    extra: list[str] = []
    if signature is not None:
        params = signature.parameters
        var_kw = [p for p in params.values() if p.kind is inspect.Parameter.VAR_KEYWORD]
        extra = [name for name in tensors if name not in params] if var_kw else []
        kept = [p for name, p in params.items() if name not in constants and p.kind is not inspect.Parameter.VAR_KEYWORD]
        kept += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY) for name in extra]
        kept += [p for p in var_kw if not extra]  # the named ones replace **kwargs: export sees no other inputs
        signature = signature.replace(parameters=kept)
    if not constants and not extra:
        return model

    def forward_with_constants(*args: Any, **kwargs: Any) -> Any:
        return forward(*args, **kwargs, **constants)

    if signature is not None:
        forward_with_constants.__signature__ = signature  # type: ignore[attr-defined]
    bound = copy.copy(model)
    object.__setattr__(bound, "forward", forward_with_constants)
    return bound


@contextlib.contextmanager
def _keeping_dynamo_marks(inputs: list) -> Any:
    """Put back the Dynamo dimension marks export sets on its input tensors (the user's own, where contiguous).

    torch.export marks every dynamic dimension on the example inputs (``_dynamo_weak_dynamic_indices``...) and
    leaves the marks there, succeed or fail: a later ``torch.compile`` called with the same tensor then
    traces those dimensions as symbols from its first call and captures other graphs (issue 42).
    """
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    before = [{k: copy.copy(v) for k, v in vars(t).items() if k.startswith(_MARKS)} for t in tensors]
    try:
        yield
    finally:
        for tensor, marks in zip(tensors, before):
            for key in [k for k in vars(tensor) if k.startswith(_MARKS)]:
                delattr(tensor, key)
            for key, value in marks.items():
                setattr(tensor, key, value)


_MARKS = ("_dynamo_", "_has_dynamo_")  # the prefixes of torch._dynamo.mark_dynamic's (and its kin's) attributes


def export_module(model: nn.Module, args: tuple, kwargs: Mapping[str, Any],
                  dynamic_shapes: Any = None) -> tuple[fx.GraphModule, dict[str, Any], list[str]]:
    """Export ``model`` (non-strict) and return (the unlifted GraphModule, the constants bound, notes for the report).

    ``dynamic_shapes`` is torch.export's own argument, for the *tensor* inputs
    (``{"input_ids": {0: Dim("batch"), 1: Dim("seq")}}``); None picks the
    defaults described in the module docstring, ``False`` keeps every shape static.
    """
    tensors, constants = split_constants(model, kwargs)
    # a sliced example (ids[:2, :7]) would make export specialise on its strides and fail on views
    args = tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    bound = _bound(model, constants, tensors)
    if dynamic_shapes is None:
        shapes = default_dynamic_shapes(bound, args, tensors)
    elif dynamic_shapes is False:
        shapes = None
    else:
        shapes = dynamic_shapes
        if isinstance(shapes, Mapping) and not args:
            shapes = {k: v for k, v in shapes.items() if k in tensors}
    try:
        # custom autograd Functions stay one node each, forward and backward theirs (amp_fx/frontend/opaque_calls.py)
        with keeping_function_calls() as function_calls, _keeping_dynamo_marks([*args, *tensors.values()]):
            exported = torch.export.export(bound, tuple(args), tensors, dynamic_shapes=shapes, strict=False)
    except Exception as error:  # a dynamic_shapes= the model contradicts is refused naming the dimensions
        export_shapes.refuse_constraint_violation(error, shapes, type(model).__name__)
        raise
    notes = []
    if constants:
        notes.append("constants of the traced forward (not inputs of the converted module): "
                     + ", ".join(f"{k}={v!r}" for k, v in constants.items()))
    fixed_at = {(d.input, d.dim): d.reason for d in export_shapes.dimensions(_user_input_values(exported),
                                                                            exported.range_constraints) if d.reason}
    warned = _warn_specialised(exported, shapes, fixed_at) if dynamic_shapes is None and shapes else []
    notes.extend(warned)
    notes.extend(shape_notes(exported, explained=bool(warned)))
    unlifted = exported.module()
    function_calls.restore(unlifted)  # each Function call one node again, calling its real apply
    # a call with another size where export specialised one raises AmpValueError naming it, not a bare AssertionError
    export_shapes.explain_guard_failures(unlifted, _user_input_values(exported),
                                         export_shapes.requested_dims(shapes), fixed_at)
    return unlifted, constants, notes


def _user_input_values(exported: Any) -> dict[str, Any]:
    """Each user input's name and its example value in the exported program."""
    values = {}
    placeholders = {n.name: n for n in exported.graph.nodes if n.op == "placeholder"}
    for spec in exported.graph_signature.input_specs:
        if spec.kind.name == "USER_INPUT" and getattr(spec.arg, "name", None) in placeholders:
            values[spec.arg.name] = placeholders[spec.arg.name].meta.get("val")
    return values


def _warn_specialised(exported: Any, shapes: Mapping[str, Any], fixed_at: Optional[Mapping] = None) -> list[str]:
    """Warn when a dimension amp_fx asked to keep dynamic came out static (a size-1 batch, a model that fixes it); return the report note."""
    values = _user_input_values(exported)
    fixed = []
    by_reason: dict[str, list[str]] = {}  # why export fixed them (the line it gives), when it says
    for name, dims in shapes.items():
        value = values.get(name)
        if not dims or not isinstance(value, torch.Tensor):
            continue
        for d in dims:
            if export_shapes.static_size(value.shape[d]) is not None:
                fixed.append(f"{name}.shape[{d}] == {export_shapes.static_size(value.shape[d])}")
                if (fixed_at or {}).get((name, d)):
                    by_reason.setdefault(fixed_at[(name, d)], []).append(f"{name}.shape[{d}]")
    if not fixed:
        return []
    why = "".join(f" torch.export fixed {', '.join(names)} {reason}." for reason, names in by_reason.items())
    message = (
        f"torch.export kept {', '.join(fixed)} static: the converted module only accepts that size there.{why} "
        "A size of 1 is always specialised (give an example with batch and sequence length of 2 or more); "
        "otherwise the model fixes the size, or pass dynamic_shapes= to say what should vary."
    )
    warnings.warn(message, StaticShapeWarning, stacklevel=4)
    return [message]


def shape_notes(exported: Any, explained: bool = False) -> list[str]:
    """Say which input dimensions the exported program keeps dynamic (its range constraints) and why others are fixed.

    ``explained``: the specialisation warning already said why (no second note).
    """
    return export_shapes.shape_notes(_user_input_values(exported), exported.range_constraints, reasons=not explained)
