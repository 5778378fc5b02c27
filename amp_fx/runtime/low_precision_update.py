"""Rounding fp32 values into bf16/fp16 without bias: stochastic rounding and a compensated split.

Two ways to keep small updates that round-to-nearest would drop (bf16 keeps 8
significant bits, so ``w + u`` rounds back to ``w`` whenever ``|u|`` is below
about ``|w| * 2**-9``):

* :func:`stochastic_round` rounds up or down at random, with the probability of
  rounding up equal to the distance from the lower neighbour in ulps, so the
  expected result is the exact value. Driven by a seeded ``torch.Generator``:
  the same generator state gives the same bits.
* :func:`split_compensated` / :func:`merge_compensated` keep Kahan's
  compensation term: the error the last rounding made, ``c = x - round(x)``.
  It is stored as a 16-bit integer counting 1/65536ths of the weight's ulp,
  not as a bf16 float, because a bf16 ``c`` keeps only 8 bits of that error:
  adding 1e-3 to 1.0 100,000 times then ends at 99.06 instead of 100.96 (the
  increment is absorbed as 2**-10, 2.3% short, whenever ``|c| > 0.06``). With
  the integer form, ``merge(split(x)) == x`` bit for bit for bf16, so weight
  plus compensation are exactly the fp32 value, in 4 bytes instead of 2 + 4.

:func:`compensated_add_` is the Kahan-compensated ``low += delta`` built from
the two.
"""

from __future__ import annotations

import torch

from amp_fx.errors import AmpTypeError, AmpValueError

__all__ = [
    "COMPENSATION_DTYPE",
    "stochastic_round",
    "split_compensated",
    "merge_compensated",
    "compensated_add_",
    "random_uint16",
]

COMPENSATION_DTYPE = torch.int16
_LOW = (torch.float16, torch.bfloat16)
# fp16: significand bits after the leading one, and log2 of the smallest (subnormal) spacing.
_FP16_GRID = (10, -24)


def _check(x: torch.Tensor, dtype: torch.dtype) -> None:
    if x.dtype != torch.float32:
        raise AmpTypeError(f"rounding into {dtype} takes a float32 tensor, got {x.dtype}")
    if dtype not in _LOW:
        raise AmpTypeError(f"can only round into float16 or bfloat16, got {dtype}")


def random_uint16(numel: int, generator: torch.Generator, device: torch.device | str = "cpu") -> torch.Tensor:
    """``numel`` uniformly random integers in ``[0, 65536)``, as int32, drawn from ``generator``.

    Large draws come as full-range int64 words, each split into four 16-bit
    values: the generator (the cost, on a CPU) runs a quarter as often as
    ``torch.randint`` would. Small ones, where the call count is the cost,
    come from one ``randint``.
    """
    if numel < 4096:
        return torch.randint(0, 65536, (numel,), generator=generator, device=device, dtype=torch.int32)
    half = -(-numel // 4) * 2  # even, so the int64 words below start 8-byte aligned
    out = torch.empty(2 * half, dtype=torch.int32, device=device)
    low, high = out[:half], out[half:]
    high.view(torch.int64).random_(-(2**63), None, generator=generator)  # 32 random bits per int32
    torch.bitwise_right_shift(high, 16, out=low)  # the top 16 bits (arithmetic shift; masked next)
    low.bitwise_and_(0xFFFF)
    high.bitwise_and_(0xFFFF)
    return out[:numel]


def stochastic_round(
    x: torch.Tensor,
    dtype: torch.dtype,
    generator: torch.Generator,
    out: torch.Tensor | None = None,
    inplace: bool = False,
) -> torch.Tensor:
    """Round float32 ``x`` into ``dtype`` (bf16/fp16) stochastically: unbiased, ``E[result] == x``.

    ``generator`` (on ``x``'s device) supplies the random bits, so a run is
    reproducible from the generator's state. ``out`` (a ``dtype`` tensor of
    ``x``'s shape) receives the result; ``inplace=True`` lets the bf16 path
    use ``x`` as scratch (its contents are then lost). inf and NaN come back
    unchanged; a finite value may round up to inf past the largest finite
    value, with the probability its distance from it says.
    """
    _check(x, dtype)
    if out is not None and (out.dtype != dtype or out.shape != x.shape):
        raise AmpValueError(f"out must be {dtype} of shape {tuple(x.shape)}, got {out.dtype} {tuple(out.shape)}")
    with torch.no_grad():
        if dtype == torch.bfloat16:
            return _stochastic_round_bf16(x if inplace else x.clone(), out, generator)
        return _stochastic_round_grid(x, dtype, out, generator)


def _canonical_nan_(x: torch.Tensor) -> torch.Tensor:
    # Every NaN becomes 0x7FC00000, so the bit tricks below cannot carry a NaN's
    # payload into the sign bit (CUDA's NaN is 0x7FFFFFFF) or clear it into inf.
    return x.nan_to_num_(nan=float("nan"), posinf=float("inf"), neginf=float("-inf"))


def _stochastic_round_bf16(x: torch.Tensor, out: torch.Tensor | None, generator: torch.Generator) -> torch.Tensor:
    # bf16 is the top half of fp32: adding a uniform 16-bit integer to the low
    # half carries into the top half with probability low/65536, and clearing
    # the low half then leaves exactly a bf16 value. Sign-magnitude makes this
    # round |x| up, i.e. away from zero, as the probability requires.
    # Everything runs in place on x (fresh large buffers cost page faults).
    if not x.is_contiguous():
        x = x.contiguous()
    bits = _canonical_nan_(x).view(torch.int32)
    bits.view(-1).add_(random_uint16(x.numel(), generator, x.device))
    bits.bitwise_and_(-65536)
    # Exact: the low half is zero.
    return x.to(torch.bfloat16) if out is None else out.copy_(x)


def _spacing_exponent(x: torch.Tensor) -> torch.Tensor:
    """log2 of the spacing of fp16 values at ``|x|`` (int32 tensor), for finite float32 ``x``."""
    mantissa_bits, smallest = _FP16_GRID
    _, exponent = torch.frexp(x)  # |x| in [2**(e-1), 2**e); frexp(0) gives e=0
    spacing = exponent - (mantissa_bits + 1)
    spacing.masked_fill_(x == 0, smallest)
    return spacing.clamp_(min=smallest)


def _stochastic_round_grid(
    x: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None, generator: torch.Generator
) -> torch.Tensor:
    # fp16 is not a truncation of fp32, so round on its grid: truncate toward
    # zero to a multiple of the spacing s, then add s with probability frac.
    # Every step is exact in fp32 (scaling by powers of two, trunc).
    spacing = torch.ldexp(torch.ones_like(x), _spacing_exponent(x))
    down = torch.trunc(x / spacing) * spacing
    frac = (x - down).abs_().div_(spacing)  # NaN for inf/NaN: never rounds up, down is x itself
    u = torch.rand(x.shape, generator=generator, device=x.device, dtype=torch.float32)
    up = (u < frac).to(torch.float32).mul_(spacing).mul_(torch.sign(x))
    down.add_(up)
    return down.to(dtype) if out is None else out.copy_(down)


def split_compensated(
    x: torch.Tensor, low: torch.Tensor, compensation: torch.Tensor, inplace: bool = False
) -> None:
    """Write ``x`` (float32) as a low-precision value plus its rounding error, in place.

    ``low`` (bf16/fp16) receives ``x`` rounded to nearest (bf16: ties away
    from zero); ``compensation`` (int16, same shape) receives ``x - low`` in
    units of ``ulp(low) / 65536``. For bf16 the pair holds ``x`` exactly; for
    fp16 too, except below fp16's smallest normal (6.1e-5), where 16 bits
    under the fixed spacing 2**-24 are kept. ``inplace=True`` lets the bf16 path reuse ``x``.
    inf and NaN get compensation 0; a finite value past bf16's largest rounds
    to inf and keeps its remainder, so merging gives the finite value back.
    """
    _check(x, low.dtype)
    if compensation.dtype != COMPENSATION_DTYPE or compensation.shape != x.shape or low.shape != x.shape:
        raise AmpValueError("low and compensation must have x's shape, compensation of dtype int16")
    with torch.no_grad():
        if low.dtype == torch.bfloat16:
            x = x.contiguous() if inplace else x.clone()
            bits = _canonical_nan_(x).view(torch.int32)  # inf and NaN then split with no remainder
            # Round the magnitude half up (sign-magnitude: away from zero), so
            # the remainder always lies in [-32768, 32767] and fits int16.
            high = torch.bitwise_right_shift(bits + 32768, 16)  # arithmetic shift keeps the sign
            low.view(torch.int16).copy_(high)
            compensation.copy_(bits.sub_(high.mul_(65536)))
        else:
            low.copy_(x)
            lowf = low.float()
            error = x - lowf  # exact: low is x's nearest neighbour
            finite = torch.isfinite(lowf)
            error.masked_fill_(~finite, 0.0)
            units = torch.ldexp(error, 16 - _spacing_exponent(lowf.masked_fill_(~finite, 1.0)))
            compensation.copy_(units.round_().clamp_(-32768, 32767))


def merge_compensated(low: torch.Tensor, compensation: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Return the float32 value ``low + compensation`` that :func:`split_compensated` stored."""
    if low.dtype not in _LOW or compensation.dtype != COMPENSATION_DTYPE:
        raise AmpTypeError(f"expected a bf16/fp16 tensor and an int16 compensation, got {low.dtype}, {compensation.dtype}")
    with torch.no_grad():
        if low.dtype == torch.bfloat16:
            # The upcast is the top half of the bits; the remainder fills the low half.
            # split_compensated stores 0 beside inf and NaN, so they come back unchanged.
            value = low.float()
            value.view(torch.int32).add_(compensation)
        else:
            lowf = low.float()
            exponent = _spacing_exponent(lowf.masked_fill(~torch.isfinite(lowf), 1.0))
            # Subtracting the negated term keeps -0.0 (-0.0 + 0.0 would be +0.0).
            value = lowf - torch.ldexp(compensation.float().neg_(), exponent - 16)
        if out is None:
            return value
        return out.copy_(value)


def compensated_add_(low: torch.Tensor, compensation: torch.Tensor, delta: torch.Tensor | float) -> torch.Tensor:
    """Kahan-compensated ``low += delta``: the rounding error carries over to the next add.

    Returns ``low``. The sum is formed in float32 from ``low`` and its
    compensation, then split again; nothing rounds away but fp32's own error.
    """
    value = merge_compensated(low, compensation)
    value.add_(delta)
    split_compensated(value, low, compensation, inplace=True)
    return low
