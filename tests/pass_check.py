"""The check() helper every pass test uses (in the spirit of torch's test_cse_pass.py).

``check`` runs one pass on a prepared graph and asserts: the node-count delta
is what the test expects, ``modified`` is honest (True exactly when the code
changed), the graph lints, a second run changes nothing, and the outputs
stay within tolerance of the fp32 model.
"""

from __future__ import annotations

import copy
from typing import Callable, Optional

import torch
import torch.fx as fx

from amp_fx.core.config import make_config
from amp_fx.core.pass_manager import PassContext, run_passes
from amp_fx.passes.analyse_dtypes import analyse_dtypes
from amp_fx.passes.assign_precision import assign_precision
from amp_fx.passes.cast_params import cast_params
from amp_fx.passes.dedupe_casts import dedupe_casts
from amp_fx.passes.fold_casts import fold_casts
from amp_fx.passes.fuse_precision import fuse_precision
from amp_fx.passes.insert_casts import insert_casts
from amp_fx.passes.propagate_meta import propagate_meta
from amp_fx.core.policy import Policy
from amp_fx.frontend.tracing import trace_model

PIPELINE = [propagate_meta, assign_precision, cast_params, analyse_dtypes, fuse_precision, insert_casts, dedupe_casts, fold_casts]


def prepare(model: torch.nn.Module, upto: Callable, level: str = "O1", example_inputs=None, policy=None, **options):
    """Trace ``model`` and run the pipeline up to (not including) the pass ``upto``.

    O1's outputs are kept as the graph computes them unless a test asks
    otherwise: these tests are about the casts inside the graph.
    """
    if level == "O1":
        options.setdefault("cast_model_outputs", False)
    config = make_config(level, **options).with_dtype_for(model)
    source = copy.deepcopy(model) if config.cast_params else model
    gm, route = trace_model(source, example_inputs=example_inputs)
    ctx = PassContext(config=config, policy=Policy.coerce(policy), example_inputs=example_inputs, route=route)
    before = PIPELINE[: PIPELINE.index(upto)]
    if not config.cast_params:
        before = [p for p in before if p is not cast_params]
    return run_passes(gm, ctx, before), ctx


def check(pass_fn: Callable, model: torch.nn.Module, inputs: tuple, *, delta: Optional[int] = None,
          expect_modified: Optional[bool] = None, atol: float = 0.05, level: str = "O1", **prepare_kwargs) -> fx.GraphModule:
    """Run ``pass_fn`` once and twice and assert the pass contract (see module docstring)."""
    gm, ctx = prepare(model, pass_fn, level=level, **prepare_kwargs)
    nodes_before, code_before = len(gm.graph.nodes), gm.code
    result = pass_fn(gm, ctx)
    gm = result.graph_module
    gm.graph.lint()
    gm.recompile()
    changed = gm.code != code_before
    assert result.modified == changed, f"{pass_fn.__name__} reported modified={result.modified} but code changed={changed}"
    if expect_modified is not None:
        assert result.modified == expect_modified
    if delta is not None:
        assert len(gm.graph.nodes) - nodes_before == delta, (len(gm.graph.nodes) - nodes_before, gm.code)
    again = pass_fn(gm, ctx)
    assert not again.modified, f"second {pass_fn.__name__} run changed the graph"
    out, ref = gm(*inputs), model(*inputs)
    for a, b in zip(torch.utils._pytree.tree_leaves(out), torch.utils._pytree.tree_leaves(ref)):
        if isinstance(b, torch.Tensor) and b.is_floating_point():
            assert a.shape == b.shape
            assert (a.float() - b).abs().max() <= atol * max(1.0, b.abs().max().item())
    return gm
