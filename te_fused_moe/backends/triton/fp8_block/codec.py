"""FP8 block-scaling arithmetic as Triton device functions: block scale from amax, and the
FP32 -> FP8 encoding, both exactly as :mod:`te_fused_moe.quantize.fp8_block` defines them (TE's rules).

On the GPU the encoding is the hardware's ``cvt.rn.satfinite`` (round to nearest even, satfinite,
two values per instruction), four values per inline-PTX call with the NaN sign fixed on the packed
bytes (:func:`_cvt_x4`). Under Triton 3.6's CPU interpreter Triton's own FP8 cast rounds differently
(a few bytes in 256 off by one ulp) and there is no PTX, so there :func:`encode_fp8` runs the same
rules on the FP32 bits (:func:`encode_fp8_bits`) and kernel bytes can be checked bit-exactly on the
CPU too. The bit path costs ~25 integer ops per element: it made the quantize passes ALU-bound
(~630 GB/s on the H200), which is why the GPU takes the cvt. The GPU tests check the cvt against
the reference encoder bit for bit (edge values and random FP32 bit patterns, NaNs of both signs).

These kernels were bound by instructions more than by bytes (run 18 ncu of the quantize pass: 0.48
issues per cycle per scheduler, math-pipe throttled), so the per-value cost of each step mattered:
the power-of-two block scale comes from exponent bits (:func:`_pow2_block_scale`), not divisions.
After run 18 they are not (run 21: 41% fewer instructions in a Gluon pass changed nothing).
"""

import os

import triton
import triton.language as tl

# the hardware conversion everywhere but in the CPU interpreter (a global constexpr: jit code reads it)
NATIVE_CVT = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")


@triton.jit
def nan_free_abs(v):
    """|v| with NaN read as 0 (CUDA ``fmaxf`` amax semantics: NaN never wins a max). On the GPU one
    ``max.f32`` (NaN-ignoring, the |.| folded in) instead of a compare and a select (H200 DSv3, run
    18i: quantize 0.418 -> 0.389 ms); the CPU interpreter's maximum propagates NaN, so there the
    select stays."""
    a = tl.abs(v)
    if NATIVE_CVT:
        return tl.maximum(a, 0.0)
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
    quantize 0.577 -> 0.536 ms, dGLU 1.75 -> 1.59 ms, the weight quantizer 3.73 -> 2.52 ms (run 18f).
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
            return tl.inline_asm_elementwise(_CVT_E4M3X4, "=r,r,r,r,r", [v], dtype=tl.uint8, is_pure=True, pack=4)
        else:
            return tl.inline_asm_elementwise(_CVT_E5M2X4, "=r,r,r,r,r", [v], dtype=tl.uint8, is_pure=True, pack=4)
    else:
        return encode_fp8_bits(v, MANT, BIAS, FP8_MAX)


def _cvt_x4(fmt: str) -> str:
    """PTX: four FP32 (``$1``-``$4``) to four FP8 codes packed in ``$0`` (``$1``'s in the low byte) by the
    hardware's ``cvt.rn.satfinite`` (nearest even, satfinite), then a NaN's code made positive: cvt
    keeps a NaN's sign (0xFF) and the rules (TE's) give 0x7F. The only codes whose low 7 bits are all
    ones are the NaNs (E4M3's 0x7E is 448; E5M2's cvt gives 0x7F for NaN, never 0x7D-0x7E), so bit 7 of
    ``((w & 0x7F..) + 0x01..) & 0x80..`` marks them: four integer ops per four codes, where a select
    per code after unpacking cost ~10 instructions per four (the quantize pass's sm_90a build: 2232 ->
    1720 instructions with the column codes' row mask moved before the cvt; H200 DSv3, run 18g:
    0.536 -> 0.418 ms)."""
    return ("{ .reg .b16 lo, hi; .reg .b32 w, t;\n"
            f"cvt.rn.satfinite.{fmt}x2.f32 lo, $2, $1;\n"
            f"cvt.rn.satfinite.{fmt}x2.f32 hi, $4, $3;\n"
            "mov.b32 w, {lo, hi};\n"
            "and.b32 t, w, 0x7F7F7F7F;\n"
            "add.u32 t, t, 0x01010101;\n"
            "and.b32 t, t, 0x80808080;\n"
            "not.b32 t, t;\n"
            "and.b32 $0, w, t; }")


_CVT_E4M3X4 = tl.constexpr(_cvt_x4("e4m3"))
_CVT_E5M2X4 = tl.constexpr(_cvt_x4("e5m2"))


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
