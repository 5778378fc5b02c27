"""retarget_dtype_constants: a constant the model took from ``torch.finfo(dtype)`` is the low dtype's where it is read low.

The masking idioms transformers' attention implementations write, each with a
fully masked row (the second sequence is all padding):

- ``scores.masked_fill(~mask, finfo.min)`` (DeBERTa-v2),
- an additive mask ``(1 - mask) * finfo.min`` added to the scores (BERT's extended mask),
- ``torch.where(mask, scores, finfo.min)``,
- ``torch.full((n, n), finfo.min).triu(1)`` added as a causal mask,
- ``torch.max(scores, torch.tensor(finfo.min))`` (OPT's clamp: a 0-dim tensor constant).

On the torch.export route and the backend the model asks ``torch.finfo(scores.dtype)``,
as transformers does, and tracing freezes fp32's value.  Symbolic tracing cannot
read a proxy's dtype, so on that route the same model asks the dtype of its
parameters (``finfo(self.dtype)``, as transformers' ``ModuleUtilsMixin.dtype``):
fp32 either way.  The reference is always eager ``torch.autocast`` on the fp32
model that asks the tensor's dtype: what the model computes when it sees bf16.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import amp_fx
from amp_fx.converter.graph_module import AmpGraphModule
from amp_fx.errors import UnsupportedConstructError
from amp_fx.frontend.tracing import trace_model
from amp_fx.ir.config import make_config
from amp_fx.ir.pass_manager import PassContext, run_passes
from amp_fx.passes.cast_params import cast_params
from amp_fx.passes.retarget_dtype_constants import DtypeConstantWarning, finfo_member, retarget_dtype_constants
from pass_check import PIPELINE, check, run_checked, run_rest

LOW = (torch.bfloat16, torch.float16)
IDIOMS = ("masked_fill", "additive", "where", "causal_full", "tensor_max")


class Attention(nn.Module):
    """One attention head whose mask is one of :data:`IDIOMS`; ``ask`` is whose dtype finfo is asked: the scores' or the parameters'."""

    def __init__(self, idiom: str, ask: str = "tensor", width: int = 8):
        super().__init__()
        self.idiom, self.ask = idiom, ask
        self.q, self.k, self.v = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:  # keep: (batch, n) bool, True = attend
        if self.ask == "tensor" and x.dim() != 3:
            # fx cannot branch on x.dim(): the scores-dtype model stays on the export route, whose ATen
            # spellings these tests are about (finfo(scores.dtype) itself traces symbolically since issue 36).
            raise ValueError("x is (batch, n, width)")
        scores = self.q(x) @ self.k(x).transpose(-1, -2)
        dtype = scores.dtype if self.ask == "tensor" else next(self.parameters()).dtype
        lowest = torch.finfo(dtype).min
        if self.idiom == "masked_fill":
            scores = scores.masked_fill(~keep[:, None, :], lowest)
        elif self.idiom == "additive":
            scores = scores + (1.0 - keep[:, None, :].to(dtype)) * lowest
        elif self.idiom == "where":
            scores = torch.where(keep[:, None, :], scores, lowest)
        elif self.idiom == "causal_full":
            n = x.shape[1]
            scores = scores + torch.full((n, n), lowest, dtype=dtype).triu(1)
        else:
            scores = torch.max(scores.masked_fill(~keep[:, None, :], float("-inf")), torch.tensor(lowest))
        return scores.softmax(-1) @ self.v(x)


def _inputs(batch: int = 2, n: int = 4, width: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(batch, n, width)
    keep = torch.ones(batch, n, dtype=torch.bool)
    keep[0, -1] = False
    keep[1] = False  # a fully masked row: softmax over finfo.min alone is uniform, over -inf it is NaN
    return x, keep


def _twins(idiom: str, route: str) -> tuple[nn.Module, nn.Module]:
    """The model to convert on ``route`` and the tensor-dtype model with the same weights (the autocast reference)."""
    ref = Attention(idiom, "tensor")
    model = Attention(idiom, "params" if route == "symbolic" else "tensor")
    model.load_state_dict(ref.state_dict())
    return model, ref


def _convert(model: nn.Module, route: str, level: str, dtype: torch.dtype, inputs: tuple):
    """The converted model and a function that returns its report's text."""
    if route == "backend":
        backend = amp_fx.backend(level=level, dtype=dtype, inner="aot_eager")
        return torch.compile(model, backend=backend), lambda: str(backend.report)
    gm = amp_fx.convert(model, level, dtype=dtype, example_inputs=inputs)
    assert gm.amp_report.route == {"symbolic": "symbolic_trace", "export": "torch.export"}[route]
    return gm, lambda: str(gm.amp_report)


def _run(module, x: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Output (fp32) and the input gradient of a fixed sign-mixing loss."""
    x = x.clone().requires_grad_()
    out = module(x, keep)
    out.float().mul(torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
    return out.detach().float(), x.grad.float()


def _autocast(ref: nn.Module, dtype: torch.dtype, x: torch.Tensor, keep: torch.Tensor):
    with torch.autocast("cpu", dtype=dtype):
        return _run(ref, x, keep)


def _ulps(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> float:
    """Largest |got - want| in ulps of ``dtype`` at the largest magnitude of ``want``."""
    return ((got.double() - want.double()).abs().max() / (want.double().abs().max() * torch.finfo(dtype).eps)).item()


def _retargets(report: str, dtype: torch.dtype) -> list[str]:
    low = str(dtype).replace("torch.", "")
    return [line for line in report.splitlines() if f"finfo(float32).min -> finfo({low}).min at " in line]


# Where the constant is read low, and so retargeted (one line each).  The additive masks are built in
# fp32 (the parameters' dtype, or the scores' at trace: ``.to(torch.float32)`` and ``dtype=torch.float32``
# are the model's own casts, kept) and promote the bf16 scores to fp32 -- as under autocast -- so at O1
# they keep fp32's minimum.  At O2/O3 the causal mask's add runs low and reads it low; the padding mask's
# arithmetic reads the model's fp32 cast, and stays fp32.
def _expected(idiom: str, level: str) -> int:
    return 0 if idiom == "additive" or (level == "O1" and idiom == "causal_full") else 1


ROUTES = ("symbolic", "export")
# x feeds three linears.  amp_fx casts it once (one cast per value); at O1 share_cast_grads sends each linear's
# low input gradient to x, summed in fp32 as autocast's (which casts x per linear), but O2/O3's entry cast is
# shared by all three, so autograd sums their gradients in the low dtype there.  Two low additions, each within
# half an ulp of a partial sum: 2 ulps of the largest gradient (measured: under 1).
_GRAD_ULPS = 2
# Each idiom on each route (their spellings differ: torch-level calls against ATen overloads); the levels and
# dtypes in full on the symbolic route, and on the export route O1 in both dtypes and O2 (O3 spells as O2 there).
_LEVELS = {"symbolic": (("O1", torch.bfloat16), ("O1", torch.float16), ("O2", torch.bfloat16), ("O3", torch.bfloat16),
                        ("O3", torch.float16)),
           "export": (("O1", torch.bfloat16), ("O1", torch.float16), ("O2", torch.bfloat16))}
CASES = [(idiom, route, level, dtype) for idiom in IDIOMS for route in ROUTES for level, dtype in _LEVELS[route]]


@pytest.mark.parametrize("idiom,route,level,dtype", CASES,
                         ids=[f"{i}-{r}-{lv}-{str(d)[6:]}" for i, r, lv, d in CASES])
def test_convert_equals_autocast_with_no_nan_and_names_each_constant(idiom, route, level, dtype):
    """Outputs and input gradients equal eager autocast's (bitwise at O1), no NaN, and the report names the constant."""
    x, keep = _inputs()
    model, ref = _twins(idiom, route)
    converted, report = _convert(model, route, level, dtype, (x, keep))
    out, grad = _run(converted, x, keep)
    want, want_grad = _autocast(ref, dtype, x, keep)
    assert torch.isfinite(out).all() and torch.isfinite(grad).all()
    # O1: the same ops on the same dtypes on both sides (the bf16 linears and scores, the mask op with
    # finfo(bf16).min, the fp32 softmax, the low matmul): autocast casts and calls the kernel the graph calls.
    # O2/O3 hold low copies of the weights and cast where autocast would not need to: not equal by
    # construction (equal where measured), bounded as the gradients are.
    assert torch.equal(out, want) if level == "O1" else _ulps(out, want, dtype) <= 2
    assert _ulps(grad, want_grad, dtype) <= _GRAD_ULPS
    # The fully masked row attends to every key alike, as autocast's does: the mean of v.
    assert torch.allclose(out[1], want[1], rtol=0, atol=2 * torch.finfo(dtype).eps * want[1].abs().max().item())
    assert len(_retargets(report(), dtype)) == _expected(idiom, level), report()


@pytest.fixture
def fresh_dynamo():
    """Compiled code from one test never serves another (as tests/dynamo/conftest.py does for every backend test)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("idiom", IDIOMS)
@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
def test_backend_equals_autocast_with_no_nan_and_names_each_constant(idiom, dtype, fresh_dynamo):
    """torch.compile(backend="amp_fx") at O1: Dynamo's torch-level spellings, the same answer as autocast."""
    x, keep = _inputs()
    model, ref = _twins(idiom, "backend")
    compiled, report = _convert(model, "backend", "O1", dtype, (x, keep))
    out, grad = _run(compiled, x, keep)
    want, want_grad = _autocast(ref, dtype, x, keep)
    assert torch.isfinite(out).all() and torch.isfinite(grad).all()
    # aot_eager runs the ATen ops of the same graph: the kernels autocast calls on the same dtypes
    # (the gradient: one shared cast of x, as on convert's routes).
    assert torch.equal(out, want) and _ulps(grad, want_grad, dtype) <= _GRAD_ULPS
    assert len(_retargets(report(), dtype)) == _expected(idiom, "O1"), report()


# --------------------------------------------------------------------------
# The pass contract (tests/pass_check.py), and what it rewrites
# --------------------------------------------------------------------------
def _check_exported(model: nn.Module, inputs: tuple, **contract):
    """pass_check's ``check`` on the torch.export route: the graph traced as convert() traces it (an AmpGraphModule,
    which an exported program's unlifted module needs), the pipeline run up to the pass, the contract asserted."""
    gm, route = trace_model(model, example_inputs=inputs, module_class=AmpGraphModule)
    assert route == "torch.export"
    ctx = PassContext(config=make_config("O1", dtype=torch.bfloat16, cast_model_outputs=False), example_inputs=inputs,
                      route=route, verify=True)
    gm = run_passes(gm, ctx, [p for p in PIPELINE[: PIPELINE.index(retarget_dtype_constants)] if p is not cast_params])
    return run_checked(retarget_dtype_constants, gm, ctx, model=model, inputs=inputs,
                       finish=lambda done: run_rest(done, ctx, retarget_dtype_constants), **contract).graph_module


@pytest.mark.parametrize("idiom", ["masked_fill", "where", "tensor_max"])
@pytest.mark.parametrize("route", ROUTES)
def test_contract_retargets_in_place(idiom, route):
    """One constant changes in place (no node added); a second run changes nothing; numerics match fp32's.

    (atol 0.05 of the largest output: bf16 linears and scores against the fp32 model; its fully
    masked row is the same mean of v either way.)
    """
    x, keep = _inputs()
    model = Attention(idiom, "params" if route == "symbolic" else "tensor")
    contract = dict(delta=0, expect_modified=True, atol=0.05)
    if route == "export":
        gm = _check_exported(model, (x, keep), **contract)
    else:
        gm = check(retarget_dtype_constants, model, (x, keep), example_inputs=(x, keep), dtype=torch.bfloat16,
                   finish=True, **contract)
    assert torch.isfinite(gm(x, keep)).all()


@pytest.mark.parametrize("route", ROUTES)
def test_contract_nothing_to_do_at_o1_for_an_fp32_additive_mask(route):
    """An additive mask built in fp32 and promoting the scores to fp32 keeps fp32's minimum: nothing changes."""
    x, keep = _inputs()
    model = Attention("additive", "params" if route == "symbolic" else "tensor")
    contract = dict(delta=0, expect_modified=False)
    if route == "export":
        _check_exported(model, (x, keep), **contract)
    else:
        check(retarget_dtype_constants, model, (x, keep), example_inputs=(x, keep), dtype=torch.bfloat16, finish=True,
              **contract)


def _floats(gm) -> list[float]:
    return [a for n in gm.graph.nodes for a in (*n.args, *n.kwargs.values()) if type(a) is float]


class SharedMask(nn.Module):
    """One fp32 causal mask read twice: by a low ``add`` (a policy) and, in fp32, by a division returned as an output."""

    def forward(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = scores.shape[-1]
        mask = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)
        return (scores + mask).softmax(-1), mask / 2


def test_readers_that_disagree_get_a_copy():
    """The low reader gets a copy of full/triu holding bf16's minimum; the fp32 reader keeps fp32's."""
    scores = torch.randn(2, 4, 4)
    gm = check(retarget_dtype_constants, SharedMask(), (scores,), example_inputs=(scores,), dtype=torch.bfloat16,
               policy={"op:add": "low"}, delta=2, expect_modified=True, grads=False)
    fills = _floats(gm)
    assert fills.count(torch.finfo(torch.float32).min) == 1 and fills.count(torch.finfo(torch.bfloat16).min) == 1
    converted = amp_fx.convert(SharedMask(), "O1", dtype=torch.bfloat16, policy={"op:add": "low"}, example_inputs=(scores,))
    probs, halved = converted(scores)
    assert torch.isfinite(probs).all()
    assert torch.equal(halved, torch.full((4, 4), torch.finfo(torch.float32).min).triu(1) / 2)  # the fp32 reader's value
    assert "a copy of full" in str(converted.amp_report)


class WidenedMask(nn.Module):
    """A bf16 model: its finfo(bf16).min is read by a masked_fill a policy pins to fp32 (a widening)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:  # fx cannot branch on it: the export route, whose recorded constant this test is about
            raise ValueError("x is (batch, width)")
        scores = self.fc(x)
        return scores.masked_fill(~keep, torch.finfo(scores.dtype).min).softmax(-1)


def test_a_widening_changes_nothing():
    """finfo(bf16).min read in fp32 is still the model's value (fp32 can hold it): left as it is."""
    model = WidenedMask().to(torch.bfloat16)
    x, keep = torch.randn(2, 4, dtype=torch.bfloat16), torch.tensor([[True, True, False, True], [False] * 4])
    gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16, policy={"op:masked_fill": "fp32"}, example_inputs=(x, keep))
    assert torch.finfo(torch.bfloat16).min in _floats(gm) and not _retargets(str(gm.amp_report), torch.bfloat16)
    assert "retarget_dtype_constants: " not in str(gm.amp_report)
    assert torch.isfinite(gm(x, keep)).all()


class InPlaceShared(nn.Module):
    """An in-place fill of an fp32 buffer-like tensor whose readers disagree on the dtype."""

    def forward(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mask = torch.zeros(scores.shape[-2:])
        mask.fill_(torch.finfo(torch.float32).min)
        return scores + mask, mask / 2


def test_in_place_constant_read_two_ways_is_refused():
    """A constant written in place cannot be given two values: refused, naming the fix."""
    scores = torch.randn(2, 4, 4)
    with pytest.raises(UnsupportedConstructError, match="out of place"):
        amp_fx.convert(InPlaceShared(), "O1", dtype=torch.bfloat16, policy={"op:add": "low"}, example_inputs=(scores,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_finfo_member_is_exact(dtype):
    """Only a dtype's exact extremes are recognised (an approximation of one is the model's own number)."""
    info = torch.finfo(dtype)
    assert [finfo_member(getattr(info, m), dtype) for m in ("min", "max", "eps", "tiny")] == ["min", "max", "eps", "tiny"]
    assert finfo_member(-1e4, dtype) is None and finfo_member(info.min * (1 - 2 ** -20), dtype) is None


class RawMask(nn.Module):
    """``masked_fill`` with the mask straight from the caller: without example inputs its dtype is unknown."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        return self.fc(x).masked_fill(masked, torch.finfo(next(self.parameters()).dtype).min).softmax(-1)


def test_without_example_inputs_an_unknown_dtype_is_not_guessed():
    """Dtype-only mode: whether ``masked`` is a bool mask or a floating tensor (which would promote) is known only at
    run time: nothing is guessed, and the warning and the report say which constant was kept and how to have it
    retargeted (with example inputs it is)."""
    with pytest.warns(DtypeConstantWarning, match="masked_fill .* kept: .* example_inputs"):
        gm = amp_fx.convert(RawMask(), "O1", dtype=torch.bfloat16)
    assert torch.finfo(torch.float32).min in _floats(gm)
    assert "kept: the dtype it is read in is known only at run time" in str(gm.amp_report)
    x, masked = torch.randn(2, 4), torch.tensor([[True, False, False, True], [True] * 4])
    gm = amp_fx.convert(RawMask(), "O1", dtype=torch.bfloat16, example_inputs=(x, masked))
    assert torch.finfo(torch.bfloat16).min in _floats(gm) and len(_retargets(str(gm.amp_report), torch.bfloat16)) == 1
    assert torch.isfinite(gm(x, masked)).all()


def test_without_example_inputs_a_known_dtype_is_retargeted():
    """The scores come from a low GEMM, the mask from a comparison: bf16 without any example input."""
    gm = amp_fx.convert(Attention("masked_fill", "params"), "O1", dtype=torch.bfloat16)
    assert len(_retargets(str(gm.amp_report), torch.bfloat16)) == 1
    x, keep = _inputs()
    assert torch.isfinite(gm(x, keep)).all()


@pytest.mark.parametrize("model_dtype,low", [(torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16)],
                         ids=["bf16-model-to-fp16", "fp16-model-to-bf16"])
def test_a_low_model_converted_to_the_other_low_dtype(model_dtype, low):
    """finfo(bf16).min overflows fp16, and fp16's eps and tiny are not bf16's: a half model run in the other half
    dtype gets that dtype's member, as under autocast, where the model sees the other dtype."""
    x, keep = _inputs()
    model, ref = _twins("where", "export")
    model, ref = model.to(model_dtype), ref.to(model_dtype)
    gm = amp_fx.convert(model, "O1", dtype=low, example_inputs=(x.to(model_dtype), keep))
    out = gm(x.to(model_dtype), keep)
    with torch.no_grad(), torch.autocast("cpu", dtype=low):
        want = ref(x.to(model_dtype), keep)
    assert torch.isfinite(out).all()
    # The linears and scores run in the other low dtype on both sides, softmax in fp32: the same kernels.
    assert torch.equal(out.float(), want.float())
    source, target = (str(d).replace("torch.", "") for d in (model_dtype, low))
    assert f"finfo({source}).min -> finfo({target}).min at where" in str(gm.amp_report)


@pytest.mark.parametrize("idiom", ["tensor_max", "causal_full"])
def test_converting_twice_and_copies_change_nothing(idiom):
    """A converted module converted again, or deep-copied, computes the same; its state_dict keys are the model's
    (a retargeted tensor constant is a non-persistent buffer, as the trace's own constants are)."""
    x, keep = _inputs()
    model = Attention(idiom, "params")
    gm = amp_fx.convert(model, "O2", dtype=torch.bfloat16, example_inputs=(x, keep))
    out = gm(x, keep)
    assert set(gm.state_dict()) == set(model.state_dict())
    again = amp_fx.convert(gm, "O2", dtype=torch.bfloat16, example_inputs=(x, keep))
    assert torch.equal(again(x, keep), out) and torch.equal(copy.deepcopy(gm)(x, keep), out)
    assert len(_retargets(str(gm.amp_report), torch.bfloat16)) == 1


class _MaskAcrossABreak(nn.Module):
    """Longformer's sliding-window mask in small: ``finfo(q.dtype).min`` filled in one Dynamo graph, read by a
    GEMM of zero-padded ones (the diagonal of the mask) in the next one, then added to the scores."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(8, 8)

    def forward(self, x, pad):
        q = self.q(x)
        float_mask = pad.to(q.dtype).masked_fill(pad, torch.finfo(q.dtype).min)
        torch._dynamo.graph_break()
        ones = torch.cat([torch.ones_like(float_mask)[:, None], torch.zeros_like(float_mask)[:, None]], 1)
        bias = ones @ torch.stack([float_mask, float_mask])  # 1 * min + 0 * min: NaN where min is -inf
        return torch.softmax(q @ q.T + bias, -1) @ q


@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
def test_a_dynamo_graph_returns_the_low_extreme_to_the_graph_after_a_break(dtype, fresh_dynamo):
    """A constant that leaves its Dynamo graph is read by the next one, maybe low: fp32's min rounded to -inf there
    made the padded rows NaN (Longformer through 21 graphs, issue 42). It leaves as the low dtype's min, as
    under autocast; outputs and gradients are finite and autocast's within the dtype's noise."""
    torch.manual_seed(0)
    model, x, pad = _MaskAcrossABreak(), torch.randn(6, 8), torch.tensor([False] * 4 + [True] * 2)
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend=amp_fx.backend(level="O1", dtype=dtype, inner="aot_eager"))
    out = compiled(x, pad)
    out.float().square().sum().backward()
    grads = [p.grad for p in model.parameters()]
    with torch.autocast("cpu", dtype=dtype):
        want = ref(x, pad)
    want.float().square().sum().backward()
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    torch.testing.assert_close(out.float(), want.float(), rtol=4 * torch.finfo(dtype).eps, atol=4 * torch.finfo(dtype).eps)
    for got, expected in zip(grads, (p.grad for p in ref.parameters())):
        torch.testing.assert_close(got, expected, rtol=0.05, atol=0.05 * expected.abs().max().item())
