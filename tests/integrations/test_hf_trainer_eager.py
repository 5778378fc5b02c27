"""AmpFxTrainer at O1 runs eagerly unless TrainingArguments(torch_compile=True) asks for a compile (issue 36, item 7).

Before, O1 always ran torch.compile with inductor: 59 s for 8 CPU steps against 0.5 s for bf16=True.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import amp_fx  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

from .hf_runs import train  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")

STEPS = 8
RTOL = 2.0**-7  # as tests/integrations/test_hf_trainer.py: bf16 rounding at other points, through AdamW steps


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train(tmp_path_factory.mktemp("bf16"), max_steps=STEPS)[1]


def _close(losses, reference):
    assert sorted(losses) == sorted(reference) == list(range(1, STEPS + 1))
    for step in reference:
        assert abs(losses[step] - reference[step]) <= RTOL * reference[step], (step, losses[step], reference[step])


def test_o1_runs_converted_and_eager_without_torch_compile(reference, tmp_path):
    """No Dynamo frame is compiled; the forward is an AmpGraphModule sharing the model's fp32 parameters."""
    counters.clear()
    trainer, losses = train(tmp_path, level="O1", max_steps=STEPS)
    assert not trainer.amp_compiled
    assert sum(counters["frames"].values()) == 0 and counters["stats"]["unique_graphs"] == 0, dict(counters["frames"])
    assert isinstance(trainer.amp_model, amp_fx.AmpGraphModule)
    ours = {name: p for name, p in trainer.amp_model.named_parameters()}
    model = dict(trainer.model.named_parameters())
    shared = [name for name in ours if name in model and ours[name] is model[name]]
    assert shared and all(p.dtype == torch.float32 for p in ours.values())  # O1: the model's parameters, cast in-graph
    casts = [n for n in trainer.amp_model.graph.nodes if torch.bfloat16 in (*n.args, *n.kwargs.values())]
    assert casts  # and it runs bf16: the graph casts to bf16
    _close(losses, reference)


def test_o1_with_torch_compile_true_compiles_through_the_backend(reference, tmp_path):
    """torch_compile=True: amp_fx's backend compiles (Dynamo frames run), the Trainer itself does not compile."""
    counters.clear()
    trainer, losses = train(tmp_path, level="O1", max_steps=STEPS, torch_compile=True)
    assert trainer.amp_compiled and not trainer.args.torch_compile
    assert counters["stats"]["unique_graphs"] > 0
    assert not isinstance(trainer.amp_model, amp_fx.AmpGraphModule)
    _close(losses, reference)
