"""The check() helper every pass test uses (in the spirit of torch's test_cse_pass.py).

``check`` runs one pass on a prepared graph and asserts: the node-count delta
is what the test expects, ``modified`` is honest (True exactly when the code,
or the dtype or shape of a parameter or buffer, changed), the graph lints, a
second run changes nothing, and the outputs stay within tolerance of the fp32
model.

Analyses (propagate_meta, assign_precision) change no code: for them the
thing checked is ``node.meta``.  ``meta_keys`` asks that every node carries
those keys after the pass and that a second run leaves their values as they
were.  The gradients of a fixed loss w.r.t. the floating inputs and the
parameters (matched by name) are compared with the fp32 model's too
(``grads=False`` compares outputs only).  ``finish=True`` runs the rest of the
pipeline before comparing, for a pass whose result alone does not run
(cast_params' low weights need insert_casts' casts).
"""

from __future__ import annotations

import copy
from typing import Callable, Optional, Sequence

import torch
import torch.fx as fx

from amp_fx.ir.config import make_config
from amp_fx.ir.pass_manager import PassContext, run_passes
from amp_fx.passes.analyse_dtypes import analyse_dtypes
from amp_fx.passes.assign_precision import assign_precision
from amp_fx.passes.cache_weight_casts import cache_weight_casts
from amp_fx.passes.cast_params import cast_params
from amp_fx.passes.dedupe_casts import dedupe_casts
from amp_fx.passes.fold_casts import fold_casts
from amp_fx.passes.fuse_precision import fuse_precision
from amp_fx.passes.honour_autocast_regions import honour_autocast_regions
from amp_fx.passes.insert_casts import insert_casts
from amp_fx.passes.propagate_meta import propagate_meta
from amp_fx.ir.policy import Policy
from amp_fx.frontend.tracing import trace_model

# build_pipeline's order, less the optional minimize_casts and pad_gemm (their tests convert whole models).
PIPELINE = [propagate_meta, assign_precision, honour_autocast_regions, cast_params, analyse_dtypes, fuse_precision,
            insert_casts, dedupe_casts, fold_casts, cache_weight_casts]


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
    # verify: the runner also compares each pass's whole graph and paint before and after (amp_fx/ir/pass_checks.py).
    ctx = PassContext(config=config, policy=Policy.coerce(policy), example_inputs=example_inputs, route=route, verify=True)
    before = PIPELINE[: PIPELINE.index(upto)]
    if not config.cast_params:
        before = [p for p in before if p is not cast_params]
    return run_passes(gm, ctx, before), ctx


def run_rest(gm: fx.GraphModule, ctx: PassContext, after: Callable) -> fx.GraphModule:
    """Run the pipeline's passes that follow ``after`` (as ``prepare`` runs those before it)."""
    rest = PIPELINE[PIPELINE.index(after) + 1:]
    return run_passes(gm, ctx, [p for p in rest if p is not cast_params or ctx.config.cast_params])


def _state(gm: fx.GraphModule) -> tuple[str, dict]:
    """What a pass may change: the code, and each parameter's and buffer's dtype and shape."""
    tensors = list(gm.named_parameters()) + list(gm.named_buffers())
    return gm.code, {name: (t.dtype, tuple(t.shape)) for name, t in tensors}


def _meta_of(gm: fx.GraphModule, keys: Sequence[str]) -> dict:
    """{node name: {key: value}} for ``keys``, asserting every node carries them."""
    found = {}
    for node in gm.graph.nodes:
        missing = [k for k in keys if k not in node.meta]
        assert not missing, f"node {node.name!r} lacks {missing}"
        found[node.name] = {k: node.meta[k] for k in keys}
    return found


def _loss_grads(module: torch.nn.Module, inputs: tuple) -> tuple[list, dict]:
    """Output leaves of ``module`` on copies of ``inputs``, and d(fixed loss)/d(floating inputs and parameters)."""
    inputs = tuple(t.detach().clone().requires_grad_(True) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                   for t in inputs)
    out = [t for t in torch.utils._pytree.tree_leaves(module(*inputs)) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    # A fixed, sign-mixing weighting: the sum alone would hide swapped or mis-scaled elements.
    loss = sum((t.float() * torch.linspace(-1, 1, t.numel()).view(t.shape)).sum() for t in out)
    wrt = {f"input{i}": t for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.requires_grad}
    wrt.update((name, p) for name, p in module.named_parameters() if p.requires_grad)
    if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
        return out, {}
    # autograd.grad, not backward: at O1 the graph module shares the model's parameters, so no .grad is written.
    grads = torch.autograd.grad(loss, list(wrt.values()), allow_unused=True)
    return out, dict(zip(wrt, grads))


def _assert_close(got: torch.Tensor, want: torch.Tensor, atol: float, what: str) -> None:
    assert got.shape == want.shape, (what, got.shape, want.shape)
    error = (got.float() - want.float()).abs().max().item()
    assert error <= atol * max(1.0, want.float().abs().max().item()), f"{what}: max error {error}"


def assert_matches(gm: torch.nn.Module, model: torch.nn.Module, inputs: tuple, *, atol: float = 0.05, grads: bool = True) -> None:
    """Assert ``gm``'s outputs, and with ``grads`` its gradients (inputs, parameters by name), are within ``atol`` of ``model``'s."""
    if grads:
        out, got = _loss_grads(gm, inputs)
        ref, want = _loss_grads(model, inputs)
        for name, grad in want.items():
            if grad is not None:
                assert got.get(name) is not None, f"no gradient reaches {name}"
                _assert_close(got[name], grad, atol, f"gradient of {name}")
    else:
        out, ref = torch.utils._pytree.tree_leaves(gm(*inputs)), torch.utils._pytree.tree_leaves(model(*inputs))
    for a, b in zip(out, ref):
        if isinstance(b, torch.Tensor) and b.is_floating_point():
            _assert_close(a, b, atol, "output")


def check(pass_fn: Callable, model: torch.nn.Module, inputs: tuple, *, delta: Optional[int] = None,
          expect_modified: Optional[bool] = None, atol: float = 0.05, level: str = "O1",
          meta_keys: Sequence[str] = (), grads: bool = True, finish: bool = False, **prepare_kwargs) -> fx.GraphModule:
    """Run ``pass_fn`` once and twice and assert the pass contract (see module docstring)."""
    gm, ctx = prepare(model, pass_fn, level=level, **prepare_kwargs)
    nodes_before, state_before = len(gm.graph.nodes), _state(gm)
    result = pass_fn(gm, ctx)
    gm = result.graph_module
    gm.graph.lint()
    gm.recompile()
    changed = _state(gm) != state_before
    assert result.modified == changed, f"{pass_fn.__name__} reported modified={result.modified} but changed={changed}"
    if expect_modified is not None:
        assert result.modified == expect_modified
    if delta is not None:
        assert len(gm.graph.nodes) - nodes_before == delta, (len(gm.graph.nodes) - nodes_before, gm.code)
    painted = _meta_of(gm, meta_keys)
    again = pass_fn(gm, ctx)
    assert not again.modified, f"second {pass_fn.__name__} run changed the graph"
    assert _meta_of(gm, meta_keys) == painted, f"second {pass_fn.__name__} run changed node.meta"
    if finish:
        gm = run_rest(gm, ctx, pass_fn)
    assert_matches(gm, model, inputs, atol=atol, grads=grads)
    return gm
