"""Keep a Hugging Face model's interface on its converted module: config, generation, save_pretrained.

``convert(model, example_kwarg_inputs={"input_ids": ids, "labels": ids})``
traces a transformers model with torch.export (:mod:`amp_fx.frontend.export_route`),
without a key/value cache.  The converted module is for training and
scoring; :func:`attach_interface` gives it what code around a transformers
model reads:

- ``config`` and ``generation_config``: copies of the model's (editing them
  never touches the model), ``main_input_name``, ``name_or_path``;
- ``generate(...)``: the model's own ``generate`` (its cache, its decoding
  strategies), run under ``torch.autocast`` at the conversion's low dtype
  with the converted module's *current* weights.  At O0/O1 those are the
  model's own parameters; at O2/O3 they are copied (in fp32) into a private
  copy of the model before each call;
- ``save_pretrained(directory)``: writes the converted module's weights in
  the model's own dtypes (fp32; at O2 the fp32 masters while they are
  current), with ``config`` and ``generation_config``,
  so ``from_pretrained`` loads them into the unconverted class;
- ``can_generate()``.

These are instance attributes: ``copy.deepcopy`` and pickling keep the
graph and weights but not this interface; save with ``save_pretrained``.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import types
from typing import Any, Iterator, Mapping

import torch
import torch.nn as nn

from amp_fx.ir.devices import device_type_of

__all__ = ["is_transformers_model", "attach_interface", "untraceable_hint"]

_ATTRIBUTE = "_amp_fx_hf"


def is_transformers_model(model: Any) -> bool:
    """True for a ``transformers.PreTrainedModel`` (without importing transformers when it is not loaded)."""
    transformers = sys.modules.get("transformers")
    base = getattr(transformers, "PreTrainedModel", None) if transformers is not None else None
    return base is not None and isinstance(model, base)


class _Held:
    """The wrapped model, kept out of the module tree (no submodule, no state_dict entries)."""

    __slots__ = ("model", "fp32_copy", "constants", "dtypes")

    def __init__(self, model: nn.Module, constants: Mapping[str, Any]):
        self.model = model
        self.fp32_copy = None
        self.constants = dict(constants)
        # the model's own dtypes, read before any conversion casts its (copied) weights
        self.dtypes = {name: t.dtype for name, t in model.state_dict().items()}


def _held(module: nn.Module) -> _Held:
    return module.__dict__[_ATTRIBUTE]


def _shares_parameters(module: nn.Module, model: nn.Module) -> bool:
    ours = dict(module.named_parameters(remove_duplicate=False))
    return all(ours.get(name) is p for name, p in model.named_parameters(remove_duplicate=False) if name in ours)


def _model_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The converted module's weights under the model's keys, in the model's own dtypes, ties kept.

    At O2 a weight's fp32 master is used while it still rounds to the low
    weight (training went through the master-weight optimizer); otherwise
    the low weight, widened.  Weights shared under two names (GPT-2's
    ``lm_head.weight`` is ``transformer.wte.weight``) stay one tensor, so
    ``save_pretrained`` writes them once.
    """
    held = _held(module)
    originals = dict(module.named_parameters(remove_duplicate=False))
    originals.update(dict(module.named_buffers(remove_duplicate=False)))
    masters = getattr(module, "amp_fx_masters", None) or {}
    converted: dict[int, torch.Tensor] = {}
    state = {}
    for name, value in module.state_dict().items():
        if name not in held.dtypes:
            continue  # constants the trace added; not the model's
        dtype = held.dtypes[name]
        source = originals.get(name)
        key = id(source) if source is not None else id(value)
        if key not in converted:
            master = masters.get(name)
            if master is not None and source is not None and master.dtype == dtype and torch.equal(master.detach().to(source.dtype), source.detach()):
                converted[key] = master.detach()  # O2's fp32 master, still the current weight rounded
            else:
                converted[key] = value.detach().to(dtype) if value.dtype != dtype else value.detach()
        state[name] = converted[key]
    return state


def _current_model(module: nn.Module) -> nn.Module:
    """A transformers model in its own dtypes holding the converted module's current weights."""
    held = _held(module)
    if not getattr(module, "amp_fx_source_dtypes", None) and _shares_parameters(module, held.model):
        return held.model  # O0/O1: the converted module trains the model's own parameters
    if held.fp32_copy is None:
        held.fp32_copy = copy.deepcopy(held.model)
        for name, tensor in list(held.fp32_copy.named_parameters()) + list(held.fp32_copy.named_buffers()):
            dtype = held.dtypes.get(name)
            if dtype is not None and tensor.dtype != dtype:
                tensor.data = tensor.data.to(dtype)
    held.fp32_copy.load_state_dict(_model_state(module), strict=False)
    return held.fp32_copy


@contextlib.contextmanager
def _mode_of(module: nn.Module, model: nn.Module) -> Iterator[None]:
    """Run ``model`` in ``module``'s train/eval mode; restore every flag after."""
    if all(m.training == module.training for m in model.modules()):
        yield
        return
    flags = [(m, m.training) for m in model.modules()]
    model.train(module.training)
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag


def _low_dtype(module: nn.Module) -> Any:
    config = getattr(module, "amp_config", None)
    if config is None or config.level == "O0":
        return None
    return config.low_dtype


def _generate(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The wrapped model's ``generate``, under autocast at the conversion's dtype, with this module's weights."""
    model = _current_model(self)
    if getattr(self, "generation_config", None) is not None and "generation_config" not in kwargs:
        # this module's generation_config, updated by the call's generation arguments (as generate does)
        config = copy.deepcopy(self.generation_config)
        kwargs = {**config.update(**kwargs), "generation_config": config}
    low = _low_dtype(self)
    device = device_type_of(model)
    autocast = torch.autocast(device, dtype=low) if low is not None else contextlib.nullcontext()
    with _mode_of(self, model), autocast:
        return model.generate(*args, **kwargs)


def _save_pretrained(self: nn.Module, save_directory: Any, **kwargs: Any) -> Any:
    """Write this module's weights in the model's own dtypes (fp32), its config and generation config."""
    kwargs.setdefault("state_dict", _model_state(self))
    result = _held(self).model.save_pretrained(save_directory, **kwargs)
    self.config.save_pretrained(save_directory)
    if getattr(self, "generation_config", None) is not None:
        self.generation_config.save_pretrained(save_directory)
    return result


def _can_generate(self: nn.Module) -> bool:
    """Whether the wrapped model can generate."""
    can = getattr(_held(self).model, "can_generate", None)
    return bool(can()) if callable(can) else False


def attach_interface(module: nn.Module, model: nn.Module, constants: Mapping[str, Any] = ()) -> bool:
    """Give ``module`` (converted from ``model``) the transformers interface described above; False if not a transformers model."""
    if not is_transformers_model(model):
        return False
    module.__dict__[_ATTRIBUTE] = _Held(model, dict(constants))
    module.config = copy.deepcopy(model.config)
    generation_config = getattr(model, "generation_config", None)
    module.generation_config = copy.deepcopy(generation_config) if generation_config is not None else None
    module.main_input_name = getattr(model, "main_input_name", "input_ids")
    module.name_or_path = getattr(model, "name_or_path", "")
    module.generate = types.MethodType(_generate, module)
    module.save_pretrained = types.MethodType(_save_pretrained, module)
    module.can_generate = types.MethodType(_can_generate, module)
    return True


def untraceable_hint(model: nn.Module) -> str:
    """The way that works, for a model torch.fx cannot trace without example inputs (empty for most models)."""
    if not is_transformers_model(model):
        return ""
    name = type(model).__name__
    return (
        f"{name} is a Hugging Face transformers model: torch.fx cannot trace its forward (it takes **kwargs and "
        "builds a key/value cache). Give example inputs and amp_fx traces it with torch.export instead, with "
        "batch and sequence length dynamic and the cache off for the trace (generate() is kept):\n"
        f"    amp_fx.convert(model, example_kwarg_inputs={{'input_ids': input_ids, 'labels': input_ids}})\n"
        "or compile it: torch.compile(model, backend='amp_fx').\n"
    )
