"""``amp_fx.explain(gm)``: per GEMM its M K N, predicted bf16 and fp8 times, chosen format, measured error, and why.

Reads what the ``fp8_gemms`` pass recorded in the conversion's report
(``report.passes["fp8_gemms"]``): every fp8-capable GEMM, its decision and
the rule behind it, the roofline model's seconds (:mod:`amp_fx.ir.fp8_cost`,
forward and both backward GEMMs) and, under ``recipe="auto"``, the
calibration's measured error per recipe (:mod:`amp_fx.ir.fp8_sensitivity`).
``explain(gm, device="b200")`` predicts the times on another profile (the
formats stay the conversion's).  Totals: GEMMs fp8 of N, the FLOP share that
runs fp8, and the predicted GEMM-time gain of the plan over all-bf16.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

from amp_fx.errors import PACKAGE, AmpTypeError
from amp_fx.ir.fp8_cost import DeviceProfile, FORMATS, device_profile, layer_seconds

__all__ = ["explain", "Fp8Explanation", "ExplainRow"]


@dataclass
class ExplainRow:
    """One GEMM: shape, predicted seconds (``bf16`` and the fp8 recipe shown), format, measured error, why."""

    name: str
    module: str
    M: Optional[int]
    K: Optional[int]
    N: Optional[int]
    format: str  # "bf16" (the low dtype) or the fp8 recipe it runs
    rule: str  # what decided it (auto, size_rule, min_gain, error_budget, keep_first, keep_last, ...)
    why: str
    bf16_s: Optional[float] = None
    fp8_s: Optional[float] = None  # the chosen recipe's, or (kept bf16) the fastest fp8 recipe's
    fp8_recipe: Optional[str] = None  # the recipe fp8_s is for
    errors: dict[str, float] = field(default_factory=dict)  # measured sensitivity per recipe (auto only)
    flops: Optional[int] = None

    @property
    def sensitivity(self) -> Optional[float]:
        """The measured error of the recipe shown (None when nothing was measured)."""
        return self.errors.get(self.fp8_recipe) if self.fp8_recipe else None


@dataclass
class Fp8Explanation:
    """The table :func:`explain` returns: ``rows`` and the totals; ``str()`` prints it."""

    rows: list[ExplainRow]
    device: str
    fp8: int
    total: int
    fp8_flop_share: Optional[float]
    bf16_s: Optional[float]  # predicted GEMM seconds, everything bf16
    plan_s: Optional[float]  # predicted GEMM seconds, as converted

    @property
    def gain(self) -> Optional[float]:
        """Predicted ``1 - plan / all-bf16`` GEMM time (None without shapes)."""
        return None if not self.bf16_s or self.plan_s is None else 1.0 - self.plan_s / self.bf16_s

    def __str__(self) -> str:
        head = (f"{'gemm':<28} {'M':>6} {'K':>6} {'N':>6} {'bf16 us':>9} {'fp8 us':>9} {'format':<19} "
                f"{'error':>6}  why")
        lines = [f"fp8 plan on {self.device} (predicted: roofline, forward + 2 backward GEMMs, casts as bytes moved)",
                 head, "-" * len(head)]
        for row in self.rows:
            label = (row.module or row.name)[-28:]
            error = "-" if row.sensitivity is None else f"{row.sensitivity:.1%}"
            fp8 = "-" if row.fp8_s is None else _us(row.fp8_s)
            if row.fp8_s is not None and row.format == "bf16":
                fp8 += "*"  # the fastest fp8 recipe's, not run
            lines.append(f"{label:<28} {_n(row.M):>6} {_n(row.K):>6} {_n(row.N):>6} "
                         f"{'-' if row.bf16_s is None else _us(row.bf16_s):>9} {fp8:>9} "
                         f"{row.format:<19} {error:>6}  {row.why}")
        share = "-" if self.fp8_flop_share is None else f"{self.fp8_flop_share:.1%}"
        gain = "-" if self.gain is None else f"{self.gain:+.1%}"
        times = "" if self.bf16_s is None else f" ({_us(self.plan_s)} us vs {_us(self.bf16_s)} us all bf16)"
        lines.append(f"{self.fp8} of {self.total} GEMMs fp8, {share} of GEMM FLOPs fp8, predicted GEMM time {gain}{times}")
        if any(row.fp8_s is not None and row.format == "bf16" for row in self.rows):
            lines.append("* a GEMM kept bf16: its fastest fp8 recipe's predicted time (and that recipe's measured error)")
        return "\n".join(lines)

    __repr__ = __str__


def _us(seconds: float) -> str:
    """Microseconds, to 0.1 us from 100 us up, else 3 significant digits."""
    us = seconds * 1e6
    return f"{us:.1f}" if us >= 100 else f"{us:.3g}"


def _n(value: Optional[int]) -> str:
    return "?" if value is None else str(value)


def _stats(target: Any) -> dict:
    report = getattr(target, "amp_report", target)
    passes = getattr(report, "passes", None)
    if not isinstance(passes, dict):
        raise AmpTypeError(f"explain takes what {PACKAGE}.convert returned (or its amp_report), got "
                           f"{type(target).__name__}")
    return passes.get("fp8_gemms") or {"gemms": [], "fp8": 0, "fp8_flop_share": None}


def _row(gemm: dict, profile: Optional[DeviceProfile]) -> ExplainRow:
    seconds = dict(gemm.get("seconds") or {})
    M, K, N = gemm.get("M"), gemm.get("K"), gemm.get("N")
    if profile is not None and all(isinstance(v, int) and v > 0 for v in (M, K, N)):
        seconds = {fmt: layer_seconds(fmt, M, K, N, profile) for fmt in FORMATS}
    recipe = gemm.get("recipe")
    errors = dict(gemm.get("errors") or {})
    shown = recipe
    if recipe is None:
        candidates = [r for r in (errors or seconds) if r != "bf16" and r in seconds]
        shown = min(candidates, key=lambda r: seconds[r]) if candidates else None
    fp8_s = seconds.get("tensorwise" if shown == "delayed" else shown) if shown else None
    return ExplainRow(name=gemm["node"], module=gemm.get("module") or "", M=M, K=K, N=N,
                      format=recipe or "bf16", rule=gemm.get("rule", ""), why=gemm.get("why", ""),
                      bf16_s=seconds.get("bf16"), fp8_s=fp8_s, fp8_recipe=shown, errors=errors, flops=gemm.get("flops"))


def explain(target: Any, device: Union[None, str, DeviceProfile] = None) -> Fp8Explanation:
    """The fp8 plan of a converted module (or its report): one :class:`ExplainRow` per GEMM, and totals.

    ``device``: predict on this profile instead of the conversion's (``"h100"``, ``"h200"``, ``"b200"``).
    """
    stats = _stats(target)
    profile = device_profile(device) if device is not None else None
    if device is not None and profile is None:
        raise AmpTypeError(f"explain(device={device!r}): no such device profile; use 'h100', 'h200', 'b200' or a "
                           f"{PACKAGE}.ir.fp8_cost.DeviceProfile")
    rows = [_row(gemm, profile) for gemm in stats.get("gemms", [])]
    share = stats.get("fp8_flop_share")
    sized = [r for r in rows if all(isinstance(v, int) for v in (r.M, r.K, r.N))]
    if sized and len(sized) == len(rows):  # the rows' own M (tokens=, or a dynamic M the calibration measured)
        share = sum(r.M * r.K * r.N for r in sized if r.format != "bf16") / sum(r.M * r.K * r.N for r in sized)
    timed = [r for r in rows if r.bf16_s is not None]
    bf16 = sum(r.bf16_s for r in timed) if timed else None
    plan = sum(r.fp8_s if r.format != "bf16" and r.fp8_s is not None else r.bf16_s for r in timed) if timed else None
    return Fp8Explanation(rows=rows, device=profile.name if profile else stats.get("device", "h100"),
                          fp8=sum(1 for r in rows if r.format != "bf16"), total=len(rows),
                          fp8_flop_share=share, bf16_s=bf16, plan_s=plan)
