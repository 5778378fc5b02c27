"""What amp_fx refuses, and why: one test per row of the README's catalogue of bad input.

Each refusal's message names the problem, where it is, and the fix; and no
refusal leaves the user's model (parameters, buffers, train/eval flags) or
optimizer (parameters, gradients, state) changed.  Rows that are not refused
but handled (float64/complex tensors, in-place ops on a cast value, a model
without float parameters) assert what happens instead.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections import OrderedDict

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_fx
from probes import captured_because
import zoo
from amp_fx.runtime import LossScaler, LossScalerStateError
from probes import OpRecorder


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@contextlib.contextmanager
def unchanged(model: nn.Module, optimizer=None):
    """Assert that the block leaves ``model`` and ``optimizer`` exactly as they were."""
    tensors = {k: (v, v.detach().clone()) for k, v in model.state_dict(keep_vars=True).items()}
    same = lambda a, b: a.shape == b.shape if a.is_meta else torch.equal(a, b)  # noqa: E731
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    flags = [m.training for m in model.modules()]
    opt_state = copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None
    yield
    after = model.state_dict(keep_vars=True)
    assert list(after) == list(tensors)
    for key, (obj, value) in tensors.items():
        assert after[key] is obj and obj.dtype == value.dtype and same(obj.detach(), value), key
    for name, p in model.named_parameters():
        assert (p.grad is None) == (grads[name] is None) and (p.grad is None or torch.equal(p.grad, grads[name])), name
    assert [m.training for m in model.modules()] == flags
    if optimizer is not None:
        assert repr(optimizer.state_dict()) == repr(opt_state)


def refused(model, error, *fragments, **convert_kwargs):
    """convert() raises ``error`` whose message holds every fragment, and the model is unchanged."""
    with unchanged(model), pytest.raises(error) as info:
        amp_fx.convert(model, **convert_kwargs)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in: {message}"
    return message


# -- options ------------------------------------------------------------------
def test_unknown_level():
    refused(zoo.MLP(), ValueError, "unknown level 'O4'", "O0, O1, O2, O3", level="O4")
    # Through the Apex-style API too, with an optimizer that has state to protect.
    model = zoo.MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 16)).sum().backward()
    optimizer.step()
    with unchanged(model, optimizer), pytest.raises(ValueError, match="unknown level 'O4'"):
        amp_fx.initialize(model, optimizer, opt_level="O4")


def test_unknown_dtype():
    refused(zoo.MLP(), ValueError, "dtype=torch.float32 is not a low-precision dtype", "torch.bfloat16",
            level="O1", dtype=torch.float32)


def test_unknown_policy_key():
    refused(zoo.MLP(), ValueError, "unknown policy key 'layer:fc1'", "'module:'", "'op:'",
            level="O1", policy={"layer:fc1": "fp32"})


def test_unknown_policy_decision():
    refused(zoo.MLP(), ValueError, "unknown policy decision 'half'", "'low', 'fp32'", level="O1", policy={"op:linear": "half"})


def test_a_policy_naming_a_module_the_model_does_not_have_suggests_close_matches():
    refused(zoo.MLP(), ValueError, "'fc3'", "does not have", "Did you mean 'fc2', 'fc1'?", "named_modules()",
            level="O1", policy={"module:fc3": "fp32"})


# -- the model ----------------------------------------------------------------
def test_a_non_module_is_refused():
    with pytest.raises(TypeError, match="expects a torch.nn.Module, got function.*Wrap a function in an nn.Module"):
        amp_fx.convert(lambda x: x, "O1")


def test_a_model_on_the_meta_device_is_refused():
    with torch.device("meta"):
        model = zoo.MLP()
    refused(model, ValueError, "meta device", "'fc1.weight'", "model.to_empty(device=...)", level="O2")


def test_a_model_without_float_parameters_converts_with_a_note():
    """Decided: converted (its activations still benefit); the report says there was nothing else."""

    class Codebook(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("codes", torch.randint(0, 4, (8, 8)))

        def forward(self, x):
            return x @ self.codes.float()

    model = Codebook()
    with unchanged(model):
        gm = amp_fx.convert(model, "O2")
    assert any("no floating-point parameters or buffers" in note for note in gm.amp_report.notes)
    assert gm.codes.dtype == torch.int64
    x = torch.randn(2, 8)
    torch.testing.assert_close(gm(x), model(x), atol=0.1, rtol=0.02)
    # A module with no parameters at all converts normally, without the note.
    plain = amp_fx.convert(nn.Softmax(-1), "O1")
    assert not plain.amp_report.notes


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        if h.sum() > 0:  # Python control flow on a tensor value
            return h * 2
        return h


def test_untraceable_control_flow_is_captured_and_the_report_names_the_line_and_the_ways_out():
    model = DataDependent()
    with unchanged(model):
        _, message = captured_because(model, "if h.sum() > 0", "test_refusals.py", "leaf_modules=", "example_inputs=",
                                      "backend='amp_fx'", level="O1")
    assert "DataDependent" in message


@pytest.mark.slow
def test_the_suggested_way_out_of_untraceable_control_flow_works():
    """The root module itself branches, so leaf_modules cannot help; torch.compile with the backend can."""
    model = DataDependent()
    x = torch.randn(3, 4)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend=amp_fx.backend(level="O1", inner="aot_eager", cast_model_outputs=False))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = model(x)
        out = compiled(x)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, expected)
    finally:
        torch._dynamo.reset()


def test_a_banned_op_names_the_node_and_the_safe_replacement():
    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 1)

        def forward(self, x, y):
            return F.binary_cross_entropy(torch.sigmoid(self.fc(x)).squeeze(-1), y)

    for level in ("O1", "O2"):
        refused(Classifier(), amp_fx.BannedOpError, "binary_cross_entropy is unsafe", "binary_cross_entropy_with_logits",
                "allow_banned=True", "node 'binary_cross_entropy'", "test_refusals.py", level=level)


# -- tensors amp_fx leaves alone ---------------------------------------------
class PhaseShift(nn.Module):
    """A complex buffer and a float64 parameter beside an ordinary Linear."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4, dtype=torch.float64))
        self.register_buffer("phase", torch.polar(torch.ones(4), torch.arange(4.0)))

    def forward(self, x):
        h = self.fc(x)
        return h * self.phase, (h.double() * self.scale).sum(-1)


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_complex_and_float64_tensors_are_left_untouched_and_the_report_says_so(level):
    model = PhaseShift()
    with unchanged(model):
        gm = amp_fx.convert(model, level)
    assert gm.phase.dtype == torch.complex64 and gm.get_parameter("scale").dtype == torch.float64
    assert any("phase (complex64)" in n and "scale (float64)" in n for n in gm.amp_report.notes)
    x = torch.randn(3, 4)
    with OpRecorder() as rec:
        rotated, total = gm(x)
    assert rotated.dtype == torch.complex64, "a complex value was cast (its imaginary part dropped)"
    assert total.dtype == torch.float64
    ref_rotated, ref_total = model(x)
    torch.testing.assert_close(rotated, ref_rotated, atol=0.05, rtol=0.02)
    torch.testing.assert_close(total, ref_total, atol=0.1, rtol=0.02)
    assert all(torch.float64 not in dtypes for name, dtypes in rec.calls if name == "_to_copy")


# -- in-place ops on a cast value: made safe --------------------------------
class InPlaceAfterCast(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        first = self.fc(x)  # reads x cast low
        x.mul_(2.0)  # writes the fp32 input the cast was made from
        scores = self.fc(x)
        scores.add_(1.0)  # writes a low GEMM output that softmax reads cast to fp32
        return first, scores.softmax(-1)


def test_in_place_ops_on_a_cast_value_are_made_safe():
    """Not refused: a cast of a value that an in-place op writes is made after the write."""
    model = InPlaceAfterCast()
    gm = amp_fx.convert(model, "O1")
    x = torch.randn(3, 8)
    first, probs = gm(x.clone())
    w, b = model.fc.weight.bfloat16(), model.fc.bias.bfloat16()
    with torch.no_grad():
        assert torch.equal(first, F.linear(x.bfloat16(), w, b))
        scores = F.linear((x * 2).bfloat16(), w, b) + 1  # the write is seen by the later readers
        assert probs.dtype == torch.float32 and torch.equal(probs, scores.float().softmax(-1))


# -- the runtime ----------------------------------------------------------------
def _scaled_step_setup():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    # One real step first, so the optimizer has state to protect.
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer, LossScaler(level="O1")


def test_unscale_twice_is_refused():
    model, optimizer, scaler = _scaled_step_setup()
    scaler.scale(model(torch.randn(3, 4)).sum()).backward()
    scaler.unscale_(optimizer)
    with unchanged(model, optimizer), pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called.*at most once"):
        scaler.unscale_(optimizer)


def test_step_before_scale_is_refused():
    model, optimizer, scaler = _scaled_step_setup()
    model(torch.randn(3, 4)).sum().backward()  # loss.backward() instead of scaler.scale(loss).backward()
    with unchanged(model, optimizer), pytest.raises(RuntimeError, match="scaler.scale\\(loss\\) was not called.*scaler.scale\\(loss\\).backward\\(\\)"):
        scaler.step(optimizer)


def test_step_twice_without_update_is_refused():
    model, optimizer, scaler = _scaled_step_setup()
    scaler.scale(model(torch.randn(3, 4)).sum()).backward()
    scaler.step(optimizer)
    with unchanged(model, optimizer), pytest.raises(RuntimeError, match="step\\(\\) has already been called.*scaler.update\\(\\)"):
        scaler.step(optimizer)


def test_a_scaler_state_from_another_level_is_refused():
    saved = LossScaler(level="O2", init_scale=1024.0).state_dict()
    scaler = LossScaler(level="O1")
    before = scaler.state_dict()
    with pytest.raises(LossScalerStateError, match="level 'O2'.*level 'O1'.*resume with the level"):
        scaler.load_state_dict(saved)
    assert scaler.state_dict() == before


def test_a_leaf_module_name_the_model_does_not_have_is_refused():
    with pytest.raises(ValueError, match=r"leaf_modules names 'c3'.*Did you mean 'c1'"):
        amp_fx.convert(nn.Sequential(OrderedDict(c1=nn.Linear(4, 4))), "O1", leaf_modules=["c3"])


def test_a_flag_that_is_not_a_bool_is_refused():
    with pytest.raises(TypeError, match="keep_batchnorm_fp32 must be True or False, got 'yes'"):
        amp_fx.convert(nn.Linear(4, 4), "O2", keep_batchnorm_fp32="yes")


def test_a_bare_tensor_as_example_inputs_is_refused_before_tracing():
    with pytest.raises(TypeError, match=r"write example_inputs=\(x,\)"):
        amp_fx.convert(nn.Conv2d(3, 4, 3), "O1", example_inputs=torch.randn(1, 3, 8, 8))


def test_example_inputs_the_model_rejects_are_refused_naming_the_node_and_shapes(capfd):
    """A shape the model cannot take is the user's mistake, not an unknown op: an error before any rewrite, and no torch log noise."""
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))
    with pytest.raises(amp_fx.AmpError, match=r"example inputs do not fit the model: linear .*\(8, 15\)") as caught:
        amp_fx.convert(model, "O1", example_inputs=(torch.randn(8, 15),))
    assert isinstance(caught.value, ValueError)
    assert "failed while attempting to run meta" not in capfd.readouterr().err
    assert amp_fx.convert(model, "O1", example_inputs=(torch.randn(8, 16),))(torch.randn(8, 16)).shape == (8, 4)
