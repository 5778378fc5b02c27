"""One error hierarchy: every exception amp_fx defines is an AmpError; the runtime loads no fx inspection code."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import subprocess
import sys

import pytest

import amp_fx
import amp_fx.passes
from amp_fx.errors import AmpError
from amp_fx.runtime.collapse import LossScaleCollapseError, collapse_error
from amp_fx.runtime.scaler_state import LossScalerStateError

# ``python -m amp_fx`` runs the command line when imported; it defines nothing.
_NOT_IMPORTED = {"amp_fx.__main__"}


def _amp_fx_modules() -> list:
    """Every module of amp_fx, passes/ included (installed as amp_fx.passes from another folder)."""
    names = set()
    for package in (amp_fx, amp_fx.passes):
        names.add(package.__name__)
        names.update(m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + "."))
    return [importlib.import_module(name) for name in sorted(names - _NOT_IMPORTED)]


def _defined_exceptions() -> dict[str, type]:
    """Exception classes defined (not merely imported) in amp_fx, by qualified name; warnings are not errors."""
    found = {}
    for module in _amp_fx_modules():
        for _, value in inspect.getmembers(module, inspect.isclass):
            if value.__module__ == module.__name__ and issubclass(value, Exception) and not issubclass(value, Warning):
                found[f"{module.__name__}.{value.__qualname__}"] = value
    return found


def test_the_walk_reaches_every_subpackage():
    names = {m.__name__ for m in _amp_fx_modules()}
    for expected in ("amp_fx.passes.assign_precision", "amp_fx.runtime.collapse", "amp_fx.inspection.cli",
                     "amp_fx.core.pass_manager", "amp_fx.frontend.tracing", "amp_fx.apex.amp"):
        assert expected in names


def test_every_exception_amp_fx_defines_is_an_amp_error():
    found = _defined_exceptions()
    # The walk found the ones we know of, so an empty or partial walk cannot pass.
    assert {"amp_fx.runtime.collapse.LossScaleCollapseError", "amp_fx.runtime.scaler_state.LossScalerStateError",
            "amp_fx.core.pass_manager.PassError", "amp_fx.errors.BannedOpError"} <= set(found)
    strays = sorted(name for name, cls in found.items() if not issubclass(cls, AmpError))
    assert not strays, f"derive these from amp_fx.errors.AmpError: {strays}"


@pytest.mark.parametrize("cls", [LossScaleCollapseError, LossScalerStateError])
def test_runtime_errors_keep_their_runtime_error_base(cls):
    assert issubclass(cls, AmpError) and issubclass(cls, RuntimeError)


def test_collapse_error_names_find_overflow_without_loading_it():
    error = collapse_error(min_scale=1.0, streak=3, loss_scale=1.0, on_collapse="raise", reproduce=None)
    assert isinstance(error, AmpError) and error.diagnosis is None
    assert "amp_fx.find_overflow" in str(error) and 'on_collapse="diagnose"' in str(error)


def test_importing_the_runtime_loads_no_inspection_code():
    code = ("import amp_fx.runtime, sys; "
            "loaded = [m for m in sys.modules if m.startswith('amp_fx.inspection')]; "
            "assert not loaded, loaded")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_a_runtime_collapse_loads_no_inspection_code():
    code = ("import sys; from amp_fx.runtime.collapse import collapse_error; "
            "collapse_error(1.0, 3, 1.0, 'raise', None); "
            "loaded = [m for m in sys.modules if m.startswith('amp_fx.inspection')]; "
            "assert not loaded, loaded")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
