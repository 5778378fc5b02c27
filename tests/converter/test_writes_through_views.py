"""A write through a view reaches the tensor it views at every level: views follow their input, so no cast copy sits between them.

Found after the op registry learnt that diagonal, as_strided, unfold and
movedim are views: at O2/O3 the buffer they view stayed fp32 (it is written)
while the view was painted low, so the write went into a bf16 copy and the
model's buffer never changed.
"""

import pytest
import torch
import torch.nn as nn

import amp_fx

VIEWS = {
    "diagonal": lambda t: t.diagonal(),
    "movedim": lambda t: t.movedim(0, 1),
    "swapaxes": lambda t: t.swapaxes(0, 1),
    "unfold": lambda t: t.unfold(0, 2, 2),
    "as_strided": lambda t: t.as_strided((4,), (9,)),
}


class WritesItsBuffer(nn.Module):
    """Adds 1 to part of a buffer through a view on every call, then reads the whole buffer."""

    def __init__(self, view):
        super().__init__()
        self.view = view
        self.fc = nn.Linear(8, 8)
        self.register_buffer("buf", torch.zeros(8, 8))

    def forward(self, x):
        self.view(self.buf).add_(1.0)
        return self.fc(x) @ self.buf


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("view", sorted(VIEWS))
def test_a_write_through_a_view_of_a_buffer_reaches_the_model_buffer(view, level):
    torch.manual_seed(0)
    model, eager = WritesItsBuffer(VIEWS[view]), WritesItsBuffer(VIEWS[view])
    eager.load_state_dict(model.state_dict())
    x = torch.randn(2, 8)
    gm = amp_fx.convert(model, level, dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(2):
            got = gm(x)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                want = eager(x)
    # Counts of 1.0 added in place: exact in bf16 and fp32 alike.
    assert torch.equal(model.buf, eager.buf) and model.buf.sum() > 0
    # The output reads the written buffer: within a few bf16 roundings of autocast's (a lost write is off by all of it).
    assert (got.float() - want.float()).abs().max() <= 4 * 2 ** -8 * want.float().abs().max()


@pytest.mark.parametrize("view", ["diagonal", "unfold", "movedim"])
def test_views_follow_their_input_at_O2(view):
    gm = amp_fx.convert(WritesItsBuffer(VIEWS[view]), "O2", dtype=torch.bfloat16)
    rows = {r.op: r for r in gm.amp_report.nodes if r.op == view}
    assert rows and all(r.decision == "follow" for r in rows.values()), rows
