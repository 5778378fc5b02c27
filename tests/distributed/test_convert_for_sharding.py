"""convert_for_sharding in one process: blocks stay modules, numbers and gradients as convert's, masters, refusals."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

import fsdp_worker as w  # noqa: E402

import amp_fx  # noqa: E402
from amp_fx.runtime import MasterWeightOptimizer, convert_for_sharding  # noqa: E402


def _grads(module, x, y):
    module.zero_grad()
    loss = F.cross_entropy(module(x), y)
    loss.backward()
    return loss.detach(), {n: p.grad.float().clone() for n, p in module.named_parameters()}


def test_blocks_are_called_as_converted_modules_and_match_fp32_like_convert():
    torch.manual_seed(0)
    model = w.Net()
    gm = convert_for_sharding(model, "O1", blocks=w.Block, dtype=torch.bfloat16)
    names = [f"blocks.{i}" for i in range(3)]
    called = {n.target for n in gm.graph.nodes if n.op == "call_module"}
    assert called == set(names)
    # The root's graph reads no parameter of a block: FSDP2 gathers those in the block's forward.
    reads = [n.target for n in gm.graph.nodes if n.op == "get_attr"]
    assert not any(t.startswith("blocks.") for t in reads)
    for name in names:
        block = gm.get_submodule(name)
        assert block.amp_config.level == "O1" and block is not model.get_submodule(name)
        assert block.get_parameter("fc1.weight") is model.get_submodule(name).fc1.weight  # O1 shares
    x, y = w.batches(1)[0]
    ref_loss, ref = _grads(model, x, y)
    whole_loss, whole = _grads(amp_fx.convert(model, "O1", dtype=torch.bfloat16), x, y)
    loss, got = _grads(gm, x, y)
    assert loss.dtype == torch.float32 and loss != ref_loss  # bf16 ran
    # Per-block conversion lands as close to fp32 as converting the whole model (within 2x).
    for n in ref:
        scale = ref[n].abs().max()
        assert (got[n] - ref[n]).abs().max() <= 2 * max((whole[n] - ref[n]).abs().max(), 1e-3 * scale), n
    assert abs(loss - ref_loss) <= 2 * max(abs(whole_loss - ref_loss), 1e-3)


def test_o2_masters_are_the_original_fp32_parameters_and_mixed_dtype_blocks_refused():
    torch.manual_seed(0)
    model = w.Net()
    with pytest.raises(ValueError, match="keep_batchnorm_fp32=False"):
        convert_for_sharding(model, "O2", blocks=w.Block, dtype=torch.bfloat16)
    gm = convert_for_sharding(model, "O2", blocks=w.Block, dtype=torch.bfloat16, keep_batchnorm_fp32=False)
    originals = dict(model.named_parameters())
    assert {n: p.dtype for n, p in gm.named_parameters()} == {n: torch.bfloat16 for n in originals}
    assert all(gm.amp_fx_masters[n] is originals[n] for n in originals)
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), gm)
    x, y = w.batches(1)[0]
    before = originals["blocks.1.fc1.weight"].detach().clone()
    opt.zero_grad()
    F.cross_entropy(gm(x), y).backward()
    opt.step()
    assert not torch.equal(originals["blocks.1.fc1.weight"], before)  # the fp32 master stepped
    assert torch.equal(gm.get_parameter("blocks.1.fc1.weight"), originals["blocks.1.fc1.weight"].bfloat16())


def test_mistakes_are_named():
    model = w.Net()
    with pytest.raises(ValueError, match="does not have"):
        convert_for_sharding(model, "O1", blocks=["blocks.7"])
    with pytest.raises(ValueError, match="no submodule matches"):
        convert_for_sharding(model, "O1", blocks=torch.nn.GRU)
    with pytest.raises(ValueError, match="policy="):
        convert_for_sharding(model, "O1", blocks=w.Block, policy={"op:linear": "fp32"})


def test_exported_root_that_inlines_the_blocks_is_refused_naming_convert_root():
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 64, (2, 8))
    with pytest.raises(ValueError, match="convert_root=False"):
        convert_for_sharding(model, "O1", blocks=GPT2Block, dtype=torch.bfloat16,
                             example_kwarg_inputs={"input_ids": ids, "use_cache": False})
