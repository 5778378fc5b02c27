"""amp_fx: automatic mixed precision for PyTorch as a torch.fx graph rewrite.

``amp_fx.convert(model, level="O1")`` traces the model, decides each node's
precision from allow / deny / promote tables, inserts explicit casts, and
returns a GraphModule with a report of every decision.
"""

from amp_fx.converter.api import convert
from amp_fx.dynamo.backend import AmpBackend, backend, last_report
from amp_fx.ir.config import AmpConfig, LEVELS
from amp_fx.errors import (AlreadyConvertedError, AmpAttributeError, AmpError, AmpIndexError, AmpKeyError,
                           AmpNotImplementedError, AmpRuntimeError, AmpTypeError, AmpValueError, AmpWarning, BannedOpError,
                           UnknownOpError)
from amp_fx.converter.graph_module import AmpGraphModule
from amp_fx.ir.policy import Policy
from amp_fx.converter.report import ConversionReport, NodeRecord
from amp_fx.frontend.tracing import AmpTraceError
from amp_fx.converter import call_capture as _call_capture

# convert()'s capture-from-the-call route runs amp_fx's Dynamo backend, a layer above the converter's.
_call_capture.provide_backend(backend)

# Public names that live in modules with heavier imports (networkx, Dynamo,
# the runtime): loaded on first use, so ``import amp_fx`` stays light.
_LAZY = {
    # runtime (amp_fx/runtime)
    "LossScaler": ".runtime",
    "MasterWeightOptimizer": ".runtime",
    "LowPrecisionOptimizer": ".runtime",
    # Apex-style API
    "initialize": ".apex.amp",
    "scale_loss": ".apex.amp",
    "state_dict": ".apex.amp",
    "load_state_dict": ".apex.amp",
    "master_params": ".apex.amp",
    "loss_scalers": ".apex.amp",
    # views and debugging tools
    "diff": ".inspection.views",
    "to_networkx": ".inspection.views",
    "draw": ".inspection.views",
    "summary": ".inspection.views",
    "find_overflow": ".inspection.find_overflow",
    "calibrate": ".inspection.calibration",
    # torch.compile backend: Dynamo skipped or broke a model's frames, nothing converted
    "NothingConvertedWarning": ".dynamo.watch",
    "BetweenGraphsWarning": ".dynamo.between_graphs",
    # the share of GEMM FLOPs that ran in each dtype, measured at dispatch on any route
    "coverage": ".inspection.coverage",
    "Coverage": ".inspection.coverage",
    # fp8 GEMMs (docs/fp8.md): the recipe, and each fp8 GEMM's scales and amax history
    "Fp8Config": ".ir.fp8_rules",
    "fp8_states": ".passes.fp8_gemms",
    "fp8_sync": ".passes.fp8_gemms",
    "fp8_report": ".inspection.fp8_view",
    "track_fp8": ".inspection.fp8_view",
    "explain": ".inspection.explain",
    # convert()'s report where the model was captured from its calls (docs/tracing.md)
    "CapturedReport": ".converter.call_capture",
    "Fp8NothingConvertedWarning": ".ir.fp8_rules",
    # a library's custom op, its whole row in one call (docs/design.md, "Adding an op")
    "register_op": ".ir.op_properties",
    "GemmSig": ".ir.op_properties",
    "FusedForm": ".ir.op_properties",
    # cache_casts=True: drop cached weight casts after a write through p.data
    "clear_cast_cache": ".graph_ops.cast_cache",
    # errors and warnings docs/refusals.md and docs/training.md name as amp_fx.X
    "AlreadyInitializedError": ".apex.amp",
    "LossScalerStateError": ".runtime.scaler_state",
    "EpsUnderflowWarning": ".runtime.optimizer_checks",
    "MomentUnderflowWarning": ".runtime.optimizer_checks",
    # the other AmpWarning subclasses (docs/refusals.md, "Warnings"), each filterable on its own
    "RecompileLimitWarning": ".dynamo.recompiles",
    "FrozenTrainingWarning": ".converter.graph_module",
    "NoGradientsWarning": ".runtime.loss_scaler",
    "NoLowGradientsWarning": ".runtime.master_weights",
    "CompiledUpdateWarning": ".runtime.compiled_update",
    "StaticShapeWarning": ".frontend.export_route",
    "HookWarning": ".graph_ops.hook_dispatch",
    "UndecidedCustomOpWarning": ".passes.assign_precision",
    "DtypeConstantWarning": ".passes.retarget_dtype_constants",
}


# Subpackages reachable after ``import amp_fx`` alone, as the README spells them
# (``amp_fx.runtime.convert_for_sharding``): each is imported on first access.
_SUBPACKAGES = frozenset({"apex", "converter", "dynamo", "frontend", "graph_ops", "inspection", "integrations", "ir", "passes", "runtime"})


def __getattr__(name: str):
    if name in _SUBPACKAGES:
        import importlib

        return importlib.import_module(f".{name}", __name__)  # the import binds it here: asked once
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'amp_fx' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module_name, __name__), name)
    globals()[name] = value
    return value

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
    "AmpWarning",
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
