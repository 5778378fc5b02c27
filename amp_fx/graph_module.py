"""AmpGraphModule: the GraphModule that ``convert()`` returns.

It is an ordinary ``torch.fx.GraphModule`` with three additions:

- It runs with autocast disabled when an outer ``torch.autocast`` region is
  active, so ops are never cast twice (the graph already holds its casts).
- At O2/O3, ``state_dict()`` hands back the model's own dtypes (fp32), and
  ``load_state_dict()`` accepts them, so checkpoints move freely between the
  fp32 model and its converted forms.
- It keeps ``amp_report`` / ``amp_config`` (and ``amp_fx_masters`` at O2)
  across ``copy.deepcopy`` and pickling.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
import torch.fx as fx

__all__ = ["AmpGraphModule", "AMP_ATTRIBUTES"]

# Attributes that describe a conversion; carried through deepcopy and pickle.
AMP_ATTRIBUTES = ("amp_report", "amp_config", "amp_fx_masters", "amp_fx_source_dtypes")
_AUTOCAST_DEVICES = ("cpu", "cuda")


def _restore_source_dtypes(module: torch.nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """state_dict hook: report each low-precision tensor in the dtype the original model had."""
    for name, dtype in getattr(module, "amp_fx_source_dtypes", {}).items():
        key = prefix + name
        if key in state_dict and state_dict[key].dtype != dtype:
            state_dict[key] = state_dict[key].to(dtype)


def _rebuild(reduce_fn: Any, reduce_args: tuple, class_name: str) -> "AmpGraphModule":
    plain = reduce_fn(*reduce_args)
    rebuilt = AmpGraphModule(plain, plain.graph, class_name)
    for name in AMP_ATTRIBUTES:
        if name in reduce_args[0]:
            setattr(rebuilt, name, reduce_args[0][name])
    return rebuilt


class AmpGraphModule(fx.GraphModule):
    """A converted model: a GraphModule with explicit casts (see module docstring)."""

    def __init__(self, root: Any, graph: fx.Graph, class_name: str = "AmpGraphModule"):
        super().__init__(root, graph, class_name)
        self._register_state_dict_hook(_restore_source_dtypes)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        active = [d for d in _AUTOCAST_DEVICES if torch.is_autocast_enabled(d)]
        if not active:
            return super().__call__(*args, **kwargs)
        # The graph already casts explicitly: an outer autocast would cast again.
        with contextlib.ExitStack() as stack:
            for device in active:
                stack.enter_context(torch.autocast(device, enabled=False))
            return super().__call__(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> "AmpGraphModule":
        result = super().__deepcopy__(memo)
        for name in AMP_ATTRIBUTES:
            if name in self.__dict__:
                setattr(result, name, copy.deepcopy(self.__dict__[name], memo))
        return result

    def __reduce__(self) -> tuple:
        reduce_fn, reduce_args = super().__reduce__()
        return (_rebuild, (reduce_fn, reduce_args, type(self).__name__))
