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
