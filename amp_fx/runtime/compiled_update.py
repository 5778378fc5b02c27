"""O2's update as one ``torch.compile``d pass: low gradients in, momentum/moments, fp32 master and low copy out.

The chunked step (:mod:`amp_fx.runtime.chunked_step`) runs torch's fused SGD/Adam kernels, which read
gradients of the parameters' dtype only: every bf16/fp16 gradient is first copied into fp32, and every stepped
master is copied into its low parameter afterwards. Here the whole update of one parameter group is a
function over lists of tensors that ``torch.compile`` (``fullgraph=True``, ``dynamic=False``) turns into one
pass per parameter: it reads the low gradient as backward left it (``.float()`` inside the graph, times the
scaler's reciprocal scale where the unscale was left to the step), updates the optimizer state and the fp32
master, and writes ``master.to(low)`` into the module's parameter. No fp32 gradient is written or read.

The math is torch's single-tensor SGD (weight decay, momentum, dampening, nesterov, maximize) and Adam/AdamW
(betas, eps, L2 or decoupled decay, amsgrad, maximize), in torch's order of operations; the compiler may
contract a multiply and an add into an FMA, so masters and state agree with torch's fused kernels to a few
ulp per step, not bit for bit. The low copy is the stepped master rounded to nearest even, exactly.

Hyperparameters reach the graph as one small fp32 tensor per group (learning rate, momentum, betas, Adam's
bias corrections per parameter, the reciprocal scale), never as Python floats: an LR scheduler changes ``lr``
every step, and a float would be a guard, a recompile per step. What changes the graph's structure
(nesterov, maximize, amsgrad, weight decay on or off, which parameters have a gradient and a low copy) is
baked in: a new set compiles again, up to :data:`MAX_VARIANTS` per optimizer, then the caller steps as before.

It applies where the chunked step would run its kernels itself (exactly SGD, Adam or AdamW, CPU fp32 masters,
no user step hook, ``optimizer.step`` not replaced but by an LR scheduler, not capturable or differentiable),
whatever ``foreach``/``fused`` say, and once the optimizer state exists: the first step of SGD with momentum (its
buffer is the first gradient) or Adam (its moments start at zero) runs the chunked or plain route, which makes it;
plain SGD has no state and compiles on its first step.
"""

from __future__ import annotations

import math
import types
import warnings
from typing import Any, Callable

import torch

from amp_fx.errors import AmpRuntimeError, AmpValueError, AmpWarning, did_you_mean

from .chunked_step import begin_step, post_hooks, why_not_plain_class

__all__ = ["MAX_VARIANTS", "CompiledUpdate", "CompiledUpdateWarning", "check_compiled_update", "why_not_compiled"]

# Graphs one optimizer may compile (each is a dynamo cache entry; dynamo's own limit is 8 per function).
MAX_VARIANTS = 6


class CompiledUpdateWarning(AmpWarning):
    """The compiled update failed to compile (no C++ compiler for inductor, a backend error): the step runs
    the chunked or plain route from then on. Pass ``compiled_update=False`` to silence it, or a backend that
    works here (``compiled_update="aot_eager"``)."""


def check_compiled_update(value: Any) -> None:
    """Refuse a ``compiled_update=`` that is not True, False, None or the name of a registered ``torch.compile`` backend.

    Checked where it is given (``MasterWeightOptimizer``, ``amp_fx.initialize``), not at the second step, where the
    update first compiles: a misspelt backend would otherwise run one step and then fail.
    """
    if value is not None and not isinstance(value, (bool, str)):
        raise AmpValueError(
            f"compiled_update must be True, False, None or a torch.compile backend name, got {value!r}")
    if not isinstance(value, str):
        return
    from torch._dynamo import list_backends  # (registered ones, including plugins' entry points, by name)

    names = list_backends(exclude_tags=())
    if value in names:
        return
    if value.lower() in ("true", "false", "none"):
        hint = f" Pass the Python value compiled_update={value.capitalize()}, not the string {value!r}."
    else:
        hint = did_you_mean(value, names) + f" Backends registered here: {list_backends()}."
    raise AmpValueError(
        f"compiled_update={value!r} is not a torch.compile backend registered here (torch.compile(backend={value!r}) "
        f"would raise InvalidBackend).{hint} compiled_update=True is inductor; \"aot_eager\" needs no C++ compiler.")


def why_not_compiled(optimizer: torch.optim.Optimizer, masters: list[torch.Tensor] | None = None) -> str | None:
    """Why the compiled update cannot step ``optimizer`` (None: it can), before looking at gradients or state.

    ``masters``: the tensors it will step, where they are not yet in its groups (a wrapper being built)."""
    reason = why_not_plain_class(optimizer)
    if reason is not None:
        return reason
    if any(group.get("capturable") or group.get("differentiable") for group in optimizer.param_groups):
        return "a param group is capturable or differentiable"
    for p in masters if masters is not None else (p for group in optimizer.param_groups for p in group["params"]):
        if type(p) not in (torch.Tensor, torch.nn.Parameter) or p.device.type != "cpu" or p.dtype != torch.float32:
            return ("a master is not a plain CPU float32 tensor (sharded, or on a GPU: the compiled update is built "
                    "and tested on CPU only)")
    return None


def _sgd_update(masters: list, grads: list, buffers: list, lows: list, hyper: torch.Tensor,
                momentum_on: bool, nesterov: bool, maximize: bool, decay_on: bool) -> None:
    """One SGD step of a group, as ``torch.optim.sgd._single_tensor_sgd`` (the function that gets compiled)."""
    lr, momentum, keep, weight_decay, inv = hyper[0], hyper[1], hyper[2], hyper[3], hyper[4]
    for i in range(len(masters)):
        master = masters[i]
        grad = grads[i].float() * inv
        if maximize:
            grad = -grad
        if decay_on:
            grad = grad + weight_decay * master
        if momentum_on:
            buf = buffers[i] * momentum + keep * grad  # buf.mul_(momentum).add_(grad, alpha=1 - dampening)
            buffers[i].copy_(buf)
            grad = grad + momentum * buf if nesterov else buf
        new = master - lr * grad
        master.copy_(new)
        if lows[i] is not None:
            lows[i].copy_(new)


def _adam_update(masters: list, grads: list, exp_avgs: list, exp_avg_sqs: list, max_sqs: list, lows: list,
                 hyper: torch.Tensor, per_param: torch.Tensor,
                 maximize: bool, decay_on: bool, decoupled: bool, amsgrad: bool) -> None:
    """One Adam/AdamW step of a group, as ``torch.optim.adam._single_tensor_adam`` (the function that gets compiled).

    ``per_param[i]``: (lr / bias_correction1, sqrt(bias_correction2)) at parameter i's step count."""
    one_minus_beta1, beta2, one_minus_beta2, eps = hyper[0], hyper[1], hyper[2], hyper[3]
    weight_decay, decay_factor, inv = hyper[4], hyper[5], hyper[6]
    for i in range(len(masters)):
        master = masters[i]
        grad = grads[i].float() * inv
        if maximize:
            grad = -grad
        param = master
        if decay_on:
            if decoupled:
                param = master * decay_factor  # param.mul_(1 - lr * weight_decay)
            else:
                grad = grad + weight_decay * master
        exp_avg = torch.lerp(exp_avgs[i], grad, one_minus_beta1)
        exp_avg_sq = exp_avg_sqs[i] * beta2 + one_minus_beta2 * (grad * grad)
        exp_avgs[i].copy_(exp_avg)
        exp_avg_sqs[i].copy_(exp_avg_sq)
        if amsgrad:
            exp_avg_sq = torch.maximum(max_sqs[i], exp_avg_sq)
            max_sqs[i].copy_(exp_avg_sq)
        denom = exp_avg_sq.sqrt() / per_param[i, 1] + eps
        new = param - per_param[i, 0] * (exp_avg / denom)  # param.addcdiv_(exp_avg, denom, value=-step_size)
        master.copy_(new)
        if lows[i] is not None:
            lows[i].copy_(new)


def _own_copy(fn: Callable[..., None]) -> Callable[..., None]:
    """``fn`` with a code object of its own: dynamo keeps its compiled graphs per code object, so each optimizer's
    graphs (and its recompile count) stay apart from every other optimizer's in the process."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


class CompiledUpdate:
    """The compiled update of one inner optimizer (each of its groups a graph), compiled at first use.

    ``backend``: the ``torch.compile`` backend ("inductor", "aot_eager", ...). ``strict``: a compile error raises
    (``compiled_update=True`` or a backend named by the user); otherwise it warns once and ``failed`` says why.
    """

    def __init__(self, backend: str, strict: bool) -> None:
        self.backend = backend
        self.strict = strict
        self.failed: str | None = None
        self._functions: dict[str, Callable[..., None]] = {}
        self._variants: set[tuple] = set()

    def _function(self, kind: str) -> Callable[..., None]:
        if kind not in self._functions:
            fn = _own_copy(_sgd_update if kind == "sgd" else _adam_update)
            self._functions[kind] = torch.compile(fn, backend=self.backend, fullgraph=True, dynamic=False)
        return self._functions[kind]

    def step(self, optimizer: torch.optim.Optimizer, grad_sources: dict[int, torch.Tensor],
             lows: dict[int, torch.Tensor], inv_scale: float) -> set[int] | str:
        """Step ``optimizer``; the ids of the masters whose low copy was written, or why not (nothing changed).

        ``grad_sources``: ``id(master) -> low gradient`` (read as it is); other masters step on their ``.grad``.
        ``lows``: ``id(master) -> low parameter`` to write. ``inv_scale``: multiplies every gradient read (1.0
        where they are unscaled already). Call only where :func:`why_not_compiled` returned None.
        """
        if self.failed is not None:
            return f"the compiled update failed to compile: {self.failed}"
        plans = []
        for group in optimizer.param_groups:
            params = [p for p in group["params"] if p.grad is not None or id(p) in grad_sources]
            if not params:
                continue
            grads = [grad_sources[id(p)] if id(p) in grad_sources else p.grad for p in params]
            if any(g.is_sparse for g in grads):
                return "a sparse gradient"
            plan = (_sgd_plan if isinstance(optimizer, torch.optim.SGD) else _adam_plan)(
                optimizer, group, params, grads, [lows.get(id(p)) for p in params], inv_scale)
            if isinstance(plan, str):
                return plan
            plans.append(plan)
        keys = {plan[0] for plan in plans} - self._variants
        if len(self._variants) + len(keys) > MAX_VARIANTS:
            return f"more than {MAX_VARIANTS} parameter sets to compile (gradients present on some steps only)"
        begin_step(optimizer)
        written: set[int] = set()
        with torch.no_grad():
            for key, kind, args, flags, after in plans:
                if key in self._variants:
                    self._function(kind)(*args, **flags)
                else:
                    reason = self._first_call(kind, args, flags)
                    if reason is not None:
                        return reason  # (compile errors come before the graph runs: nothing was written)
                    self._variants.add(key)
                after()
                written.update(id(m) for m, low in zip(args[0], args[-3 if kind == "adam" else -2]) if low is not None)
        for hook in post_hooks(optimizer):
            hook(optimizer, (), {})
        return written

    def _first_call(self, kind: str, args: tuple, flags: dict[str, bool]) -> str | None:
        """Compile and run a new graph; a compile error raises (strict) or warns once and names why."""
        try:
            self._function(kind)(*args, **flags)
        except Exception as err:  # noqa: BLE001 (the backend's own error types are not public)
            summary = " ".join(line.strip() for line in str(err).splitlines()[:2] if line.strip())
            if self.strict:
                raise AmpRuntimeError(
                    f"MasterWeightOptimizer(compiled_update=...): torch.compile(backend={self.backend!r}) failed to "
                    f"compile the update ({type(err).__name__}: {summary}; the full error is chained below). Pass "
                    "compiled_update=False to step without it, or a backend that works on this machine "
                    "(\"aot_eager\" needs no C++ compiler).") from err
            self.failed = f"{type(err).__name__}: {summary}"
            warnings.warn(
                f"MasterWeightOptimizer: the compiled update (torch.compile backend {self.backend!r}) failed to "
                f"compile ({self.failed}); the step takes the chunked or plain route from now on. Pass "
                "compiled_update=False to silence this, or compiled_update=\"aot_eager\". (Warned once.)",
                CompiledUpdateWarning, stacklevel=4)
            return f"the compiled update failed to compile: {self.failed}"
        return None


def _hyper(values: list[float], device: torch.device) -> torch.Tensor:
    """The group's scalars as one fp32 tensor (a graph input, so a new value never recompiles)."""
    return torch.tensor(values, dtype=torch.float32, device=device)


def _layout(params: list[torch.Tensor], grads: list[torch.Tensor], lows: list[torch.Tensor | None]) -> tuple:
    """What a graph is specialised on besides its flags: the masters, gradient dtypes, which have a low copy."""
    return tuple((id(p), g.dtype, low is not None) for p, g, low in zip(params, grads, lows))


def _sgd_plan(optimizer: torch.optim.SGD, group: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor],
              lows: list[torch.Tensor | None], inv_scale: float) -> tuple | str:
    """The compiled SGD call for one group: (variant key, kind, args, flags, what to do after), or why not."""
    momentum = float(group["momentum"])
    buffers: list[torch.Tensor] = []
    if momentum != 0:
        buffers = [optimizer.state.get(p, {}).get("momentum_buffer") for p in params]
        if any(b is None for b in buffers):
            return "SGD's first step makes the momentum buffers (the compiled update runs from the second step)"
    flags = dict(momentum_on=momentum != 0, nesterov=bool(group["nesterov"]), maximize=bool(group["maximize"]),
                 decay_on=float(group["weight_decay"]) != 0)
    hyper = _hyper([float(group["lr"]), momentum, 1 - float(group["dampening"]), float(group["weight_decay"]),
                    inv_scale], params[0].device)
    key = ("sgd", tuple(flags.values()), _layout(params, grads, lows))
    return key, "sgd", (params, grads, buffers or [None] * len(params), lows, hyper), flags, lambda: None


def _adam_plan(optimizer: torch.optim.Adam, group: dict[str, Any], params: list[torch.Tensor],
               grads: list[torch.Tensor], lows: list[torch.Tensor | None], inv_scale: float) -> tuple | str:
    """The compiled Adam/AdamW call for one group (step counters advanced after the graph ran), or why not."""
    states = [optimizer.state.get(p) for p in params]
    if any(not s for s in states):
        return "Adam's first step makes its state (the compiled update runs from the second step)"
    amsgrad = bool(group["amsgrad"])
    lr, eps, weight_decay = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
    beta1, beta2 = (float(b) for b in group["betas"])
    steps = [s["step"] for s in states]
    per_param, by_count = [], {}
    for step in steps:
        count = float(step) + 1  # (as torch: the counter advances before the update reads it)
        if count not in by_count:  # lr / bias_correction1 and sqrt(bias_correction2), in double as torch's
            by_count[count] = (lr / (1 - beta1 ** count), math.sqrt(1 - beta2 ** count))
        per_param.append(by_count[count])
    decoupled = bool(group.get("decoupled_weight_decay"))
    flags = dict(maximize=bool(group["maximize"]), decay_on=weight_decay != 0, decoupled=decoupled, amsgrad=amsgrad)
    device = params[0].device
    hyper = _hyper([1 - beta1, beta2, 1 - beta2, eps, weight_decay, 1 - lr * weight_decay, inv_scale], device)
    per = torch.tensor(per_param, dtype=torch.float32, device=device)
    max_sqs = [s["max_exp_avg_sq"] for s in states] if amsgrad else [None] * len(params)
    args = (params, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], max_sqs, lows, hyper, per)
    key = ("adam", tuple(flags.values()), _layout(params, grads, lows))
    return key, "adam", args, flags, lambda: torch._foreach_add_(steps, 1)
