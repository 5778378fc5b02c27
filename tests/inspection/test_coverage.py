"""amp_fx.coverage: GEMM FLOPs by dtype, counted at dispatch, on every route (eager, autocast, converted, compiled)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import amp_fx

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
