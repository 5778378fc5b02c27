"""convert() at every level, and the invariants of DESIGN.md that users rely on."""

from __future__ import annotations

import copy
import io
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_fx
import zoo
from amp_fx.ir.cast_nodes import cast_source, cast_target, is_inserted_cast
from probes import OpRecorder

LOW_DTYPES = [torch.bfloat16, torch.float16]


def _casts(gm):
    return [n for n in gm.graph.nodes if is_inserted_cast(n)]


def _snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}, [m.training for m in model.modules()]


@pytest.mark.parametrize("name", list(zoo.CORE_MODELS))
def test_o0_is_bit_identical_in_outputs_and_gradients(name):
    model, example, kwargs = zoo.build(name)
    gm = amp_fx.convert(model, "O0", **kwargs)
    assert not _casts(gm)
    out, ref = gm(*example), model(*example)
    assert torch.equal(out, ref)
    out.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model(*example).sum().backward()
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, grads[n]), n


@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
@pytest.mark.parametrize("name", list(zoo.CORE_MODELS))
def test_every_level_and_dtype_converts_the_core_models(name, level, dtype):
    model, example, kwargs = zoo.build(name)
    before, flags = _snapshot(model)
    gm = amp_fx.convert(model, level, dtype=dtype, **kwargs)
    # convert() never mutates the model it is given.
    after, flags_after = _snapshot(model)
    assert flags == flags_after
    for key, value in before.items():
        assert after[key].dtype == value.dtype and torch.equal(after[key], value), key
    assert list(gm.state_dict()) == list(model.state_dict())
    out = gm(*example)
    ref = model(*example)
    assert out.shape == ref.shape
    tol = {"O0": 0, "O1": 0.05, "O2": 0.1, "O3": 0.1}[level]
    assert (out.float() - ref).abs().max().item() <= tol * max(1.0, ref.abs().max().item())


def test_dtype_defaults_to_bfloat16_for_a_cpu_model():
    gm = amp_fx.convert(zoo.MLP(), "O1", cast_model_outputs=False)
    assert gm.amp_config.dtype == torch.bfloat16
    assert gm(*zoo.MLP.example()).dtype == torch.bfloat16


def test_o1_shares_parameters_and_gradients_reach_the_original_model():
    model = zoo.MLP()
    gm = amp_fx.convert(model, "O1")
    assert gm.fc1.weight is model.fc1.weight
    assert all(p.dtype == torch.float32 for p in gm.parameters())
    gm(*zoo.MLP.example()).float().sum().backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.dtype == torch.float32, name
        assert param.grad.abs().sum() > 0, name


def test_o1_training_the_converted_module_trains_the_model():
    model = zoo.MLP()
    gm = amp_fx.convert(model, "O1")
    before = model.fc1.weight.detach().clone()
    opt = torch.optim.SGD(gm.parameters(), lr=0.1)
    gm(*zoo.MLP.example()).float().pow(2).mean().backward()
    opt.step()
    assert not torch.equal(model.fc1.weight, before)


@pytest.mark.parametrize("level, norm_dtype", [("O2", torch.float32), ("O3", torch.bfloat16)])
def test_o2_params_low_except_norms_and_o3_all_low(level, norm_dtype):
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 8), nn.BatchNorm1d(8))
    gm = amp_fx.convert(model, level)
    assert gm.get_parameter("0.weight").dtype == torch.bfloat16
    assert gm.get_parameter("2.weight").dtype == torch.bfloat16
    for name in ("1.weight", "1.bias", "3.weight", "3.bias"):
        assert gm.get_parameter(name).dtype == norm_dtype, name
    assert gm.get_buffer("3.running_mean").dtype == norm_dtype
    assert all(p.dtype == torch.float32 for p in model.parameters())
    out = gm(torch.randn(5, 4))
    assert out.dtype == torch.float32  # cast_model_outputs


def test_keep_batchnorm_fp32_override_at_o3():
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
    gm = amp_fx.convert(model, "O3", keep_batchnorm_fp32=True)
    assert gm.get_parameter("1.weight").dtype == torch.float32
    assert gm.get_parameter("0.weight").dtype == torch.bfloat16


def test_o2_masters_are_the_original_parameters():
    model = zoo.MLP()
    gm = amp_fx.convert(model, "O2")
    assert gm.amp_fx_masters["fc1.weight"] is model.fc1.weight
    assert set(gm.amp_fx_masters) == {n for n, _ in gm.named_parameters()}


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_o2_o3_state_dict_holds_original_dtypes_and_round_trips(level):
    model, example, _ = zoo.build("cnn")
    gm = amp_fx.convert(model, level)
    state = gm.state_dict()
    assert list(state) == list(model.state_dict())
    for key, value in model.state_dict().items():
        assert state[key].dtype == value.dtype, key
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    fresh = amp_fx.convert(zoo.SmallCNN(), level)
    fresh.load_state_dict(torch.load(buffer))
    fresh.eval(), gm.eval()
    assert torch.equal(fresh(*example), gm(*example))
    # An fp32 checkpoint of the plain model loads into the converted form.
    plain = zoo.SmallCNN()
    fresh.load_state_dict(plain.state_dict())
    assert fresh.conv1.weight.dtype == torch.bfloat16
    assert torch.equal(fresh.conv1.weight, plain.conv1.weight.to(torch.bfloat16))


def test_o1_state_dict_round_trip_is_exact():
    model, example, _ = zoo.build("mlp")
    gm = amp_fx.convert(model, "O1")
    other = amp_fx.convert(zoo.MLP(), "O1")
    other.load_state_dict(gm.state_dict())
    assert torch.equal(other(*example), gm(*example))


def test_unused_parameters_and_non_persistent_buffers_keep_the_state_dict_layout():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.used = nn.Linear(4, 4)
            self.unused = nn.Linear(4, 4)
            self.register_buffer("table", torch.ones(4), persistent=False)

        def forward(self, x):
            return self.used(x) * self.table

    model = M()
    for level in ("O1", "O2"):
        assert list(amp_fx.convert(model, level).state_dict()) == list(model.state_dict())


def test_converting_twice_changes_nothing_and_says_so():
    model, example, _ = zoo.build("sdpa")
    once = amp_fx.convert(model, "O1")
    twice = amp_fx.convert(once, "O1")
    assert twice.code == once.code
    assert torch.equal(twice(*example), once(*example))
    assert any("already converted" in note for note in twice.amp_report.notes)
    with pytest.raises(amp_fx.AlreadyConvertedError, match="Convert the original model"):
        amp_fx.convert(once, "O2")


def test_rerunning_the_pipeline_on_a_converted_graph_inserts_nothing():
    from amp_fx.ir.pass_manager import PassContext
    from amp_fx.converter.pipeline import rewrite_graph

    gm = amp_fx.convert(zoo.SDPABlock(), "O1")
    code = gm.code
    again, report = rewrite_graph(copy.deepcopy(gm), PassContext(config=gm.amp_config), own_params=False)
    assert report.passes["insert_casts"]["casts_inserted"] == 0
    assert not report.passes["insert_casts"]["modified"]
    assert again.code == code


@pytest.mark.parametrize("name", ["mlp", "sdpa", "cnn", "encoder"])
def test_one_cast_per_value_and_dtype_and_no_cast_chains(name):
    model, example, kwargs = zoo.build(name)
    gm = amp_fx.convert(model, "O1", **kwargs)
    keys = [(cast_source(n), cast_target(n)) for n in _casts(gm)]
    assert len(keys) == len(set(keys))
    for cast in _casts(gm):
        assert not is_inserted_cast(cast_source(cast)), f"{cast.name} casts a cast"


def test_no_cast_targets_the_dtype_its_input_already_has():
    model, example, _ = zoo.build("sdpa")
    gm = amp_fx.convert(model, "O1", example_inputs=example)
    seen = []

    class Watch(torch.fx.Interpreter):
        def run_node(self, n):
            if is_inserted_cast(n):
                seen.append((n.name, self.env[cast_source(n)].dtype, cast_target(n)))
            return super().run_node(n)

    Watch(gm).run(*example)
    assert seen and all(src != dst for _, src, dst in seen), seen


def test_a_weight_used_three_times_one_through_a_view_is_cast_once():
    class ThreeUses(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8))

        def forward(self, x):
            return F.linear(x, self.w) + x @ self.w + x @ self.w.t()

    gm = amp_fx.convert(ThreeUses(), "O1", cast_model_outputs=False)
    weight_casts = [n for n in _casts(gm) if cast_source(n).op == "get_attr"]
    assert len(weight_casts) == 1
    assert gm.amp_report.totals()["weight_casts"] == 1
    x = torch.randn(3, 8)
    with OpRecorder() as rec:
        gm(x)
    assert rec.count({"_to_copy"}) == 2  # the weight once, the input once
    ref = ThreeUses()
    ref.load_state_dict(gm.state_dict())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = ref(x)
    torch.testing.assert_close(gm(x), expected)


def test_integer_inputs_pass_through_untouched():
    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 8)
            self.proj = nn.Linear(8, 8)

        def forward(self, ids, mask):
            h = self.proj(self.embed(ids))
            return h.masked_fill(~mask.unsqueeze(-1), 0.0).sum(1), ids + 1

    ids = torch.randint(0, 10, (2, 5))
    mask = torch.rand(2, 5) > 0.5
    for level in ("O1", "O2", "O3"):
        gm = amp_fx.convert(Masked(), level)
        with OpRecorder() as rec:
            out, ids_out = gm(ids, mask)
        assert ids_out.dtype == torch.int64 and torch.equal(ids_out, ids + 1)
        casted = [d for name, d in rec.calls if name == "_to_copy"]
        assert all(dtypes for dtypes in casted), "an integer or bool tensor was cast"


def test_floating_inputs_may_arrive_fp32_or_already_low():
    model, example, _ = zoo.build("sdpa")
    gm = amp_fx.convert(model, "O1", cast_model_outputs=False)
    x = example[0]
    out32, out16 = gm(x), gm(x.to(torch.bfloat16))
    # The residual add follows its inputs, as under autocast: fp32 in, fp32 out.
    assert out32.dtype == torch.float32 and out16.dtype == torch.bfloat16
    assert (out32 - out16.float()).abs().max() < 0.1


def test_outer_autocast_does_not_cast_twice():
    model, example, _ = zoo.build("sdpa")
    gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16)
    expected = gm(*example)
    with torch.autocast("cpu", dtype=torch.float16):
        with OpRecorder() as rec:
            inside = gm(*example)
    assert torch.equal(inside, expected)
    assert torch.float16 not in {d for _, ds in rec.calls for d in ds}


def test_module_without_parameters_converts():
    class Attention(nn.Module):
        def forward(self, q, k, v):
            return torch.softmax(q @ k.transpose(-1, -2), -1) @ v

    gm = amp_fx.convert(Attention(), "O1", cast_model_outputs=False)
    q = torch.randn(2, 4, 8)
    assert gm(q, q, q).dtype == torch.bfloat16
    assert gm.amp_report.totals()["low_nodes"] == 2


def test_low_precision_parameters_convert_at_o1_by_their_actual_dtype():
    model = zoo.MLP().to(torch.bfloat16)
    gm = amp_fx.convert(model, "O1", cast_model_outputs=False)
    assert gm.amp_report.totals()["weight_casts"] == 0
    assert gm(torch.randn(2, 16)).dtype == torch.bfloat16

    class SoftmaxHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4).to(torch.bfloat16)

        def forward(self, x):
            return self.fc(x).softmax(-1)

    assert amp_fx.convert(SoftmaxHead(), "O1")(torch.randn(2, 4)).dtype == torch.float32


def test_in_place_fp32_op_on_a_low_value_is_computed_in_fp32_and_written_back():
    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            h = self.fc(x)
            h.exp_()
            return h

    model = InPlace()
    gm = amp_fx.convert(model, "O1", cast_model_outputs=False)
    x = torch.randn(3, 4)
    out = gm(x)
    assert out.dtype == torch.bfloat16
    with torch.no_grad():
        h = F.linear(x.bfloat16(), model.fc.weight.bfloat16(), model.fc.bias.bfloat16())
    assert torch.equal(out.detach(), h.float().exp().bfloat16())
    record = next(r for r in gm.amp_report.nodes if r.op == "exp")
    assert record.decision == "fp32" and "in-place" in record.reason


def test_report_reads_as_a_table_and_serialises_to_json():
    gm = amp_fx.convert(zoo.SDPABlock(), "O1", policy={"module:proj": "fp32"})
    report = gm.amp_report
    text = str(report)
    assert "level O1" in text and "linear" in text and "policy module 'proj' -> fp32" in text
    data = json.loads(report.to_json())
    assert data["totals"]["casts_inserted"] == len(report.casts) > 0
    assert amp_fx.ConversionReport.from_dict(data).totals() == report.totals()
    proj = next(r for r in report.nodes if r.module == "proj" and r.op == "linear")
    assert proj.decision == "fp32" and proj.rule == "policy"


def test_unknown_ops_are_counted_and_on_unknown_op_changes_them():
    class Odd(nn.Module):
        def forward(self, x):
            return torch.special.i0(x) + 1

    gm = amp_fx.convert(Odd(), "O1")
    assert gm.amp_report.totals()["unknown_ops"] == {"special_i0": 1}
    lowin = lambda: amp_fx.convert(nn.Sequential(nn.Linear(3, 3), Odd()), "O1", on_unknown_op="fp32")
    assert lowin()(torch.randn(2, 3)).dtype == torch.float32
    with pytest.raises(amp_fx.UnknownOpError, match="special_i0"):
        amp_fx.convert(Odd(), "O1", on_unknown_op="error")


def test_export_route_is_used_when_symbolic_tracing_fails():
    model, example, kwargs = zoo.build("encoder")
    gm = amp_fx.convert(model, "O1", **kwargs)
    assert gm.amp_report.route == "torch.export"
    with OpRecorder() as rec:
        gm(*example)
    gemm_dtypes = rec.dtypes_of({"addmm", "mm", "bmm", "linear", "_scaled_dot_product_flash_attention_for_cpu"})
    assert gemm_dtypes and all(d == {torch.bfloat16} for d in gemm_dtypes.values()), gemm_dtypes


def test_attributes_only_the_model_has_are_read_or_refused_by_name():
    """Code around a converted module reads the model's interface (a LightningModule's self.model.hidden_size,
    self.model.encode(x)). Plain values are read from the model (no computation, no precision at stake); a method
    runs on a copy captured from the call (converter/call_capture.py); a loose tensor would bypass the conversion:
    refused by name."""
    class Net(nn.Module):
        label = "net"

        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.hidden_size, self.sizes = 4, {"in": 4, "out": 4}
            self.loose = torch.ones(4)  # neither parameter nor buffer

        def encode(self, x):
            return self.fc(x)

        def forward(self, x):
            return self.fc(x)

    model = Net()
    gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16)
    assert (gm.hidden_size, gm.sizes, gm.label) == (4, {"in": 4, "out": 4}, "net")
    x = torch.randn(2, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model.encode(x)
    encoded = gm.encode(x)  # the model's method on a captured copy: its own ops decided, never fp32 in silence
    assert encoded.dtype == torch.bfloat16 and torch.equal(encoded, expected)
    with pytest.raises(amp_fx.AmpAttributeError, match=r"Net.loose \(Tensor\) is not part of the converted module"):
        gm.loose
    with pytest.raises(AttributeError, match="no attribute 'nothing'") as missing:
        gm.nothing
    assert not isinstance(missing.value, amp_fx.AmpError)
