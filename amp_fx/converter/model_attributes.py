"""What a converted module answers for an attribute only the original model has.

A converted module is a GraphModule: it runs ``forward`` and holds the model's
parameters, buffers and submodules, not the rest of its Python interface.  Code
around the model reads more (a LightningModule's ``self.model.hidden_size``,
``self.model.encode(x)``), and a plain ``AttributeError: 'Net' object has no
attribute 'encode'`` does not say why.  Here:

* a plain value of the model (a number, string, bool, None, or a tuple/list/dict
  of those; a ``config`` object), also one a property computes (diffusers'
  ``config``), is read from the model: it computes nothing, so no precision is
  at stake;
* a method (``generate()``, ``save_pretrained``) is the model's own, bound to a
  copy of the model captured from the call on the converted module's
  parameters (:mod:`amp_fx.converter.call_capture`): where it calls
  ``self(...)`` that call runs mixed precision, and its own ops are decided
  as the code between captured graphs is;
* a tensor that is no parameter or buffer, a submodule, or another property is
  refused with an :class:`~amp_fx.errors.AmpAttributeError` that says what the
  converted module runs and how to reach the rest.
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping

import torch
import torch.nn as nn

from amp_fx.converter.live_hooks import RECIPE_ATTR
from amp_fx.errors import PACKAGE, AmpAttributeError

# The captured route (converter/call_capture.py) puts ``call_route`` and ``method_of`` here when it is imported:
# it builds on graph_module, which reads attributes through this module, so neither may import it back.
captured_routes: dict[str, Any] = {}

__all__ = ["model_attribute"]

_PLAIN = (int, float, str, bool, type(None))
_ABSENT = object()


def _plain(value: Any) -> bool:
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, _PLAIN) and _plain(v) for k, v in value.items())
    return False


def _config_like(value: Any) -> bool:
    # A model's configuration object (transformers' PretrainedConfig and the like): data, no computation.
    return type(value).__name__.endswith("Config") and not isinstance(value, (nn.Module, torch.Tensor))


def _missing(module: nn.Module, name: str) -> AttributeError:
    return AttributeError(f"{type(module).__name__!r} object has no attribute {name!r}")


def model_attribute(module: nn.Module, name: str) -> Any:
    """``name`` read from the original model where that is safe, else an AmpAttributeError naming the fix.

    Called after nn.Module found no ``name``: a name the model lacks too (or a private one: the model's
    internals, and torch's own probes) gets the plain AttributeError.
    """
    recipe = module.__dict__.get(RECIPE_ATTR)
    model = getattr(recipe, "model", None)
    if model is None or name.startswith("_"):
        raise _missing(module, name)
    static = inspect.getattr_static(model, name, _ABSENT)
    if static is _ABSENT:
        raise _missing(module, name)
    kind = type(model).__name__
    if isinstance(static, property):  # a library reads it (diffusers' config): a plain value is safe to hand out
        value = getattr(model, name)
        if _plain(value) or _config_like(value) or isinstance(value, Mapping) and _plain(dict(value)):
            return value
    elif callable(static) and not isinstance(static, (staticmethod, classmethod)):
        # A method (generate(), encode()): the model's own, bound to a captured copy of the model on this module's
        # parameters, so the ``self(...)`` it calls runs mixed precision (converter/call_capture.py).
        return captured_routes["method_of"](module, name)
    if callable(static) or isinstance(static, (staticmethod, classmethod, property)):
        what = f"{name!r} is a method of {kind}" if not isinstance(static, property) else f"{name!r} is a property of {kind}"
        raise AmpAttributeError(
            f"{PACKAGE}: {what}, and the converted module runs forward only (it is a GraphModule holding {kind}'s "
            f"parameters, buffers and submodules). Calling the model's own {name} would run its unconverted fp32 "
            f"code. Convert a module whose forward calls {name} (wrap it: class Encode(nn.Module): def forward(self, "
            f"x): return model.{name}(x)), or call it on the original model when full precision is what you want.")
    value = getattr(model, name)
    if _plain(value) or _config_like(value):
        return value
    raise AmpAttributeError(
        f"{PACKAGE}: {kind}.{name} ({type(value).__name__}) is not part of the converted module (only forward's "
        f"parameters, buffers and submodules are); reading the model's own would bypass the conversion. Read it from "
        f"the original model, or make it a parameter or buffer of the module you convert.")
