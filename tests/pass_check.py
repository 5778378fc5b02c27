"""The check() helper every pass test uses (in the spirit of torch's test_cse_pass.py).

The pass contract is one function, :func:`assert_contract`.  Given what the
graph was before a pass and what the pass returned, it asserts:

- the node-count delta is what the test expects;
- ``modified`` is honest, as the pass's declared kind means it
  (:mod:`amp_fx.ir.pass_manager`): an analysis and a rewrite report True
  exactly when the code, or the dtype or shape of a parameter or buffer,
  changed; a repaint changes neither, and reports True exactly when the paint
  (each node's decision, reason and rule) changed;
- the graph lints (after each run);
- a second run changes nothing: it reports ``modified=False`` and keeps the
  node count, the code and tensors (and a repaint's paint), and the
  ``meta_keys`` values;
- the outputs, and with ``grads`` the gradients of a fixed loss w.r.t. the
  floating inputs and the parameters (matched by name), stay within ``atol``
  of the fp32 model's (``finish`` first runs what the pass's result needs to
  run: cast_params' low weights need insert_casts' casts).

Analyses (propagate_meta, assign_precision) change no code: for them the
thing checked is ``node.meta``.  ``meta_keys`` asks that every node carries
those keys after the pass and that a second run leaves their values as they
were.

:func:`check` traces a model, runs the pipeline up to the pass
(:func:`prepare`), runs the pass and asserts the contract: what the pass
tests call.  tests/passes/test_minimize_casts.py and test_pad_gemm.py wrap
:func:`run_checked` / :func:`assert_contract` with their pass's own extras
(moved nodes and cast bytes; padded against plain conversions).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx

from amp_fx.converter.pipeline import build_pipeline
from amp_fx.frontend.tracing import trace_model
from amp_fx.ir import meta
from amp_fx.ir.config import make_config
from amp_fx.ir.pass_manager import PassContext, PassResult, run_passes, spec_of
from amp_fx.ir.policy import Policy
from amp_fx.passes.cast_params import cast_params
from amp_fx.passes.minimize_casts import minimize_casts
from amp_fx.passes.pad_gemm import pad_gemm

__all__ = ["PIPELINE", "prepare", "run_rest", "paint", "Snapshot", "Checked", "assert_contract", "run_checked",
           "assert_matches", "check"]

# build_pipeline's order with every optional pass switched on, less minimize_casts and pad_gemm (their
# tests prepare their own graphs or convert whole models): a new pass is listed in build_pipeline only.
_LEFT_OUT = (minimize_casts, pad_gemm)
PIPELINE = [p for p in build_pipeline(make_config("O1", cast_params=True, minimize_casts=True, fuse_precision=True,
                                                  pad_gemm=True, cache_casts=True), own_params=True)
            if p not in _LEFT_OUT]


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


# --------------------------------------------------------------------------
# What a pass may change
# --------------------------------------------------------------------------
def _code_and_tensors(gm: fx.GraphModule) -> tuple[str, dict]:
    """The code (recompiled from the graph), and each parameter's and buffer's dtype and shape."""
    gm.recompile()
    tensors = list(gm.named_parameters()) + list(gm.named_buffers())
    return gm.code, {name: (t.dtype, tuple(t.shape)) for name, t in tensors}


def paint(gm: fx.GraphModule) -> dict[str, tuple]:
    """{node name: (decision, reason, rule)}: what a repaint changes."""
    return {n.name: (meta.DECISION.get(n), meta.REASON.get(n), meta.RULE.get(n)) for n in gm.graph.nodes}


def _meta_of(gm: fx.GraphModule, keys: Sequence[str]) -> dict:
    """{node name: {key: value}} for ``keys``, asserting every node carries them."""
    found = {}
    for node in gm.graph.nodes:
        missing = [k for k in keys if k not in node.meta]
        assert not missing, f"node {node.name!r} lacks {missing}"
        found[node.name] = {k: node.meta[k] for k in keys}
    return found


@dataclass(frozen=True)
class Snapshot:
    """The graph a pass ran on, as the contract compares it: node count, code and tensors, paint."""

    nodes: int
    state: tuple
    paint: dict

    @classmethod
    def of(cls, gm: fx.GraphModule) -> "Snapshot":
        return cls(len(gm.graph.nodes), _code_and_tensors(gm), paint(gm))


# --------------------------------------------------------------------------
# Numerics against the fp32 model
# --------------------------------------------------------------------------
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


# --------------------------------------------------------------------------
# The contract
# --------------------------------------------------------------------------
@dataclass
class Checked:
    """What :func:`assert_contract` saw: the module after the pass (finished, with ``finish``), and both runs' results."""

    graph_module: fx.GraphModule
    result: PassResult
    again: PassResult


def assert_contract(pass_fn: Callable, ctx: PassContext, before: Snapshot, result: PassResult, *,
                    delta: Optional[int] = None, expect_modified: Optional[bool] = None, meta_keys: Sequence[str] = (),
                    model: Optional[torch.nn.Module] = None, inputs: tuple = (), atol: float = 0.05, grads: bool = True,
                    finish: Optional[Callable[[fx.GraphModule], Any]] = None) -> Checked:
    """Assert the pass contract (module docstring) on ``result``, the pass's run on the graph ``before`` was taken of.

    ``model``: the fp32 model the outputs (and gradients) are compared with;
    None compares nothing.
    """
    name = getattr(pass_fn, "__name__", repr(pass_fn))
    kind = spec_of(pass_fn).kind
    gm = result.graph_module
    gm.graph.lint()
    after = Snapshot.of(gm)
    if kind == "repaint":
        assert after.state == before.state, f"{name} is a repaint, yet the code or a parameter changed"
        changed = after.paint != before.paint
    else:
        changed = after.state != before.state
    assert result.modified == changed, f"{name} reported modified={result.modified} but changed={changed}"
    if expect_modified is not None:
        assert result.modified == expect_modified
    if delta is not None:
        assert after.nodes - before.nodes == delta, (after.nodes - before.nodes, gm.code)
    painted = _meta_of(gm, meta_keys)
    again = pass_fn(gm, ctx)
    assert not again.modified, f"second {name} run changed the graph"
    again.graph_module.graph.lint()
    second = Snapshot.of(again.graph_module)
    assert (second.nodes, second.state) == (after.nodes, after.state), f"second {name} run changed the graph"
    assert kind != "repaint" or second.paint == after.paint, f"second {name} run changed the paint"
    assert _meta_of(again.graph_module, meta_keys) == painted, f"second {name} run changed node.meta"
    gm = again.graph_module
    if finish is not None:
        gm = finish(gm)
    if model is not None:
        assert_matches(gm, model, inputs, atol=atol, grads=grads)
    return Checked(gm, result, again)


def run_checked(pass_fn: Callable, gm: fx.GraphModule, ctx: PassContext, **contract: Any) -> Checked:
    """Run ``pass_fn`` on ``gm`` and :func:`assert_contract` on what it did."""
    before = Snapshot.of(gm)
    return assert_contract(pass_fn, ctx, before, pass_fn(gm, ctx), **contract)


def check(pass_fn: Callable, model: torch.nn.Module, inputs: tuple, *, delta: Optional[int] = None,
          expect_modified: Optional[bool] = None, atol: float = 0.05, level: str = "O1",
          meta_keys: Sequence[str] = (), grads: bool = True, finish: bool = False, **prepare_kwargs) -> fx.GraphModule:
    """Prepare ``model``'s graph up to ``pass_fn``, run it and assert the contract; return the module (finished with ``finish``)."""
    gm, ctx = prepare(model, pass_fn, level=level, **prepare_kwargs)
    rest = (lambda done: run_rest(done, ctx, pass_fn)) if finish else None
    return run_checked(pass_fn, gm, ctx, delta=delta, expect_modified=expect_modified, meta_keys=meta_keys,
                       model=model, inputs=inputs, atol=atol, grads=grads, finish=rest).graph_module
