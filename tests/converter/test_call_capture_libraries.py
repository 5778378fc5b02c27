"""Real architectures built from configs (no download) through the capture-from-the-call route, and the calls
whose Python meaning the fx/export routes keep by handing them to it (converter/call_capture.py).

transformers' XLNet fails whole-graph capture (fx cannot trace it; torch.export specialises the sequence
length); diffusers' UNet2DModel asserts on the timestep's rank and takes a Python int.  Bounds as in
test_call_capture.py, gradients against fp32 (see _compare).
"""

import copy
import json

import pytest
import torch

import amp_fx
from capture_corpus import TimestepNet, TinyGpt
from probes import GemmFlops

transformers = pytest.importorskip("transformers")
diffusers = pytest.importorskip("diffusers")


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / (b.float().norm() + 1e-12)).item()


def _tiny_xlnet():
    config = transformers.XLNetConfig(vocab_size=64, d_model=32, n_layer=1, n_head=2, d_inner=64)
    return transformers.XLNetLMHeadModel(config).eval()


def _tiny_unet():
    return diffusers.UNet2DModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
                                 block_out_channels=(8, 16), norm_num_groups=4,
                                 down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"))


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _compare(module, reference, run):
    """``run(m)`` -> loss; loss, every gradient and the bf16 GEMM share against eager autocast on ``reference``.

    Gradients against fp32: the converted module's error is at most twice autocast's plus 2% (a bias whose
    gradient is zero in exact arithmetic, as attention's key bias, is all rounding noise on both sides).
    """
    reference.zero_grad()
    run(reference).backward()
    exact = _grads(reference)
    reference.zero_grad()
    with GemmFlops() as ref_flops, torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss = run(reference)
    ref_loss.backward()
    ref_grads = _grads(reference)
    module.zero_grad()
    with GemmFlops() as flops:
        loss = run(module)
    loss.backward()
    grads = _grads(module)
    assert abs(loss.item() - ref_loss.item()) <= 0.05 * abs(ref_loss.item()) + 1e-3
    assert len(ref_grads) > 0 and set(grads) == set(ref_grads)
    for name, grad in grads.items():
        assert _rel(grad, exact[name]) <= 2 * _rel(ref_grads[name], exact[name]) + 0.02, name
    assert flops.total == ref_flops.total and ref_flops.low_share() > 0.99
    assert flops.low_share() >= ref_flops.low_share() - 1e-9


def test_xlnet_converts_without_example_inputs_at_two_sequence_lengths(tmp_path):
    model = _tiny_xlnet()
    reference = copy.deepcopy(model)
    converted = amp_fx.convert(model, "O1")
    assert isinstance(converted, transformers.XLNetLMHeadModel) and converted.config is model.config
    assert converted.amp_report.route == "dynamo" and "XLNetLMHeadModel" in converted.amp_report.trace_failure
    for length in (6, 9):  # torch.export would have specialised the first
        ids = torch.randint(0, 64, (2, length))
        _compare(converted, reference, lambda m: m(input_ids=ids, labels=ids).loss)
    assert converted.amp_report.count("low") > 0
    converted.save_pretrained(tmp_path)  # the library's own method, on the converted module's state
    reloaded = transformers.XLNetLMHeadModel.from_pretrained(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(reloaded.state_dict().values(), model.state_dict().values()))


def test_unet_takes_an_int_timestep_and_serves_a_ddpm_pipeline():
    model = _tiny_unet()
    reference = copy.deepcopy(model)
    converted = amp_fx.convert(model, "O1")
    assert converted.amp_report.route == "dynamo" and "Timesteps should be a 1d-array" in converted.amp_report.trace_failure
    sample = torch.randn(2, 3, 8, 8)
    _compare(converted, reference, lambda m: m(sample, 7).sample.square().mean())  # a Python int timestep
    pipeline = diffusers.DDPMPipeline(unet=converted, scheduler=diffusers.DDPMScheduler(num_train_timesteps=4))
    assert pipeline.unet.config.sample_size == 8  # the pipeline reads the model's config through the module
    with GemmFlops() as flops:  # another batch size, and the scheduler's 0-d tensor timestep: captured again
        images = pipeline(batch_size=1, num_inference_steps=1, output_type="np",
                          generator=torch.Generator().manual_seed(0)).images
    assert images.shape == (1, 8, 8, 3) and flops.total > 0 and flops.low_share() > 0.99


def test_a_call_the_traced_graph_cannot_take_runs_captured():
    """The fx/export routes hand on what their graph cannot serve: a left-out optional input, a Python int, a method."""
    gpt = TinyGpt()
    x, y = torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))
    converted = amp_fx.convert(gpt, "O1", example_inputs=(x, y))
    assert converted.amp_report.route == "torch.export"
    logits, loss = converted(x)  # nanoGPT's sampling call, targets left out
    assert loss is None and logits.shape == (2, 1, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, _ = gpt(x)
    assert _rel(logits, expected) <= 0.05
    logits, loss = converted(x, y)  # the graph still serves the call it was traced for
    assert loss is not None and loss.dtype == torch.float32

    net = TimestepNet()
    sample = torch.randn(3, 16)
    converted = amp_fx.convert(net, "O1", example_inputs=(sample, torch.tensor([4])))
    assert converted.amp_report.route == "torch.export"
    with GemmFlops() as flops:
        out = converted(sample, 4)  # a Python int where the example was a tensor
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = net(sample, 4)
    assert _rel(out, expected) <= 0.05 and flops.low_share() == 1.0
    assert converted.dim == 16  # a plain attribute of the model, as before


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_save_pretrained_writes_fp32_and_leaves_the_models_config_alone(tmp_path, level):
    """O2/O3 own bf16 parameters; save_pretrained still writes the model's dtypes, and from_pretrained loads fp32.

    (Saved through the copy, transformers wrote "dtype": "bfloat16" into config.json and into the config
    object the copy shares with the model: the reloaded model was bf16, the original's config changed.)
    """
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=32)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    gm = amp_fx.convert(model, level)
    gm(input_ids=torch.randint(0, 64, (2, 8)))
    gm.save_pretrained(tmp_path)
    # what the model's own save writes (transformers records its parameters' dtype), never the copy's bf16
    assert str(model.config.dtype).replace("torch.", "") == "float32"
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "float32"
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    saved = gm.state_dict()
    params = dict(loaded.named_parameters())
    assert len(params) > 5
    for name, param in params.items():
        assert param.dtype == torch.float32, name
        assert torch.equal(param, saved[name]), name
