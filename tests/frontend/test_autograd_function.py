"""Custom torch.autograd.Functions and torch.library custom ops keep their meaning through convert().

The rule under test: a Function is one node, its forward and backward are
the author's; its precision follows autocast's rules (custom_fwd(cast_inputs=)
casts its inputs, otherwise its inputs arrive as they are), and a policy
entry naming it overrides that.  Custom ops with a register_autocast rule use
that rule.
"""

import copy
import pickle

import pytest
import torch
import torch.nn as nn

import amp_fx
from probes import captured_because
from amp_fx.errors import UnsupportedConstructError
from amp_fx.frontend.opaque_calls import FunctionCall

SEEN: dict[str, list] = {}


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
    """Declares fp32 inputs for CPU autocast; backward under custom_bwd."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, x):
        SEEN.setdefault("Fp32Scale", []).append(x.dtype)
        return x * 3.0

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        return grad * 3.0


class CudaOnlyScale(torch.autograd.Function):
    """custom_fwd for CUDA: on CPU autocast does not cast its inputs."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)
    def forward(ctx, x):
        SEEN.setdefault("CudaOnlyScale", []).append(x.dtype)
        return x * 3.0

    @staticmethod
    def backward(ctx, grad):
        return grad * 3.0


class SplitHalves(torch.autograd.Function):
    """Two outputs, with a backward that is not the forward's derivative (so inlining would show)."""

    @staticmethod
    def forward(ctx, x):
        a, b = x.chunk(2, dim=-1)
        return a.clone(), b.clone()

    @staticmethod
    def backward(ctx, ga, gb):
        return torch.cat([ga * 2.0, gb * 2.0], dim=-1)


class Quantized(nn.Module):
    def __init__(self, fn=RoundST):
        super().__init__()
        self.fn = fn
        self.lin = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.fn.apply(self.lin(x) * 4.0))


class TwoOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 16)

    def forward(self, x):
        a, b = SplitHalves.apply(self.lin(x))
        return (a * b).sum(-1)


def _grads(model, x, *, autocast=False):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(x)
    out.float().sum().backward()
    return out.detach(), {n.replace("_orig_mod.", ""): p.grad.clone() for n, p in model.named_parameters()}


def _function_nodes(gm):
    return [n for n in gm.graph.nodes if isinstance(n.target, FunctionCall)]


def test_straight_through_gradient_agrees_with_autocast():
    """The backward is the Function's own: the weight gradient is autocast's, not 0.0 (forward inlined)."""
    model = Quantized()
    x = torch.randn(32, 16)
    gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16)
    _, got = _grads(gm, x)
    _, ref = _grads(model, x, autocast=True)
    _, fp32 = _grads(model, x)
    grad, expected = got["lin.weight"], ref["lin.weight"]
    assert grad.abs().sum() > 1.0  # inlined, round's derivative would make this exactly 0
    torch.testing.assert_close(grad, expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())
    torch.testing.assert_close(grad, fp32["lin.weight"], rtol=5e-2, atol=5e-2 * expected.abs().max().item())
    assert len(_function_nodes(gm)) == 1
    assert not any(n.op == "call_method" and n.target == "round" for n in gm.graph.nodes)


def test_function_node_is_reported_by_class_name():
    gm = amp_fx.convert(Quantized(), "O1", dtype=torch.bfloat16)
    record = next(r for r in gm.amp_report.nodes if r.op == "RoundST")
    assert record.decision == "follow" and record.rule == "declared"
    assert "kept whole" in record.reason
    assert gm.amp_report.to_dict()["passes"]["assign_precision"]["unknown_ops"] == {}


def test_undeclared_function_sees_what_autocast_gives_it():
    """No custom_fwd: its input arrives as it is, bf16 from the Linear before it, as under autocast."""
    SEEN.clear()
    model, x = Quantized(), torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x)
    gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16)
    SEEN["RoundST"] = SEEN["RoundST"][:1]  # tracing ran the forward once on proxies (to learn its outputs)
    gm(x)
    assert SEEN["RoundST"] == [torch.bfloat16, torch.bfloat16]


def test_custom_fwd_cast_inputs_runs_the_forward_in_fp32():
    """custom_fwd(cast_inputs=torch.float32): the forward sees fp32 inside an O1 bf16 conversion, as under autocast."""
    SEEN.clear()
    model, x = Quantized(Fp32Scale), torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x)
    gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16)
    SEEN["Fp32Scale"] = SEEN["Fp32Scale"][:1]
    out = gm(x)
    assert SEEN["Fp32Scale"] == [torch.float32, torch.float32]
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)
    record = next(r for r in gm.amp_report.nodes if r.op == "Fp32Scale")
    assert record.decision == "fp32" and "custom_fwd" in record.reason
    _, got = _grads(gm, x)
    _, ref = _grads(model, x, autocast=True)
    torch.testing.assert_close(got["lin.weight"], ref["lin.weight"], rtol=2e-2, atol=2e-2)


def test_custom_fwd_for_another_device_does_nothing_on_cpu():
    SEEN.clear()
    model, x = Quantized(CudaOnlyScale), torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x)
    gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16)
    SEEN["CudaOnlyScale"] = SEEN["CudaOnlyScale"][:1]
    gm(x)
    assert SEEN["CudaOnlyScale"] == [torch.bfloat16, torch.bfloat16]


def test_custom_fwd_is_honoured_at_O2():
    gm = amp_fx.convert(Quantized(Fp32Scale), "O2", dtype=torch.bfloat16)
    SEEN.clear()
    gm(torch.randn(4, 16))
    assert SEEN["Fp32Scale"] == [torch.float32]


@pytest.mark.parametrize("key", ["op:RoundST", RoundST])
def test_policy_names_the_function(key):
    """An op: policy entry (by class name or the class itself) beats the Function's own rule."""
    gm = amp_fx.convert(Quantized(), "O1", dtype=torch.bfloat16, policy={key: "fp32"})
    SEEN.clear()
    gm(torch.randn(4, 16))
    assert SEEN["RoundST"] == [torch.float32]
    record = next(r for r in gm.amp_report.nodes if r.op == "RoundST")
    assert record.rule == "policy" and record.decision == "fp32"


def test_two_output_function_keeps_its_backward():
    model, x = TwoOutputs(), torch.randn(4, 8)
    gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16)
    _, got = _grads(gm, x)
    _, ref = _grads(model, x, autocast=True)
    torch.testing.assert_close(got["lin.weight"], ref["lin.weight"], rtol=2e-2, atol=2e-2 * ref["lin.weight"].abs().max().item())
    assert len(_function_nodes(gm)) == 1
    assert not any(n.op == "call_method" and n.target == "chunk" for n in gm.graph.nodes)


def test_pickle_and_deepcopy_keep_the_function_node():
    model, x = Quantized(), torch.randn(4, 16)
    gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16)
    expected, grads = _grads(gm, x)
    for clone in (pickle.loads(pickle.dumps(gm)), copy.deepcopy(gm)):
        assert len(_function_nodes(clone)) == 1
        out, clone_grads = _grads(clone, x)
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(clone_grads["lin.weight"], grads["lin.weight"])


def test_function_given_an_unrecordable_argument_takes_the_call_route():
    class Apply(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, fn):
            return fn(x)

        @staticmethod
        def backward(ctx, grad):
            return grad, None

    class Model(nn.Module):
        def forward(self, x):
            return Apply.apply(x, lambda t: t * 2)

    converted, _ = captured_because(Model(), "Apply", "Apply.apply(x, lambda", "backend='amp_fx'")
    x = torch.randn(3, 4)
    assert torch.equal(converted(x), x * 2)


def test_backend_route_keeps_the_straight_through_gradient():
    model, x = Quantized(), torch.randn(32, 16)
    compiled = torch.compile(model, backend=amp_fx.backend(inner="aot_eager"))
    _, got = _grads(compiled, x)
    _, ref = _grads(model, x, autocast=True)
    expected = ref["lin.weight"]
    torch.testing.assert_close(got["lin.weight"], expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())


# -- torch.library custom ops ---------------------------------------------------

@torch.library.custom_op("amp_fx_test::triple_fp32", mutates_args=())
def triple_fp32(x: torch.Tensor) -> torch.Tensor:
    SEEN.setdefault("triple_fp32", []).append(x.dtype)
    return x * 3.0


@triple_fp32.register_fake
def _(x):
    return torch.empty_like(x)


torch.library.register_autocast("amp_fx_test::triple_fp32", "cpu", torch.float32)


@torch.library.custom_op("amp_fx_test::triple_plain", mutates_args=())
def triple_plain(x: torch.Tensor) -> torch.Tensor:
    SEEN.setdefault("triple_plain", []).append(x.dtype)
    return x * 3.0


@triple_plain.register_fake
def _(x):
    return torch.empty_like(x)


class CustomOpModel(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.op = op
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.op(self.lin(x))


@pytest.mark.parametrize("name, op, dtype", [
    ("triple_fp32", torch.ops.amp_fx_test.triple_fp32, torch.float32),
    ("triple_plain", torch.ops.amp_fx_test.triple_plain, torch.bfloat16),
])
def test_custom_op_uses_its_registered_autocast_rule(name, op, dtype):
    """register_autocast(cast_inputs=fp32) casts the op's inputs to fp32; without a rule it follows, as under autocast."""
    SEEN.clear()
    model, x = CustomOpModel(op), torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x)
    amp_fx.convert(model, "O1", dtype=torch.bfloat16)(x)
    assert SEEN[name] == [dtype, dtype]
