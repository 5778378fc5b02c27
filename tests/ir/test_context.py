"""The typed pass context and the one device rule (amp_fx/ir/devices.py), each resolved once per conversion.

Also amp_fx's own train/eval switches (no frozen-mode warning, no frame
inspection) and the one outer-autocast guard (amp_fx/graph_ops/outer_autocast.py).
"""

import dataclasses
import warnings

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

import amp_fx
import amp_fx.converter.api as api
import amp_fx.ir.pass_manager as pass_manager
from amp_fx.ir.analysis import eval_mode
from amp_fx.ir.config import make_config
from amp_fx.ir.devices import device_type_of, low_dtype_for
from amp_fx.converter.graph_module import FrozenTrainingWarning, switching_modes
from amp_fx.graph_ops.outer_autocast import call_without_outer_autocast, no_outer_autocast
from amp_fx.ir.pass_manager import PassContext, run_passes
from amp_fx.passes.propagate_meta import propagate_meta


def _fake(*shape, dtype=torch.float32, device="cuda"):
    """A fake tensor on ``device``: what Dynamo and torch.export record on nodes (no CUDA needed)."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        return torch.empty(*shape, dtype=dtype, device=device)


class NoParams(nn.Module):
    def forward(self, q, k):
        return torch.softmax(q @ k.transpose(-1, -2), -1)


class Indices(nn.Module):
    """Only an integer buffer: no floating tensor of its own."""

    def __init__(self):
        super().__init__()
        self.register_buffer("index", torch.arange(4))

    def forward(self, x):
        return x[:, self.index]


# -- the device rule -----------------------------------------------------------
def test_cpu_model_is_cpu_with_or_without_example_inputs():
    model = nn.Linear(4, 4)
    assert device_type_of(model) == "cpu"
    assert device_type_of(model, (torch.randn(2, 4),)) == "cpu"
    assert low_dtype_for(device_type_of(model)) == torch.bfloat16


def test_model_without_parameters():
    """No tensor at all: "cpu"; the example inputs decide when there are some."""
    assert device_type_of(NoParams()) == "cpu"
    assert device_type_of(NoParams(), (_fake(2, 3), _fake(2, 3))) == "cuda"


def test_example_inputs_may_be_nested():
    assert device_type_of(None, [{"q": [_fake(2, 3)]}]) == "cuda"


def test_a_floating_tensor_decides_before_an_integer_one():
    """Integer token ids elsewhere do not outvote the floating tensors the model computes with."""
    ids = _fake(2, dtype=torch.long)
    assert device_type_of(nn.Linear(4, 4), (ids,)) == "cpu"
    # ... but a model of integer tensors only still runs where they are.
    assert device_type_of(Indices(), (ids,)) == "cuda"
    assert device_type_of(Indices()) == "cpu"


def test_meta_tensors_are_not_evidence():
    meta_model = nn.Linear(4, 4, device="meta")
    assert device_type_of(meta_model) == "cpu"
    assert device_type_of(meta_model, (_fake(2, 4),)) == "cuda"


def test_graph_node_values_are_evidence():
    """A Dynamo / export graph: the fake values on its nodes carry the real device."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.relu, (x,)))
    gm = fx.GraphModule(nn.Module(), graph)
    assert device_type_of(gm) == "cpu"
    x.meta["example_value"] = _fake(2, 3)  # Dynamo's key
    assert device_type_of(gm) == "cuda"
    del x.meta["example_value"]
    x.meta["val"] = _fake(2, 3)  # torch.export's key
    assert device_type_of(gm) == "cuda"
    assert device_type_of(gm, (torch.randn(2, 3),)) == "cpu"  # the example inputs come first


# -- the typed context ------------------------------------------------------------
def test_pass_context_has_typed_fields_and_no_catch_all():
    ctx = PassContext(config=make_config("O1"))
    assert not hasattr(ctx, "extra")
    names = {f.name for f in dataclasses.fields(PassContext)}
    assert {"device_type", "placeholder_params", "source_dtypes"} <= names
    assert ctx.device_type is None and ctx.source_dtypes == {} and ctx.placeholder_params == {}


def test_run_passes_fills_the_device_when_the_caller_did_not():
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.relu, (x,)))
    x.meta["example_value"] = _fake(2, 3)
    ctx = PassContext(config=make_config("O1"))
    run_passes(fx.GraphModule(nn.Module(), graph), ctx, [propagate_meta])
    assert ctx.device_type == "cuda"
    told = PassContext(config=make_config("O1"), device_type="xpu")
    run_passes(fx.GraphModule(nn.Module(), graph), told, [propagate_meta])
    assert told.device_type == "xpu"  # what the caller decided stands


def test_convert_decides_the_device_once(monkeypatch):
    """convert() asks the rule once, before tracing; run_passes then finds it decided."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(args)
        return device_type_of(*args, **kwargs)

    monkeypatch.setattr(api, "device_type_of", counted)
    monkeypatch.setattr(pass_manager, "device_type_of", lambda *a, **k: pytest.fail("device decided twice"))
    model, x = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)), torch.randn(4, 8)
    gm = amp_fx.convert(model, "O1", example_inputs=(x,))
    assert len(calls) == 1 and gm.amp_config.dtype == torch.bfloat16
    torch.testing.assert_close(gm(x), model(x), atol=3e-2, rtol=3e-2)


def test_passes_read_the_decided_device(monkeypatch):
    """Told the model runs on CUDA, convert picks float16 and pad_gemm='auto' pads: both read ctx.device_type."""
    model, x = nn.Linear(1001, 1003), torch.randn(2, 1001, requires_grad=True)
    cpu = amp_fx.convert(model, "O1")
    assert cpu.amp_report.passes["pad_gemm"]["padded"] == 0
    monkeypatch.setattr(api, "device_type_of", lambda *args, **kwargs: "cuda")
    gm = amp_fx.convert(model, "O1")
    assert gm.amp_config.dtype == torch.float16
    assert gm.amp_report.passes["pad_gemm"]["padded"] == 1
    out = gm(x)  # float16 GEMMs run on CPU too: the padded graph computes the same linear
    assert out.shape == (2, 1003) and out.dtype == torch.float32
    reference = x.detach().clone().requires_grad_()
    torch.testing.assert_close(out, model(reference), atol=2e-2, rtol=2e-2)
    out.sum().backward()
    model(reference).sum().backward()
    torch.testing.assert_close(x.grad, reference.grad, atol=2e-2, rtol=2e-2)


def test_source_dtypes_reach_the_converted_module():
    """cast_params writes ctx.source_dtypes; convert hands them to state_dict(): fp32 comes back."""
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    gm = amp_fx.convert(model, "O2", dtype=torch.bfloat16)
    assert gm.amp_fx_source_dtypes == {"0.weight": torch.float32, "0.bias": torch.float32}
    assert gm.get_parameter("0.weight").dtype == torch.bfloat16
    assert {t.dtype for t in gm.state_dict().values()} == {torch.float32}


# -- amp_fx's own train/eval switches -----------------------------------------------
class Branches(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if self.training:
            x = x * 2
        return self.fc(x)


def test_amp_fx_switching_modes_does_not_warn_but_the_user_does():
    x = torch.randn(2, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gm = amp_fx.convert(Branches().train(), "O1", example_inputs=(x,))  # the analysis runs it in eval mode
        with eval_mode(gm):
            assert not gm.training
        assert gm.training
        with switching_modes():
            gm.eval()
        gm.train()
    with pytest.warns(FrozenTrainingWarning, match="training=True"):
        gm.eval()  # outside amp_fx's switches: the user's, and the graph keeps training=True


# -- the outer-autocast guard ---------------------------------------------------------
def test_outer_autocast_is_off_inside_and_restored_after():
    seen = []

    def probe(value, *, scale):
        seen.append(torch.is_autocast_enabled("cpu"))
        return value * scale

    assert call_without_outer_autocast(probe, 2, scale=3) == 6
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert call_without_outer_autocast(probe, 2, scale=3) == 6
        assert torch.is_autocast_enabled("cpu")
        with no_outer_autocast():
            assert not torch.is_autocast_enabled("cpu")
            a = torch.randn(4, 4)
            assert (a @ a).dtype == torch.float32
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert seen == [False, False]
