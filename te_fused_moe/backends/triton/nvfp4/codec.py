"""NVFP4 arithmetic as Triton device functions, bit-exact with :mod:`te_fused_moe.quantize.nvfp4`
(TE's rules, restated there): the FP32 tensor scales from a tensor amax, the E4M3 block scale and
encode multiplier of a 1x16 block, the E2M1 encodings (nearest-even and stochastic) and the
expansion of packed E2M1 codes times their block scales to BF16 for the GEMMs.

Hopper has no FP4 conversion instruction (``cvt.rn.satfinite.e2m1x2.f32`` is sm_100+), so the
E2M1 rounding is FP32 rounding at the grid's spacing (:func:`e2m1_round_magnitude`); the E4M3 scale cast
is ``fp8_block.codec.encode_fp8`` (the hardware ``cvt`` on the GPU).
"""

import triton
import triton.language as tl

from ..fp8_block.codec import encode_fp8

# global constexprs: jit code reads them
E2M1_MAX = tl.constexpr(6.0)
E4M3_MAX = tl.constexpr(448.0)
FLOAT32_MAX = tl.constexpr(3.4028234663852886e38)
ENCODE_NUMERATOR = tl.constexpr(2688.0)  # E4M3_MAX * E2M1_MAX
DEQUANT_FACTOR = tl.constexpr(1.0 / 2688.0)  # TE's fp32(1 / (6 * 448)): dequantization multiplies by amax * this


@triton.jit
def tensor_scales(amax):
    """(S_enc, S_dec) of a NaN-free tensor amax >= 0: ``S_enc = min(2688 / amax, FLT_MAX)``, 1 when
    amax is 0 or Inf; ``S_dec = 1 / S_enc`` (FP32, rounded to nearest)."""
    s_enc = tl.math.div_rn(tl.full(amax.shape, ENCODE_NUMERATOR, tl.float32), amax)
    s_enc = tl.minimum(s_enc, FLOAT32_MAX)
    s_enc = tl.where((amax == 0.0) | (s_enc == 0.0), 1.0, s_enc)
    return s_enc, tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), s_enc)


@triton.jit
def e4m3_to_float(code):
    """FP32 value of a non-negative E4M3 code: a block scale (never NaN: the quantizers' scales are
    satfinite; the sign bit is not read)."""
    c = code.to(tl.int32)
    e = (c >> 3) & 0xF
    m = c & 7
    significand = tl.where(e == 0, m, m + 8).to(tl.float32)
    pow2 = ((tl.maximum(e, 1) - 10 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(e - 10), e >= 1
    return significand * pow2


@triton.jit
def e4m3_signed_to_float(code):
    """FP32 value of any finite E4M3 code, sign included: the expansions decode with this. It repeats
    :func:`e4m3_to_float` instead of calling it because that changes the GEMMs' SASS, and this build
    is the one run 14d verified on the H200 (the quantizers keep the unsigned one for the same reason:
    run 14a's build)."""
    c = code.to(tl.int32)
    e = (c >> 3) & 0xF
    m = c & 7
    significand = tl.where(e == 0, m, m + 8).to(tl.float32)
    pow2 = ((tl.maximum(e, 1) - 10 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(e - 10), e >= 1
    return tl.where((c & 0x80) != 0, -significand, significand) * pow2


@triton.jit
def block_scale(block_amax, s_enc, s_dec):
    """(E4M3 scale code, encode multiplier) of 1x16 blocks with NaN-free ``block_amax``:
    ``s = e4m3(min(block_amax * (S_enc * fp32(1/6)), FLT_MAX))``, ``r = min(1 / (s * S_dec), FLT_MAX)``."""
    multiplier = s_enc * (1.0 / 6.0)
    code = encode_fp8(tl.minimum(block_amax * multiplier, FLOAT32_MAX), 3, 7, E4M3_MAX)
    r = tl.math.div_rn(tl.full(block_amax.shape, 1.0, tl.float32), e4m3_to_float(code) * s_dec)
    return code, tl.minimum(r, FLOAT32_MAX)


@triton.jit
def e2m1_round_magnitude(a):
    """Non-negative FP32 ``a`` rounded onto the E2M1 grid (0, 0.5, 1, 1.5, 2, 3, 4, 6), nearest, ties
    to even, saturated to 6. Adding and subtracting 2^22, 2^23 or 2^24 makes FP32 round at the grid's
    spacing there (0.5 below 2, 1 below 4, 2 from 4 on), and an even E2M1 code is an even multiple
    of that spacing, so FP32's ties-to-even are E2M1's. Two selects and two adds instead of seven
    compares against the midpoints (the NVFP4 quantize passes are bound by instructions)."""
    magic = tl.where(a >= 4.0, 16777216.0, tl.where(a >= 2.0, 8388608.0, 4194304.0))
    return tl.minimum((a + magic) - magic, E2M1_MAX)


@triton.jit
def e2m1_grid_code(q):
    """Magnitude code of FP32 ``q`` on the E2M1 grid: from 1 on, its exponent and first mantissa bit
    (bits >> 22 is 254 for 1.0, 255 for 1.5, ... 259 for 6.0: codes 2 to 7); 0.5 -> 1, 0 -> 0."""
    code = (q.to(tl.int32, bitcast=True) >> 22) - 252
    return tl.maximum(code, 0) + (q == 0.5).to(tl.int32)


@triton.jit
def e2m1_encode(v):
    """uint8 E2M1 code (sign bit 3) of FP32 ``v``: nearest, ties to even, satfinite to +-6, NaN -> +6,
    sign of zero kept."""
    mag = e2m1_grid_code(e2m1_round_magnitude(tl.abs(v)))
    sign = ((v.to(tl.uint32, bitcast=True) >> 28) & 8).to(tl.int32)
    return tl.where(v != v, 7, mag | sign).to(tl.uint8)


@triton.jit
def e2m1_step(a):
    """E2M1 grid spacing at magnitude ``a``: 0.5 below 2, 1 in [2, 4), 2 from 4 on."""
    return tl.where(a >= 4.0, 2.0, tl.where(a >= 2.0, 1.0, 0.5))


@triton.jit
def e2m1_encode_stochastic(v, bits):
    """E2M1 code of FP32 ``v`` rounded stochastically with 8 random bits per element (``bits`` int32
    in [0, 256)): TE's ``stochastic_round_fp4_e2m1`` as :func:`formats.stochastic_round_e2m1`
    defines it: ``t = |v| + (bits / 256) * step(|v|)``, floored onto the grid at ``t``'s step,
    saturated to 6, the sign of ``v`` kept; NaN -> +6."""
    a = tl.abs(v)
    t = a + (bits.to(tl.float32) * (1.0 / 256.0)) * e2m1_step(a)
    step = e2m1_step(t)
    # t / step without a division: step is a power of two, so t * (1 / step) is the same FP32 value
    per_step = tl.where(t >= 4.0, 0.5, tl.where(t >= 2.0, 1.0, 2.0))
    q = tl.minimum(tl.floor(t * per_step) * step, E2M1_MAX)
    sign = ((v.to(tl.uint32, bitcast=True) >> 28) & 8).to(tl.int32)
    code = e2m1_grid_code(q) | sign
    return tl.where(v != v, 7, code).to(tl.uint8)


@triton.jit
def pack_pairs(codes, ROWS: tl.constexpr, COLS: tl.constexpr):
    """[ROWS, COLS] E2M1 codes -> [ROWS, COLS / 2] bytes: element 2j in the low nibble of byte j."""
    lo, hi = tl.split(tl.reshape(codes.to(tl.uint8), (ROWS, COLS // 2, 2)))
    return lo | (hi << 4)


@triton.jit
def e2m1_values(c, UPCAST: tl.constexpr):
    """E2M1 codes ``c`` (uint8 nibbles) as FP32 values / 64, through the hardware FP8 conversion:
    the code's magnitude bits (e1 e0 m) placed at bits 4..2 of a byte make an E4M3 number whose
    value is exactly the E2M1 value times 2^-6 (exponent e - 7, or the subnormal m * 2^-7 for
    e = 0), and bit 3 of the code moves to the sign bit."""
    byte = ((c & 7) << 2) | ((c & 8) << 4)
    if UPCAST:  # the interpreter: the same number from its bits
        return e4m3_signed_to_float(byte)
    else:
        return byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def e2m1_expand_halves(packed, scale_codes, ROWS: tl.constexpr, COLS: tl.constexpr, UPCAST: tl.constexpr):
    """Packed E2M1 tile ``packed`` [ROWS, COLS / 2] (uint8) times its E4M3 block scales
    ``scale_codes`` [ROWS, COLS / 16] as two BF16 [ROWS, COLS / 2] tiles (FP32 under the
    interpreter): the even elements (low nibbles) and the odd ones (high nibbles). Exact: an E2M1
    value (2 significant bits) times an E4M3 scale (4) fits BF16's 8.

    The halves are not interleaved back: a GEMM reduces over K in any order, so it runs one dot per
    half with both operands split alike. That saves the interleaving shuffle (though on the H200 the
    K loops were no faster for it, run 14b: the expansion's arithmetic bounds them) and lets the
    weight cache store BF16 values in the same split order. Byte j holds elements 2j, 2j + 1, both
    in block j // 8."""
    scale = (e4m3_signed_to_float(scale_codes) * 64.0)[:, :, None]  # x 64 undoes e2m1_values' 2^-6
    even = tl.reshape(tl.reshape(e2m1_values(packed & 0xF, UPCAST), (ROWS, COLS // 16, 8)) * scale, (ROWS, COLS // 2))
    odd = tl.reshape(tl.reshape(e2m1_values(packed >> 4, UPCAST), (ROWS, COLS // 16, 8)) * scale, (ROWS, COLS // 2))
    if UPCAST:
        return even, odd
    else:
        return even.to(tl.bfloat16), odd.to(tl.bfloat16)  # exact: at most 6 significant bits
