"""``recipe="auto"``: one GEMM's format -- bf16 or an fp8 recipe -- from the cost model, its measured error and the rules.

:func:`choose` takes a GEMM's M, K, N, its measured sensitivity per recipe
(:mod:`amp_fx.ir.fp8_sensitivity`), the structural rule that keeps it bf16
if any (:func:`structural_rule`) and the config's budget, and returns a
:class:`Choice`: the format, the rule that decided it, and why in words.

1. A structural rule (``keep_first``, ``keep_last``, ``keep_routers``) keeps it bf16.
2. The recipes of ``config.choices`` whose sensitivity is within
   ``error_budget`` are *admissible*; none: bf16 (rule ``error_budget``).
3. Of those, the fastest by the roofline model (:mod:`amp_fx.ir.fp8_cost`);
   when its predicted gain ``1 - t_fp8 / t_bf16`` is below ``min_gain``: bf16
   (rule ``min_gain``), else that recipe (rule ``auto``).

A tighter budget (smaller ``error_budget``, larger ``min_gain``) never
converts more: the admissible set only shrinks, and its fastest member only slows.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from amp_fx.ir.fp8_cost import DeviceProfile, layer_seconds

__all__ = ["Choice", "choose", "structural_rule", "is_router", "ROUTER_NAMES", "ROUTER_MAX_N", "ROUTER_RATIO"]

# A module path component that names an MoE router / gate: exactly one of these, or ending in "_gate" / "_router"
# (Qwen's "shared_expert_gate").  Not "gate_proj" / "up_gate": those are the SwiGLU MLP's own wide GEMMs.
ROUTER_NAMES = re.compile(r"^(gate|gates|router|routers|gating|routing|wg)$|_(gate|router)$|^router")
# Under any name, a Linear with at most ROUTER_MAX_N outputs and K at least ROUTER_RATIO times N: a router's shape
# (d_model in, one logit per expert out) or a score head's.
ROUTER_MAX_N = 64
ROUTER_RATIO = 8


@dataclass
class Choice:
    """One GEMM's decision under ``recipe="auto"``."""

    recipe: Optional[str]  # None: bf16
    rule: str  # auto | error_budget | min_gain | keep_first | keep_last | keep_routers
    why: str
    seconds: dict[str, float] = field(default_factory=dict)  # "bf16" and each recipe of config.choices
    errors: dict[str, float] = field(default_factory=dict)  # each measured recipe's sensitivity
    calibrated_rows: int = 0  # the rows (tokens) the calibration measured it on
    M: Optional[int] = None  # the rows it was predicted for
    operand_errors: dict[str, dict[str, float]] = field(default_factory=dict)  # recipe -> {"input", "weight"}

    def gain(self, recipe: Optional[str] = None) -> Optional[float]:
        """Predicted ``1 - t_fp8 / t_bf16`` of ``recipe`` (default the chosen one; None for bf16)."""
        recipe = recipe or self.recipe
        if recipe is None or not self.seconds.get("bf16"):
            return None
        return 1.0 - self.seconds[recipe] / self.seconds["bf16"]


def is_router(module_path: str, N: Optional[int], K: Optional[int] = None) -> Optional[str]:
    """Why a GEMM looks like an MoE router / gate (its name, or its shape: module comment); None if not."""
    for part in (module_path or "").split("."):
        if ROUTER_NAMES.search(part.lower()):
            return f"named like a router/gate ({part!r})"
    if isinstance(N, int) and isinstance(K, int) and N <= ROUTER_MAX_N and K >= ROUTER_RATIO * N:
        return f"shaped like a router/gate: N={N} <= {ROUTER_MAX_N} outputs from K={K} >= {ROUTER_RATIO}N"
    return None


def structural_rule(*, first: bool, last: bool, module_path: str, N: Optional[int], config,
                    K: Optional[int] = None) -> Optional[tuple[str, str]]:
    """(rule, why) of the structural rule that keeps a GEMM bf16 under ``config``, or None."""
    if config.keep_last and last:
        return "keep_last", "feeds the output/loss with no GEMM between (keep_last=True)"
    if config.keep_first and first:
        return "keep_first", "the first GEMM: no GEMM before it (keep_first=True)"
    router = is_router(module_path, N, K) if config.keep_routers else None
    if router:
        return "keep_routers", f"{router} (keep_routers=True)"
    return None


def _us(seconds: float) -> str:
    us = seconds * 1e6
    return f"{us:.0f} us" if us >= 100 else f"{us:.3g} us"


def choose(M: int, K: int, N: int, errors: dict[str, float], profile: DeviceProfile, config,
           structural: Optional[tuple[str, str]] = None) -> Choice:
    """The format of one GEMM under ``config`` (an auto :class:`~amp_fx.ir.fp8_rules.Fp8Config`) on ``profile``."""
    seconds = {"bf16": layer_seconds("bf16", M, K, N, profile)}
    seconds.update({recipe: layer_seconds(recipe, M, K, N, profile) for recipe in config.choices})
    choice = Choice(None, "", "", seconds, dict(errors), M=M)
    if structural is not None:
        choice.rule, choice.why = structural
        return choice
    admissible = [r for r in config.choices if errors.get(r, float("inf")) <= config.error_budget]
    if not admissible:
        measured = ", ".join(f"{r} {errors[r]:.1%}" for r in config.choices if r in errors)
        choice.rule = "error_budget"
        choice.why = f"measured error {measured} > error_budget {config.error_budget:.1%}"
        return choice
    best = min(admissible, key=lambda r: seconds[r])
    gain = choice.gain(best)
    if gain < config.min_gain:
        choice.rule = "min_gain"
        choice.why = (f"fastest admissible {best} predicts {gain:+.1%} ({_us(seconds[best])} vs bf16 "
                      f"{_us(seconds['bf16'])}) < min_gain {config.min_gain:.0%} on {profile.name}")
        return choice
    choice.recipe, choice.rule = best, "auto"
    choice.why = (f"predicted {gain:+.1%} ({_us(seconds[best])} vs bf16 {_us(seconds['bf16'])} on {profile.name}), "
                  f"error {errors[best]:.1%} <= {config.error_budget:.1%}")
    return choice
