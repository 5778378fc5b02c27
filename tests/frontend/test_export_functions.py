"""Custom torch.autograd.Functions on the torch.export route: one node, forward and backward the Function's.

The rule under test: torch.export alone traces through ``MyFn.apply`` and
drops the backward (a straight-through estimator's gradient becomes round's,
zero).  ``convert()`` on the export route keeps each call one node that runs
the real ``apply``, decided as on the symbolic route: ``custom_fwd(cast_inputs=)``
honoured, otherwise the inputs arrive as they are ("follow", the report says
kept whole); the report and the policy name it by the Function's class name.

Numerics: at O1 the converted graph and eager autocast call the same ATen
kernels on inputs of the same dtypes (linear on bf16 casts of the same fp32
weights, mul, round, the Function's own backward), so outputs and gradients
agree bit for bit on any CPU.  At O2 the weights are bf16 copies whose
gradients are bf16 (autocast's are fp32 accumulations of the same bf16
products, rounded once more): within 2 bf16 ulps of the largest entry.
"""

import copy

import pytest
import torch
import torch.nn as nn

import amp_fx
from probes import captured_because
from amp_fx.errors import UnsupportedConstructError
from amp_fx.frontend.opaque_calls import FunctionCall
from routes import Untraceable

SEEN: dict[str, list] = {}
BF16_ULP = 2.0 ** -7


class RoundST(torch.autograd.Function):
    """Straight-through round: forward rounds, backward passes the gradient unchanged."""

    @staticmethod
    def forward(ctx, x):
        SEEN.setdefault("RoundST", []).append(x.dtype)
        return x.round()

    @staticmethod
    def backward(ctx, grad):
        return grad


class Fp32Scale(torch.autograd.Function):
    """Declares fp32 inputs for CPU autocast; its backward is not the forward's derivative (so inlining would show)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, x):
        SEEN.setdefault("Fp32Scale", []).append(x.dtype)
        return x * 3.0

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        return grad * 5.0


class MeanOver(torch.autograd.Function):
    """Divides by a size given as an argument, and returns a constant beside two tensors."""

    @staticmethod
    def forward(ctx, x, rows, scale):
        ctx.rows, ctx.scale = rows, scale
        return x * scale / rows, "tag", x.sum(0, keepdim=True)

    @staticmethod
    def backward(ctx, grad, _tag, grad_sum):
        return grad * ctx.scale / ctx.rows + grad_sum, None, None


class AddInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        return x.add_(1.0)

    @staticmethod
    def backward(ctx, grad):
        return grad


class Quantized(nn.Module):
    def __init__(self, fn=RoundST):
        super().__init__()
        self.fn = fn
        self.lin = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.fn.apply(self.lin(x) * 4.0))


class Sizes(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y, tag, total = MeanOver.apply(self.lin(x), x.shape[0], 2.0)
        assert tag == "tag"
        return y + total


def _export(model, x, level="O1"):
    gm = amp_fx.convert(Untraceable(model), level, dtype=torch.bfloat16, example_inputs=(x,))
    assert gm.amp_report.route == "torch.export"
    return gm


def _run(module, x, *, autocast=False):
    """Output and the gradients of the model's parameters (by the original names) of ``module(x).sum()``."""
    module.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = module(x)
    out.float().sum().backward()
    grads = {n.replace("inner.", ""): p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    return out.detach(), grads


def _function_nodes(gm):
    return [n for n in gm.graph.nodes if isinstance(n.target, FunctionCall)]


def _record(gm, op):
    return next(r for r in gm.amp_report.nodes if r.op == op)


def test_torch_export_alone_drops_the_straight_through_gradient():
    """Why amp_fx keeps the Function: exported as torch.export traces it, the STE's gradient is round's, zero."""
    model, x = Quantized(), torch.randn(8, 16)
    exported = torch.export.export(model, (x,), strict=False).module()
    exported(x).sum().backward()
    assert model.lin.weight.grad.abs().sum() == 0


def test_straight_through_function_keeps_its_gradient_at_O1():
    model, x = Quantized(), torch.randn(32, 16)
    gm = _export(model, x)
    out, got = _run(gm, x)
    ref_out, ref = _run(model, x, autocast=True)
    # the same kernels on the same bf16 inputs on both sides (module docstring): bit for bit
    torch.testing.assert_close(out, ref_out.float(), rtol=0, atol=0)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=0, atol=0)
    assert got["lin.weight"].abs().sum() > 1.0  # the identity backward, not round's zero
    assert len(_function_nodes(gm)) == 1
    assert not any("round" in str(n.target) for n in gm.graph.nodes)
    record = _record(gm, "RoundST")
    assert (record.decision, record.rule) == ("follow", "declared") and "kept whole" in record.reason
    assert record.dtype == "bfloat16"  # it ran on what the Linear gave it, as under autocast
    assert gm.amp_report.to_dict()["passes"]["assign_precision"]["unknown_ops"] == {}


def test_undeclared_function_sees_what_autocast_gives_it():
    model, x = Quantized(), torch.randn(4, 16)
    gm = _export(model, x)
    SEEN.clear()
    gm(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x)
    assert SEEN["RoundST"] == [torch.bfloat16, torch.bfloat16]


def test_custom_fwd_cast_inputs_is_honoured_at_O1():
    model, x = Quantized(Fp32Scale), torch.randn(16, 16)
    gm = _export(model, x)
    SEEN.clear()
    out, got = _run(gm, x)
    ref_out, ref = _run(model, x, autocast=True)
    assert SEEN["Fp32Scale"] == [torch.float32, torch.float32]  # converted, then autocast
    torch.testing.assert_close(out, ref_out.float(), rtol=0, atol=0)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=0, atol=0)
    record = _record(gm, "Fp32Scale")
    assert record.decision == "fp32" and "custom_fwd" in record.reason
    assert len(_function_nodes(gm)) == 1


@pytest.mark.parametrize("fn", [RoundST, Fp32Scale])
def test_functions_are_kept_at_O2(fn):
    """O2: the Function's backward still runs (STE gradient nonzero); custom_fwd still casts to fp32."""
    model, x = Quantized(fn), torch.randn(32, 16)
    gm = _export(model, x, "O2")
    SEEN.clear()
    out, got = _run(gm, x)
    assert SEEN[fn.__name__] == [torch.float32 if fn is Fp32Scale else torch.bfloat16]
    ref_out, ref = _run(model, x, autocast=True)
    torch.testing.assert_close(out, ref_out.float(), rtol=0, atol=2 * BF16_ULP * ref_out.abs().max().item())
    for name in ref:
        scale = ref[name].abs().max().item()
        torch.testing.assert_close(got[name].float(), ref[name], rtol=0, atol=2 * BF16_ULP * scale)
    assert got["lin.weight"].float().abs().sum() > 1.0
    assert len(_function_nodes(gm)) == 1
    assert _record(gm, fn.__name__).decision == ("fp32" if fn is Fp32Scale else "low")


def test_policy_names_the_function_on_the_export_route():
    model, x = Quantized(), torch.randn(4, 16)
    gm = amp_fx.convert(Untraceable(model), "O1", dtype=torch.bfloat16, example_inputs=(x,),
                        policy={"op:RoundST": "fp32"})
    SEEN.clear()
    gm(x)
    assert SEEN["RoundST"] == [torch.float32]
    record = _record(gm, "RoundST")
    assert (record.decision, record.rule) == ("fp32", "policy")


def test_size_arguments_stay_symbolic_and_constant_outputs_are_kept():
    """A size passed to apply is the call's own (batch 8 traced, 5 run), a constant output comes back as it was."""
    model = Sizes()
    gm = _export(model, torch.randn(8, 8))
    x = torch.randn(5, 8)
    out, got = _run(gm, x)
    ref_out, ref = _run(model, x, autocast=True)
    torch.testing.assert_close(out, ref_out.float(), rtol=0, atol=0)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=0, atol=0)
    assert len(_function_nodes(gm)) == 1


def test_deepcopy_and_state_dict_keep_the_function():
    model, x = Quantized(), torch.randn(8, 16)
    gm = _export(model, x)
    expected, grads = _run(gm, x)
    clone = copy.deepcopy(gm)
    assert len(_function_nodes(clone)) == 1
    out, clone_grads = _run(clone, x)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(clone_grads["lin.weight"], grads["lin.weight"], rtol=0, atol=0)
    fresh = Quantized()
    fresh.load_state_dict({k.replace("inner.", ""): v for k, v in gm.state_dict().items()})
    gm.load_state_dict(Untraceable(fresh).state_dict())
    torch.testing.assert_close(_run(gm, x)[0], expected, rtol=0, atol=0)


def test_function_writing_its_input_in_place_takes_the_call_route():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return AddInPlace.apply(self.lin(x))

    model, x = Model(), torch.randn(2, 4)
    converted, _ = captured_because(Untraceable(model), "AddInPlace writes to its input in place", "backend='amp_fx'",
                                    dtype=torch.bfloat16, example_inputs=(x,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = Untraceable(model)(x)
    torch.testing.assert_close(converted(x).float(), expected.float(), rtol=2e-2, atol=2e-2)


# -- BLOOM: its training-mode GELU is a custom autograd Function ----------------

def _bloom_batch(seed):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 128, (2, 16), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, -4:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_bloom_trains_through_convert(level):
    """Loss and every gradient within bf16 tolerance of fp32 eager, then two AdamW steps.

    Tolerances: bf16 keeps 8 significant bits (0.4% a rounding) and each
    gradient of this 2-layer model sums a few hundred rounded products, so a
    few percent of its largest entry is bf16's own error; 10% catches a
    missing or wrong term (GELU's backward inlined as tanh's, or dropped).
    """
    transformers = pytest.importorskip("transformers")
    config = transformers.BloomConfig(n_layer=2, hidden_size=32, n_head=4, vocab_size=128, hidden_dropout=0.0,
                                      attention_dropout=0.0)
    model = transformers.BloomForCausalLM(config).train()
    reference = copy.deepcopy(model)
    batch = _bloom_batch(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    converted, optimizer = amp_fx.initialize(model, optimizer, opt_level=level, dtype=torch.bfloat16,
                                             example_kwarg_inputs=batch)
    assert converted.amp_report.route == "torch.export"
    gelus = [r for r in converted.amp_report.nodes if r.op == "GeLUFunction"]
    assert len(gelus) == 2 and all("kept whole" in r.reason or level == "O2" for r in gelus)
    assert len(_function_nodes(converted)) == 2

    out, want = converted(**batch), reference(**batch)
    out.loss.backward()
    want.loss.backward()
    assert abs(out.loss.item() - want.loss.item()) <= 0.02 * abs(want.loss.item())
    params = converted.named_parameters() if level == "O2" else model.named_parameters()  # O2: the low copies
    grads = {n: p.grad for n, p in params if p.grad is not None}
    theirs = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    assert grads.keys() == theirs.keys()
    for name, grad in grads.items():
        scale = theirs[name].abs().max().item()
        assert torch.isfinite(grad).all(), name
        assert (grad.float() - theirs[name]).abs().max().item() <= 0.10 * scale + 1e-4, name

    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    for step in range(2):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        reference_optimizer.step()
        reference_optimizer.zero_grad(set_to_none=True)
        data = _bloom_batch(step + 1)
        loss, expected = converted(**data).loss, reference(**data).loss
        loss.backward()
        expected.backward()
        assert abs(loss.item() - expected.item()) <= 0.02 * abs(expected.item()), step
