"""The face every amp_fx optimizer wrapper shows: the wrapped optimizer's own groups, state and hooks.

:class:`~amp_fx.runtime.MasterWeightOptimizer` and
:class:`~amp_fx.runtime.LowPrecisionOptimizer` step something other than the
module's parameters, but to LR schedulers, ``zero_grad`` callers and step
hooks they must look like the optimizer they wrap.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from amp_fx.errors import AmpTypeError

__all__ = ["WrappedOptimizer"]

_HOOKS = (
    "_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks",
)


def check_inner_optimizer(optimizer: Any, wrapper: str) -> None:
    """Refuse anything but a torch optimizer (an object with ``param_groups`` and ``step``) as ``wrapper``'s inner optimizer."""
    if not (hasattr(optimizer, "param_groups") and callable(getattr(optimizer, "step", None))):
        raise AmpTypeError(
            f"{wrapper} wraps a torch optimizer, got {type(optimizer).__name__}: build one over the model's "
            f"parameters first, e.g. {wrapper}(torch.optim.AdamW(model.parameters()), converted).")


class WrappedOptimizer(torch.optim.Optimizer):
    """An Optimizer whose ``param_groups``, ``state`` and ``defaults`` are those of ``self.optimizer``.

    Deliberately no ``Optimizer.__init__``: it would build groups and state of
    its own, while these must be the wrapped optimizer's objects (so an LR
    scheduler built over either drives the real learning rates).
    Subclasses set ``self.optimizer`` and then call :meth:`_init_face`.
    """

    optimizer: torch.optim.Optimizer

    def _init_face(self) -> None:
        """Give this wrapper the hook tables and the step patching of any Optimizer."""
        for hooks in _HOOKS:
            setattr(self, hooks, OrderedDict())
        self._patch_step_function()  # step hooks and profiling, as any Optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__.copy()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
