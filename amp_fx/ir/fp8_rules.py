"""fp8 GEMMs: the option, the recipes, and the two predicates -- ``can_fp8`` (legal) and ``should_fp8`` (worth it).

``convert(model, "O1", fp8=...)`` takes ``True`` (tensorwise), a recipe name,
a dict of :class:`Fp8Config` fields or an :class:`Fp8Config`;
:func:`parse_fp8` reads it.  A GEMM runs in fp8 when

1. ``can_fp8`` -- it is legal: an op whose registry row says fp8 (``linear``, or a ``matmul`` / ``mm`` /
   ``addmm`` (``alpha = beta = 1``), or a custom op :func:`~amp_fx.ir.op_properties.register_op` gave
   ``fp8=True``) whose weight operand is a 2-D parameter; its K and N are static, nonzero multiples of 16
   (what fp8 tensor cores and ``torch._scaled_mm`` take); it is painted low
   (a GEMM the level or a policy keeps fp32 is not fp8), with an activation of
   at least 2 dims;
2. ``should_fp8`` -- it is worth it: ``size_rule="auto"`` keeps GEMMs too small
   to gain in the low dtype, by torchao's measured H100 thresholds for its
   recipe (:data:`SIZE_RULES`); ``"all"`` takes every legal GEMM.

fp8 at O0 (which rewrites nothing) is refused (:func:`fp8_for_level`); fp8 with a
float16 low dtype is supported (the GEMMs return float16, as torchao's on an fp16 model).

A policy decides first: ``"fp8"`` for a module, type or op makes its legal
GEMMs fp8 whatever their size (with ``fp8=None``, tensorwise); ``"low"``,
``"fp32"``, ``"follow"`` or ``"promote"`` keeps them out of fp8.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

from amp_fx.errors import PACKAGE, AmpTypeError, AmpValueError, AmpWarning
from amp_fx.ir import op_properties
from amp_fx.ir.fp8_cost import DEVICES, DeviceProfile, device_profile

__all__ = ["Fp8Config", "parse_fp8", "fp8_for_level", "can_fp8", "should_fp8", "RECIPES", "AMAX_COMPUTE", "SIZE_RULES",
           "ALIGNMENT", "AUTO", "AUTO_CHOICES", "Fp8NothingConvertedWarning"]

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "delayed")
AUTO = "auto"  # per GEMM: bf16 or one of AUTO_CHOICES, from the cost model and a calibration (amp_fx/ir/fp8_choice.py)
AUTO_CHOICES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
AMAX_COMPUTE = ("max", "most_recent")
ALIGNMENT = 16  # K and N of an fp8 GEMM: torch._scaled_mm's requirement


def _tensorwise_worth_it(K: int, N: int) -> bool:
    return not (K <= 4096 and N <= 1024)


def _rowwise_worth_it(K: int, N: int) -> bool:
    return N > 2048 and K > 1024 and not (N <= 4096 and K <= 2048)


# Size rules of size_rule="auto", per recipe: torchao 0.18's auto-filters (float8_linear_utils.py), measured there
# on H100s; below them a fp8 GEMM's quantization costs more than its faster GEMM gains.  Delayed scaling quantizes
# as tensorwise does (it only computes no amax first), so it takes tensorwise's rule.
SIZE_RULES = {
    "tensorwise": ("K > 4096 or N > 1024", _tensorwise_worth_it),
    "rowwise": ("N > 2048 and K > 1024 and (N > 4096 or K > 2048)", _rowwise_worth_it),
    "delayed": ("K > 4096 or N > 1024", _tensorwise_worth_it),
    # torchao's auto-filter refuses this recipe; its forward and grad_input GEMMs are rowwise's, so rowwise's rule.
    "rowwise_with_gw_hp": ("N > 2048 and K > 1024 and (N > 4096 or K > 2048)", _rowwise_worth_it),
}


@dataclass(frozen=True)
class Fp8Config:
    """How eligible GEMMs run in fp8.

    recipe: ``"tensorwise"`` (torchao's default: one scale per tensor, recomputed every call),
        ``"rowwise"`` (a power-of-two scale per row; grad_output e4m3), ``"rowwise_with_gw_hp"`` (rowwise
        forward and grad_input with a tensorwise weight, the weight-gradient GEMM in high precision), ``"delayed"``
        (Transformer Engine's: scales from an amax history kept in the module's buffers).
    emulate: run each fp8 GEMM as an fp32 ``mm`` of the dequantized operands (torchao's ``emulate``).
    size_rule: ``"auto"`` (skip GEMMs too small to gain, :data:`SIZE_RULES`) or ``"all"``.
    history_len, amax_compute, margin: delayed scaling's amax history length, ``"max"`` or
        ``"most_recent"`` of it, and ``scale = fp8_max / amax / 2**margin``.

    ``recipe="auto"`` chooses per GEMM among ``choices`` or bf16 (docs/fp8.md) and needs ``example_inputs``:
    device: the profile its roofline model predicts for (``"h100"``, ``"h200"``, ``"b200"`` or a
        :class:`~amp_fx.ir.fp8_cost.DeviceProfile`); tokens: the M to predict for (default: the example inputs' rows);
    error_budget: the largest measured operand error a recipe may have; min_gain: the smallest predicted
        ``1 - t_fp8 / t_bf16`` worth converting for;
    keep_first, keep_last, keep_routers: keep bf16 the first GEMM(s), the GEMM(s) feeding the output/loss, and
        MoE routers / gates (:func:`amp_fx.ir.fp8_choice.is_router`).  ``size_rule`` does not apply to it.
    """

    recipe: str = "tensorwise"
    emulate: bool = False
    size_rule: str = "auto"
    history_len: int = 16
    amax_compute: str = "max"
    margin: int = 0
    device: Union[str, DeviceProfile] = "h100"
    tokens: Optional[int] = None
    error_budget: float = 0.05
    min_gain: float = 0.05
    keep_first: bool = True
    keep_last: bool = True
    keep_routers: bool = True
    choices: tuple = AUTO_CHOICES

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES and self.recipe != AUTO:
            raise AmpValueError(f"fp8 recipe {self.recipe!r} is unknown; use one of {RECIPES} or {AUTO!r}")
        self._check_auto()
        if self.size_rule not in ("auto", "all"):
            raise AmpValueError(f"fp8 size_rule must be 'auto' (skip GEMMs too small to gain) or 'all', "
                                f"got {self.size_rule!r}")
        if self.amax_compute not in AMAX_COMPUTE:
            raise AmpValueError(f"fp8 amax_compute must be one of {AMAX_COMPUTE}, got {self.amax_compute!r}")
        if not isinstance(self.history_len, int) or self.history_len < 1:
            raise AmpValueError(f"fp8 history_len must be a positive int, got {self.history_len!r}")
        if not isinstance(self.margin, int) or self.margin < 0:
            raise AmpValueError(f"fp8 margin must be a non-negative int, got {self.margin!r}")
        if not isinstance(self.emulate, bool):
            raise AmpTypeError(f"fp8 emulate must be True or False, got {self.emulate!r}")

    def _check_auto(self) -> None:
        if device_profile(self.device) is None:
            raise AmpValueError(f"fp8 device {self.device!r} has no profile; use one of {sorted(DEVICES)} or an "
                                f"{PACKAGE}.ir.fp8_cost.DeviceProfile(name, bf16_flops, fp8_flops, bandwidth)")
        if self.tokens is not None and (not isinstance(self.tokens, int) or self.tokens < 1):
            raise AmpValueError(f"fp8 tokens (the M to predict for) must be a positive int or None, got {self.tokens!r}")
        if not isinstance(self.error_budget, (int, float)) or self.error_budget < 0:
            raise AmpValueError(f"fp8 error_budget must be a non-negative fraction (0.05: 5%), got {self.error_budget!r}")
        if not isinstance(self.min_gain, (int, float)) or self.min_gain >= 1:
            raise AmpValueError(f"fp8 min_gain must be a fraction below 1 (0.05: 5% of the GEMM time), got {self.min_gain!r}")
        choices = tuple(self.choices) if isinstance(self.choices, (tuple, list)) else ()
        if not choices or any(c not in AUTO_CHOICES for c in choices):
            raise AmpValueError(f"fp8 choices must be a non-empty subset of {AUTO_CHOICES}, got {self.choices!r}")
        object.__setattr__(self, "choices", choices)
        for name in ("keep_first", "keep_last", "keep_routers"):
            if not isinstance(getattr(self, name), bool):
                raise AmpTypeError(f"fp8 {name} must be True or False, got {getattr(self, name)!r}")

    @property
    def auto(self) -> bool:
        return self.recipe == AUTO

    @property
    def profile(self) -> DeviceProfile:
        return device_profile(self.device)

    def describe(self) -> str:
        """The recipe as the report names it."""
        if self.auto:
            return (f"auto (per GEMM on {self.profile.name}: error_budget {self.error_budget:.1%}, "
                    f"min_gain {self.min_gain:.0%})")
        if self.recipe == "tensorwise":
            return "tensorwise (e4m3 input/weight, e5m2 grad_output, scales every call)"
        if self.recipe == "rowwise":
            return "rowwise (e4m3, power-of-two scale per row)"
        if self.recipe == "rowwise_with_gw_hp":
            return "rowwise_with_gw_hp (e4m3 rowwise forward and grad_input, weight gradient in high precision)"
        return (f"delayed (e4m3 input/weight, e5m2 grad_output, amax history {self.history_len}, "
                f"{self.amax_compute}, margin {self.margin})")


def parse_fp8(value: Union[None, bool, str, Mapping, Fp8Config]) -> Optional[Fp8Config]:
    """The :class:`Fp8Config` that ``convert(fp8=value)`` asks for (None or False: no fp8 unless a policy asks)."""
    if value is None or value is False:
        return None
    if value is True:
        return Fp8Config()
    if isinstance(value, Fp8Config):
        return value
    if isinstance(value, str):
        return Fp8Config(recipe=value)
    if isinstance(value, Mapping):
        names = {f.name for f in dataclasses.fields(Fp8Config)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise AmpValueError(f"fp8 options {unknown} are unknown; Fp8Config takes {sorted(names)}")
        return Fp8Config(**value)
    raise AmpTypeError(f"fp8 takes True, a recipe name {RECIPES}, a dict of Fp8Config fields or an "
                       f"{PACKAGE}.Fp8Config, got {type(value).__name__}")


def fp8_for_level(level: str, value: Union[None, bool, str, Mapping, Fp8Config]) -> Optional[Fp8Config]:
    """:func:`parse_fp8`, refusing fp8 at a level that rewrites nothing (O0 leaves every GEMM fp32)."""
    config = parse_fp8(value)
    if config is not None and level == "O0":
        raise AmpValueError(f"fp8={value!r} does nothing at level O0, which leaves the model fp32 and unchanged: "
                            "use level 'O1' (or 'O2' / 'O3') with fp8=, or drop fp8=")
    return config


def can_fp8(op: Optional[str], *, decision: Optional[str], K: Any, N: Any, act_dims: Optional[int],
            weight_is_param: bool, scaled: bool = False) -> tuple[bool, str]:
    """Legality: (True, "") when the GEMM may run in fp8, else (False, why).

    ``scaled``: it is no plain GEMM (addmm's alpha or beta is not 1, or it takes arguments besides activation, weight, bias).
    """
    if not op_properties.of(op).fp8:
        return False, f"{op} is not an fp8 GEMM (the op registry's fp8 rows: linear, matmul, mm, addmm, registered ops)"
    if scaled:
        return False, "alpha or beta other than 1, or arguments besides activation, weight and bias"
    if decision != "low":
        return False, f"runs {decision}, not low precision"
    if not weight_is_param:
        return False, "its weight operand is not a 2-D parameter"
    if not isinstance(K, int) or not isinstance(N, int):
        return False, "K or N not static"
    if K <= 0 or N <= 0:
        return False, f"K={K} or N={N} is empty"
    if K % ALIGNMENT or N % ALIGNMENT:
        return False, f"K={K} or N={N} not a multiple of {ALIGNMENT}"
    if act_dims is not None and act_dims < 2:
        return False, "1-D activation"
    return True, ""


class Fp8NothingConvertedWarning(AmpWarning):
    """fp8 was asked for and no GEMM was converted; the message names the rule that kept them and the option that changes it."""


def should_fp8(K: int, N: int, config: Fp8Config) -> tuple[bool, str]:
    """Profitability: (True, "") when fp8 is worth it for a K x N weight under ``config``, else (False, why)."""
    if config.size_rule == "all":
        return True, ""
    rule, worth_it = SIZE_RULES[config.recipe]
    if worth_it(K, N):
        return True, ""
    return False, f"too small to gain (size_rule='auto' for {config.recipe} wants {rule})"
