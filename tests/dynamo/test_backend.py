"""torch.compile(model, backend="amp_fx"): the rewrite as a Dynamo backend (issue 4)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_fx
import zoo
from probes import Capture, aot_capture
from amp_fx.dynamo.graph import source_fqn, target_fqn
from amp_fx.ir.cast_nodes import is_inserted_cast





def _param_placeholders(gm):
    return [n for n in gm.graph.nodes if n.op == "placeholder" and "_parameters_" in str(n.target)]


# -- registration and the five core models -----------------------------------
def test_string_backend_is_registered_and_takes_options():
    """The entry point registers "amp_fx"; torch.compile's options= reach amp_fx.backend()."""
    assert "amp_fx" in torch._dynamo.list_backends(exclude_tags=())
    model, example, _ = zoo.build("mlp")
    compiled = torch.compile(model, backend="amp_fx", options={"level": "O1", "dtype": "bf16", "inner": "aot_eager",
                                                                 "cast_model_outputs": False})
    out = compiled(*example)
    assert out.dtype == torch.bfloat16  # the head Linear runs low, as under autocast
    report = amp_fx.last_report()
    assert len(report) == 1 and report.inner == "aot_eager" and report.dtype == "bfloat16"
    assert report.totals()["weight_casts"] == 6  # 3 Linear layers x (weight, bias)
    assert {r.module for r in report[0].casts if "weight cast" in r.reason} == {"fc1", "fc2", "head"}
    assert "inserted: fc1.weight to bfloat16" in {r.reason.split(" (")[0] for r in report[0].casts}
    # a second compiled model gets its own report; the first one's is kept
    other, other_example, _ = zoo.build("cnn")
    torch.compile(other, backend="amp_fx", options={"inner": "aot_eager"})(*other_example)
    assert amp_fx.last_report() is not report and len(report) == 1
    assert {r.module for r in amp_fx.last_report()[0].casts if "weight cast" in r.reason} == {"conv1", "conv2", "head"}


@pytest.mark.parametrize("name", ["mlp", "cnn", "encoder", "lstm", "sdpa"])
def test_core_models_match_autocast_and_fp32(name):
    """Each core model under backend=amp_fx agrees with torch.autocast + the same inner backend, and with fp32."""
    model, example, _ = zoo.build(name)
    with torch._dynamo.config.patch(allow_rnn=(name == "lstm")):
        reference = model(*example)
        out = torch.compile(model, backend=amp_fx.backend(inner="aot_eager"))(*example)
        report = amp_fx.last_report()
        torch._dynamo.reset()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast_out = torch.compile(model, backend="aot_eager")(*example)
    assert report.count("low") >= 2 and report.weight_casts >= 2
    torch.testing.assert_close(out.float(), autocast_out.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), reference, atol=3e-2, rtol=3e-2)


# -- what a Dynamo graph looks like --------------------------------------------
class SharedWeight(nn.Module):
    """One Linear whose weight is read three times (two calls and a view)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        a = self.fc(x)
        b = self.fc(F.relu(a))
        return b + a @ self.fc.weight.t()


def test_each_parameter_cast_once_per_forward():
    """However often a parameter is used, the graph casts it once, and AOT's forward keeps it at one."""
    inner, fw, _ = aot_capture()
    capture = Capture()

    def both(gm, example_inputs):
        capture(gm, example_inputs)
        return inner(gm, example_inputs)

    model = SharedWeight()
    x = torch.randn(4, 8)
    out = torch.compile(model, backend=amp_fx.backend(inner=both))(x)
    torch.testing.assert_close(out.float(), model(x), atol=3e-2, rtol=3e-2)
    (graph,) = capture.graphs
    params = _param_placeholders(graph)
    assert len(params) == 2
    for param in params:
        casts = [u for u in param.users if is_inserted_cast(u)]
        assert len(casts) == 1, param.name
        assert all(u in casts for u in param.users)  # nothing reads the fp32 weight any more
    assert amp_fx.last_report()[0].weight_casts == 2
    primals = [n for n in fw[0].graph.nodes if n.op == "placeholder"]
    weight = primals[[n.name for n in graph.graph.nodes if n.op == "placeholder"].index(params[0].name)]
    assert sum(1 for u in weight.users if u.target == torch.ops.aten._to_copy.default) == 1


def test_placeholder_names_become_fqns():
    """Dynamo sources and placeholder names map back to the parameter's qualified name."""
    assert source_fqn("L['self']._modules['fc1']._parameters['weight']") == "fc1.weight"
    assert source_fqn("L['self']._modules['layers']._modules['0']._modules['layer_norm']._buffers['running_mean']") == "layers.0.layer_norm.running_mean"
    assert source_fqn("L['x']") is None
    assert target_fqn("L_self_modules_layer_norm_parameters_weight_") == "layer_norm.weight"
    assert target_fqn("L_x_") is None


class Broken(nn.Module):
    """A print and a data-dependent branch: three Dynamo graphs."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        print("graph break")
        x = self.fc2(x)
        x = x * 2 if x.sum() > 0 else x - 1
        return self.fc3(x)


def test_graph_broken_model_is_converted_in_every_piece(capsys):
    """Every graph of a graph-broken model is converted; last_report() gathers them all."""
    capture = Capture()
    model = Broken()
    x = torch.randn(3, 8)
    out = torch.compile(model, backend=amp_fx.backend(inner=capture))(x)
    torch.testing.assert_close(out.float(), model(x), atol=3e-2, rtol=3e-2)
    report = amp_fx.last_report()
    assert len(capture.graphs) == len(report) == 3
    for graph in capture.graphs:
        (gemm,) = [n for n in graph.graph.nodes if n.op == "call_function" and n.target is torch._C._nn.linear]
        # example values are refreshed after the rewrite: the GEMM reads and makes bf16
        assert all(a.meta["example_value"].dtype == torch.bfloat16 for a in gemm.args)
        assert gemm.meta["example_value"].dtype == torch.bfloat16
    totals = report.totals()
    assert totals["graphs"] == 3 and totals["low_nodes"] == 3 and totals["weight_casts"] == 6
    assert totals["casts_inserted"] == sum(r.totals()["casts_inserted"] for r in report)
    assert [g.compile_id for g in report.graphs] == ["0/0", "1/0", "2/0"]
    assert report.to_dict()["totals"]["graphs"] == 3 and "g2:" in report.nodes[-1].name


def test_dynamic_shapes_are_not_specialised():
    """Converting a dynamic-shape graph adds no guards: three input shapes, two graphs (static, then dynamic)."""
    model, _, _ = zoo.build("sdpa")
    compiled = torch.compile(model, backend=amp_fx.backend(inner="aot_eager"))
    for batch, tokens in ((2, 6), (3, 7), (4, 9)):
        x = torch.randn(batch, tokens, 32)
        torch.testing.assert_close(compiled(x), model(x), atol=3e-2, rtol=3e-2)
    report = amp_fx.last_report()
    assert len(report) == 2  # 0/0 static, 0/1 dynamic: no pass specialised a size


def test_level_o0_leaves_graphs_alone():
    """O0 hands Dynamo's graph to the inner backend unchanged."""
    model, example, _ = zoo.build("mlp")
    out = torch.compile(model, backend=amp_fx.backend(level="O0", inner="aot_eager"))(*example)
    assert out.dtype == torch.float32
    assert amp_fx.last_report().totals()["casts_inserted"] == 0
    torch.testing.assert_close(out, model(*example))


def test_bad_settings_are_refused():
    with pytest.raises(TypeError, match="unknown conversion option"):
        amp_fx.backend(levle="O1")
    with pytest.raises(ValueError, match="twice"):
        amp_fx.backend(inner="amp_fx")
    model, example, _ = zoo.build("mlp")
    with pytest.raises(Exception, match="amp_fx has no modes"):
        torch.compile(model, backend="amp_fx", mode="max-autotune")(*example)


# -- O2 / O3 -----------------------------------------------------------------
def test_o2_o3_route_through_convert():
    """The backend refuses O2/O3 and names the route; torch.compile(convert(model, 'O2')) works."""
    with pytest.raises(ValueError, match=r"torch\.compile\(amp_fx\.convert\(model, level='O2'\)\)"):
        amp_fx.backend(level="O2")
    model, example, _ = zoo.build("mlp")
    with pytest.raises(Exception, match=r"amp_fx\.convert\(model, level='O3'\)"):
        torch.compile(model, backend="amp_fx", options={"level": "O3", "inner": "aot_eager"})(*example)
    converted = amp_fx.convert(model, level="O2")
    compiled = torch.compile(converted, backend="aot_eager")
    out = compiled(*example)
    assert out.dtype == torch.float32 and converted.fc1.weight.dtype == torch.bfloat16
    torch.testing.assert_close(out, converted(*example), atol=0, rtol=0)
    torch.testing.assert_close(out, model(*example), atol=3e-2, rtol=3e-2)


# -- outer autocast ----------------------------------------------------------
def test_outer_autocast_is_disabled_inside_compiled_graphs():
    """Under an outer torch.autocast the compiled model computes exactly what it does without one."""
    capture = Capture()
    model, example, _ = zoo.build("mlp")
    # fc2 pinned to fp32: an outer autocast that leaked in would run it low.
    compiled = torch.compile(model, backend=amp_fx.backend(inner=capture, policy={"module:fc2": "fp32"}))
    plain = compiled(*example)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = compiled(*example)
        leaky = model(*example)
    assert capture.autocast_on == [False, False]  # the recompile under autocast was converted with it off
    assert torch.equal(plain, under)
    assert not torch.equal(leaky, under)  # plain autocast would have run fc2 low


@pytest.mark.slow
def test_default_inner_inductor():
    """The default inner backend, inductor, compiles the rewritten graph (forward and backward)."""
    model, example, _ = zoo.build("mlp")
    compiled = torch.compile(model, backend="amp_fx", options={"cast_model_outputs": False})
    out = compiled(*example)
    assert out.dtype == torch.bfloat16 and amp_fx.last_report().inner == "inductor"
    torch.testing.assert_close(out.float(), model(*example), atol=3e-2, rtol=3e-2)
    out.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


# -- known limits (documented in the README) ---------------------------------
class MixedConv(nn.Module):
    """Feeds a bf16 activation to an fp32 conv weight: legal only where something casts."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return F.conv2d(x.bfloat16(), self.conv.weight, self.conv.bias)


def test_known_limit_mixed_dtype_call_rejected_before_the_backend():
    """Dynamo's fake conv rejects mixed dtypes before amp_fx sees the graph; convert() handles the same code."""
    capture = Capture()
    model, x = MixedConv(), torch.randn(1, 3, 6, 6)
    with pytest.raises(Exception, match="expected|dtype|type"):
        torch.compile(model, backend=amp_fx.backend(inner=capture), fullgraph=True)(x)
    assert capture.graphs == []
    out = amp_fx.convert(model, cast_model_outputs=False)(x)
    assert out.dtype == torch.bfloat16


def test_known_limit_rnn_frames_skipped_without_allow_rnn():
    """Without torch._dynamo.config.allow_rnn Dynamo never hands the LSTM model's frame to the backend.

    The frame runs eagerly, and amp_fx's eager mode gives its ops the tables' decisions: the LSTM and the head
    run bf16 (uncompiled), and NothingConvertedWarning says that no graph was converted."""
    capture = Capture()
    model, example, _ = zoo.build("lstm")
    with pytest.warns(amp_fx.NothingConvertedWarning, match="LSTM"):
        out = torch.compile(model, backend=amp_fx.backend(inner=capture, cast_model_outputs=False))(*example)
    assert capture.graphs == [] and out.dtype == torch.bfloat16  # ran eagerly, decided by amp_fx's eager mode
    with torch._dynamo.config.patch(allow_rnn=True):
        torch._dynamo.reset()
        out = torch.compile(model, backend=amp_fx.backend(inner=capture, cast_model_outputs=False))(*example)
    assert len(capture.graphs) == 1 and out.dtype == torch.bfloat16
