"""Policy overrides: by module name (exact, glob, regex), module type and op, with DESIGN.md's precedence."""

import pytest
import torch
import torch.nn as nn

import amp_fx
import zoo


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
        self.decoder = nn.ModuleDict({"body": nn.Linear(8, 8), "head": nn.Linear(8, 4)})

    def forward(self, x):
        h = self.decoder["body"](self.encoder(x))
        return self.decoder["head"](h).softmax(-1)


def _decisions(gm, op="linear"):
    return {r.module: r.decision for r in gm.amp_report.nodes if r.op == op and not r.inserted}


def test_pinning_a_submodule_pins_every_op_inside_it():
    gm = amp_fx.convert(Net(), "O1", policy={"module:decoder.head": "fp32"})
    assert _decisions(gm) == {"encoder.0": "low", "encoder.2": "low", "decoder.body": "low", "decoder.head": "fp32"}
    builder = amp_fx.convert(Net(), "O1", policy=amp_fx.Policy().set_module_name("encoder", "fp32"))
    assert _decisions(builder)["encoder.0"] == _decisions(builder)["encoder.2"] == "fp32"


def test_glob_and_regex_module_names():
    gm = amp_fx.convert(Net(), "O1", policy={"module:encoder.*": "fp32"})
    assert _decisions(gm)["encoder.2"] == "fp32" and _decisions(gm)["decoder.body"] == "low"
    gm = amp_fx.convert(Net(), "O1", policy={r"module_re:^decoder\.(body|head)$": "fp32"})
    assert _decisions(gm)["decoder.head"] == "fp32" and _decisions(gm)["encoder.0"] == "low"


def test_force_an_op_low_and_add_a_custom_op():
    gm = amp_fx.convert(Net(), "O1", policy={"op:softmax": "low"}, cast_model_outputs=False)
    assert _decisions(gm, "softmax") == {"": "low"}
    assert gm(torch.randn(2, 8)).dtype == torch.bfloat16

    class Custom(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4))

        def forward(self, x):
            return my_gemm(x, self.w)

    gm = amp_fx.convert(Custom(), "O1", policy={my_gemm: "low"}, cast_model_outputs=False)
    assert gm(torch.randn(2, 4)).dtype == torch.bfloat16
    record = next(r for r in gm.amp_report.nodes if r.op == "my_gemm")
    assert record.rule == "policy" and "my_gemm" in record.reason


def my_gemm(a, b):
    """A user function fx keeps as one node (wrapped below)."""
    return a @ b


torch.fx.wrap("my_gemm")


def test_module_type_override():
    gm = amp_fx.convert(zoo.SDPABlock(), "O1", policy={nn.LayerNorm: "low"})
    assert set(_decisions(gm, "layer_norm").values()) == {"low"}


def test_precedence_name_over_type_over_op():
    policy = amp_fx.Policy().set_op("linear", "fp32").set_module_type(nn.Linear, "low").set_module_name("decoder.head", "fp32")
    gm = amp_fx.convert(Net(), "O1", policy=policy)
    decisions = _decisions(gm)
    assert decisions["decoder.head"] == "fp32"  # name beats type
    assert decisions["encoder.0"] == "low"  # type beats op
    exact_first = amp_fx.Policy().set_module_name("decoder.*", "low").set_module_name("decoder.head", "fp32")
    assert _decisions(amp_fx.convert(Net(), "O1", policy=exact_first))["decoder.head"] == "fp32"


def test_unknown_module_name_is_an_error_with_close_matches():
    with pytest.raises(ValueError, match="Did you mean 'decoder.head'"):
        amp_fx.convert(Net(), "O1", policy={"module:decoder.haed": "fp32"})
    with pytest.raises(ValueError, match="matches no module"):
        amp_fx.convert(Net(), "O1", policy={"module:nothing.*": "fp32"})


@pytest.mark.parametrize("policy, message", [
    ({"layer:x": "fp32"}, "unknown policy key"),
    ({"softmax": "fp32"}, "unknown policy key"),
    ({"op:softmax": "half"}, "unknown policy decision"),
    ([("op:softmax", "low")], "policy must be"),
])
def test_bad_policies_are_refused(policy, message):
    with pytest.raises((ValueError, TypeError), match=message):
        amp_fx.convert(Net(), "O1", policy=policy)


class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.dec = nn.ModuleDict({"body": nn.Linear(8, 8), "head": nn.Linear(8, 4)})

    def forward(self, x):
        return self.dec["head"](self.dec["body"](x))


@pytest.mark.parametrize("order", ["outer first", "inner first"])
def test_the_most_specific_module_name_wins_whatever_the_order(order):
    """QConfigMapping's rule: dec.head's own rule beats dec's, registered before or after it."""
    rules = [("dec", "fp32"), ("dec.head", "low")]
    policy = amp_fx.Policy()
    for name, decision in rules if order == "outer first" else rules[::-1]:
        policy.set_module_name(name, decision)
    gm = amp_fx.convert(Nested(), "O1", policy=policy)
    assert _decisions(gm) == {"dec.body": "fp32", "dec.head": "low"}


def test_an_exact_name_beats_a_glob_on_the_same_module_and_an_inner_glob_beats_an_outer_name():
    gm = amp_fx.convert(Nested(), "O1", policy={"module:dec.*": "fp32", "module:dec.head": "low"})
    assert _decisions(gm) == {"dec.body": "fp32", "dec.head": "low"}
    inner_glob = amp_fx.convert(Nested(), "O1", policy={"module:dec": "low", "module:*.head": "fp32"})
    assert _decisions(inner_glob) == {"dec.body": "low", "dec.head": "fp32"}


def test_setting_a_key_again_overrides_it():
    policy = amp_fx.Policy().set_module_name("dec.head", "fp32").set_module_name("dec.head", "low").set_op("linear", "fp32")
    policy.set_op("linear", "follow")
    assert [(r.key, r.decision) for r in policy.rules] == [("dec.head", "low"), ("linear", "follow")]
    gm = amp_fx.convert(Nested(), "O1", policy=policy)
    assert _decisions(gm) == {"dec.body": "follow", "dec.head": "low"}


def test_a_misspelt_op_name_is_refused_with_close_matches():
    with pytest.raises(ValueError, match=r"op 'sofmax'.*Did you mean 'softmax'"):
        amp_fx.convert(Net(), "O1", policy={"op:sofmax": "low"})
    # A known op the model does not call is fine: a policy may be shared between models.
    amp_fx.convert(Nested(), "O1", policy={"op:softmax": "low"})


def test_a_regex_that_matches_nothing_or_does_not_compile_is_refused():
    with pytest.raises(ValueError, match="regex 'fc_1' matches no module"):
        amp_fx.convert(Nested(), "O1", policy={"module_re:fc_1": "fp32"})
    with pytest.raises(ValueError, match=r"'module_re:dec\[' is not a valid regular expression"):
        amp_fx.convert(Nested(), "O1", policy={"module_re:dec[": "fp32"})
    with pytest.raises(TypeError, match=r"leaf_modules=\['dec'\]"):
        amp_fx.convert(Nested(), "O1", leaf_modules="dec")


@pytest.mark.parametrize("spelling", ["nn.LayerNorm", "torch.nn.LayerNorm", "F.layer_norm", "torch.layer_norm",
                                      "aten.native_layer_norm.default"])
def test_an_op_rule_takes_every_spelling_the_cli_resolves(spelling):
    """``policy={"op:nn.LayerNorm": ...}`` decides the op nn.LayerNorm runs, as ``python -m amp_fx tables --op`` reads it."""
    from amp_fx.ir.op_keys import op_name_of  # what the CLI resolves the spelling to

    assert op_name_of(spelling) == "layer_norm"
    gm = amp_fx.convert(zoo.SDPABlock(), "O1", policy={f"op:{spelling}": "low"})
    assert set(_decisions(gm, "layer_norm").values()) == {"low"}  # fp32 by the tables
    record = next(r for r in gm.amp_report.nodes if r.op == "layer_norm" and not r.inserted)
    assert record.rule == "policy" and "'layer_norm'" in record.reason


def test_an_op_name_amp_fx_does_not_know_is_kept_as_written():
    """A user module's or custom Function's own name is its canonical op: no spelling rule rewrites it."""
    policy = amp_fx.Policy().set_op("pkg.blocks.Attention", "fp32").set_op("RoundST", "low")
    assert [rule.key for rule in policy.rules] == ["pkg.blocks.Attention", "RoundST"]
    with pytest.raises(amp_fx.AmpError, match="Did you mean 'softmax'"):
        amp_fx.convert(Net(), "O1", policy={"op:F.sofmax": "fp32"})


@pytest.mark.parametrize("decision", ["low", "fp8"])
def test_a_lowering_rule_at_o0_is_refused_not_ignored(decision):
    """O0 decides nothing, so a rule asking for low precision would silently do nothing: refused, naming the fix."""
    with pytest.raises(amp_fx.AmpValueError, match=r"level O0 .* would do nothing: policy op 'linear' -> "
                                                    + decision + r".*Use level 'O1'"):
        amp_fx.convert(Net(), "O0", policy={"op:linear": decision})
    with pytest.raises(amp_fx.AmpValueError, match=r"policy module 'encoder' -> " + decision):
        amp_fx.backend(level="O0", inner="aot_eager", policy={"module:encoder": decision})


def test_rules_that_hold_at_o0_are_accepted_and_change_nothing():
    model = Net()
    x = torch.randn(2, 8)
    gm = amp_fx.convert(model, "O0", policy={"module:decoder.head": "fp32", "op:softmax": "promote"})
    assert torch.equal(gm(x), model(x))
