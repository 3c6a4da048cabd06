"""FP8 block-scaling arithmetic as Triton device functions: block scale from amax, and the
FP32 -> FP8 encoding, both exactly as :mod:`te_fused_moe.quantize.fp8_block` defines them (TE's rules).

On the GPU the encoding is the hardware's ``cvt.rn.satfinite`` (``.to(tl.float8e4nv)``: round to
nearest even, satfinite, two values per instruction). Under Triton 3.6's CPU interpreter that cast
rounds differently (a few bytes in 256 off by one ulp), so there :func:`encode_fp8` runs the same
rules on the FP32 bits (:func:`encode_fp8_bits`) and kernel bytes can be checked bit-exactly on the
CPU too. The bit path costs ~25 integer ops per element: it made the quantize passes ALU-bound
(~630 GB/s on the H200), which is why the GPU takes the cast. The GPU tests check the cast against
the reference encoder bit for bit (edge values and random FP32 bit patterns).
"""

import os

import triton
import triton.language as tl

# the hardware conversion everywhere but in the CPU interpreter (a global constexpr: jit code reads it)
NATIVE_CVT = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")


@triton.jit
def nan_free_abs(v):
    """|v| with NaN read as 0 (CUDA ``fmaxf`` amax semantics: NaN never wins a max)."""
    a = tl.abs(v)
    return tl.where(a == a, a, 0.0)


@triton.jit
def block_scale(amax, FP8_MAX: tl.constexpr, POW2: tl.constexpr, value_for_inf):
    """Quantization multiplier ``fp8_max / amax`` (TE's ``compute_scale_from_amax``) and the
    stored dequantization scale (its reciprocal). ``amax`` is NaN-free and >= 0."""
    degenerate = (amax == 0.0) | (amax == float("inf"))
    if POW2:
        return _pow2_block_scale(amax, degenerate, FP8_MAX, value_for_inf)
    safe = tl.where(degenerate, 1.0, amax)
    scale = tl.math.div_rn(tl.full(amax.shape, FP8_MAX, tl.float32), safe)
    scale = tl.where(scale == float("inf"), value_for_inf, scale)
    scale = tl.where(degenerate, 1.0, scale)
    inv = tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), scale)
    return scale, inv


@triton.jit
def _pow2_block_scale(amax, degenerate, FP8_MAX: tl.constexpr, value_for_inf):
    """:func:`block_scale` with power-of-two scales (the recipe's default), from exponent bits instead of
    two IEEE divisions, each a reciprocal, FMAs and a checked slow path, run on every thread's copy of
    the amax vector: a fifth of the quantize pass's instructions (2880 -> 2232 in its sm_90a build),
    which bound it (run 18 ncu: 0.48 issues per cycle, math-pipe throttled). On the H200 at DSv3:
    quantize 0.577 -> 0.536 ms, dGLU 1.75 -> 1.59 ms, the weight quantizer 3.73 -> 2.52 ms (run 18d).
    The same result, bit for bit (tests/test_triton_fp8_block_interpreter.py checks edge and random
    amax values and two ``value_for_inf`` against the reference):

    with ``amax = m 2^e`` and ``FP8_MAX = M 2^E`` (``m``, ``M`` in [1, 2)), ``RN(FP8_MAX / amax)``
    lies in [2^k, 2^(k+1)) for ``k = E - e - (m > M)``: ``M / m`` is in [1, 2) for ``m <= M``, and for
    ``m > M`` it is at most ``1 - 2^-23 / M < 1 - 2^-25``, so rounding never reaches 1. The quotient
    overflows to inf (scale: ``value_for_inf`` rounded down) for ``k > 127`` and for subnormal
    ``amax``; it is never subnormal (``amax <= FLT_MAX``). ``1 / 2^k`` is exact: subnormal for k = 127."""
    bits = amax.to(tl.uint32, bitcast=True)
    exp = (bits >> 23).to(tl.int32)
    max_bits = tl.full([], FP8_MAX, tl.float32).to(tl.uint32, bitcast=True)
    k = (max_bits >> 23).to(tl.int32) - exp - ((bits & 0x7FFFFF) > (max_bits & 0x7FFFFF)).to(tl.int32)
    k_inf = (tl.full([], value_for_inf, tl.float32).to(tl.uint32, bitcast=True) >> 23).to(tl.int32) - 127
    k = tl.where((k > 127) | (exp == 0), k_inf, k)
    k = tl.where(degenerate, 0, k)
    scale = ((k + 127) << 23).to(tl.float32, bitcast=True)
    inv = tl.where(k <= 126, (127 - k) << 23, 1 << (149 - k)).to(tl.float32, bitcast=True)
    return scale, inv


@triton.jit
def encode_fp8(v, MANT: tl.constexpr, BIAS: tl.constexpr, FP8_MAX: tl.constexpr):
    """uint8 code of FP32 ``v`` in the FP8 format (see :func:`encode_fp8_bits` for the rules)."""
    if NATIVE_CVT:
        if MANT == 3:
            codes = v.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
        else:
            codes = v.to(tl.float8e5, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
        # cvt keeps a NaN's sign (0xFF); the rules (TE's) give the positive 0x7F
        return tl.where(v != v, 0x7F, codes).to(tl.uint8)
    else:
        return encode_fp8_bits(v, MANT, BIAS, FP8_MAX)


@triton.jit
def encode_fp8_bits(v, MANT: tl.constexpr, BIAS: tl.constexpr, FP8_MAX: tl.constexpr):
    """uint8 code of FP32 ``v`` in the FP8 format with ``MANT`` mantissa bits and exponent ``BIAS``
    (E4M3: 3, 7, 448; E5M2: 2, 15, 57344): nearest, ties to even, satfinite, NaN -> 0x7F, sign of
    zero kept."""
    bits = v.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    is_nan = v != v
    a = tl.minimum(tl.abs(v), FP8_MAX)  # satfinite; NaN handled by is_nan
    a = tl.where(is_nan, 0.0, a)
    abits = a.to(tl.uint32, bitcast=True)
    exp32 = (abits >> 23).to(tl.int32)  # biased FP32 exponent
    SHIFT: tl.constexpr = 23 - MANT
    # normal in FP8: drop SHIFT mantissa bits with round-to-nearest-even (a carry bumps the exponent)
    rounded = (abits + ((1 << (SHIFT - 1)) - 1) + ((abits >> SHIFT) & 1)) >> SHIFT
    normal_code = rounded.to(tl.int32) - ((127 - BIAS) << MANT)
    # subnormal in FP8 (exponent below 1 - BIAS): integer multiple of 2^(1 - BIAS - MANT), RNE
    sig = (abits & 0x7FFFFF) | 0x800000
    s = tl.minimum(tl.maximum(SHIFT + (1 - BIAS) - (exp32 - 127), 1), 31).to(tl.uint32)  # only used when > SHIFT
    half = (tl.full(s.shape, 1, tl.uint32) << (s - 1)) - 1
    sub_code = ((sig + half + ((sig >> s) & 1)) >> s).to(tl.int32)
    code = tl.where(exp32 - 127 >= 1 - BIAS, normal_code, sub_code)
    code = tl.where(exp32 == 0, 0, code)  # FP32 zero/subnormal inputs round to zero
    code = code | sign.to(tl.int32)
    code = tl.where(is_nan, 0x7F, code)
    return code.to(tl.uint8)
