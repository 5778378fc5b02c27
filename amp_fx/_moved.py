"""Module paths from before the subpackages, kept importable with a DeprecationWarning that names the new path.

Until 0.2 every module sat flat in ``amp_fx/``.  Scripts (and pickled
GraphModules, whose code imports ``amp_fx.casts.amp_cast``) may still name
the old paths; this finder serves the moved module under its old name.

``amp_fx.backend`` is special: the package exports a *function* of that
name.  Importing the old module path must not replace the function, so the
alias is a callable module: ``amp_fx.backend(...)`` still builds a backend and
``amp_fx.backend.AmpBackend`` still finds the class.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from typing import Any

__all__ = ["MOVED", "REMOVED", "install"]

MOVED = {
    "amp_fx.api": "amp_fx.core.api",
    "amp_fx.config": "amp_fx.core.config",
    "amp_fx.tables": "amp_fx.core.tables",
    "amp_fx.op_keys": "amp_fx.core.op_keys",
    "amp_fx.policy": "amp_fx.core.policy",
    "amp_fx.meta": "amp_fx.core.meta",
    "amp_fx.analysis": "amp_fx.core.analysis",
    "amp_fx.dtype_rules": "amp_fx.core.dtype_rules",
    "amp_fx.cast_costs": "amp_fx.core.cast_costs",
    "amp_fx.cast_nodes": "amp_fx.core.cast_nodes",
    "amp_fx.casts": "amp_fx.core.casts",
    "amp_fx.cast_cache": "amp_fx.core.cast_cache",
    "amp_fx.pass_manager": "amp_fx.core.pass_manager",
    "amp_fx.pipeline": "amp_fx.core.pipeline",
    "amp_fx.report": "amp_fx.core.report",
    "amp_fx.graph_module": "amp_fx.core.graph_module",
    "amp_fx.tracing": "amp_fx.frontend.tracing",
    "amp_fx.trace_guards": "amp_fx.frontend.trace_guards",
    "amp_fx.trace_hooks": "amp_fx.frontend.trace_hooks",
    "amp_fx.regions": "amp_fx.frontend.regions",
    "amp_fx.regions_export": "amp_fx.frontend.regions_export",
    "amp_fx.train_flags": "amp_fx.frontend.train_flags",
    "amp_fx.opaque_calls": "amp_fx.frontend.opaque_calls",
    "amp_fx.declared_precision": "amp_fx.frontend.declared_precision",
    "amp_fx.checkpoint_regions": "amp_fx.frontend.checkpoint_regions",
    "amp_fx.export_guards": "amp_fx.frontend.export_guards",
    "amp_fx.export_route": "amp_fx.frontend.export_route",
    "amp_fx.hf": "amp_fx.frontend.hf",
    "amp_fx.source_lines": "amp_fx.frontend.source_lines",
    "amp_fx.backend": "amp_fx.dynamo.backend",
    "amp_fx.backend_bodies": "amp_fx.dynamo.bodies",
    "amp_fx.backend_graph": "amp_fx.dynamo.graph",
    "amp_fx.backend_report": "amp_fx.dynamo.report",
    "amp_fx.apex_optimizers": "amp_fx.apex.optimizers",
    "amp_fx.apex_properties": "amp_fx.apex.properties",
    "amp_fx.views": "amp_fx.inspection.views",
    "amp_fx.views_draw": "amp_fx.inspection.draw",
    "amp_fx.views_summary": "amp_fx.inspection.summary",
    "amp_fx.overflow": "amp_fx.inspection.find_overflow",
    "amp_fx.calibration": "amp_fx.inspection.calibration",
    "amp_fx.cli": "amp_fx.inspection.cli",
}


def _warn(old: str, new: str) -> None:
    warnings.warn(
        f"{old} moved to {new}; import from {new} (public names are also on amp_fx itself). "
        "The old path will be removed in a later release.",
        DeprecationWarning,
        stacklevel=3,
    )


def _resolve_dtype(dtype: Any, module: Any = None) -> Any:
    """0.1's ``amp_fx.config.resolve_dtype``: the explicit dtype, else autocast's for the module's device."""
    from amp_fx.core.devices import device_type_of, low_dtype_for

    return dtype if dtype is not None else low_dtype_for(device_type_of(module))


def _graph_device_type(gm: Any, example_inputs: Any = ()) -> str:
    """0.1's ``amp_fx.backend_graph.graph_device_type``: now :func:`amp_fx.core.devices.device_type_of`."""
    from amp_fx.core.devices import device_type_of

    return device_type_of(gm, example_inputs)


def _low_dtype_for(device_type: str) -> Any:
    """0.1's ``amp_fx.backend_graph.low_dtype_for``: now :func:`amp_fx.core.devices.low_dtype_for`."""
    from amp_fx.core.devices import low_dtype_for

    return low_dtype_for(device_type)


# Public names of 0.1 modules that are gone from the module at the new path: served on the old path only.
REMOVED = {
    "amp_fx.config": {"resolve_dtype": _resolve_dtype},
    "amp_fx.backend_graph": {"graph_device_type": _graph_device_type, "low_dtype_for": _low_dtype_for},
}


class _OldModule(types.ModuleType):
    """An old module path whose module lost public names: the moved module's names, plus the removed ones."""

    def __dir__(self) -> list[str]:
        return sorted({*dir(importlib.import_module(MOVED[self.__name__])), *REMOVED[self.__name__]})

    def __getattr__(self, name: str) -> Any:
        removed = REMOVED[self.__name__]
        if name in removed:
            return removed[name]
        return getattr(importlib.import_module(MOVED[self.__name__]), name)


class _CallableBackendModule(types.ModuleType):
    """The old ``amp_fx.backend`` module: callable as the ``amp_fx.backend`` function, with the module's names as attributes."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from amp_fx.dynamo.backend import backend

        return backend(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(importlib.import_module("amp_fx.dynamo.backend"), name)

    def __dir__(self) -> list[str]:
        return dir(importlib.import_module("amp_fx.dynamo.backend"))


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``amp_fx.<old name>`` and loads the module at its new path."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        new = MOVED[spec.name]
        _warn(spec.name, new)
        if spec.name == "amp_fx.backend":
            return _CallableBackendModule(spec.name)
        if spec.name in REMOVED:
            return _OldModule(spec.name)
        return importlib.import_module(new)

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the module at the new path is already loaded."""


def install() -> None:
    """Put the finder on ``sys.meta_path`` once."""
    if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder())
