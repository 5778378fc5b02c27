"""Indexing a converted Sequential raises an AmpTypeError naming what works, not a bare TypeError (issue 36, item 8).

Before: ``gm[0]`` raised Python's own "'Sequential' object is not subscriptable".
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import amp_fx


def _sequential():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("key", [0, 1, slice(0, 2), "0"])
def test_indexing_a_converted_sequential_names_the_ways_that_work(level, key):
    model = _sequential()
    gm = amp_fx.convert(model, level, dtype=torch.bfloat16)
    with pytest.raises(amp_fx.AmpTypeError) as raised:
        gm[key]
    text = str(raised.value)
    assert isinstance(raised.value, TypeError)  # `except TypeError` keeps catching it
    for named in (f"model[{key!r}]", f"amp_fx.convert(model[{key!r}], level)", "gm.get_submodule(", "Sequential"):
        assert named in text, (named, text)


def test_the_advice_works_and_the_module_stays_a_module():
    model = _sequential()
    gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16)
    assert gm.get_submodule("0").weight is model[0].weight  # O1: the original's layer holds the same parameters
    layer = amp_fx.convert(model[0], "O1", dtype=torch.bfloat16)
    x = torch.randn(3, 4)
    assert layer(x).dtype == torch.float32 and not torch.equal(layer(x), model[0](x))  # converted: a bf16 GEMM
    assert bool(gm)  # no __len__: truthiness unchanged
    with pytest.raises(TypeError, match="not iterable"):  # no iteration through __getitem__
        iter(gm)
    x = torch.randn(5, 4)
    assert torch.allclose(gm(x), model(x), rtol=2.0**-6, atol=2.0**-6)  # and it still runs
