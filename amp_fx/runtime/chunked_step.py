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
stays; :mod:`amp_fx.runtime.compiled_update` makes one compiled pass that needs no fp32 gradient at all.)
"""

from __future__ import annotations

from itertools import chain
from typing import Any, Callable, Iterator

import torch
from torch.optim import optimizer as torch_optimizer

from amp_fx.converter.step_guard import _refuse_plain_step
from amp_fx.graph_ops.cast_cache import _after_step

__all__ = ["CHUNK_BYTES", "why_not_plain_class", "why_not_chunked", "chunked_step", "begin_step", "has_user_step_hooks",
           "pre_hooks", "post_hooks", "instance_step_ok"]

# Masters per chunk, in bytes: small tensors (biases, norms) share a chunk, a large one is cut into slices of
# this size. A chunk's working set (SGD: low gradient, fp32 scratch gradient, master, momentum, low copy: 5 MiB)
# stays in cache. 2 MiB measured best of 0.5/1/2/4 MiB on the benchmark MLP (docs/performance.md "O2 update").
CHUNK_BYTES = 2 << 20

_CLASSES = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
# Step hooks this step calls itself, as ``Optimizer.step``'s wrapper would (amp_fx's own global ones: they return
# None, so they cannot change the step's arguments); any other hook keeps the chunked step off.
_KNOWN_HOOKS: frozenset[Callable[..., Any]] = frozenset({_refuse_plain_step, _after_step})


def pre_hooks(optimizer: torch.optim.Optimizer) -> list[Callable[..., Any]]:
    """The step pre-hooks ``optimizer.step``'s wrapper would run: the global ones, then the optimizer's."""
    return list(chain(torch_optimizer._global_optimizer_pre_hooks.values(),
                      optimizer._optimizer_step_pre_hooks.values()))


def post_hooks(optimizer: torch.optim.Optimizer) -> list[Callable[..., Any]]:
    """The step post-hooks ``optimizer.step``'s wrapper would run: the optimizer's, then the global ones."""
    return list(chain(optimizer._optimizer_step_post_hooks.values(),
                      torch_optimizer._global_optimizer_post_hooks.values()))


def has_user_step_hooks(optimizer: torch.optim.Optimizer, pre_only: bool = False) -> bool:
    """Whether a step hook other than amp_fx's own runs around ``optimizer.step`` (its own tables, or a global one).

    ``pre_only``: pre-hooks only (what reads or edits the gradients before the update)."""
    hooks = pre_hooks(optimizer) if pre_only else chain(pre_hooks(optimizer), post_hooks(optimizer))
    return any(hook not in _KNOWN_HOOKS for hook in hooks)


def instance_step_ok(optimizer: torch.optim.Optimizer) -> bool:
    """``optimizer.step`` is its class's, or an LR scheduler's wrapper of it (which only sets a flag)."""
    patched = optimizer.__dict__.get("step")
    if patched is None:
        return True
    return bool(getattr(patched, "_wrapped_by_lr_sched", False)) and \
        getattr(patched, "__wrapped__", None) is type(optimizer).step


def why_not_plain_class(optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``optimizer.step`` may do more than its class's SGD/Adam/AdamW math (None: it does only that).

    What a route that runs that math itself (chunked, compiled) must rule out: another class, a step hook, a
    replaced ``step``, GradScaler's attributes."""
    if type(optimizer) not in _CLASSES:
        return f"{type(optimizer).__name__} is not exactly SGD, Adam or AdamW"
    if has_user_step_hooks(optimizer):
        return "an optimizer step hook is registered"
    if not instance_step_ok(optimizer):
        return "optimizer.step was replaced on the instance"
    if getattr(optimizer, "grad_scale", None) is not None or getattr(optimizer, "found_inf", None) is not None:
        return "the optimizer carries GradScaler's grad_scale/found_inf"
    return None


def why_not_chunked(optimizer: torch.optim.Optimizer) -> str | None:
    """Why the chunked step does not apply to ``optimizer`` (None: it does), before looking at gradients."""
    reason = why_not_plain_class(optimizer)
    if reason is not None:
        return reason
    for group in optimizer.param_groups:
        if not group.get("fused") or group.get("capturable") or group.get("differentiable"):
            return "a param group is not fused=True (or is capturable/differentiable)"
        if isinstance(group["lr"], torch.Tensor) or any(isinstance(b, torch.Tensor) for b in group.get("betas", ())):
            return "a param group's lr or betas is a tensor"
        for p in group["params"]:
            if type(p) not in (torch.Tensor, torch.nn.Parameter) or p.device.type != "cpu" or p.dtype != torch.float32:
                return "a master is not a plain CPU float32 tensor"
    return None


def _why_not_with_grads(optimizer: torch.optim.Optimizer, grad_sources: dict[int, torch.Tensor]) -> str | None:
    """What the gradients rule out: a sparse one, or SGD momentum buffers for some parameters with a gradient only."""
    for group in optimizer.param_groups:
        if any(p.grad is not None and p.grad.is_sparse for p in group["params"]):
            return "a sparse gradient"
        if not isinstance(optimizer, torch.optim.SGD) or group["momentum"] == 0:
            continue
        have = {optimizer.state.get(p, {}).get("momentum_buffer") is not None
                for p in group["params"] if p.grad is not None or id(p) in grad_sources}
        if len(have) == 2:
            return "SGD momentum buffers exist for some parameters only (stepped with foreach once)"
    return None


class _Piece:
    """One kernel operand set: a master (or a slice of it), its gradient, its state tensors, its low copy."""

    __slots__ = ("master", "grad", "source", "state", "step", "low")

    def __init__(self, master: torch.Tensor, grad: torch.Tensor | None, source: torch.Tensor | None,
                 state: list[torch.Tensor], step: torch.Tensor | None, low: torch.Tensor | None) -> None:
        self.master, self.grad, self.source, self.state, self.step, self.low = master, grad, source, state, step, low


def _pieces(master: torch.Tensor, source: torch.Tensor | None, state: list[torch.Tensor], step: torch.Tensor | None,
            low: torch.Tensor | None) -> Iterator[_Piece]:
    """``master`` as kernel operands: sliced into :func:`_slice_elements` runs where its low gradient is still to be
    copied and everything is contiguous (the gradient then goes through the chunk's scratch), else whole."""
    whole = (master, *state) + ((source,) if source is not None else ()) + ((low,) if low is not None else ())
    if source is None or not all(t.is_contiguous() for t in whole):
        grad = master.grad if source is None else torch.empty_like(master, memory_format=torch.preserve_format)
        yield _Piece(master, grad, source, state, step, low)
        return
    flat = [t.view(-1) for t in (master, source, *state)] + [low.view(-1) if low is not None else None]
    count, run = master.numel(), _slice_elements()
    for at in range(0, count, run):
        cut = slice(at, min(at + run, count))
        yield _Piece(flat[0][cut], None, flat[1][cut], [t[cut] for t in flat[2:-1]], step,
                     None if flat[-1] is None else flat[-1][cut])


def _slice_elements() -> int:
    """Elements per slice of a large master: :data:`CHUNK_BYTES` of fp32, a multiple of 64, so that every slice but
    a tensor's last is whole vectors for the kernels and they round each element as over the whole tensor."""
    return max(64, CHUNK_BYTES // 4 // 64 * 64)


def _chunks(pieces: list[_Piece]) -> Iterator[list[_Piece]]:
    """Consecutive pieces holding at least :data:`CHUNK_BYTES` of masters each (the last may hold less)."""
    chunk: list[_Piece] = []
    size = 0
    for piece in pieces:
        chunk.append(piece)
        size += piece.master.numel() * 4
        if size >= CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def begin_step(optimizer: torch.optim.Optimizer) -> None:
    """What ``Optimizer.step``'s wrapper does before the math, for a route that runs the math itself: the step
    pre-hooks (amp_fx's own: :data:`_KNOWN_HOOKS`), and an LR scheduler's wrapper's record of the call."""
    for hook in pre_hooks(optimizer):
        hook(optimizer, (), {})
    if "step" in optimizer.__dict__:  # an LR scheduler's wrapper: it would have recorded the call
        optimizer._opt_called = True  # type: ignore[attr-defined]


def chunked_step(optimizer: torch.optim.Optimizer, grad_sources: dict[int, torch.Tensor],
                 lows: dict[int, torch.Tensor], scratch: list[torch.Tensor]) -> set[int] | str:
    """Step ``optimizer`` chunk by chunk; the ids of the masters whose low copy was written, or why it did not step.

    ``grad_sources``: ``id(master) -> low gradient`` not copied anywhere yet: the step reads it through a
    chunk-sized fp32 scratch buffer (cache-resident; the master's ``.grad`` stays None). Masters not in it step
    on their ``.grad``. ``lows``: ``id(master) -> low parameter`` to copy the stepped master into. ``scratch``:
    a one-element list holding the fp32 scratch buffer, kept by the caller from step to step (grown here).
    Call only where :func:`why_not_chunked` returned None; a reason returned here means nothing was changed.
    """
    reason = _why_not_with_grads(optimizer, grad_sources)
    if reason is not None:
        return reason
    begin_step(optimizer)
    written: set[int] = set()
    with torch.no_grad():
        for group in optimizer.param_groups:
            params = [p for p in group["params"] if p.grad is not None or id(p) in grad_sources]
            if not params:
                continue
            if isinstance(optimizer, torch.optim.SGD):
                state, steps, run = _sgd_state(optimizer, group, params, grad_sources)
            else:
                state, steps, run = _adam_state(optimizer, group, params)
            pieces = [piece for p, tensors, step in zip(params, state, steps)
                      for piece in _pieces(p, grad_sources.get(id(p)), tensors, step, lows.get(id(p)))]
            for chunk in _chunks(pieces):
                need = sum(piece.master.numel() for piece in chunk if piece.grad is None)
                if scratch[0].numel() < need or scratch[0].device != chunk[0].master.device:
                    scratch[0] = torch.empty(need, device=chunk[0].master.device)
                grads, at = [], 0
                for piece in chunk:
                    if piece.grad is None:
                        grads.append(scratch[0][at:at + piece.master.numel()])
                        at += piece.master.numel()
                    else:
                        grads.append(piece.grad)
                into = [g for g, piece in zip(grads, chunk) if piece.source is not None]
                if into:
                    torch._foreach_copy_(into, [piece.source for piece in chunk if piece.source is not None])
                run(chunk, grads)
                out = [piece for piece in chunk if piece.low is not None]
                if out:
                    torch._foreach_copy_([piece.low for piece in out], [piece.master for piece in out])
            written.update(id(p) for p in params if id(p) in lows)
    for hook in post_hooks(optimizer):
        hook(optimizer, (), {})
    return written


def _sgd_state(optimizer: torch.optim.SGD, group: dict[str, Any], params: list[torch.Tensor],
               grad_sources: dict[int, torch.Tensor]) -> tuple[list[list[torch.Tensor]], list[None], Any]:
    """``SGD.step``'s fused path for one group: each parameter's state tensors and a kernel over pieces."""
    momentum = group["momentum"]
    first = False
    if momentum != 0:
        buffers = [optimizer.state[p].get("momentum_buffer") for p in params]
        first = all(b is None for b in buffers)  # (a mix was refused by _why_not_with_grads)
        if first:  # as torch's _fused_sgd: empty buffers like the gradients, into which the kernel writes buf = grad
            buffers = [torch.empty_like(p if id(p) in grad_sources else p.grad, memory_format=torch.preserve_format)
                       for p in params]
        for p, buf in zip(params, buffers):
            optimizer.state[p]["momentum_buffer"] = buf
        state = [[buf] for buf in buffers]
    else:
        state = [[] for _ in params]
    options = dict(weight_decay=group["weight_decay"], momentum=momentum, lr=group["lr"],
                   dampening=group["dampening"], nesterov=group["nesterov"], maximize=group["maximize"],
                   is_first_step=first)

    def run(chunk: list[_Piece], grads: list[torch.Tensor]) -> None:
        buffers = [piece.state[0] for piece in chunk] if momentum != 0 else []
        torch._fused_sgd_([piece.master for piece in chunk], grads, buffers, **options)
    return state, [None] * len(params), run


def _adam_state(optimizer: torch.optim.Adam, group: dict[str, Any],
                params: list[torch.Tensor]) -> tuple[list[list[torch.Tensor]], list[torch.Tensor], Any]:
    """``Adam.step``'s (and AdamW's) fused path for one group: state tensors, step counters (advanced here,
    once per parameter, as torch advances them all before its kernel) and a kernel over pieces."""
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
    tensors = [[s["exp_avg"], s["exp_avg_sq"]] + ([s["max_exp_avg_sq"]] if amsgrad else []) for s in states]
    steps = [s["step"] for s in states]
    torch._foreach_add_(steps, 1)
    kernel = torch._fused_adamw_ if group.get("decoupled_weight_decay") else torch._fused_adam_
    beta1, beta2 = group["betas"]
    options = dict(amsgrad=amsgrad, lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
                   eps=group["eps"], maximize=group["maximize"])

    def run(chunk: list[_Piece], grads: list[torch.Tensor]) -> None:
        kernel([piece.master for piece in chunk], grads, [piece.state[0] for piece in chunk],
               [piece.state[1] for piece in chunk], [piece.state[2] for piece in chunk] if amsgrad else [],
               [piece.step for piece in chunk], **options)
    return tensors, steps, run
