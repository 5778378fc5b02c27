"""The subpackage layout: old flat module paths still import (with a warning), and no module shadows a public name."""

import importlib
import pathlib
import pickle
import sys
import warnings

import pytest
import torch

import amp_fx
from amp_fx._moved import MOVED, REMOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_path_imports_the_moved_module_with_a_warning_naming_the_new_path(old):
    new = MOVED[old]
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.")):
        module = importlib.import_module(old)
    moved = importlib.import_module(new)
    if old == "amp_fx.backend" or old in REMOVED:
        public = [name for name in vars(moved) if not name.startswith("_")]
        assert all(getattr(module, name) is getattr(moved, name) for name in public)
    else:
        assert module is moved


def test_public_names_that_left_a_module_are_still_served_on_its_old_path():
    for old, names in REMOVED.items():
        sys.modules.pop(old, None)
        with pytest.warns(DeprecationWarning):
            module = importlib.import_module(old)
        for name in names:
            assert callable(getattr(module, name))
    config = importlib.import_module("amp_fx.config")
    assert config.resolve_dtype(None, torch.nn.Linear(2, 2)) == torch.bfloat16
    assert config.resolve_dtype(torch.float16, None) == torch.float16
    graph = importlib.import_module("amp_fx.backend_graph")
    assert graph.low_dtype_for("cuda") == torch.float16
    assert graph.graph_device_type(torch.fx.symbolic_trace(torch.nn.Linear(2, 2)), (torch.randn(1, 2),)) == "cpu"


def test_importing_the_old_backend_module_leaves_amp_fx_backend_callable():
    sys.modules.pop("amp_fx.backend", None)
    with pytest.warns(DeprecationWarning):
        import amp_fx.backend  # noqa: F401  (the path a 0.1 script imports)
    built = amp_fx.backend(level="O1")
    assert isinstance(built, amp_fx.AmpBackend)
    assert amp_fx.backend.AmpBackend is amp_fx.AmpBackend


def test_no_module_or_subpackage_shadows_a_public_name():
    package = pathlib.Path(amp_fx.__file__).parent
    modules = {path.stem for path in package.glob("*.py")} | {path.name for path in package.iterdir() if path.is_dir()}
    assert not modules & set(amp_fx.__all__)


def test_a_graph_module_pickled_before_the_move_still_loads():
    from torch.fx.graph import _register_custom_builtin
    from amp_fx.core.casts import amp_cast

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    converted = amp_fx.convert(model, level="O1")
    # Pickle as 0.1 did: its graphs imported the cast helper from the flat path.
    _register_custom_builtin("amp_cast", "from amp_fx.casts import amp_cast", amp_cast)
    try:
        old_blob = pickle.dumps(converted)
    finally:
        _register_custom_builtin("amp_cast", "from amp_fx.core.casts import amp_cast", amp_cast)
    assert b"from amp_fx.casts import amp_cast" in old_blob, "the graph no longer calls amp_cast; update this test"
    sys.modules.pop("amp_fx.casts", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        loaded = pickle.loads(old_blob)
    x = torch.randn(2, 4)
    assert torch.equal(loaded(x), converted(x))


def test_source_lines_treat_every_amp_fx_subpackage_and_the_passes_as_library_code():
    # After the move a module's own folder is no longer the package: reports
    # must still point at the model's line, never at amp_fx/core or passes/.
    import amp_fx.core.api
    import amp_fx.passes.insert_casts
    import amp_fx.runtime.loss_scaler
    from amp_fx.frontend.source_lines import is_library_file, is_user_file

    for module in (amp_fx.core.api, amp_fx.passes.insert_casts, amp_fx.runtime.loss_scaler, torch.nn.functional):
        assert is_library_file(module.__file__) and not is_user_file(module.__file__)
    assert is_user_file(__file__) and not is_library_file(__file__)


def test_old_modules_list_their_names_and_are_reachable_as_attributes_of_amp_fx():
    sys.modules.pop("amp_fx.views", None)
    vars(amp_fx).pop("views", None)  # (an earlier import of the old path set it)
    with pytest.warns(DeprecationWarning):
        views = amp_fx.views  # as in 0.1, where amp_fx's own imports made it an attribute
    assert views is importlib.import_module("amp_fx.inspection.views")
    sys.modules.pop("amp_fx.config", None)
    with pytest.warns(DeprecationWarning):
        config = importlib.import_module("amp_fx.config")
    assert {"AmpConfig", "make_config", "resolve_dtype"} <= set(dir(config))
