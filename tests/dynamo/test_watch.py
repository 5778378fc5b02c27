"""watch: the per-model compile bookkeeping of a backend is run-time state; a compiled model saves with its backend."""

from __future__ import annotations

import io

import torch
from torch import nn

import amp_fx


def test_torch_save_of_a_compiled_model_after_it_ran():
    """The backend's watch state holds weak references (which do not pickle): it is saved empty, as after reset()."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    compiled = torch.compile(model, backend=amp_fx.backend(level="O1", inner="aot_eager"))
    x = torch.randn(4, 8)
    out = compiled(x)
    out.sum().backward()
    assert out.dtype == torch.float32 and amp_fx.last_report() is not None  # the amp_fx backend compiled it
    buffer = io.BytesIO()
    torch.save(compiled, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    torch._dynamo.reset()
    assert torch.equal(loaded(x), out)  # the loaded copy compiles again with the same backend: the same numbers
    torch._dynamo.reset()
