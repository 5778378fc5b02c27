"""convert() and initialize() take models no whole graph captures: capture from the real call (converter/call_capture.py).

The corpus (tests/converter/capture_corpus.py) is written in the styles of issue 40's table.  Each model goes
through convert/initialize at O0-O3 without example inputs and is checked against eager ``torch.autocast``:
loss and gradients within a bf16 bound, a second input shape, and the share of GEMM FLOPs that ran bf16,
counted at dispatch (tests/probes.py GemmFlops), at least autocast's.

Bound: bf16 keeps 8 significant bits (relative rounding 2**-9); a few layers of GEMMs whose inputs are rounded
differently from autocast's (casts placed elsewhere, fp32 between graphs) stay within a few percent, so
gradients are compared in relative norm against 5% (O1) and 10% (O2/O3: parameters themselves rounded).
"""

import copy

import pytest
import torch

import amp_fx
from capture_corpus import CASES
from probes import GemmFlops

LEVEL_BOUND = {"O1": 0.05, "O2": 0.10, "O3": 0.10}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / (b.float().norm() + 1e-12)).item()


def _autocast_run(model, case, batch):
    """Loss, parameter gradients (by name) and GEMM FLOP counts of eager autocast on ``model``."""
    args, kwargs = case.inputs(batch)
    model.zero_grad()
    with GemmFlops() as flops, torch.autocast("cpu", dtype=torch.bfloat16):
        loss = case.loss(model(*args, **kwargs))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, flops


def _converted_run(module, case, batch, torch_seed):
    torch.manual_seed(torch_seed)
    args, kwargs = case.inputs(batch)
    module.zero_grad()
    with GemmFlops() as flops:
        loss = case.loss(module(*args, **kwargs))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}, flops


def _check_against_autocast(module, reference, case, level, dtype=torch.bfloat16):
    """Two input shapes: loss, every gradient and the bf16 GEMM share against autocast's on ``reference``."""
    for batch in (1, 2):
        torch.manual_seed(batch)
        ref_loss, ref_grads, ref_flops = _autocast_run(reference, case, batch)
        loss, grads, flops = _converted_run(module, case, batch, batch)
        assert loss.dtype == torch.float32
        assert abs(loss.item() - ref_loss.item()) <= LEVEL_BOUND[level] * abs(ref_loss.item()) + 1e-3, (batch, loss, ref_loss)
        assert set(grads) == set(ref_grads), case.name  # every parameter autocast trains gets its gradient
        for name, grad in grads.items():
            assert grad.shape == ref_grads[name].shape
            assert _rel(grad, ref_grads[name]) <= LEVEL_BOUND[level], (case.name, level, batch, name)
        # The FLOPs autocast runs in bf16 run in bf16 here too.  DEPENDS ON DECISIONS BETWEEN GRAPHS (issue 40 item 2):
        # for cases with case.between_graphs (the Function Dynamo leaves eager) and the O1 item-break case, the
        # GEMMs outside Dynamo's graphs run low only because call_capture runs that code under autocast at O1; if
        # the backend's own between-graph decisions (issue-40b) replace that, these assertions test them.
        assert ref_flops.low_share(dtype) > 0.99
        assert flops.total == ref_flops.total, (case.name, dict(flops.flops), dict(ref_flops.flops))
        assert flops.low_share(dtype) >= ref_flops.low_share(dtype) - 1e-9, (case.name, level, dict(flops.flops))


def test_the_corpus_has_every_construct_of_the_table():
    assert len(INITIALIZE_RUNS) == 2 * len(CASES) + 2
    assert [case.name for case in CASES] == [
        "dcgan_device_branch", "nanogpt_assert_targets", "int_timestep", "nonzero_branch", "attribute_in_forward",
        "item_break_in_submodule", "function_with_modulelist"]


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_o0_runs_the_model_unchanged_bit_for_bit(case):
    """O0 captures nothing: convert and initialize hand back the model's own forward on its own tensors."""
    model = case.build()
    converted = amp_fx.convert(model, "O0")
    initialized = amp_fx.initialize(case.build(), opt_level="O0", verbosity=0)
    initialized.load_state_dict(model.state_dict())
    assert converted.amp_report.route == "dynamo" and "O0" in str(converted.amp_report)
    assert type(converted) is type(model) and converted is not model
    for module in (converted, initialized):
        for batch in (1, 2):
            torch.manual_seed(batch)
            args, kwargs = case.inputs(batch)
            model.zero_grad()
            expected = case.loss(model(*args, **kwargs))
            expected.backward()
            expected_grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
            module.zero_grad()
            got = case.loss(module(*args, **kwargs))
            got.backward()
            assert torch.equal(got, expected)
            grads = [q.grad for q in module.parameters()]
            assert len(grads) == len(expected_grads) and any(g is not None for g in grads)
            for grad, expected_grad in zip(grads, expected_grads):  # (Gate.score has none: .item() cuts it off)
                assert (grad is None and expected_grad is None) or torch.equal(grad, expected_grad)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_convert_o1_runs_what_autocast_runs_low(case):
    model = case.build()
    reference = copy.deepcopy(model)
    converted = amp_fx.convert(model, "O1")
    report = converted.amp_report
    assert report.route == "dynamo" and report.trace_failure  # why the whole-graph capture failed, verbatim
    assert all(p is q for p, q in zip(converted.parameters(), model.parameters()))  # O1 shares the parameters
    _check_against_autocast(converted, reference, case, "O1")
    assert len(report.graphs) >= 1 and report.count("low") > 0
    assert str(len(report.graphs)) in str(report).splitlines()[0]


# Every case at O2 and O3; at O1 initialize hands the optimizer back unchanged and converts as convert() does
# (test_convert_o1_runs_what_autocast_runs_low), so two cases there keep the suite's time down.
INITIALIZE_RUNS = [(case, level) for level in ("O2", "O3") for case in CASES] + [(CASES[0], "O1"), (CASES[1], "O1")]


@pytest.mark.parametrize("case, level", INITIALIZE_RUNS, ids=lambda v: v if isinstance(v, str) else v.name)
def test_initialize_trains_the_captured_model(case, level):
    """initialize() without example inputs; one Apex-style step; state_dict keeps the model's keys (fp32 at O2)."""
    model = case.build()
    reference = copy.deepcopy(model)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    module, optimizer = amp_fx.initialize(model, optimizer, opt_level=level, verbosity=0)
    assert module.amp_report.route == "dynamo" and module.amp_report.level == level
    _check_against_autocast(module, reference, case, level)
    state = module.state_dict()
    assert list(state) == list(model.state_dict())
    if level == "O2":
        assert all(value.dtype == model.state_dict()[key].dtype for key, value in state.items())
    torch.manual_seed(0)
    args, kwargs = case.inputs(2)
    optimizer.zero_grad()
    with amp_fx.scale_loss(case.loss(module(*args, **kwargs)), optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    trained = [name for name, p in model.named_parameters() if not torch.equal(p.detach(), before[name])]
    if level in ("O1", "O2"):  # the model's own fp32 parameters (O2: the masters) take the step
        assert trained, (case.name, level)
    else:  # O3 trains the low copies the optimizer was re-pointed at
        assert any(not torch.equal(p.detach().float(), before[n].to(p.dtype).float())
                   for n, p in module.named_parameters())


def test_a_captured_module_converted_again_is_itself_or_refused():
    model = CASES[3].build()
    converted = amp_fx.convert(model, "O1")
    assert amp_fx.convert(converted, "O1") is converted
    with pytest.raises(amp_fx.AlreadyConvertedError):
        amp_fx.convert(converted, "O2")


def test_the_report_lists_graphs_and_breaks_and_says_why():
    model = CASES[5].build()  # .item() inside a submodule breaks the graph
    converted = amp_fx.convert(model, "O1")
    assert len(converted.amp_report.graphs) == 0  # nothing captured before the first call
    converted(*CASES[5].inputs(1)[0])
    report = converted.amp_report
    assert len(report.graphs) >= 2 and len(report.breaks) >= 1
    text = str(report)
    assert "captured from the call with Dynamo" in text and "Tensor.item()" in text and "int(proxy)" not in text
    assert "whole-graph capture failed" in text and report.totals()["graphs"] == len([g for g in report.graphs if g.region is None])


class _AssertingNet(torch.nn.Module):
    """A shape assert (fx cannot trace it) over Linear, LayerNorm and a loss computed inside forward."""

    def __init__(self):
        super().__init__()
        self.fc, self.ln, self.out = torch.nn.Linear(16, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 10)

    def forward(self, x, targets):
        assert x.shape[-1] == 16
        h = self.out(self.ln(self.fc(x)))
        return torch.nn.functional.cross_entropy(h, targets)


def test_conversions_of_one_class_past_dynamos_recompile_limit_still_capture_graphs():
    """Each conversion has its own Dynamo cache: the 9th O2 conversion of a class keeps its loss fp32 as the 1st.

    (With the class's shared forward, Dynamo's recompile limit of 8 per code object made every later
    conversion run eagerly, graphless: O2's loss came back bf16-rounded, with no warning after the first.)
    """
    x, y = torch.randn(32, 16), torch.randint(0, 10, (32,))
    limit = torch._dynamo.config.recompile_limit
    losses, graphs = [], []
    for _ in range(limit + 2):
        torch.manual_seed(0)
        gm = amp_fx.convert(_AssertingNet(), "O2")
        losses.append(gm(x, y).item())
        graphs.append(len(gm.amp_report.graphs))
    assert len(losses) == limit + 2
    assert all(count >= 1 for count in graphs), graphs
    assert all(loss == losses[0] for loss in losses), losses
    assert torch.tensor(losses[-1]).bfloat16().item() != losses[-1]  # fp32, not a bf16 value


class _RemembersNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
        self.last_norm = None

    def forward(self, x):
        h = self.a(x)
        self.last_norm = h.norm()  # a tensor autograd recorded, kept on the module
        return self.b(torch.nn.functional.gelu(h))


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_a_tensor_an_earlier_forward_left_on_the_model_does_not_stop_o2_o3(level):
    """deepcopy refuses a non-leaf tensor: a model run once before conversion must still convert (and initialize)."""
    model = _RemembersNorm()
    model(torch.randn(2, 8))
    assert model.last_norm.grad_fn is not None
    x = torch.randn(2, 8)
    gm = amp_fx.convert(model, level)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = model(x)
    out = gm(x)
    assert out.dtype == torch.float32
    assert (out - reference.float()).abs().max().item() <= 0.05 * reference.float().abs().max().item() + 1e-2
    model2, _ = amp_fx.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=level)
    assert model2(x).shape == (2, 4)
