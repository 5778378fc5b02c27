"""One error hierarchy: every exception amp_fx defines is an AmpError; the runtime loads no fx inspection code."""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import amp_fx
import amp_fx.passes
from amp_fx.errors import AmpError
from amp_fx.inspection.cli import CliError, check_writable
from amp_fx.inspection.cli import main as cli_main
from amp_fx.runtime import LossScaler, LowPrecisionOptimizer, MasterWeightOptimizer, convert_for_sharding
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
                     "amp_fx.ir.pass_manager", "amp_fx.frontend.tracing", "amp_fx.apex.amp"):
        assert expected in names


def test_every_exception_amp_fx_defines_is_an_amp_error():
    found = _defined_exceptions()
    # The walk found the ones we know of, so an empty or partial walk cannot pass.
    assert {"amp_fx.runtime.collapse.LossScaleCollapseError", "amp_fx.runtime.scaler_state.LossScalerStateError",
            "amp_fx.ir.pass_manager.PassError", "amp_fx.errors.BannedOpError"} <= set(found)
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


# -- every check amp_fx makes raises an AmpError that is still the built-in it used to be --------------------
ROOT = Path(__file__).resolve().parent.parent


class _Net(nn.Module):
    """Two Linears under names a policy or leaf_modules can misspell."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


def _backward(model):
    model(torch.randn(3, 4)).float().sum().backward()


def _scaled_step(scaler, model, opt, calls):
    """Scale a loss, run backward, then make ``calls`` (names of scaler methods taking the optimizer)."""
    scaler.scale(model(torch.randn(3, 4)).sum()).backward()
    for name in calls:
        getattr(scaler, name)(opt)


def _unscale_twice():
    model = _Net()
    _scaled_step(LossScaler(dtype=torch.float16), model, _sgd(model), ["unscale_", "unscale_"])


def _step_twice():
    model = _Net()
    _scaled_step(LossScaler(dtype=torch.float16), model, _sgd(model), ["step", "step"])


def _step_before_scale():
    model = _Net()
    _backward(model)
    LossScaler(dtype=torch.float16).step(_sgd(model))


def _o3():
    return amp_fx.convert(_Net(), "O3", dtype=torch.bfloat16)


def _scale_loss_with_a_plain_optimizer():
    model = _Net()
    with amp_fx.scale_loss(model(torch.randn(3, 4)).sum(), _sgd(model)):
        pass


def _masters_of_another_model():
    model = _Net()
    mw = MasterWeightOptimizer(_sgd(model), amp_fx.convert(model, "O2", dtype=torch.bfloat16))
    state = mw.state_dict()
    other = nn.Sequential(nn.Linear(4, 4))
    MasterWeightOptimizer(_sgd(other), amp_fx.convert(other, "O2", dtype=torch.bfloat16)).load_state_dict(state)


# (id, the misuse, the built-in it raised before AmpError, a fragment of the fix the message names)
MISUSES = [
    ("convert-not-a-module", lambda: amp_fx.convert(lambda x: x), TypeError, "Wrap a function in an nn.Module"),
    ("convert-unknown-level", lambda: amp_fx.convert(_Net(), "O4"), ValueError, "O0 = fp32"),
    ("convert-fp32-dtype", lambda: amp_fx.convert(_Net(), dtype=torch.float32), ValueError, "torch.bfloat16"),
    ("convert-tensor-example-inputs", lambda: amp_fx.convert(_Net(), example_inputs=torch.randn(3, 4)), TypeError,
     "example_inputs=(x,)"),
    ("convert-meta-model", lambda: amp_fx.convert(_Net().to("meta")), ValueError, "to_empty"),
    ("convert-misspelt-keyword", lambda: amp_fx.convert(_Net(), "O1", keep_batchnorm_fp23=True), TypeError,
     "Did you mean 'keep_batchnorm_fp32'?"),
    ("convert-on-unknown-op", lambda: amp_fx.convert(_Net(), on_unknown_op="ignore"), ValueError, "'follow'"),
    ("convert-pad-gemm", lambda: amp_fx.convert(_Net(), pad_gemm="always"), ValueError, "'auto', True or False"),
    ("convert-cast-model-outputs", lambda: amp_fx.convert(_Net(), cast_model_outputs=3), ValueError, "torch.dtype"),
    ("convert-leaf-modules-string", lambda: amp_fx.convert(_Net(), leaf_modules="fc1"), TypeError,
     "leaf_modules=['fc1']"),
    ("convert-leaf-modules-misspelt", lambda: amp_fx.convert(_Net(), leaf_modules=["fc3"]), ValueError,
     "Did you mean"),
    ("policy-not-a-dict", lambda: amp_fx.convert(_Net(), policy=[("module:fc1", "fp32")]), TypeError,
     "amp_fx.Policy or a dict"),
    ("policy-unknown-prefix", lambda: amp_fx.convert(_Net(), policy={"layer:fc1": "fp32"}), ValueError,
     "'module:', 'module_re:', 'op:'"),
    ("policy-unknown-decision", lambda: amp_fx.convert(_Net(), policy={"module:fc1": "half"}), ValueError,
     "use one of"),
    ("policy-missing-module", lambda: amp_fx.convert(_Net(), policy={"module:fc3": "fp32"}), ValueError,
     "Did you mean"),
    ("policy-set-module-type", lambda: amp_fx.Policy().set_module_type("Linear", "fp32"), TypeError,
     "nn.Module subclass"),
    ("backend-o2", lambda: amp_fx.backend(level="O2"), ValueError, "Convert first, then compile"),
    ("backend-misspelt-option", lambda: amp_fx.backend(levle="O1"), TypeError, "Did you mean 'level'?"),
    ("initialize-misspelt-property",
     lambda: amp_fx.initialize(_Net(), None, "O1", keep_batchnorm_fp23=True), TypeError, "Apex properties"),
    ("initialize-unknown-level", lambda: amp_fx.initialize(_Net(), None, "O5"), ValueError, "O3 = everything low"),
    ("scale-loss-plain-optimizer", _scale_loss_with_a_plain_optimizer, RuntimeError, "amp_fx.initialize"),
    ("loss-scaler-misspelt-option", lambda: LossScaler(init_scal=2.0), TypeError, "Did you mean 'init_scale'?"),
    ("loss-scaler-bad-dtype", lambda: LossScaler(dtype="int8"), ValueError, "torch.float16"),
    ("loss-scaler-bad-growth", lambda: LossScaler(dtype=torch.float16, growth_factor=0.5), ValueError, "> 1.0"),
    ("loss-scaler-foreign-state", lambda: LossScaler(dtype=torch.float16).load_state_dict({"foo": 1}), ValueError,
     "LossScaler.state_dict()"),
    ("loss-scaler-unscale-twice", _unscale_twice, RuntimeError, "update()"),
    ("loss-scaler-step-twice", _step_twice, RuntimeError, "scaler.update() once per iteration"),
    ("loss-scaler-step-before-scale", _step_before_scale, RuntimeError, "scaler.scale(loss)"),
    ("master-weights-at-o1", lambda: MasterWeightOptimizer(_sgd(_Net()), amp_fx.convert(_Net(), "O1")), ValueError,
     "convert at O2"),
    ("master-weights-fp32-model", lambda: MasterWeightOptimizer(_sgd(_Net()), _Net()), ValueError,
     "amp_fx.convert(model, 'O2')"),
    ("master-weights-foreign-state", _masters_of_another_model, KeyError, "rebuild the model and optimizer"),
    ("low-precision-update", lambda: LowPrecisionOptimizer(_sgd(_Net()), _o3(), update="round"), ValueError,
     "stochastic"),
    ("low-precision-lbfgs", lambda: LowPrecisionOptimizer(torch.optim.LBFGS(_o3().parameters()), _o3()), TypeError,
     "per-parameter optimizer"),
    ("report-node-misspelt", lambda: _o3().amp_report.node("linear_9"), KeyError, "Did you mean 'linear_1'"),
    ("draw-pdf", lambda: amp_fx.draw(_o3(), "graph.pdf"), ValueError, ".svg, .html or .dot"),
    ("summary-plain-model", lambda: amp_fx.summary(_Net()), TypeError, "converted module"),
    ("sharding-no-block", lambda: convert_for_sharding(_Net(), blocks=["layers.0"]), ValueError, "which the model"),
    ("cli-out-missing-folder", lambda: check_writable("--out", "/nonexistent/amp_fx/r.html"), None, "mkdir -p"),
]


@pytest.mark.parametrize("misuse, builtin, fix", [m[1:] for m in MISUSES], ids=[m[0] for m in MISUSES])
def test_every_misuse_raises_an_amp_error_that_is_still_its_builtin(misuse, builtin, fix):
    with pytest.raises(AmpError) as info:
        misuse()
    if builtin is not None:
        assert isinstance(info.value, builtin), f"{type(info.value).__name__} is no longer a {builtin.__name__}"
        with pytest.raises(builtin):  # `except ValueError:` around amp_fx calls keeps working
            misuse()
    message = str(info.value)
    assert fix in message, message
    assert not message.startswith("'"), "a KeyError message printed as its repr"


def test_the_table_covers_the_surfaces_the_issue_names():
    surfaces = {m[0].split("-")[0] for m in MISUSES}
    assert {"convert", "policy", "backend", "initialize", "loss", "master", "low", "report", "draw", "cli"} <= surfaces
    assert len(MISUSES) >= 20 and len({m[0] for m in MISUSES}) == len(MISUSES)


def test_unknown_keywords_keep_the_signature_and_list_every_option():
    assert "keep_batchnorm_fp32" in inspect.signature(amp_fx.convert).parameters  # help() still shows them
    assert "init_scale" in inspect.signature(LossScaler).parameters
    with pytest.raises(amp_fx.AmpTypeError) as info:
        amp_fx.convert(_Net(), "O1", keep_batchnorm_fp23=True, polcy={})
    message = str(info.value)
    assert "['keep_batchnorm_fp23', 'polcy']" in message and "'keep_batchnorm_fp32', 'policy'?" in message
    assert "Valid options are [" in message and "'dynamic_shapes'" in message and "'model'" not in message


def test_a_foreign_scaler_state_is_refused_before_anything_changes():
    scaler = LossScaler(dtype=torch.float16, init_scale=8.0)
    with pytest.raises(amp_fx.AmpValueError, match=r"missing keys \['scale'\], unknown keys \['foo'\]"):
        scaler.load_state_dict({"foo": 1})
    with pytest.raises(amp_fx.AmpValueError, match=r"missing keys \[\], unknown keys \['model'\]"):
        scaler.load_state_dict({**scaler.state_dict(), "model": {}})  # a whole checkpoint is not a scaler state
    with pytest.raises(amp_fx.AmpTypeError, match="got list"):
        scaler.load_state_dict([("scale", 2.0)])
    assert scaler.get_scale() == 8.0
    # What LossScaler and GradScaler write still loads.
    from amp_fx.runtime.scaler_state import STATE_KEYS

    assert tuple(scaler.state_dict()) == STATE_KEYS
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.load_state_dict(grad_scaler.state_dict())
    assert scaler.get_scale() == 4.0


# -- the command line: output paths are checked before converting, op names get close matches --------------
def _cli(*args, capsys):
    code = cli_main(["inspect", "examples/inspect_factory.py:build", "--input-shape", "2,3,8,8", *args])
    return code, capsys.readouterr()


def test_cli_refuses_an_out_path_in_a_missing_folder_and_creates_none(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    missing = tmp_path / "no" / "such"
    code, out = _cli("--out", str(missing / "r.html"), capsys=capsys)
    assert code == 2 and not (tmp_path / "no").exists()
    assert f"the folder {str(missing)!r} does not exist" in out.err and "mkdir -p" in out.err
    assert "Traceback" not in out.err and out.out == ""  # refused before the model was converted or printed


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs a folder that refuses new files (/proc on Linux)")
def test_cli_refuses_an_out_path_where_no_file_can_be_created(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    code, out = _cli("--out", "/proc/r.html", capsys=capsys)
    assert code == 2 and "cannot create files in '/proc'" in out.err and "Traceback" not in out.err


def test_cli_refuses_a_folder_as_the_json_path(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    code, out = _cli("--json", str(tmp_path), capsys=capsys)
    assert code == 2 and "is a folder" in out.err and str(tmp_path / "report.json") in out.err


def test_check_writable_accepts_a_new_file_in_a_writable_folder_and_leaves_nothing(tmp_path):
    check_writable("--out", str(tmp_path / "graph.html"))
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(CliError):
        check_writable("--out", str(tmp_path / "missing" / "graph.html"))


@pytest.mark.parametrize("op, meant", [("softmx", "'softmax'"), ("torch.matmull", "'matmul'")])
def test_cli_tables_suggests_close_op_names(op, meant, capsys):
    assert cli_main(["tables", "--op", op]) == 0
    line = capsys.readouterr().out
    assert "in no table" in line and "Did you mean" in line and meant in line.split("Did you mean", 1)[1]


def test_cli_tables_suggests_nothing_for_a_known_op_or_a_far_name(capsys):
    assert cli_main(["tables", "--op", "softmax"]) == 0 and "Did you mean" not in capsys.readouterr().out
    assert cli_main(["tables", "--op", "aten.softmax.int"]) == 0  # an aten overload is resolved, not guessed
    assert "(softmax): fp32" in capsys.readouterr().out
    assert cli_main(["tables", "--op", "frobnicate"]) == 0 and "Did you mean" not in capsys.readouterr().out


# -- statically: amp_fx raises no bare built-in for its own checks ---------------------------------------------
_BUILTINS = {"ValueError", "TypeError", "RuntimeError", "KeyError", "IndexError", "NotImplementedError"}
# Files another change owns right now; they convert their own raises when it lands. Each may hold at most
# this many bare built-ins, so nothing new slips in unnoticed meanwhile.
_ALLOWED = {
    "passes/fuse_precision.py": 0,  # being reworked by the fused-norm change (issue 16)
    "amp_fx/graph_ops/fused_norms.py": 0,  # new module of the same change
}


def _bare_builtin_raises(path: Path, root: Path = ROOT) -> list[str]:
    """``raise ValueError(...)`` and friends, and built-in errors built to be raised later (``return ValueError(...)``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        target = node.exc if isinstance(node, ast.Raise) else node if isinstance(node, ast.Call) else None
        target = target.func if isinstance(target, ast.Call) else target
        if isinstance(target, ast.Name) and target.id in _BUILTINS:
            if target.id == "NotImplementedError" and _is_protocol_stub(path, node):
                continue
            found.append(f"{path.relative_to(root)}:{node.lineno}: {target.id}")
    return sorted(set(found))


def _is_protocol_stub(path: Path, node: ast.AST) -> bool:
    """``raise NotImplementedError`` as the whole body of an abstract method (protocol, not a refusal)."""
    for function in ast.walk(ast.parse(path.read_text())):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = [s for s in function.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
            if len(body) == 1 and isinstance(body[0], ast.Raise) and body[0].lineno == node.lineno:
                return True
    return False


def test_the_scan_finds_a_bare_raise(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("def f():\n    raise ValueError('x')\n\ndef g():\n    return KeyError('y')\n\n"
                      "class P:\n    def m(self):\n        raise NotImplementedError\n")
    assert _bare_builtin_raises(sample, tmp_path) == ["sample.py:2: ValueError", "sample.py:5: KeyError"]


def test_amp_fx_raises_no_bare_builtin_error():
    files = sorted([*ROOT.joinpath("amp_fx").rglob("*.py"), *ROOT.joinpath("passes").rglob("*.py")])
    assert len(files) > 50  # the walk found the package
    offenders, over = [], []
    for path in files:
        found = _bare_builtin_raises(path)
        allowed = _ALLOWED.get(str(path.relative_to(ROOT)))
        if allowed is None:
            offenders.extend(found)
        elif len(found) > allowed:
            over.extend(found)
    assert not offenders, ("raise amp_fx.errors.AmpValueError / AmpTypeError / AmpRuntimeError / AmpKeyError / "
                           f"AmpIndexError / AmpNotImplementedError instead of the built-in: {offenders}")
    assert not over, f"files on the allowlist gained bare built-in raises: {over}"


def test_config_keys_initialize_properties_and_aten_op_names_get_close_matches():
    import torch

    import amp_fx
    from amp_fx.ir.op_keys import op_name_of

    with pytest.raises(ValueError, match="Did you mean 'level'"):
        amp_fx.AmpConfig.from_dict({"levle": "O1"})
    model = torch.nn.Linear(2, 2)
    with pytest.raises(amp_fx.AmpError, match="Did you mean 'keep_batchnorm_fp32'"):
        amp_fx.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1", keep_batchnorm_fp23=True)
    assert [op_name_of(s) for s in ("aten.softmax.int", "torch.ops.aten.add_.Tensor", "torch.matmul", "x.softmax_")] == [
        "softmax", "add", "matmul", "softmax"]


def test_optimizer_wrappers_and_tools_refuse_misspelt_keywords_and_non_optimizers():
    import torch

    import amp_fx

    gm = amp_fx.convert(torch.nn.Linear(4, 4), "O2")
    model = torch.nn.Linear(4, 4)
    cases = [
        (lambda: amp_fx.MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), gm, mastrs={}), "'masters'"),
        (lambda: amp_fx.LowPrecisionOptimizer(torch.optim.SGD(gm.parameters(), lr=0.1), gm, updte="kahan"), "'update'"),
        (lambda: amp_fx.find_overflow(gm, torch.randn(2, 4), tagret=1), "'target'"),
        (lambda: amp_fx.calibrate(torch.nn.Linear(4, 4), [torch.randn(2, 4)], rnage_fraction=0.1), "'range_fraction'"),
    ]
    for call, meant in cases:
        with pytest.raises(TypeError, match=f"Did you mean {meant}") as caught:
            call()
        assert isinstance(caught.value, amp_fx.AmpError)
    with pytest.raises(amp_fx.AmpError, match="wraps a torch optimizer, got NoneType"):
        amp_fx.MasterWeightOptimizer(None, gm)


def test_cli_out_paths_that_are_empty_or_under_a_file_are_refused(tmp_path):
    from amp_fx.inspection.cli import CliError, check_writable

    with pytest.raises(CliError, match="needs a file name"):
        check_writable("--out", "")
    a_file = tmp_path / "afile"
    a_file.write_text("x")
    with pytest.raises(CliError, match="is a file, not a folder"):
        check_writable("--out", str(a_file / "r.html"))


def test_op_names_spelt_as_module_classes_and_dunders_resolve():
    from amp_fx.ir.op_keys import op_name_of

    spelt = {"nn.LayerNorm": "layer_norm", "Softmax": "softmax", "nn.Linear": "linear", "__add__": "add",
             "__iadd__": "add", "__matmul__": "matmul"}
    assert {s: op_name_of(s) for s in spelt} == spelt
