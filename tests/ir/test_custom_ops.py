"""torch.library custom ops get a decision: the registry's, a policy's, or (undecided) one dtype for their inputs.

The rules under test (issue 26, item 2):

- a custom op is named ``"ns::name"`` on every route (symbolic trace, torch.export, the backend);
- an op the tables do not list and that gets mixed floating dtypes runs in the widest of them, as promote
  ops do, instead of crashing in its kernel; if it reads a parameter, one warning per conversion names it
  with the policy line that decides it;
- ``policy={"op:ns::name": ...}`` decides one (a misspelt name is an error with close matches);
- the registry ships transformers' grouped expert GEMM as low, like ``mm``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import amp_fx
from amp_fx.ir import op_properties, tables
from amp_fx.ir.op_keys import op_name_of
from amp_fx.passes.assign_precision import UndecidedCustomOpWarning

LOW = torch.bfloat16
SEEN: list[tuple[torch.dtype, torch.dtype]] = []  # the input dtypes each call of the op's kernel got


# -- a GEMM-like custom op, defined here, with a fake kernel and an autograd formula ---------------
@torch.library.custom_op("amp_fx_test_custom::gemm", mutates_args=())
def gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    SEEN.append((x.dtype, w.dtype))
    return x @ w  # mixed dtypes fail here, as a real kernel's would


@gemm.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[1])


def _gemm_backward(ctx, grad):
    x, w = ctx.saved_tensors
    return grad @ w.t(), x.t() @ grad


def _gemm_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


gemm.register_autograd(_gemm_backward, setup_context=_gemm_setup)


class Experts(nn.Module):
    """A Linear (low at O1) feeding the custom op twice, with an fp32 weight: mixed dtypes at the op."""

    def __init__(self, export_only: bool = False):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.randn(8, 6) / 3)
        self.export_only = export_only

    def forward(self, x):
        if self.export_only and x.dim() == 2:  # symbolic tracing cannot branch on x.dim(): torch.export traces it
            x = x * 1.0
        h = self.proj(x)
        return gemm(h, self.w) + torch.ops.amp_fx_test_custom.gemm(h.relu(), self.w)  # two spellings


def _reference(model, h):
    """Experts' result with its op run in fp32 on ``h``, the bf16 Linear output (relu is exact on it)."""
    return gemm(h.float(), model.w) + gemm(h.relu().float(), model.w)


def _records(gm, op="amp_fx_test_custom::gemm"):
    return [r for r in gm.amp_report.nodes if r.op == op]


def _convert(model, level="O1", **options):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gm = amp_fx.convert(model, level, dtype=LOW, cast_model_outputs=False, **options)
    return gm, [w for w in caught if issubclass(w.category, UndecidedCustomOpWarning)]


@pytest.mark.parametrize("export_only", [False, True], ids=["symbolic", "export"])
def test_undecided_custom_op_gets_one_dtype_and_one_warning(export_only):
    """Unknown custom op, a bf16 activation and an fp32 weight: it runs fp32 (the widest), warned once, named ns::name."""
    model, x = Experts(export_only), torch.randn(4, 8)
    gm, warned = _convert(model, example_inputs=(x,))
    assert gm.amp_report.route == ("torch.export" if export_only else "symbolic_trace")
    records = _records(gm)
    assert len(records) == 2 and {r.decision for r in records} == {"promote"} and {r.rule for r in records} == {"unknown"}
    assert len(warned) == 1, [str(w.message) for w in warned]
    message = str(warned[0].message)
    assert "'amp_fx_test_custom::gemm'" in message and "'w'" in message
    assert "policy={'op:amp_fx_test_custom::gemm': 'low'}" in message
    assert any("amp_fx_test_custom::gemm" in line for line in gm.amp_report.passes["assign_precision"]["report_lines"])

    SEEN.clear()
    out = gm(x)
    assert SEEN == [(torch.float32, torch.float32)] * 2
    # The reference runs the same kernels: autocast's bf16 Linear, then the op on its result widened to fp32.
    with torch.autocast("cpu", dtype=LOW):
        h = model.proj(x)
    torch.testing.assert_close(out, _reference(model, h), rtol=0, atol=0)


def test_mixed_inputs_without_parameters_are_equalised_without_a_warning():
    """No parameter read: nothing to warn about, but the mixed inputs are still made one dtype (fp32)."""

    class Mixed(nn.Module):
        def forward(self, a, b):
            return gemm(a.to(LOW), b)

    gm, warned = _convert(Mixed())
    assert not warned
    SEEN.clear()
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    out = gm(a, b)
    assert SEEN == [(torch.float32, torch.float32)] and out.dtype == torch.float32
    torch.testing.assert_close(out, a.to(LOW).float() @ b, rtol=0, atol=0)


@pytest.mark.parametrize("key", ["op:amp_fx_test_custom::gemm", "op:torch.ops.amp_fx_test_custom.gemm.default",
                                 torch.ops.amp_fx_test_custom.gemm, gemm])
def test_policy_decides_a_custom_op_low_and_its_gradient_flows(key):
    """policy={"op:ns::name": "low"} (or another spelling, or the op itself): bf16 inputs, no warning, gradients flow."""
    model, x = Experts(), torch.randn(4, 8, requires_grad=True)
    reference = Experts()
    reference.load_state_dict(model.state_dict())
    gm, warned = _convert(model, policy={key: "low"})
    assert not warned
    assert {(r.decision, r.rule) for r in _records(gm)} == {("low", "policy")}

    SEEN.clear()
    out = gm(x)
    assert SEEN == [(LOW, LOW)] * 2 and out.dtype == LOW
    out.float().sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    reference(x_ref).sum().backward()
    # bf16 keeps 8 significant bits (2^-9 relative rounding): each gradient here sums 4-8 products of
    # rounded operands, rounded again in bf16, so a few 2^-8 of its scale; 3% bounds it and catches a missing term.
    for got, want, name in [(model.w.grad, reference.w.grad, "w"), (model.proj.weight.grad, reference.proj.weight.grad, "proj"),
                            (x.grad, x_ref.grad, "x")]:
        assert got is not None and torch.isfinite(got).all(), name
        assert (got.float() - want).abs().max() <= 0.03 * want.abs().max(), name


def test_a_misspelt_custom_op_is_refused_with_a_close_match():
    with pytest.raises(amp_fx.AmpValueError, match=r"'amp_fx_test_custom::gemn'.*Did you mean 'amp_fx_test_custom::gemm'"):
        amp_fx.Policy.from_dict({"op:amp_fx_test_custom::gemn": "low"})
    # A namespace nothing registered is checked when converting (its library may be imported later).
    policy = amp_fx.Policy.from_dict({"op:amp_fx_test_custon::gemm": "low"})
    with pytest.raises(amp_fx.AmpValueError, match=r"Did you mean 'amp_fx_test_custom::gemm'"):
        amp_fx.convert(Experts(), "O1", policy=policy)


def test_a_custom_op_that_writes_an_argument_is_never_cast():
    """A cast copy would take the write: an undecided op that mutates its input follows, at O1 and O2."""
    calls = []

    @torch.library.custom_op("amp_fx_test_custom::scale_", mutates_args=("x",))
    def scale_(x: torch.Tensor, s: torch.Tensor) -> None:
        calls.append((x.dtype, s.dtype))
        x.mul_(s.to(x.dtype))

    class Scales(nn.Module):
        def __init__(self):
            super().__init__()
            self.s = nn.Parameter(torch.full((4,), 2.0))

        def forward(self, x):
            y = x.to(LOW) * 1
            scale_(y, self.s)
            return y

    for level in ("O1", "O2"):
        gm, _ = _convert(Scales(), level)
        record = _records(gm, "amp_fx_test_custom::scale_")[0]
        assert record.decision == "follow" and "writes an argument" in record.reason
        calls.clear()
        out = gm(torch.ones(3, 4))
        assert calls[0][0] == LOW and torch.equal(out.float(), torch.full((3, 4), 2.0)), level


def test_backend_names_the_custom_op_and_equalises_its_inputs():
    """Under torch.compile the op is ns::name too: the same paint and the same result as convert()."""
    model, x = Experts(), torch.randn(4, 8)
    backend = amp_fx.backend(level="O1", dtype=LOW, inner="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        SEEN.clear()
        out = torch.compile(model, backend=backend)(x)
    assert SEEN == [(torch.float32, torch.float32)] * 2
    assert [w for w in caught if issubclass(w.category, UndecidedCustomOpWarning)]
    decisions = {r.decision for r in backend.report.nodes if r.op == "amp_fx_test_custom::gemm"}
    assert decisions == {"promote"}
    with torch.autocast("cpu", dtype=LOW):
        h = model.proj(x)
    torch.testing.assert_close(out, _reference(model, h), rtol=0, atol=0)


# -- the registry's entries -------------------------------------------------------------------
def test_every_shipped_custom_op_entry_is_a_qualified_name_with_a_reason():
    assert tables.CUSTOM_OPS == {"transformers::grouped_mm_fallback", "transformers::grouped_mm_fallback_backward",
                                 "transformers_msa::sparse_atten"}
    for op in tables.CUSTOM_OPS:
        namespace, _, name = op.partition("::")
        assert namespace and name and op_name_of(op) == op
        props = op_properties.of(op)
        assert props.table != "unknown" and props.reason


def _transformers_ops():
    """Import the module that registers transformers' MoE ops (no model is built), or skip without transformers."""
    pytest.importorskip("transformers.integrations.moe")


def test_transformers_ops_are_registered_as_the_tables_name_them():
    """The entries name ops transformers really registers (a rename upstream would leave them dead)."""
    _transformers_ops()
    pytest.importorskip("transformers.integrations.msa_attention")  # registers transformers_msa::sparse_atten
    registered = {n.split(".")[0] for n in torch._C._dispatch_get_all_op_names()}
    assert tables.CUSTOM_OPS <= registered, sorted(tables.CUSTOM_OPS - registered)
    for op in ("transformers::grouped_mm_fallback", "transformers::grouped_mm_fallback_backward",
               "transformers_msa::sparse_atten"):
        assert op_properties.of(op).table == "low"


class GroupedExperts(nn.Module):
    """transformers' expert GEMM as its MoE layer calls it: the input cast to the weight's dtype, then the op."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 8, 6) / 3)  # (experts, in, out)
        self.proj = nn.Linear(8, 8)

    def forward(self, x, offs):
        h = self.proj(x)
        return torch.ops.transformers.grouped_mm_fallback(h.to(self.weight.dtype), self.weight, offs=offs)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_transformers_grouped_mm_runs_low_with_its_gradient(level):
    """The registry decides transformers' grouped GEMM low at O1 and O2: bf16 forward and backward, no warning."""
    _transformers_ops()
    model, x, offs = GroupedExperts(), torch.randn(7, 8), torch.tensor([2, 2, 7])
    reference = GroupedExperts()
    reference.load_state_dict(model.state_dict())
    gm, warned = _convert(model, level)
    assert not warned
    assert {(r.decision, r.rule) for r in _records(gm, "transformers::grouped_mm_fallback")} == \
        {("low", "table" if level == "O1" else "level")}
    out = gm(x, offs)
    assert out.dtype == LOW
    out.float().sum().backward()
    reference(x, offs).sum().backward()
    # bf16 bound as in the policy test above (8-term sums of rounded products): 3% of each gradient's scale.
    grad = dict(gm.named_parameters())["weight"].grad  # O2: the converted module's low copy
    assert grad is not None and torch.isfinite(grad).all()
    assert (grad.float() - reference.weight.grad).abs().max() <= 0.03 * reference.weight.grad.abs().max()
