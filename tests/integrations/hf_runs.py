"""A tiny GPT-2 from a config, a fixed dataset and a Trainer runner that records the logged losses."""

from __future__ import annotations

import torch

import transformers

from amp_fx.integrations.hf import AmpFxTrainer

STEPS, BATCH, LENGTH = 20, 4, 16


def gpt2(dropout: float = 0.0) -> "transformers.GPT2LMHeadModel":
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=96, n_positions=LENGTH,
                                     bos_token_id=0, eos_token_id=0, use_cache=False, attn_implementation="sdpa",
                                     resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)  # lm_head.weight is tied to transformer.wte.weight


class Tokens(torch.utils.data.Dataset):
    """Fixed token rows; labels are the inputs, and padding (-100) at the end of some rows varies the label count."""

    def __init__(self, rows: int, seed: int = 1):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, 96, (rows, LENGTH), generator=g)
        self.pad = torch.randint(0, LENGTH // 2, (rows,), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        labels = self.ids[i].clone()
        if self.pad[i]:
            labels[-int(self.pad[i]):] = -100
        return {"input_ids": self.ids[i], "labels": labels}


def arguments(out, **overrides) -> "transformers.TrainingArguments":
    options = dict(output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=3e-3,
                   logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0, data_seed=0,
                   gradient_accumulation_steps=2, max_grad_norm=1.0, disable_tqdm=True, dataloader_num_workers=0,
                   per_device_eval_batch_size=BATCH)
    options.update(overrides)
    return transformers.TrainingArguments(**options)


def train(out, *, level=None, resume=None, dropout=0.0, **overrides):
    """Train a fresh tiny GPT-2 (bf16=True when level is None); return (trainer, logged losses by step)."""
    model = gpt2(dropout)
    data = Tokens(STEPS * BATCH * 2)
    if level is None:
        trainer = transformers.Trainer(model=model, args=arguments(out, bf16=True, **overrides), train_dataset=data,
                                       eval_dataset=Tokens(8, seed=2))
    else:
        trainer = AmpFxTrainer(model=model, args=arguments(out, **overrides), train_dataset=data,
                               eval_dataset=Tokens(8, seed=2), amp_level=level,
                               amp_options=_options(level, overrides.get("torch_compile", False)))
    trainer.train(resume_from_checkpoint=resume)
    losses = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
    return trainer, losses


def _options(level, compiled):
    """O0/O1 compiled (torch_compile=True): aot_eager inside amp_fx's backend, not inductor (CPU test time)."""
    return {"inner": "aot_eager"} if compiled and level in ("O0", "O1") else {}
