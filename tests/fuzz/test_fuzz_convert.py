"""Property-based fuzzing: random modules over every op-table category keep DESIGN.md's invariants.

Two hypothesis profiles are registered here (not in conftest, so other
tests are unaffected) and chosen with ``AMP_FX_FUZZ_PROFILE``:

- ``ci`` (default): derandomized (a fixed seed), no example database, about
  two hundred examples in all, under two minutes on two cores;
- ``long``: random seeds, 2000 examples for the main property (see
  docs/fuzzing.md for how to run it and what to do with a failure).

Every failure the fuzzer found is a plain test in ``test_fuzz_regressions.py``.
"""

from __future__ import annotations

import os
import tempfile
import warnings

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

import amp_fx
from fuzz.invariants import LEVELS, LOW_DTYPES, check_model, reference_run, tolerance
from fuzz.predictions import Recorder, check_predictions
from fuzz.strategies import CATEGORIES, OPS, build_model, make_inputs, programs

# Hypothesis keeps caches (and, on a failure, patches) under its home directory: not in the repository.
set_hypothesis_home_dir(os.path.join(tempfile.gettempdir(), "amp_fx-hypothesis"))
_COMMON = dict(database=None, deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
settings.register_profile("ci", max_examples=180, derandomize=True, **_COMMON)
settings.register_profile("long", max_examples=2000, derandomize=False, **_COMMON)
PROFILE = os.environ.get("AMP_FX_FUZZ_PROFILE", "ci")
if PROFILE not in ("ci", "long"):
    raise ValueError(f"AMP_FX_FUZZ_PROFILE={PROFILE!r}: use 'ci' (default) or 'long'")
_BASE = settings.get_profile(PROFILE)


def _share(fraction: float) -> settings:
    """The profile, with ``fraction`` of its examples (the main property takes them all)."""
    return settings(_BASE, max_examples=max(4, int(_BASE.max_examples * fraction)))


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def test_the_vocabulary_covers_every_table_category():
    """The generator can reach GEMMs, convs, norms, softmax, reductions, pointwise, promote, views,
    integer indexing, bool masks, in-place ops and user casts."""
    assert set(CATEGORIES) >= {"low", "fp32", "follow", "promote", "cast", "view", "index", "int", "bool", "inplace"}
    for name in ("linear", "matmul2", "bmm", "conv1d", "layer_norm", "batch_norm", "group_norm", "softmax",
                 "log_softmax", "sum", "mean", "logsumexp", "exp", "addcmul", "atan2", "cat", "stack",
                 "relu_", "add_", "mul_", "exp_", "embedding", "index", "masked_fill", "where", "matmul_shared_t"):
        assert name in OPS, name


@pytest.mark.slow
@_share(1.0)
@given(program=programs(), dtype=st.sampled_from(LOW_DTYPES), example_inputs=st.booleans())
def test_random_modules_keep_the_invariants_at_every_level(program, dtype, example_inputs):
    """O0-O3 in the drawn low dtype, with or without example inputs (see fuzz/invariants.py)."""
    check_model(lambda: build_model(program), lambda: make_inputs(program), dtypes=(dtype,), example_inputs=example_inputs)


@_share(0.15)
@given(program=programs(max_steps=6), input_dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       dtype=st.sampled_from(LOW_DTYPES))
def test_what_runs_under_autocast_converts_and_the_analysis_tells_the_truth(program, input_dtype, dtype):
    """Floating inputs arrive fp32, bf16 or fp16.  If the model runs under torch.autocast, convert() with those
    example inputs runs too, returns what autocast returns (floating or not, same shapes), and every dtype and
    shape the analysis predicted is what the converted module produced, node by node."""
    model = build_model(program)

    def inputs():
        return tuple(t.to(input_dtype) if t.is_floating_point() else t for t in make_inputs(program))

    try:
        with torch.autocast("cpu", dtype=dtype):
            eager = torch.utils._pytree.tree_leaves(model(*inputs()))
    except RuntimeError:
        assume(False)  # illegal under autocast too: nothing to promise
    gm = amp_fx.convert(model, "O1", dtype=dtype, example_inputs=inputs(), cast_model_outputs=False)
    recorder = Recorder(gm)
    out = torch.utils._pytree.tree_leaves(recorder.run(*inputs()))
    assert [(t.is_floating_point(), t.shape) for t in out] == [(t.is_floating_point(), t.shape) for t in eager]
    check_predictions(gm, recorder, exact=True)


# In-place ops are left out here: Dynamo functionalises them on its own terms,
# and convert() covers them above.
_BACKEND_OPS = [name for name, op in OPS.items() if not op.inplace]


@pytest.mark.slow
@_share(0.16)
@given(program=programs(max_steps=6, ops=_BACKEND_OPS), dtype=st.sampled_from(LOW_DTYPES))
def test_the_backend_agrees_with_convert(program, dtype):
    """torch.compile(backend=amp_fx.backend(level="O1", inner="aot_eager")): outputs in convert's dtypes,
    within tolerance of fp32, and gradients reach every parameter."""
    model = build_model(program)
    ref = reference_run(model, lambda: make_inputs(program))
    converted = amp_fx.convert(model, "O1", dtype=dtype, example_inputs=make_inputs(program))
    expected = [t.dtype for t in torch.utils._pytree.tree_leaves(converted(*make_inputs(program)))]
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend=amp_fx.backend(level="O1", dtype=dtype, inner="aot_eager"), fullgraph=True)
        out = compiled(*make_inputs(program))
        leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        assert [t.dtype for t in leaves] == expected
        for got, want in zip(leaves, ref.outputs):
            if want.is_floating_point():
                scale = max(1.0, want.abs().max().item())
                assert (got.double() - want.double()).abs().max().item() <= tolerance("O1", dtype) * scale
            else:
                assert torch.equal(got, want)
        if ref.grads:
            model.zero_grad(set_to_none=True)
            sum((t.double() * 0.5).sum() for t in leaves if t.is_floating_point() and t.requires_grad).backward()
            for name in ref.grads:
                assert model.get_parameter(name).grad is not None, f"no gradient reaches {name} through the backend"
    finally:
        torch._dynamo.reset()


def test_the_ci_profile_is_fixed_and_writes_no_database():
    profile = settings.get_profile("ci")
    assert profile.derandomize and profile.database is None and profile.deadline is None
    assert settings.get_profile("long").max_examples >= 2000
    assert set(LEVELS) == {"O0", "O1", "O2", "O3"}
