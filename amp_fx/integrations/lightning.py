"""Lightning ``Precision`` plugin that trains a LightningModule with amp_fx: ``Trainer(plugins=[AmpFxPrecision("O2")])``.

The LightningModule's code stays as it is.  The plugin

* converts the submodules the LightningModule calls (every direct child that
  holds parameters, or the ones ``modules=`` names) with :func:`amp_fx.convert`.
  The LightningModule itself is not converted: its ``training_step`` returns
  dicts and logs, which is Python around the model, not a graph;
* wraps each optimizer ``configure_optimizers`` returns in
  :class:`amp_fx.MasterWeightOptimizer` at O2 (fp32 masters: the model's own
  parameters, so checkpoints hold fp32 weights);
* runs an :class:`amp_fx.LossScaler`: the loss is scaled before backward,
  gradients are unscaled before Lightning clips them, a step with inf/NaN
  gradients is skipped, and the scale is updated;
* puts the scaler's state in Lightning checkpoints, so resume is exact.

Lightning is imported here only, never by ``import amp_fx``.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Optional, Union

import torch
from torch import nn

import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import Precision

from amp_fx.converter.api import convert
from amp_fx.converter.graph_module import AmpGraphModule
from amp_fx.frontend.compiled_modules import is_compiled, unwrap_compiled
from amp_fx.runtime.compiled_update import check_compiled_update
from amp_fx.errors import PACKAGE, AmpError, AmpTypeError, AmpValueError, did_you_mean
from amp_fx.ir.config import LEVELS
from amp_fx.runtime import LossScaler, MasterWeightOptimizer

__all__ = ["AmpFxPrecision"]

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "half": torch.float16, torch.bfloat16: torch.bfloat16, torch.float16: torch.float16}


def _refuse_ties_across(module: nn.Module, targets: list[str], level: str) -> None:
    """Refuse a parameter shared by two converted submodules, or by one and the rest of the LightningModule.

    At O2/O3 each conversion gets its own low copy of a parameter: converted apart, a tied weight would
    become two tensors, each trained on one path's gradient (measured: a 101% wrong O2 step).
    """
    holders: dict[int, list[str]] = {}
    inside: set[int] = set()
    for name in targets:
        for _, param in module.get_submodule(name).named_parameters(remove_duplicate=False):
            places = holders.setdefault(id(param), [])
            if name not in places:
                places.append(name)
            inside.add(id(param))
    for path, param in module.named_parameters(remove_duplicate=False):
        if id(param) in inside and not any(path == t or path.startswith(t + ".") for t in targets):
            holders[id(param)].append(f"{path} (not converted)")
    shared = next((places for places in holders.values() if len(places) > 1), None)
    if shared:
        raise AmpValueError(
            f"AmpFxPrecision({level!r}): a parameter is shared by {shared[0]!r} and {shared[1]!r} (a tied weight). "
            f"Each submodule is converted on its own, and at {level} each conversion keeps its own low-precision "
            "copy, so the tie would break and neither copy would get the whole gradient. Put the modules that "
            "share it in one module with its own forward (self.model = YourModel(...)), which the plugin then "
            "converts whole, or use O1 (fp32 parameters, the tie kept).")


def _unwrapped(optimizer: Any) -> Any:
    """The optimizer behind Lightning's ``LightningOptimizer`` (the scaler keeps its state per optimizer object)."""
    return getattr(optimizer, "_optimizer", optimizer)


class _ParamSet(nn.Module):
    """The low parameters one optimizer steps, under names without dots, for its MasterWeightOptimizer.

    An optimizer may step one converted submodule (a GAN's generator) or
    several plus unconverted ones (``self.parameters()``): this holder gives
    MasterWeightOptimizer exactly the optimizer's tensors, whatever their owner.
    """

    def __init__(self, params: dict[str, nn.Parameter]):
        super().__init__()
        for name, param in params.items():
            self.register_parameter(name, param)


class AmpFxPrecision(Precision):
    """Train with amp_fx's converted modules in place of ``torch.autocast`` (``precision="bf16-mixed"``).

    Args:
        level: ``"O0"``-``"O3"`` (Apex semantics, as :func:`amp_fx.convert`).
        dtype: the low dtype, ``"bf16"`` (default) or ``"fp16"`` (or the torch dtype).
            Explicit, because the plugin converts before Lightning moves the model to its device.
        modules: names of the LightningModule's submodules to convert (dotted paths allowed), or a dict
            of name -> options for that submodule's :func:`amp_fx.convert` (``{"gpt": {"example_kwarg_inputs":
            batch}}``). Default: every direct child that holds parameters.
        scaler: a :class:`amp_fx.LossScaler` to use; default ``LossScaler(dtype=dtype, level=level)``
            (dynamic scaling for fp16, none for bf16; non-finite steps are skipped either way).
        compiled_update: O2: :class:`amp_fx.MasterWeightOptimizer`'s option (the update, unscale and low copy in
            one compiled pass; docs/training.md). Default None: on where a converted child is ``torch.compile``d.
        **convert_options: passed to every :func:`amp_fx.convert` call (``policy=``, ``example_inputs=``, ...).
    """

    def __init__(self, level: str = "O1", dtype: Union[str, torch.dtype] = "bf16", *,
                 modules: Union[None, Iterable[str], Mapping[str, Mapping[str, Any]]] = None,
                 scaler: Optional[LossScaler] = None,
                 compiled_update: Union[None, bool, str] = None,
                 **convert_options: Any) -> None:
        if level not in LEVELS:
            raise AmpValueError(f"AmpFxPrecision: level must be one of {list(LEVELS)}, got {level!r}")
        if dtype not in _DTYPES:
            raise AmpValueError(f"AmpFxPrecision: dtype must be 'bf16' or 'fp16' (or the torch dtype), got {dtype!r}")
        if scaler is not None and not isinstance(scaler, LossScaler):
            raise AmpTypeError(f"AmpFxPrecision: scaler must be an amp_fx.LossScaler, got {type(scaler).__name__}")
        check_compiled_update(compiled_update)
        if compiled_update not in (None, False) and level != "O2":
            raise AmpValueError(f"AmpFxPrecision: compiled_update={compiled_update!r} compiles O2's master-weight "
                                f"update; level {level!r} steps no fp32 masters. Use level='O2', or leave it unset.")
        self.compiled_update = compiled_update
        self.level = level
        self.dtype = _DTYPES[dtype]
        # What Lightning reports as trainer.precision: the mixed setting this plugin stands in for.
        self.precision = "bf16-mixed" if self.dtype is torch.bfloat16 else "16-mixed"
        per_module = dict(modules) if isinstance(modules, Mapping) else {name: {} for name in modules or ()}
        self.modules = None if modules is None else list(per_module)
        self.module_options = {name: dict(options) for name, options in per_module.items()}
        self.convert_options = dict(convert_options)
        self.scaler = scaler if scaler is not None else LossScaler(dtype=self.dtype, level=level)
        self.converted: dict[str, nn.Module] = {}  # an AmpGraphModule, or torch.compile of one

    # ------------------------------------------------------------ conversion
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Convert the LightningModule's submodules in place (the LightningModule object stays the same)."""
        targets = self._targets(module)
        if self.level in ("O2", "O3"):
            _refuse_ties_across(module, targets, self.level)
        for name in targets:
            child = module.get_submodule(name)
            if not isinstance(unwrap_compiled(child), AmpGraphModule):  # fit() called again: converted the first time
                options = {**self.convert_options, **self.module_options.get(name, {})}
                try:
                    child = convert(child, self.level, dtype=self.dtype, **options)
                except AmpError as error:
                    error.add_note(
                        f"(AmpFxPrecision was converting the LightningModule's submodule {name!r}. Options for "
                        f"{PACKAGE}.convert go in the plugin: AmpFxPrecision(level, example_kwarg_inputs=batch) for every "
                        f"submodule, or AmpFxPrecision(level, modules={{{name!r}: {{...}}}}) for this one.)")
                    raise
            parent_name, _, attr = name.rpartition(".")
            setattr(module.get_submodule(parent_name) if parent_name else module, attr, child)
            self.converted[name] = child
        return module

    def _targets(self, module: nn.Module) -> list[str]:
        if self.modules is None:
            names = [n for n, c in module.named_children() if any(True for _ in c.parameters())]
            if not names:
                raise AmpValueError(
                    f"AmpFxPrecision: {type(module).__name__} has no submodule with parameters to convert. The "
                    "plugin converts the modules a LightningModule calls (self.model = ...); layers used directly "
                    "in its forward must live in a submodule, or name them with AmpFxPrecision(modules=[...]).")
            return names
        known = [n for n, _ in module.named_modules() if n]
        for name in self.modules:
            if name not in known:
                raise AmpValueError(f"AmpFxPrecision(modules=...): {type(module).__name__} has no submodule "
                                    f"{name!r}{did_you_mean(name, known)}")
        return self.modules

    # ------------------------------------------------------------ optimizers
    def connect(self, model: nn.Module, optimizers: list, lr_schedulers: list) -> tuple:
        """Wrap each optimizer in a MasterWeightOptimizer at O2 (fp32 masters; schedulers keep working)."""
        if any(gm.amp_config.master_weights for gm in self.converted.values()):
            optimizers = [self._with_masters(opt) for opt in optimizers]
        return model, optimizers, lr_schedulers

    def _with_masters(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if isinstance(optimizer, MasterWeightOptimizer):
            return optimizer
        owners: dict[int, tuple[str, nn.Parameter, torch.Tensor]] = {}  # low param or master -> (key, low, master)
        for prefix, converted in self.converted.items():
            gm = unwrap_compiled(converted)  # a compiled submodule stays compiled, converted inside (amp_fx.convert)
            masters = getattr(gm, "amp_fx_masters", {})
            for name, param in gm.named_parameters():
                master = masters.get(name)
                if master is not None and master is not param:
                    entry = (f"{prefix}.{name}".replace(".", "__"), param, master)
                    owners[id(param)] = owners[id(master)] = entry
        held: dict[str, nn.Parameter] = {}
        masters: dict[str, torch.Tensor] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                key, low, master = owners.get(id(p), (f"fp32__{len(held)}", p, None))
                held[key] = low
                if master is not None:
                    masters[key] = master
        if not masters:
            return optimizer  # this optimizer steps no converted weights: nothing to keep masters of
        wrapped = MasterWeightOptimizer(optimizer, _ParamSet(held), masters=masters, compiled_update=self.compiled_update)
        if self.compiled_update is None and any(is_compiled(child) for child in self.converted.values()):
            wrapped._compile_update_by_default()  # a compiled child: compilation was chosen, as over a compiled module
        return wrapped

    # ------------------------------------------------------------ backward and step
    def pre_backward(self, tensor: torch.Tensor, module: "pl.LightningModule") -> torch.Tensor:
        """Scale the loss (fp16), then run Lightning's on_before_backward hooks."""
        return super().pre_backward(self.scaler.scale(tensor), module)

    def optimizer_step(self, optimizer: Any, model: "pl.LightningModule", closure: Callable[[], Any],
                       **kwargs: Any) -> Any:
        """Run the closure (forward, backward), unscale, let Lightning clip, then step unless inf/NaN."""
        if isinstance(optimizer, torch.optim.LBFGS):
            raise AmpTypeError("AmpFxPrecision: LBFGS re-evaluates its closure inside step(), after the gradients "
                               "were checked and unscaled; use another optimizer with mixed precision.")
        closure_result = closure()
        skipped_backward = closure_result is None and model.automatic_optimization  # training_step returned None
        if not skipped_backward and not self.scaler.is_unscaled(_unwrapped(optimizer)):
            # Unscaling also copies O2's gradients into the fp32 masters, which Lightning then clips.
            self.scaler.unscale_(_unwrapped(optimizer))
        self._after_closure(model, optimizer)
        if skipped_backward:
            return closure_result
        self.scaler.step(_unwrapped(optimizer), **kwargs)  # False: inf/NaN gradients, the step was skipped
        self.scaler.update()
        return closure_result

    def clip_gradients(self, optimizer: Any, clip_val: Union[int, float] = 0.0,
                       gradient_clip_algorithm: Any = None) -> None:
        """Unscale first (at O2: copy the gradients into the fp32 masters), then clip what the step will use.

        Under automatic optimization the gradients are unscaled before Lightning clips; under manual
        optimization ``self.clip_gradients(opt, ...)`` comes before ``opt.step()``, so it unscales here,
        once per step. Without that, O2 clipped master gradients the next unscale then overwrote.
        """
        if clip_val and clip_val > 0 and not self.scaler.is_unscaled(_unwrapped(optimizer)):
            self.scaler.unscale_(_unwrapped(optimizer))
        if gradient_clip_algorithm is None:
            return super().clip_gradients(optimizer, clip_val)
        return super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The loss scaler's state: Lightning stores it in the checkpoint under this class's name."""
        return self.scaler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scaler.load_state_dict(state_dict)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Load each converted submodule's weights through its own load_state_dict (at O2 it loads the masters).

        Lightning restores the weights before the plugin converts (the usual
        order) or after (strategies that restore after setup); in the second case
        the LightningModule's load reached the low copies only.
        """
        weights = checkpoint.get("state_dict") or {}
        for prefix, gm in self.converted.items():
            own = {k[len(prefix) + 1:]: v for k, v in weights.items() if k.startswith(prefix + ".")}
            if own:
                gm.load_state_dict(own)
