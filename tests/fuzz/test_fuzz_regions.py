"""Property-based fuzzing of the model's own regions: random graphs with grad-mode and autocast blocks.

Random programs from :mod:`fuzz.strategies` get random steps wrapped in
``torch.no_grad()``, ``torch.enable_grad()``, ``torch.autocast("cpu",
enabled=False)`` or ``torch.autocast("cpu", dtype=bf16/fp16)`` blocks
(nested or disjoint).  Converted at O1 (with and without example inputs),
each must, like the model run eagerly under ``torch.autocast``:

- run every GEMM in the same dtype, in order (the regions' rules);
- give gradients to the same parameters (the grad-mode regions);
- stay within O1's tolerance of the model run eagerly without autocast
  (where autocast's own outputs are finite).

Programs that eager autocast itself cannot run (an fp32 Linear fed a low
value inside a disabled region) are not drawn.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import amp_fx
from fuzz.invariants import LOW_DTYPES, DispatchProbe, tolerance
from fuzz.strategies import OPS, FuzzModel, build_model, make_inputs, programs
from fuzz.test_fuzz_convert import _BASE

KINDS = ("no_grad", "enable_grad", "autocast_off", "autocast_bf16", "autocast_fp16")
_OPS = sorted(name for name, op in OPS.items() if not op.inplace)  # in-place writes under no_grad: eager's own rules


def _context(kind: str):
    if kind == "no_grad":
        return torch.no_grad()
    if kind == "enable_grad":
        return torch.enable_grad()
    if kind == "autocast_off":
        return torch.autocast("cpu", enabled=False)
    return torch.autocast("cpu", dtype=torch.bfloat16 if kind == "autocast_bf16" else torch.float16)


def _run_with_regions(self, inputs):
    """FuzzModel.run with ``self.regions`` ((start, end, kind): steps start..end-1 inside the block)."""
    values = list(inputs)
    open_blocks: list = []  # (end, ExitStack), innermost last
    for index, step in enumerate(self.program.steps):
        while open_blocks and open_blocks[-1][0] == index:
            open_blocks.pop()[1].close()
        for start, end, kind in self.regions:
            if start == index:
                block = contextlib.ExitStack()
                block.enter_context(_context(kind))
                open_blocks.append((end, block))
        op = OPS[step.op]
        args = [values[a] for a in step.args]
        if step.upcast:
            args[0] = args[0].float()
        values.append(op.fn(self, f"s{index}", *args))
    while open_blocks:
        open_blocks.pop()[1].close()
    outs = tuple(values[o] for o in self.program.outputs)
    return outs[0] if len(outs) == 1 else outs


_CLASSES: dict[type, type] = {}


def build_region_model(program, regions) -> FuzzModel:
    """The strategies' model for ``program``, running its steps inside ``regions``."""
    model = build_model(program)
    base = type(model)
    if base not in _CLASSES:
        _CLASSES[base] = type(f"Regions{base.__name__}", (base,), {"run": _run_with_regions})
    model.__class__ = _CLASSES[base]
    model.regions = tuple(regions)
    return model


def _nested_or_disjoint(a, b) -> bool:
    (s1, e1, _), (s2, e2, _) = a, b
    return e1 <= s2 or e2 <= s1 or (s1 <= s2 and e2 <= e1) or (s2 <= s1 and e1 <= e2)


@st.composite
def region_programs(draw):
    program = draw(programs(max_steps=6, ops=_OPS))
    n = len(program.steps)
    regions: list = []
    for _ in range(draw(st.integers(1, 3))):
        start = draw(st.integers(0, n - 1))
        region = (start, draw(st.integers(start + 1, n)), draw(st.sampled_from(KINDS)))
        if all(_nested_or_disjoint(region, other) and region[:2] != other[:2] for other in regions):
            regions.append(region)
    # outer blocks open first: by start, then longest
    return program, tuple(sorted(regions, key=lambda r: (r[0], -r[1])))


def _leaves(out):
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _run(fn, model, program):
    """(outputs, GEMM result dtypes in order, names of the parameters that got a gradient)."""
    model.zero_grad(set_to_none=True)
    with DispatchProbe() as probe:
        out = fn(*make_inputs(program))
    leaves = _leaves(out)
    trained = [t for t in leaves if t.is_floating_point() and t.requires_grad]
    if trained:
        sum((t.double() * 0.5).sum() for t in trained).backward()
    grads = {name for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return [t.detach() for t in leaves], probe.gemms, grads


@pytest.mark.slow
@settings(_BASE, max_examples=max(4, _BASE.max_examples // 6))
@given(drawn=region_programs(), dtype=st.sampled_from(LOW_DTYPES), example_inputs=st.booleans())
def test_random_regions_keep_their_meaning(drawn, dtype, example_inputs):
    program, regions = drawn
    model = build_region_model(program, regions)
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with torch.autocast("cpu", dtype=dtype):
                auto, auto_gemms, auto_grads = _run(reference, reference, program)
        except RuntimeError:
            assume(False)  # eager autocast cannot run it either (dtype mismatch inside a region)
        plain, _, _ = _run(reference, reference, program)
        gm = amp_fx.convert(model, "O1", dtype=dtype, example_inputs=make_inputs(program) if example_inputs else None)
        out, gemms, grads = _run(gm, model, program)
    assert gemms == auto_gemms, f"GEMM dtypes {gemms}, eager autocast {auto_gemms} ({regions})"
    assert grads == auto_grads, f"gradients reach {sorted(grads)}, eager autocast {sorted(auto_grads)} ({regions})"
    if not all(torch.isfinite(t).all() for t in auto if t.is_floating_point()):
        return  # the low dtype overflows under autocast too: values are not comparable with fp32
    tol = tolerance("O1", dtype)
    for got, want in zip(out, plain):
        if not want.is_floating_point():
            assert torch.equal(got, want)
            continue
        finite = torch.isfinite(want)
        if finite.any():
            scale = max(1.0, want[finite].abs().max().item())
            assert (got.double() - want.double())[finite].abs().max().item() <= 2 * tol * scale
