"""The backend says when it converted nothing: Dynamo skipped the model's frame or broke it before every GEMM (issue 22).

A token-routing MoE (``nonzero()`` in the expert loop) makes Dynamo skip the
whole frame: the model runs eagerly and the backend is never called (amp_fx's
eager mode still decides its ops: issue 40, so they run as under autocast).  amp_fx
then warns once (``amp_fx.NothingConvertedWarning``) with Dynamo's reason and
hint, and ``amp_fx.last_report()`` says "nothing converted" instead of
returning None.  Models that convert, and functions with no GEMM that Dynamo
captures whole, get no warning.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_fx

D, EXPERTS, TOKENS = 16, 4, 32


class TokenRoutingMoE(nn.Module):
    """Top-1 routing: each expert Linear runs on the tokens the router sends it, found with nonzero()."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, EXPERTS)
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(EXPERTS))
        with torch.no_grad():  # the router reads the first EXPERTS features: see _tokens()
            self.router.weight.zero_()
            self.router.weight[:, :EXPERTS] = torch.eye(EXPERTS)
            self.router.bias.zero_()

    def forward(self, x):
        choice = self.router(x).argmax(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            idx = (choice == e).nonzero().squeeze(-1)
            out[idx] = expert(x[idx]).to(out.dtype)  # as HF MoE blocks write it: the buffer keeps its dtype
        return out


class Expert(nn.Module):
    """An expert MLP class of the model's own: Dynamo compiles its forward as a frame of its own."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class ExpertClassMoE(TokenRoutingMoE):
    """The same routing over Expert modules."""

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))


class GemmOutsideDynamo(nn.Module):
    """The only GEMM runs in a torch.compiler.disable'd method: every graph Dynamo captures is elementwise."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    @torch.compiler.disable
    def project(self, x):
        return self.fc(x)

    def forward(self, x):
        return torch.sigmoid(self.project(torch.relu(x))) * 2


def _logged(x):
    print("amp_fx test: a graph break inside a helper")
    return x * 2


class BreakInHelperBeforeGemm(nn.Module):
    """The helper's print breaks the graph twice (in forward and in the helper) before the GEMM resumes forward."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        return self.fc(_logged(torch.relu(x)))


def _tokens(requires_grad: bool = False) -> torch.Tensor:
    """Tokens whose routing margin (about 3) dwarfs bf16 rounding (3 * 2**-8): fp32 and bf16 route alike."""
    x = 0.1 * torch.randn(TOKENS, D)
    x[torch.arange(TOKENS), torch.arange(TOKENS) % EXPERTS] += 3.0
    return x.requires_grad_(requires_grad)


def _run(model, *inputs, times: int = 1, **compile_kwargs):
    """Compile ``model`` with the amp_fx backend, call it ``times`` times; the output and the NothingConvertedWarnings."""
    compile_kwargs.setdefault("backend", amp_fx.backend(level="O1", inner="aot_eager"))
    compiled = torch.compile(model, **compile_kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # "once" must come from amp_fx, not from the warnings registry
        for _ in range(times):
            out = compiled(*inputs)
    return out, [w for w in caught if issubclass(w.category, amp_fx.NothingConvertedWarning)]


def test_moe_frame_skipped_by_dynamo_warns_once_with_the_reason_and_the_fix(capsys):
    """Dynamo skips the MoE's frame (nonzero in a loop): one warning, at the user's call, naming frame, reason, fixes."""
    model, x = TokenRoutingMoE(), _tokens(requires_grad=True)
    out, caught = _run(model, x, times=2)
    assert len(caught) == 1  # two calls, one warning
    message = str(caught[0].message)
    assert "amp_fx converted nothing" in message and "ran eagerly, uncompiled: its ops got amp_fx's eager decisions" in message
    assert "Dynamo skipped forward" in message and "nonzero" in message  # the frame and Dynamo's reason
    assert "capture_dynamic_output_shape_ops = True" in message  # Dynamo's hint: the fix test_documented_fix... checks
    assert "torch._dynamo.explain(model)" in message and "amp_fx.convert(model" in message
    assert caught[0].filename == __file__  # points at the call of the compiled model, not into torch
    # The frame ran eagerly with amp_fx's decisions: the GEMMs' inputs cast to bf16 as autocast casts them, the same
    # kernels, so equal bit for bit to autocast, gradients too.
    reference_x = x.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", torch.bfloat16):
        reference = model(reference_x)
    assert torch.equal(out, reference)
    out.square().sum().backward()
    expert_grad = model.experts[0].weight.grad.clone()
    model.zero_grad()
    reference.square().sum().backward()
    assert torch.equal(x.grad, reference_x.grad) and torch.equal(expert_grad, model.experts[0].weight.grad)

    report = amp_fx.last_report()
    assert report is not None and report.nothing_converted and len(report) == 0
    (skip,) = report.breaks
    assert skip.kind == "frame skipped" and skip.frame == "forward" and "nonzero" in skip.reason
    assert skip.where.endswith(f"{os.path.basename(__file__)}:{TokenRoutingMoE.forward.__code__.co_firstlineno}")
    print(report)
    printed = capsys.readouterr().out
    assert printed.startswith("nothing converted: Dynamo skipped forward") and "because:" in printed
    assert report.to_dict()["nothing_converted"] is True and report.to_dict()["breaks"][0]["kind"] == "frame skipped"


def test_documented_fix_makes_the_moe_capture_and_convert():
    """capture_dynamic_output_shape_ops=True (Dynamo's hint) makes the MoE one graph: 5 bf16 GEMMs, as autocast."""
    model, x = TokenRoutingMoE(), _tokens(requires_grad=True)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        out, caught = _run(model, x)
    assert caught == []
    report = amp_fx.last_report()
    assert not report.nothing_converted and report.breaks == [] and len(report) == 1
    low_gemms = [r for r in report.nodes if r.decision == "low" and r.op == "linear"]
    assert len(low_gemms) == 1 + EXPERTS  # the router and every expert
    g = torch.randn_like(out)
    (out * g).sum().backward()
    x_ref = x.detach().clone().requires_grad_(True)
    weights = [e.weight for e in model.experts]  # the router gets none: argmax has no gradient
    grads = [w.grad.clone() for w in weights]
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = model(x_ref)
    (reference * g).sum().backward()
    # Both sides round the same fp32 values to bf16 and run bf16 GEMMs (K=16 forward, at most 32 tokens for
    # weight gradients) with fp32 accumulation and one bf16 rounding of the result (2**-8 relative): they can
    # differ only by accumulation order, a few bf16 ulps of values below 5, so 2e-2 absolute bounds it.
    torch.testing.assert_close(out, reference, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(x.grad, x_ref.grad, atol=2e-2, rtol=1e-2)
    for grad, weight in zip(grads, weights):
        torch.testing.assert_close(grad, weight.grad, atol=2e-2, rtol=1e-2)


def test_mlp_compiled_the_same_way_warns_nothing_and_reports_as_before():
    """A model that converts: no warning, and last_report() is the usual report."""
    model = nn.Sequential(nn.Linear(D, 32), nn.GELU(), nn.Linear(32, D))
    _, caught = _run(model, torch.randn(8, D), times=2)
    assert caught == []
    report = amp_fx.last_report()
    assert not report.nothing_converted and report.breaks == [] and report.count("low") == 2
    assert str(report).startswith("amp_fx compiler backend: level O1")


def test_function_without_gemm_is_no_false_alarm():
    """Dynamo captures a pure elementwise function whole: nothing to convert, no reason to warn."""
    out, caught = _run(lambda x: torch.sigmoid(x) * 2 + 1, torch.randn(8, D))
    assert caught == [] and not amp_fx.last_report().nothing_converted and len(amp_fx.last_report()) == 1


def test_every_graph_breaking_before_its_gemm_warns_naming_the_break():
    """Captured graphs hold only the elementwise ops; the GEMM ran eagerly: a warning naming the break and line."""
    model, x = GemmOutsideDynamo(), torch.randn(8, D)
    out, caught = _run(model, x)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "none of the 2 graph(s) Dynamo captured holds a matrix multiply" in message
    assert "Dynamo broke the graph of forward" in message and "torch.compiler.disable" in message
    assert "nothing to convert" in message  # says when it is no alarm at all
    report = amp_fx.last_report()
    assert report.nothing_converted and len(report) == 2 and report.count("low") == 0
    assert report.breaks[0].kind == "graph break" and report.breaks[0].at is not None
    # The GEMM ran eagerly with amp_fx's decisions (bf16), as autocast runs it.
    assert amp_fx.coverage(torch.compile(model, backend=amp_fx.backend(level="O1", inner="aot_eager")), x).low_share == 1.0


def test_graph_breaks_before_a_gemm_that_converts_later_are_no_false_alarm(capsys):
    """The helper's own frame ends with nothing low, but forward's resume function still holds the GEMM: no warning."""
    _, caught = _run(BreakInHelperBeforeGemm(), torch.randn(8, D))
    assert caught == []
    report = amp_fx.last_report()
    assert not report.nothing_converted and report.count("low") == 1 and len(report.breaks) == 2


def test_skipped_frame_whose_expert_classes_convert_is_no_false_alarm():
    """Dynamo skips the MoE frame but compiles the Expert classes' forwards on their own: those convert, no warning."""
    model = ExpertClassMoE()
    _, caught = _run(model, _tokens())
    assert caught == []
    report = amp_fx.last_report()
    assert not report.nothing_converted and report.count("low") >= 2  # up and down of the experts
    assert [b.kind for b in report.breaks] == ["frame skipped"]  # still listed: the router ran eagerly
    assert "eager, amp_fx's eager decisions: Dynamo skipped forward" in str(report)


def test_fullgraph_raises_instead_and_does_not_warn():
    """With fullgraph=True Dynamo raises the break to the user: nothing is silent, so no warning on top."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(Exception, match="disable"):
            torch.compile(GemmOutsideDynamo(), backend=amp_fx.backend(inner="aot_eager"), fullgraph=True)(
                torch.randn(8, D))
    assert not [w for w in caught if issubclass(w.category, amp_fx.NothingConvertedWarning)]


def test_suppressed_backend_failure_runs_eagerly_and_is_said():
    """suppress_errors=True turns an inner backend's failure into an eager run: a warning, and no graph reported."""

    def failing_inner(gm, example_inputs):
        raise ZeroDivisionError("the inner backend failed")

    model, x = nn.Sequential(nn.Linear(D, D), nn.ReLU()), torch.randn(4, D)
    with torch._dynamo.config.patch(suppress_errors=True):
        out, caught = _run(model, x, backend=amp_fx.backend(inner=failing_inner))
    assert len(caught) == 1 and "the inner backend failed" in str(caught[0].message)
    report = amp_fx.last_report()
    assert report.nothing_converted and len(report) == 0  # the converted graph never ran: not listed
    assert [b.kind for b in report.breaks] == ["compile failed"]
    with torch.autocast("cpu", torch.bfloat16):
        assert torch.equal(out, model(x))  # eager, amp_fx's eager decisions: autocast's casts and kernels


def test_backend_by_name_warns_in_a_fresh_process():
    """backend="amp_fx" after a plain `import amp_fx` (Dynamo not yet imported) warns too: the user's usual order."""
    script = textwrap.dedent(f"""
        import warnings, torch, amp_fx, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_backend_nothing_converted import TokenRoutingMoE, _tokens
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.compile(TokenRoutingMoE(), backend="amp_fx", options={{"inner": "aot_eager"}})(_tokens())
        ours = [w for w in caught if issubclass(w.category, amp_fx.NothingConvertedWarning)]
        print(len(ours), amp_fx.last_report().nothing_converted)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["1", "True"], done.stdout[-2000:]
