"""fuse_precision: fp32 norms fed low and read low run as one mixed-dtype kernel, as precise as the cast form."""

from __future__ import annotations

import io
import pickle
from typing import Optional

import copy

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import amp_fx
from amp_fx.ir import meta
from amp_fx.graph_ops.fused_norms import layer_norm_fp32_stats
from amp_fx.passes.fuse_precision import fuse_precision
from amp_fx.passes.insert_casts import insert_casts
from pass_check import check

LOW = (torch.bfloat16, torch.float16)


class NormBetween(nn.Module):
    """norm (fp32 in the tables) -> Linear (low): the norm is read low.

    Fed a low-precision input, the norm's own input and weight gradients are
    what the test compares (``x.grad`` is the norm's input gradient);
    ``fc1`` (Linear -> GELU) in front feeds it low from an fp32 input instead.
    """

    def __init__(self, norm: str, c: int = 16, front: bool = False):
        super().__init__()
        self.kind, self.front = norm, front
        self.fc1, self.fc2 = nn.Linear(c, c), nn.Linear(c, c)
        self.norm = {"group_norm": nn.GroupNorm(4, c), "batch_norm": nn.BatchNorm1d(c),
                     "instance_norm": nn.InstanceNorm1d(c, affine=True), "layer_norm": nn.LayerNorm(c, elementwise_affine=False),
                     "layer_norm_affine": nn.LayerNorm(c)}[norm]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, length, c)
        h = F.gelu(self.fc1(x)) if self.front else x
        if self.kind in ("group_norm", "batch_norm", "instance_norm"):
            h = self.norm(h.transpose(1, 2)).transpose(1, 2)  # channels second
        else:
            h = self.norm(h)
        return self.fc2(h)


# batch_norm and instance_norm follow their input at O1: fp32 only when a policy says so.
POLICY = {"batch_norm": {"op:batch_norm": "fp32"}, "instance_norm": {"op:instance_norm": "fp32"}}
FORMS = ["group_norm", "instance_norm", "layer_norm", "layer_norm_affine"]


def _inputs(seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(8, 12, 16) * 3 + 1


def _convert(model: nn.Module, norm: str, dtype: torch.dtype, fuse: bool, example: bool = True,
             x: Optional[torch.Tensor] = None) -> fx.GraphModule:
    x = _inputs() if x is None else x
    return amp_fx.convert(model, "O1", dtype=dtype, policy=POLICY.get(norm), fuse_precision=fuse,
                          example_inputs=(x,) if example else None)


def _norm_node(gm: fx.GraphModule) -> fx.Node:
    return next(n for n in gm.graph.nodes if n.meta.get("amp_fx.op") in ("group_norm", "batch_norm", "instance_norm", "layer_norm"))


def _run(gm: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    x = x.clone().requires_grad_()
    gm.zero_grad(set_to_none=True)
    out = gm(x)
    out.backward(torch.linspace(-1, 1, out.numel()).view(out.shape))
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in gm.named_parameters() if p.grad is not None}


def _ulps(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> float:
    """Largest |got - want| in units of ``dtype``'s ulp at the tensor's largest magnitude.

    (Element by element would be too strict after a GEMM: its sums cancel, and a
    one-ulp change upstream is many ulps of a near-zero result.)
    """
    return ((got.double() - want.double()).abs().max() / (want.double().abs().max() * torch.finfo(dtype).eps)).item()


# layer_norm fuses in bf16 only (fp16 keeps the cast form: test_fp16_affine_layer_norm_keeps_the_cast_form).
FORM_DTYPES = [(norm, dtype) for norm in FORMS for dtype in LOW if not (norm.startswith("layer_norm") and dtype == torch.float16)]


@pytest.mark.parametrize("norm,dtype", FORM_DTYPES, ids=[f"{n}-{d}" for n, d in FORM_DTYPES])
def test_fused_form_equals_the_cast_form_forward_and_backward(norm, dtype):
    """Through convert(): output and input gradient within 1 low ulp of the cast form; weight and bias gradients as fp32's."""
    model = NormBetween(norm)
    x = _inputs(1).to(dtype)  # a low input straight into the norm: x.grad is the norm's input gradient
    fused, cast = _convert(model, norm, dtype, True, x=x), _convert(model, norm, dtype, False, x=x)
    assert _norm_node(fused).meta.get("amp_fx.fused") and not _norm_node(cast).meta.get("amp_fx.fused")
    (out_f, gx_f, gp_f), (out_c, gx_c, gp_c) = _run(fused, x), _run(cast, x)
    # The norm's fused result is the cast form's rounded once, as the cast back rounds it.
    assert _ulps(out_f, out_c, dtype) <= 1.0
    assert gx_f.dtype == gx_c.dtype == dtype and _ulps(gx_f, gx_c, dtype) <= 1.0
    assert gp_f.keys() == gp_c.keys() and any(k.startswith("norm.") for k in gp_c) == (norm != "layer_norm")
    for name, want in gp_c.items():
        # (group/instance norm's weight gradients agree to ~1e-7; batch norm with running statistics
        # rounds its weight and bias gradients once to the input's dtype: within one ulp.)
        assert gp_f[name].dtype == want.dtype and _ulps(gp_f[name], want, dtype) <= 1.0, name


@pytest.mark.parametrize("example", [True, False], ids=["example_inputs", "dtype_only"])
def test_report_and_prediction(example):
    """The report keeps the fp32 decision with a 'fused' reason; the predicted dtype is the one the module produces."""
    gm = _convert(NormBetween("group_norm", front=True), "group_norm", torch.bfloat16, True, example=example)
    node = _norm_node(gm)
    record = gm.amp_report.node(node.name)
    assert record.decision == "fp32" and "fused" in record.reason
    assert "fuse_precision" in str(gm.amp_report)
    seen = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n):
            result = super().run_node(n)
            seen[n.name] = result.dtype if isinstance(result, torch.Tensor) else None
            return result

    Recorder(gm).run(_inputs())
    assert seen[node.name] == meta.float_dtype(node) == torch.bfloat16
    reader = next(iter(node.users))
    assert not reader.meta.get("amp_fx.inserted")  # the low reader takes the result as it is: no cast between


class _Casts(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ == "_to_copy" and isinstance(out, torch.Tensor) and out.dtype != args[0].dtype:
            self.count += 1
        return out


def test_fusion_removes_two_casts_forward_and_two_backward():
    model = NormBetween("group_norm", front=True)
    counts = {}
    for fuse in (True, False):
        gm = _convert(model, "group_norm", torch.bfloat16, fuse)
        with _Casts() as probe:
            _run(gm, _inputs())
        counts[fuse] = probe.count
    assert counts[False] - counts[True] == 4, counts


@pytest.mark.parametrize("case", ["leaf_affine_layer_norm", "fp32_reader", "switched_off"])
def test_not_fused(case):
    """A leaf nn.LayerNorm with weights (CPU's own mixed backward would round dw/db low), a reader that computes
    in fp32, and the switch."""
    if case == "leaf_affine_layer_norm":
        gm = amp_fx.convert(NormBetween("layer_norm_affine", front=True), "O1", dtype=torch.bfloat16,
                            example_inputs=(_inputs(),), leaf_modules=[nn.LayerNorm])
        assert _norm_node(gm).op == "call_module"
    elif case == "switched_off":
        gm = _convert(NormBetween("group_norm", front=True), "group_norm", torch.bfloat16, False)
    else:
        class Residual(NormBetween):
            def forward(self, x):  # the norm's result meets fp32 x in an add: fusing would round what the add reads
                h = F.gelu(self.fc1(x)).transpose(1, 2)
                return self.fc2(self.norm(h).transpose(1, 2) + x)

        gm = _convert(Residual("group_norm", front=True), "group_norm", torch.bfloat16, True)
    node = _norm_node(gm)
    assert not node.meta.get("amp_fx.fused") and meta.float_dtype(node) == torch.float32
    assert "fused" not in gm.amp_report.node(node.name).reason


def test_pass_contract():
    """pass_check: the pass only marks (code unchanged, modified=False) and is idempotent; insert_casts then writes
    two casts fewer than without it (the norm's input up and its result back down)."""
    model, x = NormBetween("group_norm", front=True), _inputs()
    check(fuse_precision, model, (x,), delta=0, expect_modified=False, example_inputs=(x,))
    fused = check(insert_casts, model, (x,), example_inputs=(x,))
    plain = check(insert_casts, model, (x,), example_inputs=(x,), fuse_precision=False)
    assert len(plain.graph.nodes) - len(fused.graph.nodes) == 2


class ConvGroupNormRelu(nn.Module):
    """conv -> GroupNorm -> ReLU -> max pool -> conv: exact ops between the norm and its low reader."""

    def __init__(self):
        super().__init__()
        self.conv1, self.gn, self.conv2 = nn.Conv2d(3, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.Conv2d(16, 8, 3)

    def forward(self, x):
        return self.conv2(F.max_pool2d(F.relu(self.gn(self.conv1(x))), 2))


def test_fused_through_relu_and_max_pool():
    """relu and max pooling commute with rounding: the fused form gives exactly what the cast form gives."""
    torch.manual_seed(0)
    model, x = ConvGroupNormRelu(), torch.randn(4, 3, 12, 12)
    fused = amp_fx.convert(model, "O1", dtype=torch.bfloat16, example_inputs=(x,))
    cast = amp_fx.convert(model, "O1", dtype=torch.bfloat16, example_inputs=(x,), fuse_precision=False)
    assert _norm_node(fused).meta.get("amp_fx.fused") and not _norm_node(cast).meta.get("amp_fx.fused")
    (out_f, gx_f, gp_f), (out_c, gx_c, gp_c) = _run(fused, x), _run(cast, x)
    assert _ulps(out_f, out_c, torch.bfloat16) <= 1.0 and _ulps(gx_f, gx_c, torch.bfloat16) <= 1.0
    for name, want in gp_c.items():
        assert _ulps(gp_f[name], want, torch.bfloat16) <= 1.0, name


# ---- affine layer_norm: retargeted to layer_norm_fp32_stats (mixed forward, the cast form's fp32 backward) ----

class LinearLayerNormLinear(nn.Module):
    """fp32 input -> Linear (bf16 GEMM) -> nn.LayerNorm (fp32 at O1, fed low) -> Linear (low reader)."""

    def __init__(self, c: int = 16, bias: bool = True):
        super().__init__()
        self.fc1, self.ln, self.fc2 = nn.Linear(c, c), nn.LayerNorm(c, bias=bias), nn.Linear(c, c)
        with torch.no_grad():  # weights away from 1 and 0: their gradients then depend on them
            self.ln.weight.uniform_(0.5, 2.0)
            if bias:
                self.ln.bias.uniform_(-1.0, 1.0)

    def forward(self, x):  # (no annotations: under `from __future__ import annotations` fx records them as
        return self.fc2(self.ln(self.fc1(x)))  # strings, which GraphModule pickling cannot import)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """|got - want| / |want| in the 2-norm."""
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def _ln_pair(bias: bool, dtype: torch.dtype, c: int = 16, seed: int = 0):
    torch.manual_seed(seed)
    model, x = LinearLayerNormLinear(c, bias), torch.randn(8, 12, c) * 3 + 1
    fused = amp_fx.convert(model, "O1", dtype=dtype, example_inputs=(x,))
    cast = amp_fx.convert(model, "O1", dtype=dtype, example_inputs=(x,), fuse_precision=False)
    return fused, cast, x


def test_fp16_affine_layer_norm_keeps_the_cast_form():
    """In fp16 CPU's mixed forward differs from the cast form in ~1e-4 of its outputs (1 ulp), enough for a
    200-step fp16 run to drift 1.7% from autocast (examples/train_vs_autocast.py, digits): no fused form there."""
    fused, cast, x = _ln_pair(True, torch.float16)
    assert not _norm_node(fused).meta.get("amp_fx.fused") and _norm_node(fused).target is not layer_norm_fp32_stats
    assert torch.equal(fused(x), cast(x))


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=str)
def test_affine_layer_norm_fused_and_as_precise_as_the_cast_form(dtype, bias):
    """Output within 1 low ulp of the cast form; LN weight/bias gradients as fp32's (1e-5, not CPU's mixed ~1%);
    input and upstream Linear gradients within 1 low ulp."""
    fused, cast, x = _ln_pair(bias, dtype)
    node = _norm_node(fused)
    assert node.meta.get("amp_fx.fused") == "layer_norm with fp32 statistics and fp32 weight/bias gradients"
    assert node.target is layer_norm_fp32_stats and not _norm_node(cast).meta.get("amp_fx.fused")
    record = fused.amp_report.node(node.name)
    assert record.decision == "fp32" and "fp32 weight/bias gradients" in record.reason
    assert meta.float_dtype(node) == dtype  # the analysis predicts the low result
    (out_f, gx_f, gp_f), (out_c, gx_c, gp_c) = _run(fused, x), _run(cast, x)
    assert _ulps(out_f, out_c, dtype) <= 1.0
    assert _ulps(gx_f, gx_c, dtype) <= 1.0
    assert gp_f.keys() == gp_c.keys() and ("ln.bias" in gp_c) == bias
    for name in ("ln.weight", "ln.bias") if bias else ("ln.weight",):
        assert gp_f[name].dtype == torch.float32 and _rel(gp_f[name], gp_c[name]) < 1e-5, name
    for name in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"):
        assert _ulps(gp_f[name], gp_c[name], dtype) <= 1.0, name


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_layer_norm_fp32_stats_against_an_fp32_reference(dtype):
    """The function itself, on the issue's 256x1024: weight/bias gradients as the cast form's (~1e-7 of an fp64
    reference), where CPU's own mixed-dtype layer_norm is ~1e-3..1e-2 off; output and input gradient equal it."""
    torch.manual_seed(0)
    x = (torch.randn(256, 1024) * 3 + 1).to(dtype)
    w, b, g = torch.rand(1024) + 0.5, torch.randn(1024), torch.randn(256, 1024).to(dtype)

    def grads(fn, precision):
        leaves = [t.detach().to(precision).requires_grad_() for t in (x, w, b)]
        out = fn(*leaves)
        out.backward(g.to(out.dtype))
        return [out.detach()] + [t.grad for t in leaves]

    ours = grads(lambda x_, w_, b_: layer_norm_fp32_stats(x_.to(dtype), (1024,), w_, b_, 1e-5), torch.float32)
    mixed = grads(lambda x_, w_, b_: F.layer_norm(x_.to(dtype), (1024,), w_, b_, 1e-5), torch.float32)
    exact = grads(lambda x_, w_, b_: F.layer_norm(x_, (1024,), w_, b_, 1e-5), torch.float64)
    assert ours[0].dtype == dtype and _ulps(ours[0], exact[0], dtype) <= 1.0
    for i in (2, 3):  # weight, bias
        assert _rel(ours[i], exact[i]) < 1e-5 and _rel(mixed[i], exact[i]) > 1e-4  # the test can tell them apart
    assert _ulps(ours[1], exact[1], dtype) <= 1.0  # the input gradient, rounded once to the input's dtype


def test_affine_layer_norm_saves_casts():
    """Two casts fewer forward (fc1's result up, the norm's result down), the same number backward: the cast
    form's backward casts the gradient up and the input gradient down (2); the fused one computes the input
    gradient with no cast (the mixed kernel) and upcasts the gradient and the saved low input for the fp32
    weight and bias gradients (2)."""
    counts = {}
    for fuse, gm in zip((True, False), _ln_pair(True, torch.bfloat16)[:2]):
        with _Casts() as probe:
            _run(gm, _inputs())
        counts[fuse] = probe.count
    assert counts[False] - counts[True] == 2, counts


def test_affine_layer_norm_under_torch_compile_and_pickled():
    """torch.compile(backend="aot_eager") traces the custom Function; the module pickles (the code imports
    layer_norm_fp32_stats from amp_fx.graph_ops.fused_norms) and computes the same, gradients included."""
    fused, _, x = _ln_pair(True, torch.bfloat16)
    want_out, want_gx, want_gp = _run(fused, x)
    buffer = io.BytesIO()
    torch.save(fused, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert any(n.target is layer_norm_fp32_stats for n in loaded.graph.nodes)
    assert b"from amp_fx.graph_ops.fused_norms import layer_norm_fp32_stats" in pickle.dumps(fused)  # the code's import
    for module in (torch.compile(fused, backend="aot_eager"), loaded, pickle.loads(pickle.dumps(fused))):
        out, gx, gp = _run(module, x)
        assert torch.equal(out, want_out) and torch.equal(gx, want_gx)
        gp = {name.removeprefix("_orig_mod."): grad for name, grad in gp.items()}  # torch.compile's wrapper
        assert gp.keys() == want_gp.keys() and all(torch.equal(gp[name], want_gp[name]) for name in want_gp)


def test_affine_layer_norm_dtype_only_and_pass_contract():
    """Without example inputs the node is fused and predicted low too; the pass changes the code only by the
    retarget (modified=True once, then idempotent), and insert_casts writes two casts fewer."""
    model, x = LinearLayerNormLinear(), _inputs()
    gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16)
    node = _norm_node(gm)
    assert node.target is layer_norm_fp32_stats and meta.float_dtype(node) == torch.bfloat16
    assert gm(x).dtype == torch.float32
    check(fuse_precision, model, (x,), delta=0, expect_modified=True, example_inputs=(x,))
    fused = check(insert_casts, model, (x,), example_inputs=(x,))
    plain = check(insert_casts, model, (x,), example_inputs=(x,), fuse_precision=False)
    assert len(plain.graph.nodes) - len(fused.graph.nodes) == 2


def test_affine_layer_norm_read_in_fp32_keeps_the_cast_form():
    """A residual add reads the norm's result with fp32 x: not fused, and the call stays F.layer_norm."""
    class Residual(LinearLayerNormLinear):
        def forward(self, x):
            return self.fc2(self.ln(self.fc1(x)) + x)

    gm = amp_fx.convert(Residual(), "O1", dtype=torch.bfloat16, example_inputs=(_inputs(),))
    node = _norm_node(gm)
    assert node.target is F.layer_norm and not node.meta.get("amp_fx.fused")
    assert meta.float_dtype(node) == torch.float32


@pytest.mark.parametrize("norm", FORMS)
def test_fused_input_gradient_is_as_precise_as_the_cast_form_against_fp64(norm):
    """Within one ulp of the cast form is not enough: the fused input gradient's error against fp64 is the cast form's."""
    model, x = NormBetween(norm), _inputs(1).to(torch.bfloat16)
    fused, cast = _convert(model, norm, torch.bfloat16, True, x=x), _convert(model, norm, torch.bfloat16, False, x=x)
    assert _norm_node(fused).meta.get("amp_fx.fused")
    reference = copy.deepcopy(model).double()
    xr = x.double().requires_grad_()
    out = reference(xr)
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view(out.shape))
    error = lambda g: ((g.double() - xr.grad).norm() / xr.grad.norm()).item()  # noqa: E731
    assert error(_run(fused, x)[1]) <= 1.05 * error(_run(cast, x)[1])


def test_batch_norm_pinned_fp32_keeps_the_cast_form():
    """CPU's mixed batch_norm backward is 1.17x the cast form's input-gradient error: a policy's fp32 batch_norm is not fused."""
    gm = _convert(NormBetween("batch_norm"), "batch_norm", torch.bfloat16, True)
    assert _norm_node(gm).meta["amp_fx.decision"] == "fp32" and not _norm_node(gm).meta.get("amp_fx.fused")


@pytest.mark.parametrize("norm", ["group_norm", "instance_norm", "batch_norm"])
def test_a_norm_without_weight_and_bias_keeps_the_cast_form(norm):
    """CPU's mixed backward computes a weightless norm's input gradient in bf16 (1.5x the cast form's error)."""
    model = NormBetween(norm)
    plain = {"group_norm": nn.GroupNorm(4, 16, affine=False), "instance_norm": nn.InstanceNorm1d(16),
             "batch_norm": nn.BatchNorm1d(16, affine=False)}[norm]
    model.norm = plain
    gm = _convert(model, norm, torch.bfloat16, True)
    assert not _norm_node(gm).meta.get("amp_fx.fused")
