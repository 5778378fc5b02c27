"""One conversion serves train and eval: ``.train()`` / ``.eval()`` switch graphs on the torch.export route (issue 24, item 2).

torch.export fixes every module's train/eval flag in the graph it makes, so a
module converted in train mode used to apply dropout forever.  Now each
mode has its graph, built at its first call, on the converted module's own
weights and buffers (amp_fx/converter/specialisations.py).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import amp_fx
from routes import Untraceable

transformers = pytest.importorskip("transformers")

# bf16 keeps 8 significant bits (unit roundoff 2**-8 = 0.0039).  Through two GPT-2 blocks of width 64 the
# logits (|logit| < ~3) of an O1/O2 graph and of torch.autocast differ by a few roundoffs of the largest
# intermediate values; 0.05 absolute is ~13 roundoffs, and the mean loss over 32 tokens is far tighter.
LOGIT_ATOL, LOSS_RTOL = 5e-2, 1e-2


def _gpt2(dropout: float = 0.1):
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64, bos_token_id=0, eos_token_id=0,
        attn_implementation="sdpa", resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    return transformers.GPT2LMHeadModel(config)


def _batch(seed: int = 0):
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def _flags(model):
    return {name: m.training for name, m in model.named_modules()}


@pytest.fixture(scope="module")
def gpt2_converted():
    """GPT-2 (dropout 0.1) in train mode, converted once per level; shared by the tests below (each call re-reads the mode)."""
    torch.manual_seed(0)
    model = _gpt2().train()
    batch = _batch()
    return model, batch, {level: amp_fx.convert(model, level, dtype=torch.bfloat16, example_kwarg_inputs=batch)
                          for level in ("O1", "O2")}


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_gpt2_converted_in_train_mode_evaluates_without_dropout(gpt2_converted, level):
    """eval twice: bit-identical, and equal within bf16 tolerance to the fp32 model in eval under autocast."""
    model, batch, converted = gpt2_converted
    gm = converted[level]
    assert gm.amp_report.route == "torch.export"
    before = _flags(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no FrozenTrainingWarning: the switch takes effect
        gm.eval()
    first, second = gm(**batch), gm(**batch)
    assert torch.equal(first.logits, second.logits) and torch.equal(first.loss, second.loss)
    reference = copy.deepcopy(model).eval()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = reference(**batch)
    torch.testing.assert_close(first.logits.float(), expected.logits.float(), atol=LOGIT_ATOL, rtol=0)
    torch.testing.assert_close(first.loss, expected.loss.float(), rtol=LOSS_RTOL, atol=0)
    assert _flags(model) == before  # the model stays in train mode
    assert "graph for eval mode" in " ".join(gm.amp_report.notes)
    gm.train()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_gpt2_train_mode_still_applies_dropout(gpt2_converted, level):
    """train: two seeds give two outputs, one seed one output; after an eval call, train applies dropout again."""
    _, batch, converted = gpt2_converted
    gm = converted[level]
    gm.eval()
    evaluated = gm(**batch).logits
    gm.train()
    torch.manual_seed(1)
    a = gm(**batch).logits
    torch.manual_seed(2)
    b = gm(**batch).logits
    torch.manual_seed(1)
    a_again = gm(**batch).logits
    assert not torch.equal(a, b) and torch.equal(a, a_again)
    assert not torch.equal(a, evaluated)


def test_one_set_of_weights_serves_both_modes(gpt2_converted):
    """Switching keeps every parameter and buffer object; no weight is copied; state_dict keys stay the model's."""
    model, batch, converted = gpt2_converted
    gm = converted["O2"]
    gm.train()
    gm(**batch)
    params = {n: p for n, p in gm.named_parameters(remove_duplicate=False)}
    masters = dict(gm.amp_fx_masters)
    gm.eval()
    gm(**batch)
    assert {n: p for n, p in gm.named_parameters(remove_duplicate=False)} == params
    assert all(gm.amp_fx_masters[n] is m for n, m in masters.items())
    assert set(gm.state_dict()) == set(model.state_dict())
    gm.train()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_eval_gradients_match_autocast_and_train_steps_reach_the_masters(level):
    """Gradients of the eval graph against autocast's; an optimizer step in train mode changes what eval computes."""
    torch.manual_seed(0)
    model, batch = _gpt2().train(), _batch()
    reference = copy.deepcopy(model).eval()
    gm = amp_fx.convert(model, level, dtype=torch.bfloat16, example_kwarg_inputs=batch)
    gm.eval()
    gm(**batch).loss.backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference(**batch).loss.backward()
    ours, theirs = dict(gm.named_parameters()), dict(reference.named_parameters())
    for name in ("transformer.h.0.attn.c_attn.weight", "transformer.h.1.mlp.c_fc.weight", "transformer.wte.weight"):
        # a weight gradient sums 32 tokens' bf16 products: relative to its largest entry, a few roundoffs
        grad, expected = ours[name].grad.float(), theirs[name].grad
        scale = expected.abs().max()
        torch.testing.assert_close(grad / scale, expected / scale, atol=3e-2, rtol=0)
    gm.zero_grad()
    before = gm(**batch).logits
    gm.train()
    params = [p for p in gm.parameters() if p.requires_grad]
    if level == "O2":
        optimizer = amp_fx.MasterWeightOptimizer(torch.optim.SGD(list(gm.amp_fx_masters.values()), lr=1.0), gm)
    else:
        optimizer = torch.optim.SGD(params, lr=1.0)
    gm(**batch).loss.backward()
    optimizer.step()
    gm.eval()
    after = gm(**batch).logits
    assert not torch.equal(before, after)


class BatchNormNet(nn.Module):
    """Linear -> BatchNorm1d -> Dropout -> Linear."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.drop(self.bn(self.fc(x))))


def _convert(model, route, x, level):
    if route == "export":
        wrapped = Untraceable(model)
        gm = amp_fx.convert(wrapped, level, dtype=torch.bfloat16, example_inputs=(x,))
        assert gm.amp_report.route == "torch.export"
        return wrapped, gm, "inner."
    gm = amp_fx.convert(model, level, dtype=torch.bfloat16, example_inputs=(x,))
    assert gm.amp_report.route == "symbolic_trace"
    return model, gm, ""


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("route", ["export", "symbolic"])
def test_batch_norm_statistics_update_in_train_and_serve_eval(route, level):
    """train updates the running statistics (the model's too); eval reads them, updates nothing, and matches autocast."""
    torch.manual_seed(0)
    model, x = BatchNormNet().train(), torch.randn(8, 8)
    top, gm, prefix = _convert(model, route, x, level)
    state = lambda: {k: v.clone() for k, v in gm.state_dict().items() if "running" in k or "num_batches" in k}  # noqa: E731
    start = state()
    gm(x)
    gm(x + 1)
    trained = state()
    assert trained[f"{prefix}bn.num_batches_tracked"].item() == 2
    assert not torch.equal(trained[f"{prefix}bn.running_mean"], start[f"{prefix}bn.running_mean"])
    # the model's own statistics are the converted module's (O1: the same tensors; O2: copied back after forward)
    torch.testing.assert_close(model.bn.running_mean, trained[f"{prefix}bn.running_mean"], rtol=0, atol=0)
    gm.eval()
    out, again = gm(x), gm(x)
    assert torch.equal(out, again)
    assert all(torch.equal(v, trained[k]) for k, v in state().items())  # eval: no update
    reference = copy.deepcopy(top).eval()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = reference(x)
    # two bf16 GEMMs of width 8 around an fp32 norm: a few roundoffs of values below ~4
    torch.testing.assert_close(out.float(), expected.float(), atol=5e-2, rtol=0)
    gm.train()
    torch.manual_seed(1)
    a = gm(x)
    torch.manual_seed(2)
    b = gm(x)
    assert not torch.equal(a, b) and state()[f"{prefix}bn.num_batches_tracked"].item() == 4


def test_a_deep_copy_switches_on_its_own():
    """A copy of a converted module builds its own graphs; the original's mode and graph are untouched."""
    torch.manual_seed(0)
    model, x = BatchNormNet().train(), torch.randn(8, 8)
    _, gm, _ = _convert(model, "export", x, "O1")
    twin = copy.deepcopy(gm)
    twin.eval()
    assert torch.equal(twin(x), twin(x))
    torch.manual_seed(1)
    a = gm(x)
    torch.manual_seed(2)
    assert gm.training and not torch.equal(a, gm(x))


def test_per_module_flags_reach_modules_torch_export_drops():
    """gm.apply(eval on every Dropout) works though torch.export keeps no Dropout module: the converted module has
    stand-ins at every path of the model, and the graph for those flags matches the model with the same flags."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=128, n_positions=32, bos_token_id=0, eos_token_id=0,
        attn_implementation="sdpa", resid_pdrop=0.5, embd_pdrop=0.5, attn_pdrop=0.0)).train()
    ids = _batch()["input_ids"]
    gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16, example_kwarg_inputs={"input_ids": ids})
    assert [p for p, _ in gm.named_modules() if p in dict(model.named_modules())] == [p for p, _ in model.named_modules()]
    assert set(gm.state_dict()) == set(model.state_dict())  # the stand-ins hold no state
    gm.apply(lambda m: m.eval() if isinstance(m, nn.Dropout) else None)
    assert gm.training
    first, second = gm(input_ids=ids).logits, gm(input_ids=ids).logits
    assert torch.equal(first, second)
    reference = copy.deepcopy(model)
    reference.apply(lambda m: m.eval() if isinstance(m, nn.Dropout) else None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = reference(input_ids=ids).logits
    torch.testing.assert_close(first.float(), expected.float(), atol=LOGIT_ATOL, rtol=0)
    assert all(m.training for m in model.modules())  # the model's flags are its own


def test_every_graph_shares_the_conversions_fp8_state():
    """Delayed fp8 scaling on the export route: the eval graph and a graph without labels quantize with the
    scales training built and update the one amax history, and state_dict keeps its keys. Before, each new graph
    got a fresh history (its first call quantized at scale 1) under new keys, and a checkpoint saved after an eval
    did not load into a fresh conversion."""
    def build():
        torch.manual_seed(0)
        return amp_fx.convert(_gpt2(0.0).train(), "O1", fp8={"recipe": "delayed", "size_rule": "all"},
                              example_kwarg_inputs=_batch())

    gm = build()
    opt = torch.optim.AdamW(gm.parameters(), lr=1e-3)
    for _ in range(3):
        opt.zero_grad()
        gm(**_batch()).loss.backward()
        opt.step()
    keys, states = set(gm.state_dict()), dict(gm.amp_fx_fp8.named_children())
    history = states["transformer_h_0_attn_c_attn"].amax_history
    recorded = history.clone()
    gm.eval()
    with torch.no_grad():
        gm(**_batch())
    gm.train()
    gm(input_ids=_batch()["input_ids"])  # another graph: no labels
    assert set(gm.state_dict()) == keys and dict(gm.amp_fx_fp8.named_children()) == states
    assert not torch.equal(history, recorded)  # the other graphs updated the one history
    fresh = build()
    fresh.load_state_dict(gm.state_dict())  # a checkpoint saved after eval loads into a fresh conversion
    assert torch.equal(fresh.amp_fx_fp8.transformer_h_0_attn_c_attn.amax_history, history)
