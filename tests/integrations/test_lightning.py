"""Lightning: Trainer(plugins=[AmpFxPrecision(level)]) against precision="bf16-mixed" / "16-mixed", and exact resume.

Real Lightning (CPU), the tiny LightningModule of lightning_runs.py, 2 epochs of 10 steps.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lightning")

from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

import amp_fx  # noqa: E402
from amp_fx.integrations.lightning import AmpFxPrecision  # noqa: E402

from .lightning_runs import fit  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

# Loss tolerance, relative, per step. bf16 keeps 8 significant bits (unit roundoff u = 2^-9); amp_fx and
# autocast round the same GEMMs to bf16 but not always at the same points (autocast re-casts each use,
# amp_fx casts once, and O2's weights are their masters rounded once per step), so the two losses may
# differ by a few u, and that difference travels through 20 AdamW steps. 4u = 2^-7 (7.8e-3); measured
# max 1.9e-3 (O1 and O2). fp16 keeps 11 bits (u = 2^-12): 4u = 2^-10 (9.8e-4); measured max 2.6e-4.
BF16_RTOL, FP16_RTOL = 2.0**-7, 2.0**-10


def _fp16_autocast(scaler=None):
    # Lightning's precision="16-mixed" on CPU silently trains in bf16; its plugin built by hand runs fp16.
    return MixedPrecision("16-mixed", "cpu", scaler=scaler or torch.amp.GradScaler("cpu"))


def _close(losses, reference, rtol):
    assert len(losses) == len(reference) == 20
    for step, (ours, theirs) in enumerate(zip(losses, reference)):
        assert abs(ours - theirs) <= rtol * abs(theirs), (step, ours, theirs)


@pytest.fixture(scope="module")
def bf16_reference():
    return fit(2, precision="bf16-mixed")[0]


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_bf16_losses_match_bf16_mixed(level, bf16_reference):
    """20 steps at O1/O2 give bf16-mixed's losses within bf16 tolerance; the model trained (loss fell)."""
    losses, module, trainer = fit(2, plugin=AmpFxPrecision(level))
    _close(losses, bf16_reference, BF16_RTOL)
    assert losses[-1] < 0.8 * losses[0]
    assert isinstance(module.model, amp_fx.AmpGraphModule)
    opt = trainer.optimizers[0]
    assert isinstance(opt, amp_fx.MasterWeightOptimizer) == (level == "O2")
    if level == "O2":
        # the graph runs bf16 copies; the checkpointed weights are the fp32 masters the optimizer steps
        assert all(p.dtype == torch.bfloat16 for n, p in module.model.named_parameters() if n.endswith("weight") and "2" not in n)
        masters = [m for g in opt.param_groups for m in g["params"]]
        state = module.state_dict()
        assert all(t.dtype == torch.float32 for t in state.values())
        assert any(torch.equal(state["model.0.weight"], m) for m in masters)
        assert not torch.equal(state["model.0.weight"], state["model.0.weight"].bfloat16().float())


def test_fp16_losses_match_16_mixed_with_clipping():
    """O1 fp16 with gradient clipping matches autocast + GradScaler: gradients are unscaled before Lightning clips."""
    reference = fit(2, plugin=_fp16_autocast(), gradient_clip_val=0.05)[0]
    losses, _, trainer = fit(2, plugin=AmpFxPrecision("O1", "fp16"), gradient_clip_val=0.05)
    _close(losses, reference, FP16_RTOL)
    unclipped = fit(2, plugin=AmpFxPrecision("O1", "fp16"))[0]
    assert max(abs(a - b) for a, b in zip(unclipped, losses)) > 1e-2  # clipping at 0.05 changed the run
    assert trainer.precision_plugin.scaler.get_scale() == 2.0**16


def test_bf16_clipping_reads_o2_master_gradients(bf16_reference):
    """At O2 Lightning clips the fp32 masters' gradients, copied from the bf16 ones before it clips."""
    reference = fit(2, precision="bf16-mixed", gradient_clip_val=0.05)[0]
    losses = fit(2, plugin=AmpFxPrecision("O2"), gradient_clip_val=0.05)[0]
    _close(losses, reference, BF16_RTOL)
    assert max(abs(a - b) for a, b in zip(reference, bf16_reference)) > 1e-2


@pytest.mark.parametrize("level,dtype", [("O1", "fp16"), ("O2", "fp16"), ("O2", "bf16")])
def test_nonfinite_step_is_skipped(level, dtype):
    """A step whose loss is inf leaves the weights as they were; fp16 halves the scale, as GradScaler."""
    weights = []
    losses, _, trainer = fit(1, plugin=AmpFxPrecision(level, dtype), poison_step=3, weights=weights)
    assert losses[3] == float("inf") and all(torch.isfinite(torch.tensor(losses[:3] + losses[4:])))
    assert torch.equal(weights[3], weights[2]) and not torch.equal(weights[4], weights[3])
    scaler = trainer.precision_plugin.scaler
    assert scaler.skipped_steps == 1
    assert scaler.get_scale() == (2.0**15 if dtype == "fp16" else 1.0)


@pytest.mark.parametrize("level,dtype", [("O1", "bf16"), ("O2", "bf16"), ("O1", "fp16"), ("O3", "bf16")])
def test_resume_at_step_10_is_bit_identical(level, dtype, tmp_path):
    """Save after step 10, resume: steps 11-20 and the final weights equal an uninterrupted run bit for bit."""
    def plugin():  # growth every 3 steps: the scale changes during the run, so its state must be restored
        return AmpFxPrecision(level, dtype, scaler=amp_fx.LossScaler(
            2.0**8, growth_interval=3, dtype=dtype, level=level) if dtype == "fp16" else None)

    full, whole, whole_trainer = fit(2, plugin=plugin())
    first, _, _ = fit(1, plugin=plugin(), save_to=tmp_path / "step10.ckpt")
    checkpoint = torch.load(tmp_path / "step10.ckpt", weights_only=False)
    assert checkpoint["global_step"] == 10 and "AmpFxPrecision" in checkpoint
    assert all(t.dtype == torch.float32 for t in checkpoint["state_dict"].values())
    second, resumed, resumed_trainer = fit(2, plugin=plugin(), ckpt_path=tmp_path / "step10.ckpt")
    assert first == full[:10]
    assert second == full[10:]
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    scale = whole_trainer.precision_plugin.scaler.state_dict()
    assert resumed_trainer.precision_plugin.scaler.state_dict() == scale
    if dtype == "fp16":
        assert scale["scale"] >= 2.0**12  # it grew: a resume from the initial scale would not equal it


def test_bad_arguments_are_refused():
    with pytest.raises(amp_fx.AmpValueError, match="level"):
        AmpFxPrecision("O4")
    with pytest.raises(amp_fx.AmpValueError, match="dtype"):
        AmpFxPrecision("O1", "fp8")
    with pytest.raises(amp_fx.AmpValueError, match="no submodule 'modle'"):
        fit(1, plugin=AmpFxPrecision("O1", modules=["modle"]))


def test_hf_gpt2_child_at_o2_checkpoints_fp32_tied_weights(tmp_path):
    """A GPT-2 inside a LightningModule, converted with a batch as example inputs: bf16-mixed's losses, fp32 masters saved."""
    transformers = pytest.importorskip("transformers")
    import lightning.pytorch as pl

    class CausalLM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                             use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
            self.gpt = transformers.GPT2LMHeadModel(config)  # lm_head.weight is transformer.wte.weight

        def training_step(self, batch, batch_idx):
            return self.gpt(input_ids=batch[0], labels=batch[0]).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

    ids = torch.randint(0, 64, (16, 16), generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=4)

    def run(**kwargs):
        losses = []

        class Record(pl.Callback):
            def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
                losses.append(outputs["loss"].item())

        module = CausalLM()
        trainer = pl.Trainer(max_steps=4, accelerator="cpu", logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, callbacks=[Record()], **kwargs)
        trainer.fit(module, loader)
        return losses, module, trainer

    reference = run(precision="bf16-mixed")[0]
    plugin = AmpFxPrecision("O2", modules={"gpt": {"example_kwarg_inputs": {"input_ids": ids[:4], "labels": ids[:4]}}})
    losses, module, trainer = run(plugins=[plugin])
    assert all(abs(a - b) <= BF16_RTOL * b for a, b in zip(losses, reference)), (losses, reference)
    trainer.save_checkpoint(tmp_path / "gpt.ckpt")
    weights = torch.load(tmp_path / "gpt.ckpt", weights_only=False)["state_dict"]
    masters = {id(m): m for g in trainer.optimizers[0].param_groups for m in g["params"]}
    wte = module.gpt.amp_fx_masters["transformer.wte.weight"]
    assert id(wte) in masters and wte.dtype == torch.float32
    assert torch.equal(weights["gpt.lm_head.weight"], wte) and torch.equal(weights["gpt.transformer.wte.weight"], wte)


def test_an_untraceable_child_is_captured_from_the_call():
    transformers = pytest.importorskip("transformers")
    import lightning.pytorch as pl

    class CausalLM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.gpt = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32))

    # fx cannot trace GPT-2 without example inputs: convert() captures it from its calls (converter/call_capture.py)
    module = AmpFxPrecision("O1").convert_module(CausalLM())
    assert isinstance(module.gpt, transformers.GPT2LMHeadModel) and module.gpt.amp_report.route == "dynamo"
    ids = torch.randint(0, 32, (2, 5))
    module.gpt.eval()  # no dropout: the same function on both sides
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = module.gpt.__class__.forward(module.gpt, input_ids=ids).logits  # the model's own forward
    torch.testing.assert_close(module.gpt(input_ids=ids).logits, expected.float(), rtol=5e-2, atol=5e-2)


def test_o2_optimizer_over_converted_and_unconverted_submodules(bf16_reference):
    """Two Linears converted on their own, the LayerNorm not: one optimizer over all gets masters for the Linears."""
    plugin = AmpFxPrecision("O2", modules=["model.0", "model.3"])
    losses, module, trainer = fit(2, plugin=plugin)
    _close(losses, bf16_reference, BF16_RTOL)
    assert isinstance(module.model[0], amp_fx.AmpGraphModule) and not isinstance(module.model[2], amp_fx.AmpGraphModule)
    stepped = [p for g in trainer.optimizers[0].param_groups for p in g["params"]]
    assert len(stepped) == 6 and all(p.dtype == torch.float32 for p in stepped)
    assert any(p is module.model[2].weight for p in stepped)  # the fp32 LayerNorm is its own master
    assert module.model[0].weight.dtype == torch.bfloat16


class _ManualClip(__import__("lightning").pytorch.LightningModule):
    """Manual optimization: manual_backward, self.clip_gradients, opt.step() (Lightning's documented order)."""

    def __init__(self, clip):
        super().__init__()
        self.automatic_optimization = False
        self.clip = clip
        self.model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64), torch.nn.Linear(64, 4))
        self.losses = []

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.model(x), y)
        self.losses.append(loss.item())
        opt.zero_grad()
        self.manual_backward(loss)
        if self.clip:
            self.clip_gradients(opt, gradient_clip_val=self.clip, gradient_clip_algorithm="norm")
        opt.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _fit_manual(clip, **trainer_kwargs):
    import lightning.pytorch as pl
    from .lightning_runs import data

    torch.manual_seed(0)
    module = _ManualClip(clip)
    pl.Trainer(max_steps=10, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, **trainer_kwargs).fit(module, data())
    return module.losses


@pytest.mark.parametrize("level,dtype", [("O2", "bf16"), ("O1", "fp16")])
def test_manual_optimization_clips_what_the_step_uses(level, dtype):
    """self.clip_gradients before opt.step() under manual optimization: at O2 the plugin unscales (copies into the
    masters) first, so the clip reaches what is stepped (before: O2 with and without clipping gave identical
    losses); fp16 clips unscaled gradients. Clipping at 0.01 changes the run as it does under bf16-mixed."""
    plugin = lambda: AmpFxPrecision(level, dtype)  # noqa: E731
    clipped, free = _fit_manual(0.01, plugins=[plugin()]), _fit_manual(0.0, plugins=[plugin()])
    reference = _fit_manual(0.01, precision="bf16-mixed")
    assert max(abs(a - b) for a, b in zip(clipped, free)) > 0.1
    rtol = BF16_RTOL if dtype == "bf16" else 2.0**-7  # fp16 against the bf16 reference: bf16's tolerance bounds both
    for step, (ours, theirs) in enumerate(zip(clipped, reference)):
        assert abs(ours - theirs) <= rtol * abs(theirs), (step, ours, theirs)


def test_a_weight_tied_across_two_converted_children_is_refused_at_o2():
    """tied and out share a weight but are separate children: converted apart at O2/O3 the tie would break
    (measured before: a 101% wrong O2 step, two untied tensors at O3). Refused with the fix; O1 keeps the tie."""
    import lightning.pytorch as pl
    from .lightning_runs import data

    class Tied(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.emb, self.head = torch.nn.Linear(32, 16, bias=False), torch.nn.Linear(16, 32, bias=False)  # untied
            self.tied = torch.nn.Linear(32, 4)
            self.out = torch.nn.Linear(32, 4)
            self.out.weight = self.tied.weight

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.out(self.head(self.emb(x))) + self.tied(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def trainer(level):
        return pl.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False, plugins=[AmpFxPrecision(level)])

    for level in ("O2", "O3"):
        with pytest.raises(amp_fx.AmpValueError, match="shared by 'tied' and 'out'.*one module with its own forward"):
            trainer(level).fit(Tied(), data())
    module = Tied()
    trainer("O1").fit(module, data())
    assert module.out.weight is module.tied.weight  # at O1 both conversions read the one fp32 parameter


def test_a_compiled_child_trains_as_the_uncompiled_one_at_o2():
    """self.model = torch.compile(model): the plugin converts the module inside, the child stays compiled, and the
    optimizer steps its fp32 masters with the clip applied: the same losses bit for bit (aot_eager runs eager's
    kernels). Before, the converted wrapper's listed parameters were copies the forward never read."""
    expected, _, _ = fit(1, plugin=AmpFxPrecision("O2", compiled_update=False), gradient_clip_val=0.05)
    losses, module, trainer = fit(1, plugin=AmpFxPrecision("O2", compiled_update="aot_eager"), gradient_clip_val=0.05,
                                  compile_child=True)
    assert len(losses) == len(expected) == 10 and losses[:2] == expected[:2]
    # later steps: the compiled update may contract to FMA (a few ulp per step; tests/runtime/test_compiled_update.py)
    assert all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(losses, expected))
    assert type(module.model).__name__ == "OptimizedModule"
    assert isinstance(module.model._orig_mod, amp_fx.AmpGraphModule)
    assert isinstance(trainer.optimizers[0], amp_fx.MasterWeightOptimizer)
    # compiled_update given (aot_eager: the default over a compiled child is inductor, seconds of compile here)
    assert trainer.optimizers[0].last_step_route == "compiled"


def test_compiled_update_is_an_o2_option_checked_when_the_plugin_is_built():
    with pytest.raises(amp_fx.AmpValueError, match="steps no fp32 masters"):
        AmpFxPrecision("O1", compiled_update=True)
    with pytest.raises(amp_fx.AmpValueError, match="aot_eager"):
        AmpFxPrecision("O2", compiled_update="aot_eagr")
