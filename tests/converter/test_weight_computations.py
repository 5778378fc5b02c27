"""Legacy ``torch.nn.utils.weight_norm``: refused at O2/O3 naming the parametrizations form, converted at O1.

Before, O2/O3 crashed inside ``copy.deepcopy`` with torch's "Only Tensors
created explicitly by the user" error (after a forward the legacy weight is a
non-leaf tensor its pre-hook computed).
"""

import pytest
import torch
import torch.nn as nn
from torch.nn.utils import parametrizations

import amp_fx
from amp_fx.errors import AmpError, UnsupportedConstructError


def _legacy():
    torch.manual_seed(0)
    with pytest.warns(FutureWarning):  # torch deprecates the legacy form
        return nn.Sequential(torch.nn.utils.weight_norm(nn.Linear(8, 8)), nn.ReLU(), nn.Linear(8, 4))


@pytest.mark.parametrize("level", ["O2", "O3"])
@pytest.mark.parametrize("after_forward", [False, True])
def test_legacy_weight_norm_is_refused_at_o2_and_o3_naming_the_parametrizations_form(level, after_forward):
    model = _legacy()
    if after_forward:
        model(torch.randn(2, 8))  # the legacy weight is now a non-leaf tensor
    with pytest.raises(UnsupportedConstructError) as caught:
        amp_fx.convert(model, level=level, dtype=torch.bfloat16)
    message = str(caught.value)
    assert isinstance(caught.value, AmpError)
    assert "torch.nn.utils.parametrizations.weight_norm" in message and "0.weight" in message and "O1" in message


def test_initialize_at_o2_refuses_it_too():
    model = _legacy()
    with pytest.raises(UnsupportedConstructError, match="parametrizations.weight_norm"):
        amp_fx.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2")


def test_legacy_weight_norm_converts_at_o1_with_gradients_to_g_and_v():
    model, x = _legacy(), torch.randn(4, 8)
    gm = amp_fx.convert(model, level="O1", dtype=torch.bfloat16)
    assert sorted(gm.state_dict()) == sorted(model.state_dict()) and "0.weight_g" in gm.state_dict()
    gm(x).sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with torch.autocast("cpu", torch.bfloat16):
        model(x).float().sum().backward()
    for name, p in model.named_parameters():
        assert got[name] is not None and got[name].dtype == torch.float32, name
        torch.testing.assert_close(got[name], p.grad, rtol=2 ** -6, atol=2 ** -8, msg=name)


def test_parametrizations_weight_norm_trains_at_o2():
    torch.manual_seed(0)
    model = nn.Sequential(parametrizations.weight_norm(nn.Linear(8, 8)), nn.ReLU(), nn.Linear(8, 4))
    reference = nn.Sequential(parametrizations.weight_norm(nn.Linear(8, 8)), nn.ReLU(), nn.Linear(8, 4))
    reference.load_state_dict(model.state_dict())
    x = torch.randn(4, 8)
    before = {name: value.clone() for name, value in reference.state_dict().items()}
    gm, opt = amp_fx.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2")
    loss = gm(x).float().sum()
    with amp_fx.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    reference(x).sum().backward()
    ref_opt.step()
    state = gm.state_dict()
    assert sorted(state) == sorted(reference.state_dict())
    assert "0.parametrizations.weight.original0" in state and "0.parametrizations.weight.original1" in state
    for name, want in reference.state_dict().items():
        assert state[name].dtype == torch.float32, name  # O2 checkpoints hold fp32 masters
        torch.testing.assert_close(state[name], want, rtol=2 ** -6, atol=2 ** -7, msg=name)
    moved = [name for name in before if (state[name] - before[name]).abs().max() > 2 ** -5]
    assert "0.parametrizations.weight.original1" in moved and "2.weight" in moved, "the step changed g, v and W"
