"""The model's own autocast regions keep their meaning on every route (issue 18, points 1-3).

Each test runs the model eagerly under ``torch.autocast("cpu", bfloat16)`` as
the reference and converts it by each route in :mod:`routes`: symbolic,
symbolic with example inputs, torch.export (forced: fx cannot trace the
wrapper) and the torch.compile backend.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn as nn

from probes import GEMM_OPS, OpRecorder
from routes import ROUTES, convert, eager_autocast

D = 8


class Disabled(nn.Module):
    """``a`` runs low; ``b`` runs inside ``autocast(enabled=False)`` on ``h.float()``: an fp32 GEMM."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        h = self.a(x)
        with torch.autocast("cpu", enabled=False):
            return self.b(h.float()).softmax(-1)


class Half(nn.Module):
    """``b`` runs inside ``autocast(dtype=float16)``: under a bf16 conversion its GEMM runs in fp16."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        h = self.a(x)
        with torch.autocast("cpu", dtype=torch.float16):
            return self.b(h)


class Decorated(nn.Module):
    """``@torch.autocast("cpu", enabled=False)`` on a method: ``head`` runs fp32."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    @torch.autocast("cpu", enabled=False)
    def head(self, h):
        return self.b(h.float())

    def forward(self, x):
        return self.head(self.a(x))


class Nested(nn.Module):
    """Innermost region wins: a low, b fp32, c low (bf16 region inside the disabled one), d fp32 again."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x):
        h = self.a(x)
        with torch.autocast("cpu", enabled=False):
            y = self.b(h.float())
            with torch.autocast("cpu", dtype=torch.bfloat16):
                z = self.c(y)
            return self.d(z.float())


class Rotary(nn.Module):
    """Rotary frequencies written as Hugging Face writes them (LlamaRotaryEmbedding)."""

    def __init__(self, dim=16):
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.q = nn.Linear(dim, dim)

    def forward(self, x):
        q = self.q(x)
        position_ids = torch.arange(x.shape[1], device=x.device)[None, :].expand(x.shape[0], -1) * 37
        # HF expands inv_freq to the batch; matmul broadcasts the same (fx cannot expand a constant to a traced size)
        inv_freq_expanded = self.inv_freq[None, :, None].float()
        position_ids_expanded = position_ids[:, None, :].float()
        device_type = x.device.type if isinstance(x.device.type, str) and x.device.type != "mps" else "cpu"
        with torch.autocast(device_type=device_type, enabled=False):
            freqs = (inv_freq_expanded.float() @ position_ids_expanded.float()).transpose(1, 2)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos = emb.cos()
            sin = emb.sin()
        return q, cos, sin


def _check_against_autocast(model, route, x, expected_gemms, atol=2e-2):
    conv = convert(model, route, x)
    assert conv.gemm_dtypes(x) == expected_gemms
    out, reference = conv.fn(x), eager_autocast(model, x)
    # (O1 may hand outputs back in fp32: compare values)
    torch.testing.assert_close(out.float(), reference.float(), atol=atol, rtol=atol)
    return conv


@pytest.mark.parametrize("route", ROUTES)
def test_disabled_region_runs_an_fp32_gemm(route):
    """autocast(enabled=False) around a Linear: its GEMM and softmax run fp32, rule "autocast", as eager autocast."""
    model, x = Disabled(), torch.randn(4, D)
    conv = _check_against_autocast(model, route, x, [{torch.bfloat16}, {torch.float32}])
    (b,) = conv.records("linear", "b")
    assert (b.decision, b.rule) == ("fp32", "autocast") and "enabled=False" in b.reason
    (a,) = conv.records("linear", "a")
    assert a.decision == "low" and a.rule != "autocast"


@pytest.mark.parametrize("route", ROUTES)
def test_float16_region_inside_a_bf16_conversion(route):
    """autocast(dtype=float16) inside a bf16 conversion: that GEMM runs fp16, the rest bf16."""
    model, x = Half(), torch.randn(4, D)
    conv = _check_against_autocast(model, route, x, [{torch.bfloat16}, {torch.float16}])
    (b,) = conv.records("linear", "b")
    assert b.dtype == "float16" and b.rule == "autocast"


@pytest.mark.parametrize("route", ROUTES)
def test_autocast_decorator_on_a_method(route):
    """@torch.autocast("cpu", enabled=False) on a method is a region too."""
    _check_against_autocast(Decorated(), route, torch.randn(4, D), [{torch.bfloat16}, {torch.float32}])


@pytest.mark.parametrize("route", ROUTES)
def test_nested_regions_resolve_innermost_first(route):
    """disabled > bf16 > disabled: each GEMM runs in its innermost region's precision."""
    expected = [{torch.bfloat16}, {torch.float32}, {torch.bfloat16}, {torch.float32}]
    _check_against_autocast(Nested(), route, torch.randn(4, D), expected)


# The backend converts graphs, not parameters: it runs O0/O1 only.
@pytest.mark.parametrize("route, level", [(r, lv) for r in ROUTES for lv in ("O1", "O2") if (r, lv) != ("backend", "O2")])
def test_rotary_frequencies_are_bitwise_fp32(route, level):
    """HF-style rotary cos/sin under autocast(enabled=False) equal the fp32 model's bit for bit; q still runs low."""
    model, x = Rotary(), torch.randn(2, 40, 16)
    with torch.no_grad():
        _, cos_ref, sin_ref = model(x)
    conv = convert(model, route, x, level=level)
    q, cos, sin = conv.fn(x)
    assert cos.dtype == sin.dtype == torch.float32
    assert torch.equal(cos, cos_ref) and torch.equal(sin, sin_ref)
    (q_record,) = conv.records("linear", "q")
    assert q_record.decision == "low" and q_record.dtype == "bfloat16"
    if level == "O2":
        assert conv.fn.state_dict().keys() == conv.model.state_dict().keys()  # (export wraps the model)


def test_bf16_autocast_of_the_rotary_really_loses_bits():
    """The test above can fail: without the region, the same product in bf16 is not fp32's."""
    model, x = Rotary(), torch.randn(2, 40, 16)
    _, cos_ref, _ = model(x)
    inv = model.inv_freq[None, :, None].bfloat16()
    pos = (torch.arange(40)[None, None, :] * 37).bfloat16()
    assert not torch.equal((inv @ pos).transpose(1, 2).float().cos(), cos_ref[..., :8])


def test_o0_keeps_regions_running_as_written():
    """O0 rewrites nothing: the markers run autocast itself, so O0 is bit-identical to the model."""
    for model in (Half(), Nested(), Disabled()):
        x = torch.randn(4, D)
        gm = convert(model, "symbolic", x, level="O0").fn
        out, ref = gm(x), model(x)
        assert out.dtype == ref.dtype and torch.equal(out, ref)


@pytest.mark.parametrize("route", ["symbolic", "symbolic+examples"])
def test_regions_survive_pickle_and_deepcopy(route):
    """A pickled or deep-copied converted module keeps its regions (fp32 GEMM in the disabled one)."""
    model, x = Disabled(), torch.randn(4, D)
    gm = convert(model, route, x).fn
    for clone in (pickle.loads(pickle.dumps(gm)), copy.deepcopy(gm)):
        with OpRecorder() as rec:
            out = clone(x)
        assert [set(d) for name, d in rec.calls if name in GEMM_OPS] == [{torch.bfloat16}, {torch.float32}]
        torch.testing.assert_close(out, gm(x))


def test_o0_pickle_keeps_the_autocast_markers():
    """At O0 the autocast region runs at run time: after a pickle round trip too."""
    model, x = Half(), torch.randn(4, D)
    gm = pickle.loads(pickle.dumps(convert(model, "symbolic", x, level="O0").fn))
    assert gm(x).dtype == torch.float16 and torch.equal(gm(x), model(x))


class Mixed(nn.Module):
    """A weight read under no_grad and outside it, a disabled region and a float16 region."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        with torch.no_grad():
            t = self.a(x)
        h = self.a(x)
        with torch.autocast("cpu", enabled=False):
            y = self.b(h.float() + t.float())
        with torch.autocast("cpu", dtype=torch.float16):
            return self.b(y)


def test_the_region_pass_is_idempotent_and_reports_honestly():
    """A second run of honour_autocast_regions changes nothing; the first one says what it did."""
    from amp_fx.ir.config import make_config
    from amp_fx.ir.pass_manager import PassContext
    from amp_fx.passes.assign_precision import assign_precision
    from amp_fx.passes.honour_autocast_regions import honour_autocast_regions
    from amp_fx.passes.propagate_meta import propagate_meta
    from amp_fx.ir.policy import Policy
    from amp_fx.frontend.tracing import trace_model

    gm, _ = trace_model(Mixed())
    ctx = PassContext(config=make_config("O1", dtype=torch.bfloat16), policy=Policy.coerce(None), route="symbolic_trace")
    propagate_meta(gm, ctx)
    assign_precision(gm, ctx)
    first = honour_autocast_regions(gm, ctx)
    gm.graph.lint()
    assert first.modified
    assert first.stats["regions"] == 2 and first.stats["grad_regions"] == 1 and first.stats["separate_grad_reads"] == 2
    before = [(n.name, n.meta.get("amp_fx.decision"), n.meta.get("amp_fx.reason")) for n in gm.graph.nodes]
    second = honour_autocast_regions(gm, ctx)
    assert not second.modified
    assert [(n.name, n.meta.get("amp_fx.decision"), n.meta.get("amp_fx.reason")) for n in gm.graph.nodes] == before


class HalfByHand(nn.Module):
    """Inside a disabled region the model casts to fp16 itself: that GEMM runs fp16, as written."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, D)
        self.w = nn.Parameter(torch.randn(D, D) / D)

    def forward(self, x):
        h = self.a(x)
        with torch.autocast("cpu", enabled=False):
            return (h.half() @ self.w.half()).relu()


@pytest.mark.parametrize("route", ROUTES)
def test_a_cast_the_model_writes_inside_a_disabled_region_is_kept(route):
    conv = _check_against_autocast(HalfByHand(), route, torch.randn(4, D), [{torch.bfloat16}, {torch.float16}])
    (matmul,) = conv.records("matmul")
    assert matmul.decision == "follow" and "runs as written" in matmul.reason
