"""The backend on graphs that traced torch.vmap: functorch's level stack is left as Dynamo made it (issue 26, item 4).

transformers' Mamba runs its CPU scan through ``associative_scan``, which
vmaps the combine function at a different batch size per level.  Dynamo
writes ``_vmap_increment_nesting(n)`` ... ``_vmap_decrement_nesting()``
into the graph; the dtype analysis fake-runs them, and a memoised push with
a memo-missed pop (the pushes differ by size, the pops do not) left a level
on the real stack, so Dynamo refused its own graph: "Guard failed on the
same frame it was created ... compare_functorch_state".
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import amp_fx


class TwoVmaps(nn.Module):
    """Two vmaps of different batch sizes, a GEMM inside one: the construct of Mamba's scan, small."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, x):
        h = self.fc(x)
        rows = torch.vmap(lambda r: (r @ self.w) * r.sum().tanh())(h)  # batch size 4
        first = torch.vmap(lambda r: r * 2)(h[:1])  # batch size 1: another push, the same pop
        return self.fc(rows + first)


def _depth() -> int:
    return torch._C._functorch.get_dynamic_layer_stack_depth()


def test_vmap_graph_compiles_runs_low_and_agrees_with_autocast():
    """It compiles (no guard failure), the GEMM inside the vmap runs low, and output and gradients match autocast."""
    torch.manual_seed(0)
    model = TwoVmaps()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 8)
    be = amp_fx.backend(dtype=torch.bfloat16, inner="aot_eager")
    out = torch.compile(model, backend=be)(x)
    assert _depth() == 0
    decisions = [r.decision for r in be.report.nodes if r.op in ("linear", "matmul")]
    assert decisions == ["low", "low", "low"], decisions  # fc, the vmapped r @ w, fc again
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = reference(x)
    # Both sides run bf16 GEMMs on the same bf16 inputs; aot_eager may pick another mm than eager's vmap
    # (a batched mm for the per-row matmul): within 2 bf16 ulps (2 * 2**-8 relative) plus a small floor.
    torch.testing.assert_close(out, expected.float(), rtol=2 * 2 ** -8, atol=1e-3)
    out.square().sum().backward()
    expected.float().square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        # Backward GEMMs run bf16 on both sides, maybe in another order: within 4 bf16 ulps (2**-6) of the largest entry.
        assert (p.grad - q.grad).abs().max() <= 2 ** -6 * q.grad.abs().max(), name


def test_the_functorch_stack_is_as_dynamo_left_it_after_every_compile():
    """Recompiles (a new shape) and a second model: the level stack never grows, and every call runs."""
    torch.manual_seed(0)
    model = TwoVmaps()
    compiled = torch.compile(model, backend=amp_fx.backend(dtype=torch.bfloat16, inner="aot_eager"))
    for rows in (4, 6, 4):
        assert compiled(torch.randn(rows, 8)).shape == (rows, 8)
        assert _depth() == 0


transformers = pytest.importorskip("transformers")


@pytest.mark.slow
def test_mamba_compiles_with_the_backend_and_matches_fp32():
    """Tiny Mamba (transformers' CPU scan: associative_scan under torch.compile): loss within bf16 tolerance, grads finite."""
    torch.manual_seed(0)
    config = transformers.MambaConfig(num_hidden_layers=1, hidden_size=32, vocab_size=128, state_size=8)
    model = transformers.MambaForCausalLM(config)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    out = torch.compile(model, backend=amp_fx.backend(dtype=torch.bfloat16, inner="aot_eager"))(input_ids=ids, labels=ids)
    expected = reference(input_ids=ids, labels=ids)
    # The loss is a mean over 30 tokens of a fp32 cross-entropy on bf16 logits: within 2% of fp32.
    assert abs(out.loss.item() - expected.loss.item()) <= 0.02 * abs(expected.loss.item())
    out.loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert any(r.decision == "low" for r in amp_fx.last_report().nodes if r.op in ("linear", "matmul", "mm"))


class GradInside(nn.Module):
    """torch.func.grad in forward: its input is marked requires-grad in place after it is made."""

    def __init__(self, disable: bool = False):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.slope = torch.compiler.disable(self._slope) if disable else self._slope

    @staticmethod
    def _slope(h):
        return torch.func.grad(lambda t: t.sum() * 3)(h)  # sum is fp32 by the tables: a cast on t

    def forward(self, x):
        return self.fc(self.slope(self.fc(x)))


def test_torch_func_grad_inline_is_refused_naming_the_line_and_the_fix():
    """Converted, the cast on t would read it before the in-place mark: gradient zero. UnsupportedConstructError instead."""
    compiled = torch.compile(GradInside(), backend=amp_fx.backend(dtype=torch.bfloat16, inner="aot_eager"))
    with pytest.raises(Exception) as caught:
        compiled(torch.randn(4, 8))
    error = caught.value
    while not isinstance(error, amp_fx.AmpError) and (error.__cause__ or getattr(error, "inner_exception", None)):
        error = error.__cause__ or error.inner_exception
    assert isinstance(error, amp_fx.errors.UnsupportedConstructError), caught.value
    assert "torch.func.grad" in str(error) and "test_backend_functorch.py" in error.where
    assert "torch.compiler.disable" in str(error)
    assert _depth() == 0


def test_the_fix_the_refusal_names_runs():
    """With the transform behind torch.compiler.disable it runs eagerly: the result is fp32's (a constant slope of 3)."""
    torch.manual_seed(0)
    model = GradInside(disable=True)
    x = torch.randn(4, 8)
    out = torch.compile(model, backend=amp_fx.backend(dtype=torch.bfloat16, inner="aot_eager"))(x)
    expected = model.fc(torch.full((4, 8), 3.0))  # the slope of t.sum() * 3 is 3 everywhere
    torch.testing.assert_close(out, expected, rtol=2 * 2 ** -8, atol=2e-2)  # the outer fc runs bf16: 2 ulps of ~3
