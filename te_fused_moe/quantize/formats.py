"""Element formats: E4M3, E5M2 (FP8), E2M1 (FP4) and E8M0 (power-of-two scales).

Everything here works on float32 tensors with plain torch ops (CPU or GPU, no host syncs) and
returns bit codes as ``torch.uint8``.

Rounding and saturation (the rules of TE's CUDA casts; see the module docstrings of ``mxfp8``,
``nvfp4`` and ``fp8_block`` for where each cast is used):

* E4M3 / E5M2 / E2M1 (:func:`encode`): round to nearest, ties to even, with **saturation to the
  largest finite value** (``satfinite``): finite values and ±Inf beyond the range become ±max
  (E4M3 448, E5M2 57344, E2M1 6). TE casts with ``cvt.rn.satfinite.{e4m3x2,e5m2x2,e2m1x2}.f32``
  and ``static_cast<fp8e4m3>`` (``__NV_SATFINITE``) in ``transformer_engine/common/util/ptx.cuh``.
  Subnormals of the format are produced (no flush to zero). The sign of zero is kept (a negative
  value that rounds to zero gives -0), as the hardware cast does. NaN gives the canonical NaN
  ``0x7F`` for E4M3/E5M2; E2M1 has no NaN and NaN gives +6 (code ``0x7``), the satfinite rule
  TE documents next to ``stochastic_round_fp4_e2m1`` in ``ptx.cuh``. (TE's pure-PyTorch
  reference ``pytorch/custom_recipes/reference_nvfp4.py:cast_to_fp4x2`` differs only in mapping
  -0.0 to +0 and NaN to +0.)
* E2M1 stochastic rounding (:func:`stochastic_round_e2m1`): TE's software definition
  ``stochastic_round_fp4_e2m1`` in ``ptx.cuh`` (8 random bits per element, the operand width of
  ``cvt.rs.satfinite.e2m1x4.f32``): ``t = fma(u, step(|x|), |x|)`` with ``u = rbits / 256``, then
  floor ``t`` onto the E2M1 grid at ``t``'s own step, saturate to 6, keep the sign, NaN -> +6.
* E8M0 (:func:`e8m0_encode`): round **up** to a power of two with satfinite, TE's
  ``float_to_e8m0`` (``transformer_engine/common/util/ptx_arch_spec.cuh``, ``cvt.rp.satfinite.
  ue8m0x2.f32`` on Blackwell): 0 -> 0 (2^-127), values <= 2^-127 -> 0, NaN -> 255, +Inf and
  values above 2^127 -> 254 (2^127). :func:`e8m0_reciprocal` is TE's ``exp2f_rcp`` (``ptx.cuh``).

Inputs to these functions are float32; callers round wider inputs to float32 first, as TE's
kernels compute in float32.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

FLOAT32_MAX = float(torch.finfo(torch.float32).max)


@dataclasses.dataclass(frozen=True)
class ElementFormat:
    """A small binary float format: sign bit, ``exponent_bits``, ``mantissa_bits``, ``bias``.

    ``max_value`` is the largest finite value; ``nan_code`` is the code NaN encodes to, or None for
    a format without NaN (E2M1), where NaN saturates to +max as TE's satfinite casts do."""

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    max_value: float
    nan_code: Optional[int]
    torch_dtype: Optional[torch.dtype]

    @property
    def min_normal_exponent(self) -> int:
        return 1 - self.bias

    @property
    def sign_bit(self) -> int:
        return 1 << (self.exponent_bits + self.mantissa_bits)

    def decode_code(self, code: int) -> float:
        """Value of one bit code (Python float); used to build the decode table."""
        sign = -1.0 if code & self.sign_bit else 1.0
        magnitude = code & (self.sign_bit - 1)
        exp_field = magnitude >> self.mantissa_bits
        mantissa = magnitude & ((1 << self.mantissa_bits) - 1)
        if self.nan_code is not None and (magnitude == self.nan_code or self._is_special(exp_field, mantissa)):
            return float("nan")
        if self.name == "e5m2" and exp_field == (1 << self.exponent_bits) - 1 and mantissa == 0:
            return sign * float("inf")
        if exp_field == 0:
            return sign * mantissa * 2.0 ** (self.min_normal_exponent - self.mantissa_bits)
        return sign * (1.0 + mantissa / (1 << self.mantissa_bits)) * 2.0 ** (exp_field - self.bias)

    def _is_special(self, exp_field: int, mantissa: int) -> bool:
        # E5M2 (IEEE-like): all-ones exponent with a non-zero mantissa is NaN.
        return self.name == "e5m2" and exp_field == (1 << self.exponent_bits) - 1 and mantissa != 0


E4M3 = ElementFormat("e4m3", 4, 3, 7, 448.0, 0x7F, torch.float8_e4m3fn)
E5M2 = ElementFormat("e5m2", 5, 2, 15, 57344.0, 0x7F, torch.float8_e5m2)
E2M1 = ElementFormat("e2m1", 2, 1, 1, 6.0, None, None)

FP8_FORMATS = {"e4m3": E4M3, "e5m2": E5M2}


def fp8_format(name: str) -> ElementFormat:
    """The FP8 element format called ``name`` (``"e4m3"`` or ``"e5m2"``)."""
    if not isinstance(name, str) or name.lower() not in FP8_FORMATS:
        raise ValueError(f"fp8_format: expected 'e4m3' or 'e5m2', got {name!r}")
    return FP8_FORMATS[name.lower()]


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """2**exponent as float32, built from bits (exact); exponent must lie in [-126, 127]."""
    return ((exponent.to(torch.int32) + 127) << 23).view(torch.float32)


def round_to_format(x: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """Nearest value of ``fmt`` (ties to even, satfinite), as float32; NaN stays NaN here."""
    _require_float32("x", x)
    # Anything above 2*max saturates anyway; clamping first keeps a/quantum finite.
    a = torch.clamp(x.abs(), max=2.0 * fmt.max_value)
    _, e = torch.frexp(a)  # a = m * 2**e with m in [0.5, 1): unbiased exponent is e - 1
    exponent = torch.clamp(e - 1, min=fmt.min_normal_exponent)
    quantum = _pow2(exponent - fmt.mantissa_bits)
    rounded = torch.round(a / quantum) * quantum  # torch.round: half to even; a/quantum is exact
    rounded = torch.clamp(rounded, max=fmt.max_value)
    return torch.copysign(rounded, x)


def encode(x: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """Bit codes (uint8) of float32 ``x`` in ``fmt``: RNE, satfinite, NaN rule of the module doc."""
    value = round_to_format(x, fmt).abs()
    return _codes_of_representable(value, torch.signbit(x), torch.isnan(x), fmt)


def _codes_of_representable(
    value: torch.Tensor, negative: torch.Tensor, nan: torch.Tensor, fmt: ElementFormat
) -> torch.Tensor:
    # value >= 0 is exactly representable in fmt (or NaN, handled by the mask).
    value = torch.where(nan, torch.zeros_like(value), value)
    _, e = torch.frexp(value)
    exponent = torch.clamp(e - 1, min=fmt.min_normal_exponent)
    normal = value >= 2.0 ** fmt.min_normal_exponent
    exp_field = torch.where(normal, exponent + fmt.bias, torch.zeros_like(exponent))
    significand = value / _pow2(exponent - fmt.mantissa_bits)  # integer in [0, 2**(m+1))
    mantissa = torch.where(normal, significand - (1 << fmt.mantissa_bits), significand)
    code = (exp_field << fmt.mantissa_bits) | mantissa.to(torch.int32)
    code = torch.where(negative, code | fmt.sign_bit, code)
    nan_code = fmt.nan_code if fmt.nan_code is not None else _max_code(fmt)
    code = torch.where(nan, torch.full_like(code, nan_code), code)
    return code.to(torch.uint8)


def _max_code(fmt: ElementFormat) -> int:
    return max(c for c in range(fmt.sign_bit) if fmt.decode_code(c) == fmt.max_value)


_DECODE_TABLES: dict = {}


def decode_table(fmt: ElementFormat, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Value of every code of ``fmt`` (index = code), cached per device and dtype."""
    key = (fmt.name, str(device), dtype)
    if key not in _DECODE_TABLES:
        values = [fmt.decode_code(c) for c in range(2 * fmt.sign_bit)]
        _DECODE_TABLES[key] = torch.tensor(values, dtype=dtype, device=device)
    return _DECODE_TABLES[key]


def decode(codes: torch.Tensor, fmt: ElementFormat, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values (``dtype``, float32 by default) of uint8 ``codes`` in ``fmt``."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes: expected torch.uint8 bit codes, got {codes.dtype}")
    return decode_table(fmt, codes.device, dtype)[codes.long()]


def codes_to_fp8(codes: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """Reinterpret uint8 codes as the torch float8 dtype of ``fmt`` (no rounding)."""
    return codes.view(fmt.torch_dtype)


def fp8_to_codes(data: torch.Tensor) -> torch.Tensor:
    return data.view(torch.uint8)


def stochastic_round_e2m1(x: torch.Tensor, random_bits: torch.Tensor) -> torch.Tensor:
    """E2M1 codes of float32 ``x`` rounded stochastically with 8 random bits per element
    (uint8 ``random_bits``, same shape): TE's ``stochastic_round_fp4_e2m1`` (``ptx.cuh``).

    ``|x|`` rounds up to its upper E2M1 neighbour with probability ``floor-ish(256·frac)/256``
    where ``frac`` is its position between the two neighbours, so the bias is below 1/256 of a
    grid step; values on the grid are returned unchanged."""
    _require_float32("x", x)
    if random_bits.dtype != torch.uint8 or random_bits.shape != x.shape:
        raise ValueError(
            f"random_bits: expected a uint8 tensor of shape {tuple(x.shape)}, got "
            f"{random_bits.dtype} {tuple(random_bits.shape)}"
        )
    a = x.abs()
    u = random_bits.to(torch.float32) * (1.0 / 256.0)
    t = a + u * _e2m1_step(a)  # u*step is exact, so this is fmaf's single rounding
    step_t = _e2m1_step(t)
    q = torch.fmin(torch.floor(t / step_t) * step_t, torch.full_like(t, E2M1.max_value))  # fmin: NaN -> 6
    nan = torch.isnan(x)
    q = torch.copysign(q, torch.where(nan, torch.ones_like(x), x))
    return _codes_of_representable(q.abs(), torch.signbit(q), torch.zeros_like(nan), E2M1)


def _e2m1_step(a: torch.Tensor) -> torch.Tensor:
    # Grid spacing of E2M1 at magnitude a: 0.5 below 2, 1 in [2, 4), 2 from 4 on.
    return torch.where(a >= 4.0, 2.0, torch.where(a >= 2.0, 1.0, 0.5)).to(torch.float32)


def e8m0_encode(v: torch.Tensor) -> torch.Tensor:
    """E8M0 biased exponent (uint8) of non-negative float32 ``v``, rounded up, satfinite."""
    _require_float32("v", v)
    bits = v.contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    round_up = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
    code = exponent + round_up.to(torch.int32)
    code = torch.where(torch.isinf(v), torch.full_like(code, 0xFE), code)
    code = torch.where(torch.isnan(v), torch.full_like(code, 0xFF), code)
    return code.to(torch.uint8)


def e8m0_decode(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """2**(code - 127) (code 255 is NaN), in ``dtype``."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes: expected torch.uint8 E8M0 exponents, got {codes.dtype}")
    e = codes.to(torch.int32)
    value = torch.ldexp(torch.ones_like(e, dtype=torch.float64), e - 127)  # exact in float64
    value = torch.where(e == 255, torch.full_like(value, float("nan")), value)
    return value.to(dtype)


def e8m0_reciprocal(codes: torch.Tensor) -> torch.Tensor:
    """2**(127 - code) as float32 (2**-127 is a float32 subnormal; code 255 gives NaN): TE's
    ``exp2f_rcp<float>``, the multiplier MXFP8 applies before the FP8 cast."""
    return e8m0_decode(254 - codes.clamp(max=254), torch.float32).where(
        codes != 255, torch.full((), float("nan"), device=codes.device)
    )


def nan_ignoring_amax(x: torch.Tensor, dim) -> torch.Tensor:
    """max |x| over ``dim``, skipping NaN (CUDA ``fmaxf``/``__hmax`` semantics, which TE's amax
    reductions use); a block of NaN or zeros has amax 0."""
    a = x.abs()
    a = torch.where(torch.isnan(a), torch.zeros_like(a), a)
    return torch.amax(a, dim=dim)


def _require_float32(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.float32:
        raise TypeError(f"{name}: expected a float32 tensor, got {x.dtype}")
