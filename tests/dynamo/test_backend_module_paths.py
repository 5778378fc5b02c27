"""Backend policies by module path hold however the compiled function names its model (issue 12, point 4)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import amp_fx


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


class OddSelf(Net):
    """``forward(s, x)``: the module argument is not called ``self``."""

    def forward(s, x):  # noqa: N805 - the point of the test
        return s.head(torch.relu(s.body(x)))


model = Net()  # a module global, read by `_global_step`


def _global_step(x):
    return model(x)


def _step(m, x):
    return m(x)


def _closure_over(net):
    def step(x):
        return net(x)

    return step


class Trainer:
    """Not a module: holds the model and compiles a method."""

    def __init__(self, net):
        self.net = net

    def step(self, x):
        return self.net(x)


STYLES = {
    "forward(self)": lambda net: (torch.compile(net, backend=_BE()), ()),
    "step(m, x)": lambda net: (torch.compile(_step, backend=_BE()), (net,)),
    "global model": lambda net: (torch.compile(_global_step, backend=_BE()), ()),
    "closure": lambda net: (torch.compile(_closure_over(net), backend=_BE()), ()),
    "forward(s, x)": lambda net: (torch.compile(net, backend=_BE()), ()),
    "trainer method": lambda net: (torch.compile(Trainer(net).step, backend=_BE()), ()),
}


def _BE():
    return amp_fx.backend(policy={"module:head": "fp32"}, dtype=torch.bfloat16, inner="aot_eager")


@pytest.mark.parametrize("style", list(STYLES))
def test_module_policy_applies_whatever_the_argument_is_called(style):
    """{"module:head": "fp32"} pins the head GEMM for every calling style; the body GEMM still runs low."""
    global model
    torch.manual_seed(0)
    net = OddSelf() if style == "forward(s, x)" else Net()
    model = net
    reference = copy.deepcopy(net)
    compiled, leading = STYLES[style](net)
    x = torch.randn(8, 16)
    out = compiled(*leading, x)
    report = amp_fx.last_report()
    decisions = {r.module: r.decision for r in report.nodes if r.op == "linear"}
    assert decisions == {"body": "low", "head": "fp32"}, decisions
    assert out.dtype == torch.float32  # without the rule the head would return bfloat16
    expected = reference(x)
    torch.testing.assert_close(out, expected, atol=3e-2, rtol=3e-2)
    out.square().sum().backward()
    expected.square().sum().backward()
    for (name, p), q in zip(net.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=5e-2, rtol=5e-2, msg=name)
    # weight casts are named from the same roots: the body's weight is cast, the head's is not
    cast = {r.reason.split("inserted: ")[-1].split(" to ")[0] for r in report.nodes if r.inserted and "weight cast" in r.reason}
    assert cast == {"body.weight", "body.bias"}, cast


def test_registered_name_gives_each_compiled_model_its_own_report():
    """backend="amp_fx" without options: two models compiled in turn keep separate reports (no frame inspection)."""
    first, second = Net(), OddSelf()  # two classes: Dynamo reuses one class's code for equal settings
    x = torch.randn(2, 16)
    torch.compile(first, backend="amp_fx", options={"inner": "aot_eager"})(x)
    report = amp_fx.last_report()
    torch.compile(second, backend="amp_fx", options={"inner": "aot_eager"})(x)
    assert amp_fx.last_report() is not report and len(report) == 1 and len(amp_fx.last_report()) == 1
