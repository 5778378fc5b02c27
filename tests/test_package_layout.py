"""The package layout: no module shadows a public name, amp_fx.backend is the function, and amp_fx's own files count as library code."""

import pathlib
import subprocess
import sys

import torch

import amp_fx


def test_no_module_or_subpackage_shadows_a_public_name():
    package = pathlib.Path(amp_fx.__file__).parent
    modules = {path.stem for path in package.glob("*.py")} | {path.name for path in package.iterdir() if path.is_dir()}
    assert not modules & set(amp_fx.__all__)


def test_amp_fx_backend_is_the_function_and_nothing_else():
    assert callable(amp_fx.backend) and not isinstance(amp_fx.backend, type(amp_fx))
    assert isinstance(amp_fx.backend(level="O1"), amp_fx.AmpBackend)


def test_source_lines_treat_every_amp_fx_subpackage_and_the_passes_as_library_code():
    # A module's own folder is not the package: reports must point at the
    # model's line, never at amp_fx/converter or passes/.
    import amp_fx.converter.api
    import amp_fx.passes.insert_casts
    import amp_fx.runtime.loss_scaler
    from amp_fx.frontend.source_lines import is_library_file, is_user_file

    for module in (amp_fx.converter.api, amp_fx.passes.insert_casts, amp_fx.runtime.loss_scaler, torch.nn.functional):
        assert is_library_file(module.__file__) and not is_user_file(module.__file__)
    assert is_user_file(__file__) and not is_library_file(__file__)


def test_import_amp_fx_loads_no_heavy_module():
    # networkx and the inspection views load when first used, not on import.
    code = ("import sys, amp_fx; heavy = [m for m in ('networkx', 'amp_fx.inspection.views', 'amp_fx.runtime', 'amp_fx.apex') "
            "if m in sys.modules]; print(','.join(heavy))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == ""
