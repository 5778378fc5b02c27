"""amp_fx: automatic mixed precision for PyTorch as a torch.fx graph rewrite.

``amp_fx.convert(model, level="O1")`` traces the model, decides each node's
precision from allow / deny / promote tables, inserts explicit casts, and
returns a GraphModule with a report of every decision.
"""

from amp_fx import _moved
from amp_fx.core.api import convert
from amp_fx.dynamo.backend import AmpBackend, backend, last_report
from amp_fx.core.config import AmpConfig, LEVELS
from amp_fx.errors import (AlreadyConvertedError, AmpError, AmpIndexError, AmpKeyError, AmpNotImplementedError,
                           AmpRuntimeError, AmpTypeError, AmpValueError, BannedOpError, UnknownOpError)
from amp_fx.core.graph_module import AmpGraphModule
from amp_fx.core.policy import Policy
from amp_fx.core.report import ConversionReport, NodeRecord
from amp_fx.frontend.tracing import AmpTraceError

# Public names that live in modules with heavier imports (networkx, Dynamo,
# the runtime): loaded on first use, so ``import amp_fx`` stays light.
_LAZY = {
    # runtime (amp_fx/runtime)
    "LossScaler": "amp_fx.runtime",
    "MasterWeightOptimizer": "amp_fx.runtime",
    "LowPrecisionOptimizer": "amp_fx.runtime",
    # Apex-style API
    "initialize": "amp_fx.apex.amp",
    "scale_loss": "amp_fx.apex.amp",
    "state_dict": "amp_fx.apex.amp",
    "load_state_dict": "amp_fx.apex.amp",
    "master_params": "amp_fx.apex.amp",
    "loss_scalers": "amp_fx.apex.amp",
    # views and debugging tools
    "diff": "amp_fx.inspection.views",
    "to_networkx": "amp_fx.inspection.views",
    "draw": "amp_fx.inspection.views",
    "summary": "amp_fx.inspection.views",
    "find_overflow": "amp_fx.inspection.find_overflow",
    "calibrate": "amp_fx.inspection.calibration",
    # torch.compile backend: Dynamo skipped or broke a model's frames, nothing converted
    "NothingConvertedWarning": "amp_fx.dynamo.watch",
    # cache_casts=True: drop cached weight casts after a write through p.data
    "clear_cast_cache": "amp_fx.core.cast_cache",
    # errors and warnings docs/refusals.md and docs/training.md name as amp_fx.X
    "AlreadyInitializedError": "amp_fx.apex.amp",
    "LossScalerStateError": "amp_fx.runtime.scaler_state",
    "EpsUnderflowWarning": "amp_fx.runtime.optimizer_checks",
}


# Subpackages reachable after ``import amp_fx`` alone, as the README spells them
# (``amp_fx.runtime.convert_for_sharding``): each is imported on first access.
_SUBPACKAGES = frozenset({"apex", "core", "dynamo", "frontend", "inspection", "passes", "runtime"})


def __getattr__(name: str):
    if name in _SUBPACKAGES:
        import importlib

        return importlib.import_module(f"amp_fx.{name}")  # the import binds it here: asked once
    module_name = _LAZY.get(name)
    if module_name is None and f"amp_fx.{name}" in _moved.MOVED:  # amp_fx.config without an import, as in 0.1
        import importlib

        return importlib.import_module(f"amp_fx.{name}")
    if module_name is None:
        raise AttributeError(f"module 'amp_fx' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


_moved.install()  # old flat module paths (amp_fx.casts, amp_fx.views, ...) still import, with a warning

__all__ = [*_LAZY,
    "AmpBackend",
    "backend",
    "last_report",
    "convert",
    "AmpConfig",
    "LEVELS",
    "Policy",
    "AmpGraphModule",
    "ConversionReport",
    "NodeRecord",
    "AmpError",
    "AmpValueError",
    "AmpTypeError",
    "AmpRuntimeError",
    "AmpKeyError",
    "AmpIndexError",
    "AmpNotImplementedError",
    "AmpTraceError",
    "BannedOpError",
    "UnknownOpError",
    "AlreadyConvertedError",
]
