"""Past Dynamo's recompile limit a frame runs eagerly: the amp_fx backend warns, naming the fixes (issue 36, item 6).

Dynamo checks the limit before any backend or compile callback runs and says so in one log line only; the
frame then runs eagerly, uncompiled, with amp_fx's eager decisions (issue 40).  The tests set the limit to 1 (restored by config.patch), so the second
input shape is one compile too many.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch._dynamo
import torch.nn as nn

import amp_fx
RecompileLimitWarning = amp_fx.RecompileLimitWarning  # public name


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _compiled(model, **options):
    return torch.compile(model, backend=amp_fx.backend("O1", dtype=torch.bfloat16, inner="aot_eager"), **options)


def _inputs():
    return torch.randn(4, 8), torch.randn(6, 8)


def test_a_frame_past_the_recompile_limit_warns_and_runs_eagerly_with_decisions():
    model = _model()
    compiled = _compiled(model, dynamic=False)  # each new batch size is a recompile
    first, second = _inputs()
    with torch._dynamo.config.patch(recompile_limit=1), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        converted = compiled(first)
        fallen_back = compiled(second)
        compiled(second)  # the frame stays at the limit: one warning, not one per call
    limits = [w for w in caught if issubclass(w.category, RecompileLimitWarning)]
    assert len(limits) == 1, [str(w.message) for w in caught]
    text = str(limits[0].message)
    for fix in ("torch._dynamo.config.recompile_limit", "cache_size_limit", "dynamic=True", "mark_dynamic"):
        assert fix in text, (fix, text)
    assert "runs eagerly, uncompiled" in text and "forward" in text
    assert limits[0].filename == __file__  # pointed at the call of the compiled model
    assert issubclass(RecompileLimitWarning, amp_fx.AmpWarning)
    with torch.no_grad():
        with torch.autocast("cpu", torch.bfloat16):
            # What the warning says: the frame ran eagerly, its GEMMs low as the tables (and autocast) decide.
            assert torch.equal(fallen_back, model(second))
        assert amp_fx.coverage(compiled, second).low_share == 1.0
        reference = model(first)
    assert not torch.equal(converted, reference)  # the first call was converted (bf16 GEMMs)
    assert (converted - reference).abs().max() <= 2.0**-6 * reference.abs().max()


def test_one_filter_raises_it():
    compiled = _compiled(_model(), dynamic=False)
    first, second = _inputs()
    with torch._dynamo.config.patch(recompile_limit=1), warnings.catch_warnings():
        warnings.simplefilter("error", amp_fx.AmpWarning)
        compiled(first)
        with pytest.raises(Exception) as raised:
            compiled(second)
    chain, error = [], raised.value
    while error is not None:
        chain.append(error)
        error = error.__cause__ or error.__context__
    assert any(isinstance(e, RecompileLimitWarning) for e in chain), chain


def test_dynamic_true_or_a_higher_limit_gives_no_warning():
    """The fixes it names work: no recompile past the limit, so no warning, and the second shape is converted."""
    model = _model()
    first, second = _inputs()
    for options, limit in (({"dynamic": True}, 1), ({"dynamic": False}, 2)):
        torch._dynamo.reset()
        compiled = _compiled(model, **options)
        with torch._dynamo.config.patch(recompile_limit=limit), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compiled(first)
            out = compiled(second)
        assert not [w for w in caught if issubclass(w.category, RecompileLimitWarning)], options
        with torch.no_grad():
            assert not torch.equal(out, model(second))  # converted, not the fp32 fallback


def test_a_plain_backend_past_the_limit_gets_no_amp_fx_warning():
    """Only frames compiled with an amp_fx backend: torch's own backends keep torch's log line alone."""
    compiled = torch.compile(_model(), backend="aot_eager", dynamic=False)
    first, second = _inputs()
    with torch._dynamo.config.patch(recompile_limit=1), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(first)
        compiled(second)
    assert not [w for w in caught if issubclass(w.category, amp_fx.AmpWarning)]
