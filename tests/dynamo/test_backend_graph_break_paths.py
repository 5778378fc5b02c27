"""Module policies match full paths from the compiled model after a graph break inside a submodule (issue 26, item 4).

A graph break inside ``Layer.forward`` makes Dynamo compile that forward
(and its resume function) as frames of their own, whose graphs name
modules from the layer (``fc1``, not ``encoder.layers.0.fc1``); and Dynamo
runs the frame compiled for one ``Layer`` for every other ``Layer``.  A
policy ``{"module:encoder.layers.0": "fp32"}`` must pin layer 0 and layer 0
only, or the backend must refuse.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import amp_fx
from amp_fx.errors import AmpValueError


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        x = torch.relu(self.fc1(x))
        torch._dynamo.graph_break()
        return self.fc2(x)


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Layer(), Layer()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder, self.head = Encoder(), nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.encoder(x))


def _step(m, x):
    return m(x)


STYLES = {
    "torch.compile(model)": lambda net, be: (torch.compile(net, backend=be), ()),
    "torch.compile(step)(model, x)": lambda net, be: (torch.compile(_step, backend=be), (net,)),
}


def _backend():
    return amp_fx.backend(policy={"module:encoder.layers.0": "fp32"}, dtype=torch.bfloat16, inner="aot_eager")


def _reference(net: Net, x: torch.Tensor) -> torch.Tensor:
    """What the policy means, in eager: autocast everywhere but encoder.layers.0, which runs fp32."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.autocast("cpu", enabled=False):
            h = net.encoder.layers[0](x.float())
        return net.head(net.encoder.layers[1](h))


@pytest.mark.parametrize("style", list(STYLES))
def test_a_module_policy_pins_the_named_layer_only(style):
    """Layer 0's GEMMs and relu fp32, layer 1 and the head low, whichever layer's frame Dynamo compiled first."""
    torch.manual_seed(0)
    net = Net()
    reference = copy.deepcopy(net)
    be = _backend()
    compiled, leading = STYLES[style](net, be)
    x = torch.randn(2, 8)
    out = compiled(*leading, x)
    decided = {r.module: r.decision for r in be.report.nodes if r.op in ("linear", "relu") and not r.inserted}
    assert decided == {
        "encoder.layers.0.fc1": "fp32", "encoder.layers.0": "fp32", "encoder.layers.0.fc2": "fp32",
        "encoder.layers.1.fc1": "low", "encoder.layers.1": "follow", "encoder.layers.1.fc2": "low",
        "head": "low",
    }, decided
    weights = {r.reason.split("inserted: ")[-1].split(" to ")[0] for r in be.report.nodes if "weight cast" in r.reason}
    assert weights == {f"{m}.{p}" for m in ("encoder.layers.1.fc1", "encoder.layers.1.fc2", "head") for p in ("weight", "bias")}
    # Each layer has graphs of its own (Dynamo would otherwise run layer 0's fp32 graph for layer 1).
    assert any("kept to module encoder.layers.1" in note for g in be.report.graphs for note in g.report.notes)
    expected = _reference(reference, x)
    # The same casts and GEMMs as the eager reference; aot_eager's addmm against eager's linear: 2 bf16 ulps.
    torch.testing.assert_close(out, expected.float(), rtol=2 * 2 ** -8, atol=1e-3)
    out.square().sum().backward()
    expected.float().square().sum().backward()
    for (name, p), q in zip(net.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=3e-2, atol=3e-2, msg=name)


class ForgetfulLayer(Layer):
    """After the break nothing reads ``self``: the resume function holds no reference to its layer."""

    def forward(self, x):
        x = self.fc1(x)
        torch._dynamo.graph_break()
        return torch.relu(x) * 2


class ForgetfulNet(Net):
    def __init__(self):
        super().__init__()
        self.encoder.layers = nn.ModuleList([ForgetfulLayer(), ForgetfulLayer()])


def test_a_frame_that_cannot_tell_its_layers_apart_is_refused():
    """The resume graph would serve both layers, which the policy decides differently: AmpValueError, not a silent miss."""
    compiled = torch.compile(ForgetfulNet(), backend=_backend())
    with pytest.raises(Exception) as caught:
        compiled(torch.randn(2, 8))
    error = caught.value
    while not isinstance(error, AmpValueError) and (error.__cause__ or getattr(error, "inner_exception", None)):
        error = error.__cause__ or error.inner_exception
    assert isinstance(error, AmpValueError), caught.value
    message = str(error)
    assert "every ForgetfulLayer of the model" in message and "encoder.layers.0" in message
    assert "remove the graph break" in message and "amp_fx.convert(model" in message


def test_without_module_rules_frames_are_shared_and_named_fully():
    """No module policy: Dynamo may share a layer's frame (no extra compiles), and the report still names full paths."""
    torch.manual_seed(0)
    be = amp_fx.backend(dtype=torch.bfloat16, inner="aot_eager")
    torch.compile(Net(), backend=be)(torch.randn(2, 8))
    modules = {r.module for r in be.report.nodes if r.op == "linear"}
    assert "encoder.layers.0.fc1" in modules and "head" in modules and "fc1" not in modules, modules
    assert not any("kept to module" in note for g in be.report.graphs for note in g.report.notes)
