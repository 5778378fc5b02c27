"""A roofline time model of one linear layer's three GEMMs in bf16 and under each fp8 recipe, per device profile.

A layer ``y = x @ W.t()`` with ``x`` M x K and ``W`` N x K runs three GEMMs
per training step, each ``2 M K N`` FLOPs: the forward (M x K by K x N),
grad_input (M x N by N x K) and grad_weight (N x M by M x K).  Each GEMM takes
``max(FLOPs / peak, bytes / bandwidth)``: peak is the profile's dense bf16 or
fp8 tensor-core rate, bytes are its operands (2 bytes an element in bf16, 1 in
fp8) and its bf16 result.  fp8 adds the casts, which are memory-bound kernels
counted as bytes moved (:data:`QUANT_BYTES` an element: the amax read, the
scale-and-cast read, the fp8 write), per recipe:

- ``tensorwise``: x, W and grad_output quantized once each, written in both
  layouts their two GEMMs take (one more byte an element);
- ``rowwise``: each operand quantized twice (scaled along a different dim for
  each GEMM it feeds), and the two backward GEMMs' row scales applied to their
  results after the kernel (a bf16 read and write of the result);
- ``rowwise_with_gw_hp``: x and grad_output rowwise once, W rowwise (forward)
  and tensorwise (grad_input); grad_weight a bf16 GEMM; grad_input's result scaled after.

The model is a bound, not a measurement: real kernels reach a fraction of peak
(less for small GEMMs), so its use is the *ratio* fp8 / bf16 per GEMM.  Pure
arithmetic (no torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from amp_fx.errors import AmpValueError

__all__ = ["DeviceProfile", "DEVICES", "device_profile", "gemm_seconds", "layer_seconds", "QUANT_BYTES", "FORMATS"]

QUANT_BYTES = 5  # one quantization, per element: read bf16 for the amax (2), read again to scale and cast (2), write e4m3 (1)
FORMATS = ("bf16", "tensorwise", "rowwise", "rowwise_with_gw_hp")


@dataclass(frozen=True)
class DeviceProfile:
    """A GPU's dense peak rates (public datasheet figures, no sparsity) and its memory bandwidth."""

    name: str
    bf16_flops: float  # FLOP/s, dense bf16 tensor core
    fp8_flops: float  # FLOP/s, dense fp8 tensor core
    bandwidth: float  # bytes/s, HBM


# NVIDIA datasheets, dense figures (the sheets print sparse rates, twice these): H100 SXM5 and H200 SXM share the
# Hopper tensor cores and differ in HBM (3.35 vs 4.8 TB/s); B200 (HGX) doubles both rates, 8 TB/s of HBM3e.
DEVICES = {
    "h100": DeviceProfile("h100", 989.4e12, 1978.9e12, 3.35e12),
    "h200": DeviceProfile("h200", 989.4e12, 1978.9e12, 4.8e12),
    "b200": DeviceProfile("b200", 2.25e15, 4.5e15, 8.0e12),
}


def device_profile(device: Union[str, DeviceProfile]) -> Optional[DeviceProfile]:
    """The profile named ``device`` (``"h100"``, ``"h200"``, ``"b200"``) or ``device`` itself; None if unknown."""
    if isinstance(device, DeviceProfile):
        return device
    return DEVICES.get(str(device).lower())


def gemm_seconds(m: int, k: int, n: int, profile: DeviceProfile, fp8: bool) -> float:
    """One (m x k) @ (k x n) GEMM on the roofline: compute- or memory-bound, whichever is slower; bf16 result."""
    flops = 2.0 * m * k * n
    operand_bytes = (1 if fp8 else 2) * (m * k + k * n)
    moved = operand_bytes + 2 * m * n
    return max(flops / (profile.fp8_flops if fp8 else profile.bf16_flops), moved / profile.bandwidth)


def _cast_bytes(recipe: str, M: int, K: int, N: int) -> float:
    """Bytes the recipe's casts move for one layer step (module docstring)."""
    x, w, g = M * K, K * N, M * N
    if recipe == "tensorwise":
        return (QUANT_BYTES + 1) * (x + w + g)
    if recipe == "rowwise":
        return 2 * QUANT_BYTES * (x + w + g) + 4 * (M * K + N * K)  # + the post-scaled grad_input and grad_weight
    if recipe == "rowwise_with_gw_hp":
        return QUANT_BYTES * (x + 2 * w + g) + 4 * M * K  # + the post-scaled grad_input
    raise AmpValueError(f"no cost model for fp8 recipe {recipe!r}; it models {FORMATS[1:]}")


def layer_seconds(fmt: str, M: int, K: int, N: int, profile: DeviceProfile) -> float:
    """Predicted seconds of one layer's forward and two backward GEMMs in ``fmt`` (bf16 or an fp8 recipe), casts included."""
    forward, grad_input, grad_weight = (M, K, N), (M, N, K), (N, M, K)
    if fmt == "bf16":
        return sum(gemm_seconds(*shape, profile, fp8=False) for shape in (forward, grad_input, grad_weight))
    gemms = gemm_seconds(*forward, profile, fp8=True) + gemm_seconds(*grad_input, profile, fp8=True)
    gemms += gemm_seconds(*grad_weight, profile, fp8=fmt != "rowwise_with_gw_hp")
    return gemms + _cast_bytes(fmt, M, K, N) / profile.bandwidth
