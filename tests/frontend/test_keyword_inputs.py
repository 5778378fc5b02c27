"""Keyword inputs given at conversion may be left out at call time where the model's forward allows it (issue 24, item 2).

A model converted with ``labels`` in ``example_kwarg_inputs`` returns logits
and no loss when called without them, as the model does; a keyword input
the graph has no input for, or one the model requires, is refused naming it
(amp_fx/converter/specialisations.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_fx
from amp_fx.errors import AmpTypeError

transformers = pytest.importorskip("transformers")

# bf16 unit roundoff 2**-8; tiny two-layer models' logits (|logit| < ~3) differ from autocast's by a few
# roundoffs of the largest intermediates: 0.05 absolute (~13 roundoffs).
LOGIT_ATOL = 5e-2


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64, bos_token_id=0, eos_token_id=0,
        attn_implementation="sdpa", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        attn_implementation="sdpa"))


@pytest.mark.parametrize("build, level", [(_gpt2, "O1"), (_gpt2, "O2"), (_llama, "O1")], ids=["gpt2-O1", "gpt2-O2", "llama-O1"])
def test_hf_model_called_without_labels_gives_logits_and_no_loss(build, level):
    """Without labels (left out, or None): loss None, logits as with labels and as the model's under autocast."""
    torch.manual_seed(0)
    model = build().eval()
    ids = torch.randint(0, 128, (2, 12))
    gm = amp_fx.convert(model, level, dtype=torch.bfloat16, example_kwarg_inputs={"input_ids": ids, "labels": ids})
    assert gm.amp_report.route == "torch.export"
    with_labels = gm(input_ids=ids, labels=ids)
    without = gm(input_ids=ids)
    explicit_none = gm(input_ids=ids, labels=None)
    assert with_labels.loss is not None and without.loss is None and explicit_none.loss is None
    assert torch.equal(without.logits, explicit_none.logits)
    reference = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = reference(input_ids=ids)
    assert expected.loss is None
    torch.testing.assert_close(without.logits.float(), expected.logits.float(), atol=LOGIT_ATOL, rtol=0)
    # the same weights: logits with and without labels agree to the bf16 roundoff of the head's output
    torch.testing.assert_close(without.logits.float(), with_labels.logits.float(), atol=LOGIT_ATOL, rtol=0)
    # and back: with labels again, the loss graph (kept) runs
    assert torch.equal(gm(input_ids=ids, labels=ids).loss, with_labels.loss)


def test_gradients_flow_in_the_graph_without_labels():
    """A loss computed outside the module from the logits of the label-less graph trains the same parameters."""
    torch.manual_seed(0)
    model = _gpt2().train()
    ids = torch.randint(0, 128, (2, 12))
    gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16, example_kwarg_inputs={"input_ids": ids, "labels": ids})
    logits = gm(input_ids=ids).logits
    F.cross_entropy(logits[:, :-1].reshape(-1, 128).float(), ids[:, 1:].reshape(-1)).backward()
    inside = {n: p.grad.clone() for n, p in gm.named_parameters()}
    gm.zero_grad()
    gm(input_ids=ids, labels=ids).loss.backward()
    for name, p in gm.named_parameters():
        # the same loss, computed in the graph or outside it: equal to bf16 roundoff relative to each gradient's size
        scale = p.grad.abs().max().clamp_min(1e-12)
        torch.testing.assert_close(inside[name] / scale, p.grad / scale, atol=3e-2, rtol=0)


class WithLoss(nn.Module):
    """Returns the loss only when labels are given; a branch on a size keeps fx from tracing it (torch.export does)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x, labels=None, *, weight=None):
        out = self.fc(x if x.shape[0] > 0 else x + 1)
        if weight is not None:
            out = out * weight
        if labels is None:
            return out
        return out, F.cross_entropy(out, labels)


class NeedsMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x, mask):
        return self.fc(x if x.shape[0] > 0 else x + 1) * mask


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_plain_module_omits_optional_keywords(level):
    torch.manual_seed(0)
    model = WithLoss()
    x, labels, weight = torch.randn(6, 8), torch.randint(0, 4, (6,)), torch.rand(4)
    gm = amp_fx.convert(model, level, dtype=torch.bfloat16, example_kwarg_inputs={"x": x, "labels": labels, "weight": weight})
    assert gm.amp_report.route == "torch.export"
    out, loss = gm(x=x, labels=labels, weight=weight)
    assert loss.dim() == 0
    plain = gm(x=x)
    assert isinstance(plain, torch.Tensor) and plain.shape == (6, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x)
    # one bf16 GEMM of width 8: a few roundoffs of values below ~2
    torch.testing.assert_close(plain.float(), expected.float(), atol=2e-2, rtol=0)
    weighted = gm(x=x, weight=weight)
    torch.testing.assert_close(weighted.float(), out.float(), atol=0, rtol=0)


def test_keywords_the_graph_cannot_take_are_refused_by_name():
    x, labels = torch.randn(4, 8), torch.randint(0, 4, (4,))
    gm = amp_fx.convert(WithLoss(), "O1", dtype=torch.bfloat16, example_kwarg_inputs={"x": x, "labels": labels})
    with pytest.raises(AmpTypeError, match="takes no keyword input 'bogus'"):
        gm(x=x, bogus=labels)
    with pytest.raises(AmpTypeError, match="'weight' was not among example_kwarg_inputs"):
        gm(x=x, weight=torch.rand(4))
    gm(x=x, weight=None)  # None is what forward's default gives: nothing to refuse
    needs = amp_fx.convert(NeedsMask(), "O1", dtype=torch.bfloat16,
                           example_kwarg_inputs={"x": x, "mask": torch.ones(4, 4)})
    with pytest.raises(AmpTypeError, match="needs keyword input 'mask'"):
        needs(x=x)


class TraceableWithLoss(nn.Module):
    """fx traces it; ``labels is None`` is False for a Proxy, so fx alone keeps only the loss branch."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x, labels=None):
        out = self.fc(x)
        if labels is None:
            return out
        return out, F.cross_entropy(out, labels)


def test_symbolic_route_traces_an_omitted_keyword_as_none():
    """Symbolic route: a call without labels runs a graph traced with labels=None; hooks stay live in both graphs."""
    torch.manual_seed(0)
    model = TraceableWithLoss()
    x, labels = torch.randn(6, 8), torch.randint(0, 4, (6,))
    gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16, example_kwarg_inputs={"x": x, "labels": labels})
    assert gm.amp_report.route == "symbolic_trace"
    out, loss = gm(x=x, labels=labels)
    plain = gm(x)
    assert isinstance(plain, torch.Tensor) and torch.equal(plain, out)  # the same ops on the same weights
    assert isinstance(gm(x, labels=None), torch.Tensor)
    fired = []
    model.fc.register_forward_hook(lambda module, args, output: fired.append(output.dtype))
    gm(x)
    gm(x=x, labels=labels)
    gm(x)
    assert fired == [torch.bfloat16] * 3  # what autocast gives a Linear's hook, in every graph


def test_keyword_inputs_given_by_position_count_as_given():
    """torch.export binds positional arguments to forward's names: gm(x, labels) is gm(x=x, labels=labels)."""
    torch.manual_seed(0)
    x, labels = torch.randn(6, 8), torch.randint(0, 4, (6,))
    gm = amp_fx.convert(WithLoss(), "O1", dtype=torch.bfloat16, example_kwarg_inputs={"x": x, "labels": labels})
    out, loss = gm(x, labels)
    by_name, loss_by_name = gm(x=x, labels=labels)
    assert torch.equal(out, by_name) and torch.equal(loss, loss_by_name)
    assert torch.equal(gm(x), gm(x=x))


# -- optional parameters the example inputs leave out (tester finding f1) --------------------------------------
# fx traces every parameter as a Proxy, and a Proxy is never None: without tracing such a parameter at its default,
# `if scale is not None` multiplied by None, `if labels is not None` computed a loss of None, and (silently)
# `if past is None` dropped the offset. The conversion now traces each at its default, as model(x) runs.

U = 2.0 ** -8  # bf16 unit roundoff


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x, scale=None):
        y = self.fc(x)
        if scale is not None:
            y = y * scale
        return y


class Offset(nn.Module):
    """The silent case: the branch fx would skip does work (no cache: add the start offset)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)
        self.register_buffer("offset", torch.full((4,), 3.0))

    def forward(self, x, past=None):
        y = self.fc(x)
        if past is None:
            y = y + self.offset
        else:
            y = y + past
        return y


class Labelled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x, labels=None):
        logits = self.fc(x)
        if labels is not None:
            return F.cross_entropy(logits, labels)
        return logits


def _linear_error(fc: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """Elementwise bound on a bf16 Linear's output error against fp32.

    x, W and b are each rounded to bf16 (U relative), the fp32 accumulation
    of 16 products adds ~16 * 2**-24 (negligible), and the output is rounded
    to bf16 once (U of at most |x| |W|^T + |b|): 4U (|x| |W|^T + |b|).
    """
    return 4 * U * (x.abs() @ fc.weight.detach().abs().T + fc.bias.detach().abs())


def _grad_bounds(g: torch.Tensor, g_error: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bounds on the Linear's weight and bias gradients (dW = g^T x, db = sum g) against fp32.

    g is what reaches the Linear (error g_error against fp32); the bf16
    backward rounds g and x (U each) and its result (U): (g_error + 4U|g|)^T |x|.
    """
    a = g_error + 4 * U * g.abs()
    return a.T @ x.abs(), a.sum(0)


def _run(module, x, kwargs, projection):
    """(output, the Linear's weight and bias gradients) of one call; a loss is its own, logits are projected."""
    module.zero_grad()
    out = module(x, **kwargs)
    loss = out.float() if out.dim() == 0 else (out.float() * projection).sum()
    loss.backward()
    fc = module.get_submodule("fc")
    return out.detach().float(), fc.weight.grad.float(), fc.bias.grad.float()


def _expected(case, model, x, kwargs, projection):
    """fp32 output and gradients, and their bf16 bounds for this case (derived in the comments)."""
    out, dw, db = _run(model, x, kwargs, projection)
    lin_error = _linear_error(model.fc, x)
    with torch.no_grad():
        lin = model.fc(x)
    if out.dim() == 0:  # cross entropy (fp32 in the graph) of logits off by e: |d loss| <= 2 max e per sample, mean
        e = lin_error.amax(1, keepdim=True)
        out_bound = 2 * e.max()
        p = lin.softmax(-1)
        g = (p - F.one_hot(kwargs["labels"], 4)) / x.shape[0]
        g_error = 3 * e * p / x.shape[0]  # softmax moves by p (e^{2e} - 1) <= 3 e p for e < 0.1
    else:  # y * s (s = 2: exact) or y + offset / past (one more bf16 rounding at O2): s e_lin + 2U |y|
        s = abs(kwargs.get("scale", 1.0))
        out_bound = s * lin_error + 2 * U * out.abs()
        g = (projection * s).expand_as(out)
        g_error = torch.zeros_like(g)  # a constant projection, exact in bf16 (powers of two)
    dw_bound, db_bound = _grad_bounds(g, g_error, x)
    return (out, dw, db), (out_bound, dw_bound, db_bound)


def _check(got, expected, bounds):
    for name, a, b, bound in zip(("output", "weight grad", "bias grad"), got, expected, bounds):
        excess = ((a - b).abs() - bound).max().item()
        assert excess <= 1e-6, f"{name}: error exceeds its bf16 bound by {excess}"


CASES = {
    "scale": (Scaled, lambda x: {"scale": 2.0}),
    "past": (Offset, lambda x: {"past": torch.full((4,), 0.5)}),
    "labels": (Labelled, lambda x: {"labels": torch.randint(0, 4, (x.shape[0],))}),
}


@pytest.mark.parametrize("examples", ["none", "x"])
@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("case", list(CASES))
def test_optional_input_left_out_at_conversion_is_traced_at_its_default(case, level, examples):
    """gm(x) computes model(x); gm(x, kw=...) builds a graph with kw as an input: outputs and gradients within bf16."""
    torch.manual_seed(0)
    build, given = CASES[case]
    model = build()
    x = torch.randn(8, 16)
    projection = torch.tensor([1.0, -0.5, 0.25, 2.0])
    options = {} if examples == "none" else {"example_inputs": (x,)}
    gm = amp_fx.convert(model, level, dtype=torch.bfloat16, **options)
    assert gm.amp_report.route == "symbolic_trace"
    note = [n for n in gm.amp_report.notes if n.startswith("traced at their defaults")]
    assert note and f"{case}=None" in note[0]
    plain = _run(gm, x, {}, projection)
    _check(plain, *_expected(case, model, x, {}, projection))
    kwargs = given(x)
    with_kw = _run(gm, x, kwargs, projection)
    _check(with_kw, *_expected(case, model, x, kwargs, projection))
    assert any(f"giving {case}" in n for n in gm.amp_report.notes)  # the report of the graph in use says so
    # the same graph by position, and the first graph again, kept: the same kernels on the same inputs
    assert torch.equal(_run(gm, x, {}, projection)[0], plain[0])
    assert torch.equal(gm(x, *kwargs.values()).detach().float(), with_kw[0])
    assert torch.equal(gm(x, **{case: None}).detach().float(), plain[0])


class Flagged(nn.Module):
    """A flag fx cannot trace as a graph input (Python control flow on it)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x, return_dict=True, k: int = 2):
        y = self.fc(x) * k
        return {"y": y} if return_dict else y


def test_a_default_fx_cannot_take_as_an_input_runs_captured_from_the_call():
    torch.manual_seed(0)
    model = Flagged()
    x = torch.randn(8, 16)
    gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16)
    note = [n for n in gm.amp_report.notes if n.startswith("traced at their defaults")][0]
    assert "return_dict=True" in note and "k=2" in note
    out = gm(x)["y"]
    assert torch.equal(gm(x, return_dict=True)["y"], out) and torch.equal(gm(x, True, 2)["y"], out)  # the defaults
    for _ in range(2):  # fx cannot take it as an input: the call runs captured from the call, on gm's parameters
        plain = gm(x, return_dict=False)
        assert isinstance(plain, torch.Tensor) and torch.equal(plain, out)
    # k is arithmetic: a graph with it as an input; y * 3 in bf16 rounds once more (U of |y|)
    tripled = gm(x, k=3)["y"].float()
    torch.testing.assert_close(tripled, 1.5 * out.float(), atol=0, rtol=3 * U)
    assert torch.equal(gm(x)["y"], out)


class ExportOnly(nn.Module):
    """fx fails on the size branch, so torch.export traces it; it runs forward's defaults for what is not given."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)
        self.register_buffer("offset", torch.full((4,), 3.0))

    def forward(self, x, labels=None, past=None, mode: str = "mean"):
        y = self.fc(x if x.shape[0] > 0 else x + 1)
        if past is None:
            y = y + self.offset
        if mode == "sum":
            y = y * 2
        if labels is not None:
            return F.cross_entropy(y, labels)
        return y


@pytest.mark.parametrize("options", ["example_inputs", "example_kwarg_inputs"])
def test_export_route_runs_forward_defaults_for_what_the_examples_leave_out(options):
    torch.manual_seed(0)
    model = ExportOnly()
    x, labels = torch.randn(8, 16), torch.randint(0, 4, (8,))
    examples = {"example_inputs": (x,)} if options == "example_inputs" else {"example_kwarg_inputs": {"x": x}}
    gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16, **examples)
    assert gm.amp_report.route == "torch.export"
    out = gm(x).float()
    # y + offset in fp32 after the bf16 Linear: the Linear's bound and one rounding of |y| (see _linear_error)
    with torch.no_grad():
        expected = model(x)
    assert ((out - expected).abs() - (_linear_error(model.fc, x) + U * expected.abs())).max() <= 1e-6
    assert torch.equal(gm(x, None).float(), out)  # a default given by position
    for call in (lambda: gm(x, labels), lambda: gm(x, labels=labels)):
        with pytest.raises(AmpTypeError, match=r"'labels' was not among example_kwarg_inputs.*'labels': <an example>"):
            call()


def test_export_route_refuses_a_bound_constant_left_out_where_the_default_differs():
    x = torch.randn(8, 16)
    gm = amp_fx.convert(ExportOnly(), "O1", dtype=torch.bfloat16, example_kwarg_inputs={"x": x, "mode": "sum"})
    gm(x=x, mode="sum")
    with pytest.raises(AmpTypeError, match=r"mode='sum' was given at conversion.*default mode='mean'"):
        gm(x=x)


def test_hf_model_converted_without_labels_refuses_them_by_name():
    torch.manual_seed(0)
    model = _gpt2().eval()
    ids = torch.randint(0, 128, (2, 12))
    gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16, example_kwarg_inputs={"input_ids": ids})
    assert gm.amp_report.route == "torch.export"
    out = gm(input_ids=ids)
    assert out.loss is None  # torch.export ran forward with labels=None, its default
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = copy.deepcopy(model)(input_ids=ids)
    torch.testing.assert_close(out.logits.float(), expected.logits.float(), atol=LOGIT_ATOL, rtol=0)
    with pytest.raises(AmpTypeError, match=r"'labels' was not among example_kwarg_inputs"):
        gm(input_ids=ids, labels=ids)


class Masked(nn.Module):
    """forward cannot run at its default (None has no unsqueeze): the mask is a graph input although not given at conversion."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x, mask=None):
        return self.fc(x) * mask.unsqueeze(-1)


def test_an_input_forward_cannot_do_without_stays_an_input_and_leaving_it_out_runs_as_eager():
    torch.manual_seed(0)
    model = Masked()
    x, mask = torch.randn(8, 16), (torch.rand(8) > 0.5).float()
    gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16)
    assert any(n.startswith("traced as graph inputs") and "mask" in n for n in gm.amp_report.notes)
    out = gm(x, mask).float()
    with torch.no_grad():  # times a 0/1 mask: exact, so the Linear's bound alone (see _linear_error)
        assert ((out - model(x, mask)).abs() - _linear_error(model.fc, x)).max() <= 1e-6
    # Leaving it out runs the model's own forward, captured from the call: what eager does, its error included.
    with pytest.raises(AttributeError, match="'NoneType' object has no attribute 'unsqueeze'"):
        model(x)
    with pytest.raises(AttributeError, match="'NoneType' object has no attribute 'unsqueeze'"):
        gm(x)
    assert torch.equal(gm(x, mask=mask).float(), out)
