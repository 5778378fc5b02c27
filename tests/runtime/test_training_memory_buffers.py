"""measure_training_memory counts the fp32 gradient buffers keep_grad_buffers=True keeps (issue 36, item 8).

Before, after ``zero_grad(set_to_none=True)`` the report said 0 bytes of gradients although the optimizer held
one fp32 buffer per master for the next step.
"""

from __future__ import annotations

import torch
import torch.nn as nn

import amp_fx
from amp_fx.runtime.training_memory import measure_training_memory


def _setup(keep):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.Linear(32, 4))
    gm = amp_fx.convert(model, "O2", dtype=torch.bfloat16)
    # foreach=True: the plain route, which copies the gradients into fp32 buffers (the chunked step, which
    # MasterWeightOptimizer takes with fused SGD, reads the bf16 gradients through a scratch buffer and keeps none)
    opt = amp_fx.MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, foreach=True), gm,
                                       keep_grad_buffers=keep)
    return gm, opt


def _steps(gm, opt, n=2):
    gen = torch.Generator().manual_seed(1)
    for _ in range(n):
        gm(torch.randn(4, 8, generator=gen)).float().square().mean().backward()
        opt.step()


def test_kept_gradient_buffers_are_counted_once():
    reports = {}
    for keep in (True, False):
        gm, opt = _setup(keep)
        _steps(gm, opt)
        after_step = measure_training_memory(gm, opt)
        opt.zero_grad(set_to_none=True)
        assert all(m.grad is None for m in opt.master_parameters())
        reports[keep] = after_step, measure_training_memory(gm, opt), opt
    masters = sum(m.numel() * m.element_size() for m in reports[True][2].master_parameters())
    assert masters == 4 * sum(m.numel() for m in reports[True][2].master_parameters())  # fp32
    # After the step each master's .grad is its kept buffer: counted once, as the .grad, the same bytes either way.
    assert reports[True][0].bytes == reports[False][0].bytes and reports[True][0].bytes["gradients"] > masters
    # After zero_grad(set_to_none=True): kept, one fp32 buffer per master is still held; not kept, nothing.
    assert reports[True][1].bytes["gradients"] == masters == reports[True][2].grad_buffer_bytes()
    assert reports[False][1].bytes["gradients"] == 0 == reports[False][2].grad_buffer_bytes()
    assert reports[True][1].bytes_per_param["gradients"] == masters / reports[True][1].params
