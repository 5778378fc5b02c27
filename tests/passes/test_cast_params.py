"""cast_params: O2/O3 give the module low parameters and buffers once; norms stay fp32 when asked.

``check`` counts a parameter's or buffer's dtype as a change (``modified``
must say so), asserts a second run casts nothing, and with ``finish=True``
compares the finished module's outputs and gradients with the fp32 model's.
"""

import pytest
import torch
import torch.nn as nn

import amp_fx
from amp_fx.passes.cast_params import cast_params
from pass_check import check

D = 8


class Net(nn.Module):
    """A Linear, a BatchNorm (parameters, running statistics, an int64 counter) and a LayerNorm."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.bn = nn.BatchNorm1d(D)
        self.ln = nn.LayerNorm(D)
        self.out = nn.Linear(D, 2)

    def forward(self, x):
        return self.out(self.ln(self.bn(self.fc(x)).relu()))


def _inputs():
    return (torch.randn(4, D),)


def _dtypes(module):
    return {name: t.dtype for name, t in list(module.named_parameters()) + list(module.named_buffers())}


def test_o2_casts_every_floating_tensor_but_the_norms_once():
    model = Net().eval()
    gm = check(cast_params, model, _inputs(), level="O2", delta=0, expect_modified=True, finish=True, atol=0.1)
    dtypes = _dtypes(gm)
    low = {n for n, d in dtypes.items() if d == torch.bfloat16}
    assert low == {"fc.weight", "fc.bias", "out.weight", "out.bias"}
    assert {n for n in dtypes if n.startswith(("bn.", "ln."))} == {n for n, d in dtypes.items() if d != torch.bfloat16}
    assert dtypes["bn.num_batches_tracked"] == torch.int64 and dtypes["bn.running_mean"] == torch.float32
    # The traced copy was cast: the user's model keeps its fp32 tensors.
    assert set(_dtypes(model).values()) == {torch.float32, torch.int64}


def test_without_keep_batchnorm_fp32_the_norms_go_low_too():
    gm = check(cast_params, Net().eval(), _inputs(), level="O2", keep_batchnorm_fp32=False, expect_modified=True,
               finish=True, atol=0.1)
    floating = {n: d for n, d in _dtypes(gm).items() if n != "bn.num_batches_tracked"}
    assert set(floating.values()) == {torch.bfloat16}


class Float64Scale(nn.Module):
    """A float64 parameter, which autocast never casts."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.scale = nn.Parameter(torch.ones(D, dtype=torch.float64))

    def forward(self, x):
        return self.fc(x) * self.scale


def test_float64_tensors_are_never_cast():
    gm = check(cast_params, Float64Scale(), _inputs(), level="O2", expect_modified=True, finish=True, atol=0.1)
    assert _dtypes(gm) == {"fc.weight": torch.bfloat16, "fc.bias": torch.bfloat16, "scale": torch.float64}


def test_the_source_dtypes_recorded_give_back_the_models_state_dict():
    model = Net().eval()
    converted = amp_fx.convert(model, "O2", dtype=torch.bfloat16)
    assert converted.get_parameter("fc.weight").dtype == torch.bfloat16
    state = converted.state_dict()
    assert {k: v.dtype for k, v in state.items()} == {k: v.dtype for k, v in model.state_dict().items()}
    # The low copy is its master rounded, so the master itself is saved: full fp32 precision.
    assert torch.equal(state["fc.weight"], model.fc.weight.detach())


class WritesBuffers(nn.Module):
    """An fp32 EMA written in place through a view (kept fp32), a constant buffer (cast), a tied weight."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.out = nn.Linear(D, D)
        self.out.weight = self.fc.weight
        self.register_buffer("ema", torch.zeros(D))
        self.register_buffer("scale", torch.full((D,), 1.1))

    def forward(self, x):
        h = self.out(self.fc(x)) * self.scale
        self.ema.view(-1).mul_(0.9).add_(0.1 * h.detach().mean(0))
        return h


def test_a_buffer_written_in_place_keeps_its_dtype_and_every_name_of_a_tie_is_recorded():
    """Accumulated state stays in its dtype (an EMA loses its small updates in bf16); constants go low."""
    gm = check(cast_params, WritesBuffers(), _inputs(), level="O2", expect_modified=True, finish=True, atol=0.1)
    dtypes = _dtypes(gm)
    assert dtypes["ema"] == torch.float32 and dtypes["scale"] == torch.bfloat16 and dtypes["fc.weight"] == torch.bfloat16
    converted = amp_fx.convert(WritesBuffers(), "O2")
    assert converted.amp_report.passes["cast_params"]["kept_written"] == ["ema"]
    assert set(converted.amp_fx_source_dtypes) == {"fc.weight", "fc.bias", "out.weight", "out.bias", "scale"}


# A library's own norm, as torch.library defines it: mean/variance of its input in fp32, then an affine map with
# parameters and a (running) buffer.  Its decomposition gives autograd.
_LIB = torch.library.Library("amp_fx_test_cp", "DEF")
_LIB.define("scale_norm(Tensor x, Tensor weight, Tensor bias, Tensor running_scale) -> Tensor")


def _scale_norm(x, weight, bias, running_scale):
    wide = x.float()
    normed = (wide - wide.mean(-1, keepdim=True)) * torch.rsqrt(wide.var(-1, unbiased=False, keepdim=True) + 1e-5)
    return (normed * running_scale.float() * weight.float() + bias.float()).to(x.dtype)


_LIB.impl("scale_norm", _scale_norm, "CompositeImplicitAutograd")
CUSTOM_NORM = "amp_fx_test_cp::scale_norm"


class ScaleNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(1 + torch.randn(D) / 8)
        self.bias = nn.Parameter(torch.randn(D) / 8)
        self.register_buffer("running_scale", 1 + torch.rand(D) / 4)

    def forward(self, x):
        return torch.ops.amp_fx_test_cp.scale_norm(x, self.weight, self.bias, self.running_scale)


class CustomNormNet(nn.Module):
    """A Linear, the custom norm, a BatchNorm beside it for comparison, a Linear."""

    def __init__(self):
        super().__init__()
        self.fc, self.norm, self.bn, self.out = nn.Linear(D, D), ScaleNorm(), nn.BatchNorm1d(D), nn.Linear(D, 2)

    def forward(self, x):
        return self.out(self.bn(self.norm(self.fc(x))).relu())


@pytest.mark.parametrize("kind, table, decision", [("statistics", "fp32", "fp32"), ("input_dtype", "follow", "follow")])
def test_a_registered_custom_norm_keeps_its_tensors_fp32_at_o2_like_batchnorm(kind, table, decision):
    """One register_op call makes a torch.library norm's parameters and buffer stay fp32 under keep_batchnorm_fp32."""
    torch.manual_seed(0)
    model, x = CustomNormNet().eval(), torch.randn(4, D)
    norm_tensors = {"norm.weight", "norm.bias", "norm.running_scale"}
    with pytest.warns(amp_fx.AmpWarning, match="scale_norm"):  # unregistered: a guess, and its tensors go low
        unregistered = amp_fx.convert(model, "O2", keep_batchnorm_fp32=True, example_inputs=(x,))
    assert {_dtypes(unregistered)[n] for n in norm_tensors} == {torch.bfloat16}
    handle = amp_fx.register_op(CUSTOM_NORM, table=table, reason="a test library's norm", norm=kind)
    try:
        gm = amp_fx.convert(model, "O2", keep_batchnorm_fp32=True, example_inputs=(x,))
        off = amp_fx.convert(model, "O2", keep_batchnorm_fp32=False, example_inputs=(x,))
    finally:
        handle.remove()
    dtypes = _dtypes(gm)
    kept = {n for n, d in dtypes.items() if d == torch.float32}
    assert kept == norm_tensors | {"bn.weight", "bn.bias", "bn.running_mean", "bn.running_var"}, dtypes
    assert {d for n, d in dtypes.items() if n.startswith(("fc.", "out."))} == {torch.bfloat16}
    assert {_dtypes(off)[n] for n in norm_tensors} == {torch.bfloat16}  # keep_batchnorm_fp32=False: low, as bn's
    row = next(r for r in gm.amp_report.nodes if r.op == CUSTOM_NORM)
    assert row.decision == decision, row
    # It runs, forward and backward, near the fp32 model; the kept parameters get fp32 gradients.
    out = gm(x)
    want = model(x)
    assert out.dtype == torch.float32 and (out - want).abs().max() < 0.1
    out.square().sum().backward()
    want.square().sum().backward()
    grads = dict(gm.named_parameters())
    for name, param in model.named_parameters():
        got = grads[name].grad
        assert got is not None and got.dtype == dtypes[name], name
        assert ((got.float() - param.grad).norm() / param.grad.norm()) < 0.05, name
