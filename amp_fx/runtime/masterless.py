"""Train a low-precision module's own parameters without fp32 masters, as an optimizer wrapper.

O2 keeps an fp32 master per weight; O3 drops it, and then every update below
half an ulp of the weight (``|w| * 2**-9`` in bf16) rounds away.
:class:`LowPrecisionOptimizer` keeps those updates without masters::

    gm = amp_fx.convert(model, "O3")                      # bf16 parameters
    opt = LowPrecisionOptimizer(torch.optim.AdamW(gm.parameters(), lr=1e-3), gm,
                                update="kahan", state_dtype=torch.bfloat16)
    for x, y in data:
        opt.zero_grad()
        loss_fn(gm(x), y).backward()
        opt.step()                                        # or scaler.step(opt) with a LossScaler

Each step runs the wrapped optimizer, unchanged, on float32 scratch copies of
the parameters and gradients (a chunk at a time, freed after the chunk), and
rounds the result once into the module's bf16/fp16 storage:

* ``update="stochastic"``: stochastic rounding from a seeded generator;
  unbiased, so small updates survive in expectation. No extra memory.
* ``update="kahan"``: the rounding error is kept in a 2-byte compensation
  buffer per parameter and added back before the next step; weight plus
  buffer are the fp32 value (exactly, for bf16).
* ``update="nearest"``: round to nearest. The step's arithmetic is fp32 but
  small updates still vanish: the baseline the other two fix.

``state_dtype=torch.bfloat16`` stores per-element optimizer state (Adam's
moments, SGD's momentum) in bf16 between steps, stochastically rounded: a
nearest-rounded second moment freezes, since ``beta2 = 0.999`` moves it by
0.1% per step, under bf16's half-ulp of 0.2%.

With :class:`~amp_fx.runtime.LossScaler`, ``scaler.step(opt)`` checks (and for
fp16 unscales, in fp16, as plain O3 does) the module's own gradients, then
calls :meth:`LowPrecisionOptimizer.step`.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
from torch import nn

from amp_fx.ir.config import AmpConfig
from amp_fx.runtime.wrapped_optimizer import WrappedOptimizer

from .low_precision_update import COMPENSATION_DTYPE, merge_compensated, split_compensated, stochastic_round
from amp_fx.frontend.compiled_modules import unwrap_compiled
from .training_memory import MemoryReport, measure_training_memory
from amp_fx.errors import AmpKeyError, AmpNotImplementedError, AmpTypeError, AmpValueError, checks_keywords

__all__ = ["LowPrecisionOptimizer", "UPDATES"]

UPDATES = ("stochastic", "kahan", "nearest")
_LOW = (torch.float16, torch.bfloat16)
# Per-parameter scalars some optimizers keep beside the per-element state: never downcast
# (a bf16 step counter stops counting at 256).
_SCALAR_STATE_KEYS = frozenset({"step", "mu_product", "eta", "mu"})


def _check_module(module: nn.Module) -> None:
    """Refuse modules with no low-precision parameters: nothing would be trained without masters."""
    config = getattr(module, "amp_config", None)
    if isinstance(config, AmpConfig) and not config.cast_params:
        raise AmpValueError(
            f"LowPrecisionOptimizer got a module converted at {config.level}: its parameters are the "
            "model's fp32 ones, cast in the graph, so there is nothing to train without masters. "
            "Convert at O3 (amp_fx.convert(model, 'O3')) and build the optimizer over its parameters."
        )
    if not any(p.dtype in _LOW for p in module.parameters()):
        raise AmpValueError(
            f"LowPrecisionOptimizer got a {type(module).__name__} with no float16/bfloat16 parameters, so "
            "there is nothing to train without masters; pass the module amp_fx.convert(model, 'O3') returned."
        )


class LowPrecisionOptimizer(WrappedOptimizer):
    """Step a low-precision module's parameters in fp32 scratch and round once: no fp32 masters.

    Args:
        optimizer: any per-parameter ``torch.optim`` optimizer (SGD, Adam,
            AdamW, ...) built over ``module``'s parameters. Its step runs
            unchanged, in float32.
        module: the module that trains (e.g. ``amp_fx.convert(model, "O3")``,
            or ``torch.compile`` of it); its bf16/fp16 parameters are updated
            in place, float32 ones as usual. A module with no low-precision
            parameter (O0/O1, or unconverted) is refused.
        update: ``"stochastic"``, ``"kahan"`` or ``"nearest"`` (see the module doc).
        state_dtype: dtype of per-element optimizer state between steps:
            ``torch.bfloat16`` halves it; ``None``/``torch.float32`` keeps fp32.
        seed: seeds the rounding generators (one per device), for
            reproducible runs; their state is in :meth:`state_dict`.
        scaler: optional :class:`~amp_fx.runtime.LossScaler` for calling
            ``opt.step()`` directly (Apex style); then ``step()`` returns
            whether it stepped. Not needed with ``scaler.step(opt)``.
        chunk_numel: at most this many parameter elements are upcast at once
            (the fp32 scratch is ~8 bytes per element, plus upcast state);
            ``None`` steps each parameter group whole.

    ``param_groups``, ``state`` and ``defaults`` are the wrapped optimizer's
    own objects, so LR schedulers built over either drive the real rates.
    Hooks registered on the *wrapped* optimizer run once per chunk.
    """

    # No Optimizer.__init__: param_groups and state must be the wrapped optimizer's objects.
    @checks_keywords("LowPrecisionOptimizer")
    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        module: nn.Module,
        update: str = "stochastic",
        state_dtype: torch.dtype | None = None,
        seed: int = 0,
        scaler: Any = None,
        chunk_numel: int | None = 2**24,
    ) -> None:
        if update not in UPDATES:
            raise AmpValueError(f"update must be one of {UPDATES}, got {update!r}")
        if state_dtype not in (None, torch.float32, torch.bfloat16):
            hint = (" float16 state underflows Adam's second moment (grad**2 below 6e-8 becomes 0);"
                    if state_dtype == torch.float16 else "")
            raise AmpValueError(f"state_dtype must be None, torch.float32 or torch.bfloat16, got {state_dtype}.{hint}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise AmpTypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, torch.optim.LBFGS):
            raise AmpTypeError(
                "LowPrecisionOptimizer cannot wrap LBFGS: its step re-evaluates the model through the "
                "closure while the parameters are float32 scratch, and it couples all parameters. "
                "Use a per-parameter optimizer (SGD, Adam, AdamW), or MasterWeightOptimizer at O2."
            )
        module = unwrap_compiled(module)
        _check_module(module)
        if chunk_numel is not None and chunk_numel < 1:
            raise AmpValueError(f"chunk_numel must be >= 1 or None, got {chunk_numel}")
        self.optimizer = optimizer
        self.module = module
        self.update = update
        self.state_dtype = torch.float32 if state_dtype is None else state_dtype
        self.seed = int(seed)
        self._scaler = scaler
        self._chunk_numel = chunk_numel
        self._init_face()

        self._names = {id(p): n for n, p in module.named_parameters()}
        self._compensation: dict[str, torch.Tensor] = {}
        self._versions: dict[str, int | None] = {}
        self._generators: dict[str, torch.Generator] = {}
        for group in optimizer.param_groups:
            self._adopt(group["params"])
        stepped = {id(p) for g in optimizer.param_groups for p in g["params"]}
        missing = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in stepped]
        if missing:
            raise AmpValueError(
                f"module parameters {missing} are in no param group of the optimizer, so they would "
                "never be updated; build the optimizer over all of the module's parameters, add them "
                "with add_param_group(), or set requires_grad=False on them."
            )

    def _adopt(self, params: list[torch.Tensor]) -> None:
        """Check that ``params`` are the module's; give low ones compensation, every device a generator."""
        for p in params:
            name = self._names.get(id(p))
            if name is None:
                raise AmpValueError(
                    "optimizer does not own the module's parameters: it holds a tensor of shape "
                    f"{tuple(p.shape)} and dtype {p.dtype} that is not a parameter of the module. "
                    "Build the optimizer over the converted module's parameters "
                    "(torch.optim.AdamW(gm.parameters())), not the original model's."
                )
            if p.dtype in _LOW and self.update == "kahan" and name not in self._compensation:
                self._compensation[name] = torch.zeros_like(p, dtype=COMPENSATION_DTYPE)
                self._versions[name] = p._version
            self._generator(p.device)

    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        gen = self._generators.get(key)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed)
            self._generators[key] = gen
        return gen

    # ------------------------------------------------ the optimizer's face

    def __repr__(self) -> str:
        return (f"LowPrecisionOptimizer({type(self.optimizer).__name__}, update={self.update!r}, "
                f"state_dtype={self.state_dtype}, seed={self.seed})")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of the module's parameters."""
        params = param_group["params"]
        self._adopt([params] if isinstance(params, torch.Tensor) else list(params))
        self.optimizer.add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the module's gradients (through the wrapped optimizer)."""
        self.optimizer.zero_grad(set_to_none)

    def compensation_buffers(self) -> dict[str, torch.Tensor]:
        """``{parameter name: int16 Kahan compensation}`` (empty unless ``update="kahan"``)."""
        return dict(self._compensation)

    def state_dtypes(self) -> dict[str, str]:
        """``{state key: dtype}`` of the optimizer state held now, e.g. ``{"exp_avg": "bfloat16", ...}``."""
        return self.memory_report().state_dtypes

    def memory_report(self) -> MemoryReport:
        """Bytes per parameter held now (weights, gradients, compensation, state), measured from the tensors."""
        return measure_training_memory(self.module, self)

    # ------------------------------------------------------------------ step
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Run the wrapped optimizer on fp32 scratch copies and round the result into the module.

        ``closure`` (optional) is evaluated once, before the step. With a
        ``scaler`` given at construction and a direct call, the scaler checks
        the gradients first and a non-finite step is skipped; the return value
        is then whether it stepped.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scaler = self._scaler
        if scaler is not None and not scaler._is_stepping(self):
            if not scaler._begin_step(self):
                return False
            loss = True
        inner = self.optimizer
        groups = inner.param_groups
        with torch.no_grad():
            for group in groups:
                params = group["params"]
                try:
                    for chunk in self._chunks(params):
                        group["params"] = chunk
                        inner.param_groups = [group]
                        self._step_chunk(chunk)
                finally:
                    group["params"] = params
                    inner.param_groups = groups
        return loss

    def _chunks(self, params: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
        if self._chunk_numel is None:
            yield params
            return
        chunk: list[torch.Tensor] = []
        size = 0
        for p in params:
            if chunk and size + p.numel() > self._chunk_numel:
                yield chunk
                chunk, size = [], 0
            chunk.append(p)
            size += p.numel()
        if chunk:
            yield chunk

    def _step_chunk(self, chunk: list[torch.Tensor]) -> None:
        staged = []
        try:
            for p in chunk:
                if p.grad is None:
                    continue  # the optimizer skips it too
                if p.grad.is_sparse:
                    raise AmpNotImplementedError("LowPrecisionOptimizer does not support sparse gradients")
                staged.append((p, p.data, p.grad))
                if p.dtype in _LOW:
                    scratch, grad = self._upcast_param(p), p.grad.float()
                    p.data = scratch
                    p.grad = grad
                self._upcast_state(p)
            if staged:
                self.optimizer.step()
        finally:
            # Round back even if the step raised, so the module never keeps fp32 scratch.
            for p, low, grad in staged:
                if p.dtype != low.dtype:
                    name = self._names[id(p)]
                    self._round_into(p.data, low, name)
                    p.data = low
                    p.grad = grad
                    if name in self._compensation:
                        self._versions[name] = p._version  # our own write: the compensation matches it
                self._downcast_state(p)

    def _upcast_param(self, p: torch.Tensor) -> torch.Tensor:
        name = self._names[id(p)]
        comp = self._compensation.get(name)
        if comp is None:
            return p.data.float()
        seen = self._versions.get(name)
        if seen is not None and p._version != seen:
            comp.zero_()  # the weight was written since our last step (e.g. loaded): its old error is stale
        return merge_compensated(p.data, comp)

    def _round_into(self, value: torch.Tensor, low: torch.Tensor, name: str) -> None:
        if self.update == "stochastic":
            stochastic_round(value, low.dtype, self._generator(low.device), out=low, inplace=True)
        elif self.update == "kahan":
            split_compensated(value, low, self._compensation[name], inplace=True)
        else:
            low.copy_(value)

    def _per_element_state(self, p: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        for key, value in self.optimizer.state.get(p, {}).items():
            if (isinstance(value, torch.Tensor) and value.is_floating_point()
                    and key not in _SCALAR_STATE_KEYS and value.shape == p.shape):
                yield key, value

    def _upcast_state(self, p: torch.Tensor) -> None:
        state = self.optimizer.state.get(p)
        for key, value in list(self._per_element_state(p)):
            if value.dtype != torch.float32:
                state[key] = value.float()

    def _downcast_state(self, p: torch.Tensor) -> None:
        if self.state_dtype == torch.float32:
            return
        state = self.optimizer.state.get(p)
        for key, value in list(self._per_element_state(p)):
            if value.dtype == torch.float32:
                state[key] = stochastic_round(value, self.state_dtype, self._generator(value.device), inplace=True)

    # ------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state, the compensation buffers and the rounding generators' states.

        With the module's own ``state_dict``, this resumes training bit for bit.
        Tensors are references, as in ``Optimizer.state_dict``; ``torch.save`` copies.
        """
        return {
            "optimizer": self.optimizer.state_dict(),
            "update": self.update,
            "state_dtype": str(self.state_dtype).replace("torch.", ""),
            "compensation": dict(self._compensation),
            "generators": {device: gen.get_state() for device, gen in self._generators.items()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore optimizer state (in the dtypes saved), compensation and generator states.

        Load the module's weights before or after this, either order: the
        compensation is trusted for the next step. A plain optimizer state (no
        ``"update"`` key) loads into the wrapped optimizer only.
        """
        if "update" not in state_dict:
            self.optimizer.load_state_dict(state_dict)
            return
        if state_dict["update"] != self.update:
            raise AmpValueError(
                f"this state was saved with update={state_dict['update']!r}, but this optimizer uses "
                f"update={self.update!r}; resuming would drop or invent rounding state. Build the "
                f"LowPrecisionOptimizer with update={state_dict['update']!r}."
            )
        saved = state_dict["compensation"]
        if set(saved) != set(self._compensation):
            raise AmpKeyError(
                f"compensation buffers in the state do not match this model: missing "
                f"{sorted(set(self._compensation) - set(saved))}, unexpected "
                f"{sorted(set(saved) - set(self._compensation))}; rebuild the model and optimizer as when saving."
            )
        inner_state = state_dict["optimizer"]
        self.optimizer.load_state_dict(inner_state)
        self._restore_state_dtypes(inner_state)
        for name, comp in self._compensation.items():
            comp.copy_(saved[name])
            self._versions[name] = None
        for device, gen_state in state_dict["generators"].items():
            self._generator(torch.device(device)).set_state(gen_state)

    def _restore_state_dtypes(self, inner_state: dict[str, Any]) -> None:
        # Optimizer.load_state_dict casts floating state to the parameter's dtype (bf16
        # here); put back the saved tensors as they were, so fp32 state stays fp32.
        saved_ids = [i for g in inner_state["param_groups"] for i in g["params"]]
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        for index, p in zip(saved_ids, params):
            for key, value in inner_state["state"].get(index, {}).items():
                if isinstance(value, torch.Tensor) and value.is_floating_point() and key != "step":
                    self.optimizer.state[p][key] = value.to(device=p.device, copy=True)
