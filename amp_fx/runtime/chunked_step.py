"""O2's update one cache-sized chunk of masters at a time: gradient copy in, fused update, low copy out.

:class:`~amp_fx.runtime.MasterWeightOptimizer`'s plain step makes three passes over all the parameters:
copy every low gradient into its master's fp32 gradient, step the wrapped optimizer over all the masters,
copy every master into its low parameter. Each pass reads what the one before wrote, but over a model's
worth of tensors that no longer sits in the CPU's caches. Here the same kernels run on consecutive chunks
of a parameter group (each at least :data:`CHUNK_BYTES` of masters, a parameter never split): the chunk's
gradient copy, torch's fused kernel for it, and its low copy, so the update reads the gradients the copy
just wrote and the low copy reads the masters the update just wrote while they are still in cache.

Same kernels on the same tensors: the masters, optimizer state and low copies come out bit for bit as
from the plain step (tested). It calls torch's fused kernels (``torch._fused_sgd_``, ``torch._fused_adam_``,
``torch._fused_adamw_``) directly, doing what ``SGD.step``/``Adam.step`` do around them (state made on a
first step, Adam's step counters), so it applies only where nothing else would have run: the exact classes
SGD, Adam and AdamW with ``fused=True`` in every group (what ``MasterWeightOptimizer`` picks on CPU where the
user left it unset), float ``lr`` and betas, CPU fp32 masters, no step hook, no GradScaler attributes, and
``optimizer.step`` not replaced on the instance except by an LR scheduler (whose "stepped" flag is set as
its wrapper would). :func:`why_not_chunked` names what keeps it off; the wrapper then steps as before.
(These kernels read gradients of the parameters' dtype only: fp32, not the low bf16 ones, so the copy in
stays; one pass with no fp32 gradient at all needs a compiled kernel, docs/performance.md "O2 update".)
"""

from __future__ import annotations

from itertools import chain
from typing import Any, Callable, Iterator

import torch
from torch.optim import optimizer as torch_optimizer

from amp_fx.converter.step_guard import _refuse_plain_step
from amp_fx.graph_ops.cast_cache import _after_step

__all__ = ["CHUNK_BYTES", "why_not_chunked", "chunked_step"]

# Masters per chunk, in bytes: small tensors (biases, norms) share a chunk, a large one is a chunk alone.
# A chunk's working set (SGD: gradient in, fp32 gradient, master, momentum, low copy) stays in L2/L3.
CHUNK_BYTES = 1 << 20

_CLASSES = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
# Step hooks this step calls itself, as ``Optimizer.step``'s wrapper would (amp_fx's own global ones: they return
# None, so they cannot change the step's arguments); any other hook keeps the chunked step off.
_KNOWN_HOOKS: frozenset[Callable[..., Any]] = frozenset({_refuse_plain_step, _after_step})


def _pre_hooks(optimizer: torch.optim.Optimizer) -> list[Callable[..., Any]]:
    return list(chain(torch_optimizer._global_optimizer_pre_hooks.values(),
                      optimizer._optimizer_step_pre_hooks.values()))


def _post_hooks(optimizer: torch.optim.Optimizer) -> list[Callable[..., Any]]:
    return list(chain(optimizer._optimizer_step_post_hooks.values(),
                      torch_optimizer._global_optimizer_post_hooks.values()))


def _instance_step_ok(optimizer: torch.optim.Optimizer) -> bool:
    """``optimizer.step`` is its class's, or an LR scheduler's wrapper of it (which only sets a flag)."""
    patched = optimizer.__dict__.get("step")
    if patched is None:
        return True
    return bool(getattr(patched, "_wrapped_by_lr_sched", False)) and \
        getattr(patched, "__wrapped__", None) is type(optimizer).step


def why_not_chunked(optimizer: torch.optim.Optimizer) -> str | None:
    """Why the chunked step does not apply to ``optimizer`` (None: it does), before looking at gradients."""
    if type(optimizer) not in _CLASSES:
        return f"{type(optimizer).__name__} is not exactly SGD, Adam or AdamW"
    if any(hook not in _KNOWN_HOOKS for hook in chain(_pre_hooks(optimizer), _post_hooks(optimizer))):
        return "an optimizer step hook is registered"
    if not _instance_step_ok(optimizer):
        return "optimizer.step was replaced on the instance"
    if getattr(optimizer, "grad_scale", None) is not None or getattr(optimizer, "found_inf", None) is not None:
        return "the optimizer carries GradScaler's grad_scale/found_inf"
    for group in optimizer.param_groups:
        if not group.get("fused") or group.get("capturable") or group.get("differentiable"):
            return "a param group is not fused=True (or is capturable/differentiable)"
        if isinstance(group["lr"], torch.Tensor) or any(isinstance(b, torch.Tensor) for b in group.get("betas", ())):
            return "a param group's lr or betas is a tensor"
        for p in group["params"]:
            if type(p) not in (torch.Tensor, torch.nn.Parameter) or p.device.type != "cpu" or p.dtype != torch.float32:
                return "a master is not a plain CPU float32 tensor"
    return None


def _why_not_with_grads(optimizer: torch.optim.Optimizer) -> str | None:
    """What the gradients rule out: a sparse one, or SGD momentum buffers for some parameters with a gradient only."""
    for group in optimizer.param_groups:
        if any(p.grad is not None and p.grad.is_sparse for p in group["params"]):
            return "a sparse gradient"
        if not isinstance(optimizer, torch.optim.SGD) or group["momentum"] == 0:
            continue
        have = {optimizer.state.get(p, {}).get("momentum_buffer") is not None
                for p in group["params"] if p.grad is not None}
        if len(have) == 2:
            return "SGD momentum buffers exist for some parameters only (stepped with foreach once)"
    return None


def _chunks(count: int, params: list[torch.Tensor]) -> Iterator[slice]:
    """Consecutive slices of ``params`` holding at least :data:`CHUNK_BYTES` of them each (the last may hold less)."""
    start, size = 0, 0
    for i in range(count):
        size += params[i].numel() * 4
        if size >= CHUNK_BYTES:
            yield slice(start, i + 1)
            start, size = i + 1, 0
    if start < count:
        yield slice(start, count)


def chunked_step(optimizer: torch.optim.Optimizer, grad_sources: dict[int, torch.Tensor],
                 lows: dict[int, torch.Tensor]) -> set[int] | str:
    """Step ``optimizer`` chunk by chunk; the ids of the masters whose low copy was written, or why it did not step.

    ``grad_sources``: ``id(master) -> low gradient`` still to be copied into ``master.grad`` (already set to the
    buffer it is copied into); ``lows``: ``id(master) -> low parameter`` to copy the stepped master into.
    Call only where :func:`why_not_chunked` returned None; a reason returned here means nothing was changed.
    """
    reason = _why_not_with_grads(optimizer)
    if reason is not None:
        return reason
    for hook in _pre_hooks(optimizer):
        hook(optimizer, (), {})
    if "step" in optimizer.__dict__:  # an LR scheduler's wrapper: it would have recorded the call
        optimizer._opt_called = True  # type: ignore[attr-defined]
    written: set[int] = set()
    with torch.no_grad():
        for group in optimizer.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            run = _sgd_chunk(optimizer, group, params) if isinstance(optimizer, torch.optim.SGD) \
                else _adam_chunk(optimizer, group, params)
            for part in _chunks(len(params), params):
                chunk = params[part]
                into = [p.grad for p in chunk if id(p) in grad_sources]
                if into:
                    torch._foreach_copy_(into, [grad_sources[id(p)] for p in chunk if id(p) in grad_sources])
                run(part)
                out = [p for p in chunk if id(p) in lows]
                if out:
                    torch._foreach_copy_([lows[id(p)] for p in out], out)
                    written.update(id(p) for p in out)
    for hook in _post_hooks(optimizer):
        hook(optimizer, (), {})
    return written


def _sgd_chunk(optimizer: torch.optim.SGD, group: dict[str, Any], params: list[torch.Tensor]) -> Any:
    """``SGD.step``'s fused path for one group, as a function of a slice of ``params`` (state made here)."""
    momentum = group["momentum"]
    grads = [p.grad for p in params]
    buffers: list[torch.Tensor] = []
    first = False
    if momentum != 0:
        buffers = [optimizer.state[p].get("momentum_buffer") for p in params]
        first = all(b is None for b in buffers)  # (a mix was refused by _why_not_with_grads)
        if first:  # as torch's _fused_sgd: the kernel writes buf = grad into empty buffers
            buffers = [torch.empty_like(g) for g in grads]
        for p, buf in zip(params, buffers):
            optimizer.state[p]["momentum_buffer"] = buf
    options = dict(weight_decay=group["weight_decay"], momentum=momentum, lr=group["lr"],
                   dampening=group["dampening"], nesterov=group["nesterov"], maximize=group["maximize"],
                   is_first_step=first)

    def run(part: slice) -> None:
        torch._fused_sgd_(params[part], grads[part], buffers[part] if buffers else [], **options)
    return run


def _adam_chunk(optimizer: torch.optim.Adam, group: dict[str, Any], params: list[torch.Tensor]) -> Any:
    """``Adam.step``'s (and AdamW's) fused path for one group, as a function of a slice of ``params``."""
    amsgrad = group["amsgrad"]
    for p in params:
        state = optimizer.state[p]
        if len(state) == 0:  # as Adam._init_group with fused=True
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if amsgrad:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    states = [optimizer.state[p] for p in params]
    grads = [p.grad for p in params]
    exp_avgs = [s["exp_avg"] for s in states]
    exp_avg_sqs = [s["exp_avg_sq"] for s in states]
    maxima = [s["max_exp_avg_sq"] for s in states] if amsgrad else []
    steps = [s["step"] for s in states]
    kernel = torch._fused_adamw_ if group.get("decoupled_weight_decay") else torch._fused_adam_
    beta1, beta2 = group["betas"]
    options = dict(amsgrad=amsgrad, lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
                   eps=group["eps"], maximize=group["maximize"])

    def run(part: slice) -> None:
        torch._foreach_add_(steps[part], 1)
        kernel(params[part], grads[part], exp_avgs[part], exp_avg_sqs[part], maxima[part] if amsgrad else [],
               steps[part], **options)
    return run
