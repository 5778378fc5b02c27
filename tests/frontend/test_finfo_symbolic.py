"""``torch.finfo(t.dtype)`` on the symbolic route: traced as a run-time read of ``t.dtype``, not refused.

Before, fx handed the model ``s.dtype`` as a Proxy, ``torch.finfo(proxy)``
raised, and convert() without example inputs refused the model
(AmpTraceError).  Now the graph calls ``finfo_of(s.dtype)`` when it runs, so
the constant is the finfo of the dtype ``s`` has in the rewritten program:
bf16's minimum where the scores run bf16, as under torch.autocast and as the
export route's retarget_dtype_constants writes it.
"""

import pickle

import pytest
import torch
import torch.nn as nn

import amp_fx
from amp_fx.graph_ops.dtype_info import finfo_of


class MaskedScores(nn.Module):
    """Attention's masking: scores from a GEMM (low at O1), masked with finfo(scores.dtype).min."""

    def forward(self, q, k, mask):
        scores = q @ k.transpose(-1, -2)
        return scores.masked_fill(mask, torch.finfo(scores.dtype).min)


class MaskedSoftmax(MaskedScores):
    def forward(self, q, k, mask):
        return super().forward(q, k, mask).softmax(-1)


class MaskedFp32(nn.Module):
    """The masked value comes from an fp32-listed op (log_softmax): its finfo stays fp32's."""

    def forward(self, q, k, mask):
        probs = torch.log_softmax(q @ k.transpose(-1, -2), -1)
        return probs.masked_fill(mask, torch.finfo(probs.dtype).min)


def _inputs():
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 8), torch.randn(2, 4, 8)
    mask = torch.rand(2, 4, 4) > 0.5
    mask[0, 1] = True  # a fully masked row
    return q, k, mask


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_finfo_of_a_traced_dtype_converts_and_equals_the_export_route_and_autocast(level):
    inputs = _inputs()
    symbolic = amp_fx.convert(MaskedScores(), level=level, dtype=torch.bfloat16)
    assert symbolic.amp_report.route == "symbolic_trace"
    assert any(n.target is finfo_of for n in symbolic.graph.nodes), "the finfo is read when the graph runs"
    exported = amp_fx.convert(MaskedScores(), level=level, dtype=torch.bfloat16, example_inputs=inputs)
    with torch.autocast("cpu", torch.bfloat16):
        reference = MaskedScores()(*inputs)
    assert reference.dtype == torch.bfloat16
    got = symbolic(*inputs)
    # Same ops on the same bf16 values on every side (one GEMM kernel, an exact masked_fill): bit equality.
    assert torch.equal(got, exported(*inputs)) and torch.equal(got, reference.float())
    assert got.min() == torch.finfo(torch.bfloat16).min, "bf16's minimum, not fp32's (which bf16 cannot hold)"


def test_a_value_the_rewrite_keeps_fp32_keeps_fp32s_finfo():
    inputs = _inputs()
    symbolic = amp_fx.convert(MaskedFp32(), level="O1", dtype=torch.bfloat16)
    exported = amp_fx.convert(MaskedFp32(), level="O1", dtype=torch.bfloat16, example_inputs=inputs)
    got = symbolic(*inputs)
    assert got.dtype == torch.float32 and got.min() == torch.finfo(torch.float32).min
    assert torch.equal(got, exported(*inputs))


def test_a_fully_masked_row_is_uniform_not_nan():
    inputs = _inputs()
    out = amp_fx.convert(MaskedSoftmax(), level="O1", dtype=torch.bfloat16)(*inputs)
    assert not out.isnan().any()
    torch.testing.assert_close(out[0, 1], torch.full((4,), 0.25), rtol=0, atol=0)


def test_torch_finfo_is_torchs_own_again_after_tracing_and_converts_twice():
    original = torch.finfo
    gm = amp_fx.convert(MaskedScores(), level="O1", dtype=torch.bfloat16)
    assert torch.finfo is original and torch.finfo(torch.bfloat16).min == original(torch.bfloat16).min
    inputs = _inputs()
    again = amp_fx.convert(gm, level="O1", dtype=torch.bfloat16)
    assert torch.equal(again(*inputs), gm(*inputs))
    restored = pickle.loads(pickle.dumps(gm))
    assert torch.equal(restored(*inputs), gm(*inputs))
    assert not gm.amp_report.unknown_ops
