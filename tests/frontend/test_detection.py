"""What a symbolic trace would freeze or drop is refused, with the construct, its source line and the route that works.

The rules under test: a forward that changes a module's Python attribute,
or enters a PyTorch context manager that changes how ops run, makes
convert() raise UnsupportedConstructError (and leaves the model unchanged);
the compiler backend keeps such a forward's meaning; the model's own
@contextmanager functions are converted and noted in the report.
"""

import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_fx
from probes import captured_because
from amp_fx.errors import AmpError, UnsupportedConstructError


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.a(x) * self.calls


class Remember(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        self.last = h
        return h.relu()


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Counter()

    def forward(self, x):
        return self.inner(x) + 1


class BufferCounter(nn.Module):
    """The way that every route keeps: a buffer updated in place by a tensor op."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return self.a(x) * self.calls


def test_attribute_change_takes_the_call_route_and_the_report_names_line_and_route():
    model, x = Counter(), torch.randn(2, 8)
    converted, message = captured_because(model, "'calls'", "0 -> 1", "self.calls += 1", "test_detection.py",
                                          "backend='amp_fx'")
    assert model.calls == 0  # symbolic tracing stopped before the assignment: the model is not changed
    converted(x)
    converted(x)
    assert converted.calls == 2  # the assignment runs at every call, on the converted module


def test_storing_a_traced_tensor_takes_the_call_route():
    _, message = captured_because(Remember(), "'last'", "a traced tensor", "self.last = h")


def test_the_report_names_the_submodule():
    captured_because(Outer(), "module 'inner' sets attribute 'calls'")


def test_captured_from_the_call_with_example_inputs_too():
    captured_because(Counter(), "'calls'", example_inputs=(torch.randn(2, 8),))


def test_backend_keeps_the_attribute_change():
    """Dynamo replays the assignment on every call: the route the error recommends works."""
    model, x = Counter(), torch.randn(2, 8)
    compiled = torch.compile(model, backend=amp_fx.backend(inner="aot_eager"))
    first, second = compiled(x), compiled(x)
    assert model.calls == 2
    base = model.a(x)
    torch.testing.assert_close(first.float(), base, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(second.float(), 2 * base, rtol=2e-2, atol=4e-2)


def test_buffer_updated_in_place_is_kept():
    model, x = BufferCounter(), torch.randn(2, 8)
    gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16)
    base = gm(x) / 1.0
    again = gm(x)
    assert gm.calls.item() == 2
    torch.testing.assert_close(again.float(), 2 * base.float(), rtol=2e-2, atol=2e-2)


# -- context managers -------------------------------------------------------------

class ForkRng(nn.Module):
    def forward(self, x):
        with torch.random.fork_rng():
            return F.dropout(x, 0.5, training=True)


class SdpaKernel(nn.Module):
    def forward(self, q):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, q, q)


class BackendFlags(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        with torch.backends.mkldnn.flags(enabled=False):
            return self.a(x)


class SavedHooks(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            return self.a(x)


class Doubler(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class WithMode(nn.Module):
    def forward(self, x):
        with Doubler():
            return x + 1


@pytest.mark.parametrize("model, name, line", [
    (ForkRng(), "torch.random.fork_rng", "with torch.random.fork_rng():"),
    (SdpaKernel(), "sdpa_kernel", "with sdpa_kernel(SDPBackend.MATH):"),
    (BackendFlags(), "torch.backends.mkldnn.flags", "with torch.backends.mkldnn.flags(enabled=False):"),
    (SavedHooks(), "saved_tensors_hooks", "with torch.autograd.graph.saved_tensors_hooks"),
    (WithMode(), "TorchFunctionMode (Doubler)", "with Doubler():"),
])
def test_pytorch_context_managers_take_the_call_route(model, name, line):
    captured_because(model, name, line, "test_detection.py", "backend='amp_fx'")


@contextlib.contextmanager
def logging_scope(tag):
    yield tag


class OwnContext(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        with logging_scope("block"):
            h = self.a(x)
        with torch.autograd.profiler.record_function("head"):
            return h.relu()


def test_models_own_context_manager_is_converted_and_noted():
    model, x = OwnContext(), torch.randn(2, 8)
    gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x)
    torch.testing.assert_close(gm(x).float(), expected.float())
    notes = [n for n in gm.amp_report.notes if "context manager" in n]
    assert len(notes) == 1 and "logging_scope" in notes[0] and "with logging_scope" in notes[0]


# -- the torch.export route (taken when symbolic tracing fails and example inputs are given) ---------

class ShapeBranch(nn.Module):
    """``if x.shape[-1] == 8`` stops symbolic tracing; torch.export traces it."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        if x.shape[-1] == 8:
            x = x * 1.0
        return self.inner(x)


class WithCheckpoint(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.a, x, use_reentrant=False)


@pytest.mark.parametrize("inner, construct, line", [
    (Counter(), "module attribute assignment in forward", "self.calls += 1"),
    (WithCheckpoint(), "inlines checkpointed regions", "torch.utils.checkpoint.checkpoint(self.a, x"),
    (ForkRng(), "torch.random.fork_rng", "with torch.random.fork_rng():"),
])
def test_what_the_export_route_would_drop_takes_the_call_route(inner, construct, line):
    model = ShapeBranch(inner)
    captured_because(model, line, "backend='amp_fx'", example_inputs=(torch.randn(2, 8),))


def test_export_route_converts_and_notes_the_models_own_context_manager():
    model, x = ShapeBranch(OwnContext()), torch.randn(2, 8)
    gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16, example_inputs=(x,))
    assert gm.amp_report.route == "torch.export"
    assert any("logging_scope" in note for note in gm.amp_report.notes)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x)
    torch.testing.assert_close(gm(x).float(), expected.float())
