"""amp_fx.coverage: GEMM FLOPs by dtype, counted at dispatch, on every route (eager, autocast, converted, compiled)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import amp_fx
from amp_fx.inspection.coverage import GemmCounter

# Two Linear layers on a batch of 3: forward GEMM FLOPs, derived by hand (2 * M * K * N per GEMM).
FC1 = 2 * 3 * 8 * 16  # x (3x8) @ W1.T (8x16): 768
FC2 = 2 * 3 * 16 * 4  # h (3x16) @ W2.T (16x4): 384
FORWARD = FC1 + FC2  # 1152
# Backward: fc2's input gradient (3x4 @ 4x16) and weight gradient (4x3 @ 3x16); fc1's weight gradient only
# (16x3 @ 3x8): x does not require grad.
BACKWARD = 2 * 3 * 4 * 16 + 2 * 4 * 3 * 16 + 2 * 16 * 3 * 8  # 384 + 384 + 768 = 1536


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def test_fp32_eager_forward_counts_every_gemm_flop_in_fp32():
    cov = amp_fx.coverage(_mlp(), torch.randn(3, 8))
    assert cov.flops == {"float32": FORWARD}
    assert cov.by_op == {("addmm", "float32"): FORWARD} and cov.calls == {("addmm", "float32"): 2}
    assert cov.low_share == 0.0 and cov.share(torch.float32) == 1.0


def test_autocast_forward_and_backward_are_counted_in_bf16():
    model = _mlp()
    with torch.autocast("cpu", torch.bfloat16):
        forward = amp_fx.coverage(model, torch.randn(3, 8))
        both = amp_fx.coverage(model, torch.randn(3, 8), backward=True)
    assert forward.flops == {"bfloat16": FORWARD}
    assert both.flops == {"bfloat16": FORWARD + BACKWARD}
    assert model[0].weight.grad is not None  # the backward ran (and accumulated, as in training)


def test_converted_and_compiled_routes_count_alike():
    model = _mlp()
    x = torch.randn(3, 8)
    converted = amp_fx.convert(model, "O1", dtype=torch.bfloat16)
    compiled = torch.compile(model, backend=amp_fx.backend(level="O1", dtype=torch.bfloat16, inner="aot_eager"))
    compiled(x)  # compile first: compiling runs fake tensors, which are not counted anyway
    for route in (converted, compiled):
        cov = amp_fx.coverage(route, x, loss_fn=lambda out: out.float().pow(2).sum())
        assert cov.flops == {"bfloat16": FORWARD + BACKWARD}, route
        assert cov.low_share == 1.0


def test_convolution_flops():
    """Conv2d(2->4, 3x3) on 5x5: 36 outputs, each 2*9 multiply-adds; then Linear(36->5)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.Flatten(), nn.Linear(36, 5))
    cov = amp_fx.coverage(model, torch.randn(1, 2, 5, 5))
    assert cov.by_op == {("convolution", "float32"): 2 * 36 * 18, ("addmm", "float32"): 2 * 36 * 5}


def test_repr_and_dict_say_the_shares():
    with torch.autocast("cpu", torch.bfloat16):
        cov = amp_fx.coverage(_mlp(), torch.randn(3, 8))
    text = str(cov)
    assert text.startswith("GEMM coverage: 100.0% of 1.15 kFLOP ran below fp32")
    assert "addmm bfloat16: 2 call(s)" in text
    assert cov.to_dict()["by_op"] == [{"op": "addmm", "dtype": "bfloat16", "flops": FORWARD, "calls": 2}]
    assert str(amp_fx.coverage(nn.ReLU(), torch.randn(2))) == "GEMM coverage: no GEMM ran"


def test_bad_input_is_refused():
    with pytest.raises(amp_fx.AmpTypeError, match="callable"):
        amp_fx.coverage(3, torch.randn(2))
    with pytest.raises(amp_fx.AmpTypeError, match="loss_fn"):
        amp_fx.coverage(nn.Linear(2, 2).requires_grad_(False), torch.randn(1, 2), backward=True)


def test_cpu_attention_kernel_forward_and_backward():
    """q, k (B=2, H=2, L=6, S=8, E=16), v (Ev=16; Ev != E takes the math path, bmm):
    Q·Kᵀ 2·B·H·L·S·E, P·V 2·B·H·L·S·Ev; the backward twice the forward."""
    torch.manual_seed(0)
    q = torch.randn(2, 2, 6, 16, requires_grad=True)
    k, v = torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16)
    forward = 2 * 2 * 2 * 6 * 8 * 16 * 2  # 6144 + 6144

    def attention(q):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    cov = amp_fx.coverage(attention, q, backward=True)
    assert cov.by_op == {("_scaled_dot_product_flash_attention_for_cpu", "float32"): forward,
                         ("_scaled_dot_product_flash_attention_for_cpu_backward", "float32"): 2 * forward}
    with torch.autocast("cpu", torch.bfloat16):
        assert amp_fx.coverage(attention, q).flops == {"bfloat16": forward}


def test_matvec_dot_and_bilinear_flops():
    """(3x4)·(4): 12 multiply-adds; (4)·(4): 4; bilinear N=3, I=4, J=5, O=6: N·O·I·J = 360."""
    torch.manual_seed(0)
    assert amp_fx.coverage(lambda a, b: a @ b, torch.randn(3, 4), torch.randn(4)).by_op == {("mv", "float32"): 24}
    assert amp_fx.coverage(lambda a, b: a @ b, torch.randn(4), torch.randn(4)).by_op == {("dot", "float32"): 8}
    bilinear = nn.Bilinear(4, 5, 6, bias=False)
    assert amp_fx.coverage(bilinear, torch.randn(3, 4), torch.randn(3, 5)).by_op == {("_trilinear", "float32"): 2 * 360}


class WithFp32Region(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = self.a(x)
        with torch.autocast("cpu", enabled=False):
            return self.b(h.float())


def test_backward_runs_outside_the_callers_autocast_as_in_training():
    """Inside `with torch.autocast`, coverage(backward=True) counts a training step: backward after the block, so the
    backward of the enabled=False region stays fp32 (a backward under autocast would run it bf16)."""
    torch.manual_seed(0)
    model, x = WithFp32Region(), torch.randn(3, 8)
    with GemmCounter() as counter:
        with torch.autocast("cpu", torch.bfloat16):
            out = model(x)
        out.float().sum().backward()
    with torch.autocast("cpu", torch.bfloat16):
        cov = amp_fx.coverage(model, x, backward=True)
    assert cov.by_op == counter.coverage.by_op
    # b's input gradient (3x4 @ 4x16) and weight gradient (4x3 @ 3x16) in fp32: x needs no grad, a's weight grad is bf16.
    assert cov.by_op[("mm", "float32")] == 2 * 3 * 4 * 16 + 2 * 4 * 3 * 16


@torch.library.custom_op("amp_fx_test_flops::kn_gemm", mutates_args=())
def _kn_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight``, weight (K, N): a GEMM torch's FLOP counter sees only as an opaque custom op."""
    return x @ weight


@_kn_gemm.register_fake
def _(x, weight):
    return x.new_empty(*x.shape[:-1], weight.shape[1])


class _RegisteredGemm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(16, 24))

    def forward(self, x):
        return torch.ops.amp_fx_test_flops.kn_gemm(x, self.weight)


def test_coverage_and_summary_count_a_registered_gemms_flops():
    """A register_op GEMM row gives its FLOPs (2 M K N) to coverage and summary, as linear's are counted."""
    handle = amp_fx.register_op("amp_fx_test_flops::kn_gemm", table="low", reason="GEMM: x @ W",
                                gemm=amp_fx.GemmSig(activation=0, weight=1, weight_layout="KN"))
    try:
        x = torch.randn(8, 16)
        converted = amp_fx.convert(_RegisteredGemm(), "O1", dtype=torch.bfloat16, example_inputs=(x,))
        flops = 2 * 8 * 16 * 24
        assert amp_fx.coverage(converted, x).flops == {"bfloat16": flops}
        assert amp_fx.summary(converted, (x,)).gemm_flops == {"bfloat16": flops}
    finally:
        handle.remove()
    assert amp_fx.coverage(_RegisteredGemm(), x).flops == {}  # no row: torch sees no GEMM inside
