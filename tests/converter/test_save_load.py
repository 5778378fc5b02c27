"""Saving and loading converted modules: state dicts, deepcopy, pickle, to_folder, the report as JSON, torch.export.

What must survive each route: the casts themselves (the same ``_to_copy``
calls at run time), the outputs (bit for bit), ``amp_report`` and
``amp_config``, and at O2/O3 the fp32 view of the state dict.
"""

from __future__ import annotations

import copy
import importlib.util
import io
import json
import pickle
import sys
import warnings

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import amp_fx
import zoo
from amp_fx.ir.cast_nodes import cast_target
from probes import GEMM_OPS, OpRecorder

LEVELS = ["O1", "O2", "O3"]
# Symbolically traced core models (the torch.export route's graphs are not picklable, see below).
MODELS = ["mlp", "cnn", "lstm", "sdpa"]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _converted(name: str, level: str):
    model, example, kwargs = zoo.build(name)
    model.eval()  # batch-norm statistics fixed: runs compare bit for bit
    gm = amp_fx.convert(model, level, **kwargs)
    return model, gm, example


def _run(module, example):
    """Output and the casts dispatched while computing it."""
    with OpRecorder() as rec:
        out = module(*example)
    return out, rec.count({"_to_copy"})


def _assert_same_conversion(copy_, gm, example):
    assert isinstance(copy_, amp_fx.AmpGraphModule)
    assert copy_.amp_config == gm.amp_config
    assert copy_.amp_report.to_dict() == gm.amp_report.to_dict()
    # Node annotations do not survive pickling (fx re-traces the code): count casts by what they do.
    assert sum(cast_target(n) is not None for n in copy_.graph.nodes) == sum(cast_target(n) is not None for n in gm.graph.nodes)
    out, casts = _run(copy_, example)
    ref, ref_casts = _run(gm, example)
    assert casts == ref_casts > 0, "casts were lost"
    assert out.dtype == ref.dtype and torch.equal(out, ref)


@pytest.mark.parametrize("level", LEVELS)
def test_a_saved_state_dict_loads_into_a_fresh_conversion_of_the_same_model(tmp_path, level):
    """Train one step, torch.save the converted module's state dict, load it into a new convert()."""
    model, gm, example = _converted("cnn", level)
    gm.train()
    params = list(gm.parameters())
    torch.optim.SGD(params, lr=0.5).zero_grad()
    gm(*example).float().sum().backward()
    with torch.no_grad():
        for p in params:
            p -= 0.5 * p.grad.to(p.dtype)
    gm.eval()
    torch.save(gm.state_dict(), tmp_path / "ckpt.pt")
    fresh_model = zoo.SmallCNN().eval()
    fresh = amp_fx.convert(fresh_model, level)
    fresh.load_state_dict(torch.load(tmp_path / "ckpt.pt"))
    assert {k: v.dtype for k, v in fresh.state_dict().items()} == {k: v.dtype for k, v in model.state_dict().items()}
    for (name, a), (_, b) in zip(fresh.named_parameters(), gm.named_parameters()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert torch.equal(fresh(*example), gm(*example))


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", MODELS)
def test_deepcopy_keeps_casts_report_and_outputs(name, level):
    model, gm, example = _converted(name, level)
    twin = copy.deepcopy(gm)
    _assert_same_conversion(twin, gm, example)
    # A deep copy owns its parameters.
    assert all(a is not b for a, b in zip(twin.parameters(), gm.parameters()))
    if level != "O1":
        assert all(v.dtype == model.state_dict()[k].dtype for k, v in twin.state_dict().items())


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", MODELS)
def test_pickle_keeps_casts_report_and_outputs(name, level):
    """fx re-traces an unpickled GraphModule; amp_cast, amp_promote and call_with_params record
    themselves as single nodes, so the casts survive."""
    _, gm, example = _converted(name, level)
    _assert_same_conversion(pickle.loads(pickle.dumps(gm)), gm, example)


def test_torch_save_of_the_whole_module_round_trips():
    _, gm, example = _converted("lstm", "O1")  # leaf module run with cast parameters (call_with_params)
    buffer = io.BytesIO()
    torch.save(gm, buffer)
    buffer.seek(0)
    _assert_same_conversion(torch.load(buffer, weights_only=False), gm, example)


def test_runtime_promote_helpers_survive_pickling():
    class Mixed(nn.Module):
        def forward(self, a, b):
            return torch.cat([a, b.to(torch.bfloat16)]) * 2

    gm = amp_fx.convert(Mixed(), "O1")
    assert any(n.target is amp_fx.graph_ops.casts.amp_promote for n in gm.graph.nodes)
    again = pickle.loads(pickle.dumps(gm))
    assert any(n.target is amp_fx.graph_ops.casts.amp_promote for n in again.graph.nodes)
    a, b = torch.randn(2, 3), torch.randn(2, 3)
    assert again(a, b).dtype == torch.float32 and torch.equal(again(a, b), gm(a, b))


def _import_folder(folder, module_name: str):
    package = f"amp_fx_folder_{module_name}_{id(folder)}"
    spec = importlib.util.spec_from_file_location(package, folder / "__init__.py", submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[package] = module
    try:
        spec.loader.exec_module(module)
        return getattr(module, module_name)
    finally:
        sys.modules.pop(package, None)
        sys.modules.pop(f"{package}.module", None)


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("name", ["mlp", "lstm", "sdpa"])
def test_to_folder_writes_a_module_that_imports_the_cast_helpers(tmp_path, name, level):
    """GraphModule.to_folder writes code; the helpers it calls must be imported there."""
    _, gm, example = _converted(name, level)
    gm.to_folder(tmp_path, "Converted")
    code = (tmp_path / "module.py").read_text()
    assert "from amp_fx.graph_ops.casts import amp_cast" in code
    loaded = _import_folder(tmp_path, "Converted")().eval()
    out, casts = _run(loaded, example)
    ref, ref_casts = _run(gm, example)
    assert casts == ref_casts and torch.equal(out, ref)


def test_the_report_survives_json_and_a_pickled_module():
    _, gm, _ = _converted("sdpa", "O1")
    text = json.dumps(pickle.loads(pickle.dumps(gm)).amp_report.to_dict())
    back = amp_fx.ConversionReport.from_dict(json.loads(text))
    assert back.totals() == gm.amp_report.totals()
    assert [r.decision for r in back.nodes] == [r.decision for r in gm.amp_report.nodes]
    assert str(back).splitlines()[:2] == str(gm.amp_report).splitlines()[:2]
    assert amp_fx.AmpConfig.from_dict(json.loads(json.dumps(gm.amp_config.to_dict()))) == gm.amp_config


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("name", MODELS)
def test_torch_export_keeps_the_casts_as_ordinary_ops(name, level):
    """The exported program holds the casts as aten ops (``_to_copy`` after decomposition), runs the
    GEMMs in the same dtypes, and gives the same outputs."""
    _, gm, example = _converted(name, level)
    program = torch.export.export(gm, example)
    casts = [n for n in program.run_decompositions().graph.nodes if n.target is torch.ops.aten._to_copy.default]
    assert casts and {n.kwargs.get("dtype") for n in casts} <= {gm.amp_config.low_dtype, torch.float32}
    exported = program.module()
    with OpRecorder() as rec:
        out = exported(*example)
    with OpRecorder() as ref_rec:
        ref = gm(*example)
    assert rec.count({"_to_copy"}) == ref_rec.count({"_to_copy"}) <= len(casts)
    assert rec.dtypes_of(GEMM_OPS) == ref_rec.dtypes_of(GEMM_OPS)
    assert torch.equal(out, ref)


def test_fx_interpreter_runs_a_leaf_module_with_cast_parameters():
    """torch.export runs a GraphModule through fx.Interpreter, which hands call_with_params the node's
    immutable dict; functional_call updated it in place ("'immutable_dict' object does not support
    mutation").  Fixed by giving functional_call a copy."""
    _, gm, example = _converted("lstm", "O1")
    assert any(n.target is amp_fx.graph_ops.casts.call_with_params for n in gm.graph.nodes)
    assert torch.equal(fx.Interpreter(gm).run(*example), gm(*example))


def test_the_torch_export_route_converts_but_its_module_does_not_pickle():
    """Models traced with torch.export (here nn.TransformerEncoder) are GraphModules that torch.export
    made; torch cannot pickle those even unconverted, so neither can amp_fx.  deepcopy and
    state dicts work."""
    model, gm, example = _converted("encoder", "O1")
    with pytest.raises((AttributeError, pickle.PicklingError), match="local object"):
        pickle.dumps(torch.export.export(model, example).module())
    with pytest.raises(amp_fx.AmpError, match=r"cannot be pickled.*Save gm.state_dict\(\)"):
        pickle.dumps(gm)  # refused by amp_fx before torch fails deep inside, with what to save instead
    _assert_same_conversion(copy.deepcopy(gm), gm, example)
    fresh = amp_fx.convert(zoo.Encoder().eval(), "O1", example_inputs=example)
    fresh.load_state_dict(gm.state_dict())
    assert torch.equal(fresh(*example), gm(*example))


def test_o2_load_state_dict_reaches_the_masters_so_the_next_step_keeps_it():
    """gm.load_state_dict at O2 loads the fp32 masters too; the next MasterWeightOptimizer step starts from the load."""
    def net():
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))

    x, y = torch.randn(32, 8), torch.randint(0, 2, (32,))
    torch.manual_seed(0)
    model = net()
    gm = amp_fx.convert(model, "O2")
    opt = amp_fx.MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3), gm)
    torch.manual_seed(1)
    checkpoint = net().state_dict()
    gm.load_state_dict(checkpoint)
    assert torch.equal(model[0].weight, checkpoint["0.weight"])  # the master took the loaded value
    opt.zero_grad()
    torch.nn.functional.cross_entropy(gm(x), y).backward()
    opt.step()
    moved = (model[0].weight - checkpoint["0.weight"]).abs().max().item()
    assert 0 < moved < 1e-2  # one small step from the checkpoint, not back to the old weights
    assert (gm.get_parameter("0.weight").float() - checkpoint["0.weight"]).abs().max().item() < 1e-2


def test_o2_a_parent_modules_load_state_dict_reaches_the_masters_and_buffers():
    """A converted O2 module inside a parent (Lightning's LightningModule, a wrapper): the parent's load_state_dict
    loads its masters and the model's buffers too, so the next step starts from the checkpoint."""
    def net():
        return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))

    torch.manual_seed(0)
    model = net()
    parent = nn.ModuleDict({"net": amp_fx.convert(model, "O2", dtype=torch.bfloat16), "head": nn.Linear(2, 2)})
    opt = amp_fx.MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3), parent["net"])
    torch.manual_seed(1)
    source = net()
    source[1].running_mean.uniform_(-1, 1)
    checkpoint = {f"net.{k}": v for k, v in source.state_dict().items()} | {f"head.{k}": v for k, v in parent["head"].state_dict().items()}
    parent.load_state_dict(checkpoint)
    assert torch.equal(model[0].weight, source[0].weight)  # the master, exactly
    assert torch.equal(model[1].running_mean, source[1].running_mean)  # the model's own buffer
    assert torch.equal(parent["net"].get_parameter("0.weight"), source[0].weight.to(torch.bfloat16))
    x, y = torch.randn(32, 8), torch.randint(0, 2, (32,))
    opt.zero_grad()
    torch.nn.functional.cross_entropy(parent["net"](x).float(), y).backward()
    opt.step()
    assert 0 < (model[0].weight - source[0].weight).abs().max().item() < 1e-2  # one step from the load
    with pytest.raises(amp_fx.AmpValueError, match="assign=True"):
        parent.load_state_dict(checkpoint, assign=True)


def test_o2_state_dict_holds_the_exact_masters_after_master_weight_steps():
    """After MasterWeightOptimizer steps, gm.state_dict() is the fp32 masters bit for bit, not the low copies widened."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    gm = amp_fx.convert(model, "O2")
    optimizer = amp_fx.MasterWeightOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), gm)
    for _ in range(3):
        gm(torch.randn(4, 8)).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    state = gm.state_dict()
    assert state.keys() == model.state_dict().keys()
    for key, master in model.state_dict().items():
        assert state[key].dtype == torch.float32 and torch.equal(state[key], master), key
    assert not torch.equal(model[0].weight, model[0].weight.bfloat16().float())  # the masters carry more than bf16


def test_o2_state_dict_of_low_copies_trained_directly_is_them_widened():
    """A low copy stepped without the masters no longer matches them: its own value is saved, widened."""
    model = nn.Sequential(nn.Linear(8, 4))
    gm = amp_fx.convert(model, "O2")
    with torch.no_grad():
        gm.get_parameter("0.weight").add_(1.0)
    state = gm.state_dict()
    assert torch.equal(state["0.weight"], gm.get_parameter("0.weight").float())
    assert not torch.equal(state["0.weight"], model[0].weight)
