"""amp_fx: automatic mixed precision for PyTorch as a torch.fx graph rewrite.

``amp_fx.convert(model, level="O1")`` traces the model, decides each node's
precision from allow / deny / promote tables, inserts explicit casts, and
returns a GraphModule with a report of every decision.
"""

from amp_fx.api import convert
# Imported eagerly: ``amp_fx.backend`` names both this function and its
# module, and importing the module later must not rebind the package name.
from amp_fx.backend import backend, last_report
from amp_fx.config import AmpConfig, LEVELS
from amp_fx.errors import AlreadyConvertedError, AmpError, BannedOpError, UnknownOpError
from amp_fx.graph_module import AmpGraphModule
from amp_fx.policy import Policy
from amp_fx.report import ConversionReport, NodeRecord
from amp_fx.tracing import AmpTraceError

# Public names that live in modules with heavier imports (networkx, Dynamo,
# the runtime): loaded on first use, so ``import amp_fx`` stays light.
_LAZY = {
    # runtime (amp_fx/runtime)
    "LossScaler": "amp_fx.runtime",
    "MasterWeightOptimizer": "amp_fx.runtime",
    "LowPrecisionOptimizer": "amp_fx.runtime",
    # Apex-style API
    "initialize": "amp_fx.apex",
    "scale_loss": "amp_fx.apex",
    "state_dict": "amp_fx.apex",
    "load_state_dict": "amp_fx.apex",
    "master_params": "amp_fx.apex",
    "loss_scalers": "amp_fx.apex",
    # views and debugging tools
    "diff": "amp_fx.views",
    "to_networkx": "amp_fx.views",
    "draw": "amp_fx.views",
    "summary": "amp_fx.views",
    "find_overflow": "amp_fx.overflow",
    "calibrate": "amp_fx.calibration",
}


def __getattr__(name: str):
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'amp_fx' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


__all__ = [*_LAZY,
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
    "AmpTraceError",
    "BannedOpError",
    "UnknownOpError",
    "AlreadyConvertedError",
]
