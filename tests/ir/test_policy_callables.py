"""A policy keyed by a callable decides every spelling of its op, as an "op:" name does (it was silently ignored for other spellings)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_fx


class NormThenSoftmax(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.softmax(self.fc(self.norm(x)), -1)


def _decisions(gm):
    return {r.op: (r.decision, r.rule) for r in gm.amp_report.nodes if r.op in ("layer_norm", "softmax")}


@pytest.mark.parametrize("key", [torch.layer_norm, F.layer_norm, torch.ops.aten.layer_norm,
                                 torch.ops.aten.layer_norm.default, "op:torch.layer_norm"],
                         ids=["torch.layer_norm", "F.layer_norm", "aten.layer_norm", "aten.layer_norm.default", "string"])
def test_any_callable_of_layer_norm_decides_nn_LayerNorm(key):
    gm = amp_fx.convert(NormThenSoftmax(), "O1", dtype=torch.bfloat16, policy={key: "low"})
    assert _decisions(gm)["layer_norm"] == ("low", "policy")
    assert _decisions(gm)["softmax"] == ("fp32", "table")  # the rule decides its op only


def test_F_softmax_as_a_key_decides_a_torch_softmax_call():
    gm = amp_fx.convert(NormThenSoftmax(), "O1", dtype=torch.bfloat16, policy={F.softmax: "low"})
    assert _decisions(gm)["softmax"] == ("low", "policy")
    model = NormThenSoftmax()
    x = torch.randn(2, 8)
    # softmax of bf16 logits: within a few bf16 roundings of fp32 (probabilities are at most 1).
    got = amp_fx.convert(model, "O1", dtype=torch.bfloat16, policy={F.softmax: "low"})(x)
    assert (got.float() - model(x)).abs().max() <= 8 * 2 ** -8


@pytest.mark.parametrize("spelling, function", [("torch.fft.fft", torch.fft.fft), ("torch.linalg.solve", torch.linalg.solve),
                                                ("torch.special.erfcx", torch.special.erfcx)])
def test_a_dotted_torch_spelling_names_the_op_its_traced_call_is(spelling, function):
    # The CLI (tables --op) and policy "op:" names resolve through this; "torch.fft.fft" was "fft", no graph's name.
    from amp_fx.ir.op_keys import canonical_op, op_name_of

    graph = torch.fx.Graph()
    node = graph.call_function(function, (graph.placeholder("x"),))
    assert op_name_of(spelling) == canonical_op(node)
