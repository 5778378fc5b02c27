"""Encoder-decoder models on the export route: both sequence lengths stay dynamic; a size export fixed is named (issue 23, item 4).

T5 and BART are built from tiny configs (2 layers, d_model 32) and
converted once each, with ``labels`` so the loss is in the graph.  A model
that fixes its decoder length (an ``nn.Module`` fx cannot trace, so it takes
the export route too) checks the errors: a call with another size raises an
``AmpValueError`` naming the input, the dimension, the size and the fix, and a
``dynamic_shapes=`` that the model contradicts is refused at conversion.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
from torch.export import Dim

import amp_fx
from amp_fx.errors import AmpError, AmpValueError

import hf_models

transformers = pytest.importorskip("transformers")


def t5():
    config = transformers.T5Config(
        vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
    )
    return transformers.T5ForConditionalGeneration(config)


def bart():
    config = transformers.BartConfig(
        vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
    )
    return transformers.BartForConditionalGeneration(config)


def seq2seq_batch(size: int, source: int, target: int, seed: int) -> dict:
    """``input_ids`` of length ``source``; ``decoder_input_ids`` and ``labels`` of length ``target`` (no special ids)."""
    generator = torch.Generator().manual_seed(seed)
    ids = lambda length: torch.randint(3, 128, (size, length), generator=generator)  # noqa: E731
    return {"input_ids": ids(source), "decoder_input_ids": ids(target), "labels": ids(target)}


@pytest.fixture(scope="module", params=[t5, bart], ids=["t5", "bart"])
def converted(request):
    """(converted at O1 bf16, the model it trains, an fp32 copy, a copy for autocast, the conversion's warnings)."""
    torch.manual_seed(0)
    model = request.param()
    reference, autocast_copy = copy.deepcopy(model), copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16, example_kwarg_inputs=seq2seq_batch(2, 8, 6, seed=0))
    return gm, model, reference, autocast_copy, [str(w.message) for w in caught]


@pytest.mark.slow  # the first test pays for both conversions (T5 ~5-8 s on 2 cores, BART ~3 s)
def test_both_sequence_lengths_are_dynamic(converted):
    """The decoder length (6) differs from the encoder's (8): each gets its own dynamic size, and nothing is kept static."""
    gm, *_, caught = converted
    assert gm.amp_report.route == "torch.export"
    assert "torch.export: dynamic dimensions (?) in input_ids[?, ?], decoder_input_ids[?, ?], labels[?, ?]" in gm.amp_report.notes
    assert not any("static" in note for note in gm.amp_report.notes)
    assert not any("torch.export kept" in message for message in caught)


def _loss_and_grads(module, parameters, data, autocast=False):
    for p in parameters.values():
        p.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = module(**data)
    out.loss.float().backward()
    return out, {name: p.grad for name, p in parameters.items()}


@pytest.mark.slow
@pytest.mark.parametrize("size,source,target", [(2, 8, 9), (3, 11, 6), (3, 11, 13)],
                         ids=["longer_decoder", "longer_encoder", "both_longer"])
def test_new_lengths_train_like_fp32_and_autocast(converted, size, source, target):
    """Other encoder and decoder lengths run without reconversion: loss within 5% of fp32 eager, gradients finite and autocast's.

    Gradients are compared with torch.autocast's (the same bf16 precision):
    on these tiny random models bf16 itself moves some gradients by a third
    of their largest entry from fp32 (autocast as much as amp_fx).  The two
    bf16 runs differ only where torch.export's ATen ops round at other
    points than eager's; measured at most 1.6% of a parameter's largest fp32
    gradient entry, a few bf16 roundings (2^-8 each).  Bound: 5% of it, plus
    1e-4 for gradients that are zero in exact arithmetic (BART's k_proj bias).
    """
    gm, model, reference, autocast_copy, _ = converted
    data = seq2seq_batch(size, source, target, seed=source * 100 + target)
    out, grads = _loss_and_grads(gm, dict(model.named_parameters()), data)
    want, fp32 = _loss_and_grads(reference, dict(reference.named_parameters()), data)
    _, bf16 = _loss_and_grads(autocast_copy, dict(autocast_copy.named_parameters()), data, autocast=True)
    assert out.logits.shape == want.logits.shape == (size, target, 128)
    assert abs(out.loss.item() - want.loss.item()) <= 0.05 * abs(want.loss.item())
    checked = 0
    for name, grad in grads.items():
        if fp32[name] is None:
            continue
        assert grad is not None and torch.isfinite(grad).all(), name
        assert (grad - bf16[name]).abs().max().item() <= 0.05 * fp32[name].abs().max().item() + 1e-4, name
        checked += 1
    assert checked >= 20  # embeddings, attention and MLP weights of both stacks


# --------------------------------------------------------------------------
# A model that fixes its decoder length
# --------------------------------------------------------------------------
class FixedDecoderLength(nn.Module):
    """Adds a learned (6, 8) table to the decoder embeddings: the decoder length must be 6.

    The Python check on the encoder length defeats symbolic tracing, so the
    model takes the torch.export route, and export records ``length <= 100``.
    """

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.positions = nn.Parameter(torch.randn(6, 8))
        self.head = nn.Linear(8, 4)

    def forward(self, input_ids, decoder_input_ids):
        if input_ids.shape[1] > 100:
            raise ValueError("input too long")
        memory = self.embed(input_ids).mean(1, keepdim=True)
        return self.head(memory + self.embed(decoder_input_ids) + self.positions)


def _ids(size: int, length: int) -> torch.Tensor:
    return torch.randint(0, 16, (size, length), generator=torch.Generator().manual_seed(length))


EXAMPLE = {"input_ids": _ids(2, 8), "decoder_input_ids": _ids(2, 6)}


def test_a_length_the_model_fixes_is_static_and_says_so():
    """At conversion: a warning and a report note; at a call with another length: AmpValueError naming it, not AssertionError."""
    with pytest.warns(UserWarning, match=r"torch.export kept decoder_input_ids.shape\[1\] == 6 static"):
        gm = amp_fx.convert(FixedDecoderLength(), "O1", dtype=torch.bfloat16, example_kwarg_inputs=EXAMPLE)
    assert any("kept decoder_input_ids.shape[1] == 6 static" in note for note in gm.amp_report.notes)
    assert "torch.export: dynamic dimensions (?) in input_ids[?, ?], decoder_input_ids[?, 6]" in gm.amp_report.notes
    assert gm(input_ids=_ids(3, 11), decoder_input_ids=_ids(3, 6)).shape == (3, 6, 4)  # batch and encoder vary
    with pytest.raises(AmpValueError) as caught:
        gm(input_ids=_ids(3, 11), decoder_input_ids=_ids(3, 9))
    message = str(caught.value)
    assert message.startswith("decoder_input_ids.shape[1] is 9, but the converted module only accepts 6 there")
    assert "the model fixes that size" in message and "Fix: call with 6 there" in message
    assert "dynamic_shapes=" in message and not isinstance(caught.value, AssertionError)
    with pytest.raises(AmpValueError, match=r"input_ids.size\(\)\[1\] <= 100.*The model requires it"):
        gm(input_ids=_ids(2, 101), decoder_input_ids=_ids(2, 6))  # a bound the model checks: the guard is quoted


def test_a_size_kept_static_by_the_user_names_dynamic_shapes():
    """dynamic_shapes=False: the error says the conversion did not declare it dynamic and shows the spec that does."""
    gm = amp_fx.convert(FixedDecoderLength(), "O1", dtype=torch.bfloat16, example_kwarg_inputs=EXAMPLE,
                        dynamic_shapes=False)
    with pytest.raises(AmpValueError) as caught:
        gm(input_ids=_ids(2, 12), decoder_input_ids=_ids(2, 6))
    message = str(caught.value)
    assert message.startswith("input_ids.shape[1] is 12, but the converted module only accepts 8 there")
    assert "did not declare it dynamic" in message
    assert "dynamic_shapes={'input_ids': {1: torch.export.Dim.AUTO}" in message


def test_a_size_one_example_names_the_example():
    """An example batch of 1 is specialised by torch.export: the error at a batch of 3 asks for an example of 2 or more."""
    with pytest.warns(UserWarning, match=r"kept input_ids.shape\[0\] == 1, decoder_input_ids.shape\[0\] == 1"):
        gm = amp_fx.convert(FixedDecoderLength(), "O1", dtype=torch.bfloat16,
                            example_kwarg_inputs={"input_ids": _ids(1, 8), "decoder_input_ids": _ids(1, 6)})
    with pytest.raises(AmpValueError) as caught:
        gm(input_ids=_ids(3, 8), decoder_input_ids=_ids(3, 6))
    message = str(caught.value)
    assert message.startswith("input_ids.shape[0] is 3, but the converted module only accepts 1 there")
    assert "specialises a size of 1" in message and "an example where input_ids.shape[0] is 2 or more" in message


@pytest.mark.filterwarnings("ignore:torch.export kept decoder_input_ids")
def test_the_error_holds_under_torch_compile():
    """Compiled (Dynamo traces the export guards), the converted module still raises the AmpValueError, not Dynamo's error."""
    gm = amp_fx.convert(FixedDecoderLength(), "O1", dtype=torch.bfloat16, example_kwarg_inputs=EXAMPLE)
    compiled = torch.compile(gm, backend="aot_eager")
    torch.testing.assert_close(compiled(**EXAMPLE), gm(**EXAMPLE), rtol=0, atol=0)
    with pytest.raises(AmpValueError, match=r"decoder_input_ids.shape\[1\] is 7, but the converted module only accepts 6"):
        compiled(input_ids=_ids(2, 8), decoder_input_ids=_ids(2, 7))


def test_a_declared_dynamic_size_the_model_fixes_is_refused():
    """A named Dim on the fixed length: amp_fx refuses (it does not keep it static behind the user's back) and names it."""
    spec = {"input_ids": {0: Dim("batch"), 1: Dim("source", max=100)},
            "decoder_input_ids": {0: Dim("batch"), 1: Dim("target")}}
    with pytest.raises(AmpError) as caught:
        amp_fx.convert(FixedDecoderLength(), "O1", example_kwarg_inputs=EXAMPLE, dynamic_shapes=spec)
    message = str(caught.value)
    assert "dynamic_shapes= declares decoder_input_ids.shape[1] (Dim 'target') of FixedDecoderLength dynamic" in message
    assert "specialized it to be a constant (6)" in message  # torch.export's reason, quoted
    assert "leave that dimension out of dynamic_shapes=" in message
    assert isinstance(caught.value.__cause__, AmpValueError)


def test_state_dict_keys_are_the_models_and_load_strictly_both_ways(converted):
    """torch.export lifts a constant of T5/BART (``lifted_tensor_0``) into a buffer: it is non-persistent, so checkpoints keep the model's keys."""
    gm, model, *_ = converted
    assert set(gm.state_dict()) == set(model.state_dict())
    fresh = type(model)(model.config)
    fresh.load_state_dict(gm.state_dict())  # strict: no unexpected key
    gm.load_state_dict(model.state_dict())  # strict: no missing key
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, model.state_dict()[name]), name


def test_a_sliced_example_input_converts_and_matches_a_contiguous_one():
    """An example sliced from a bigger batch (non-contiguous) traces as its contiguous copy would: the strides are not the model's business."""
    torch.manual_seed(0)
    model = hf_models.gpt2()
    ids = torch.randint(3, 100, (6, 24))
    sliced = amp_fx.convert(model, "O1", example_kwarg_inputs={"input_ids": ids[:2, :7], "labels": ids[:2, :7]})
    plain = amp_fx.convert(model, "O1", example_kwarg_inputs={"input_ids": ids[:2, :7].clone(), "labels": ids[:2, :7].clone()})
    assert torch.equal(sliced(input_ids=ids, labels=ids).loss, plain(input_ids=ids, labels=ids).loss)
