"""MXFP8 scale arithmetic as Triton device functions, bit-exact with :mod:`te_fused_moe.quantize.mxfp8`
(TE's ``quantize_mxfp8.cuh``): ``e = e8m0(amax * max_norm_rcp)`` (FP32 multiply; the power of two
rounded **up**, satfinite: 0 -> 0 (2^-127), Inf -> 254, NaN -> 255), elements multiplied by
``2^(127 - e)`` before the FP8 cast, dequantized by ``2^(e - 127)``.

The FP8 element encoding itself is ``fp8_block.codec.encode_fp8`` (hardware ``cvt`` on the GPU,
the same rules on the FP32 bits under the interpreter).
"""

import triton
import triton.language as tl

from ..fp8_block.codec import NATIVE_CVT


@triton.jit
def e8m0_encode(v):
    """uint8 E8M0 exponent of non-negative FP32 ``v`` (:func:`formats.e8m0_encode`)."""
    bits = v.to(tl.uint32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF).to(tl.int32)
    mantissa = bits & 0x7FFFFF
    # round up unless exact, at the top finite exponent (satfinite), or a subnormal that rounds to 2^-127
    round_up = (mantissa > 0) & (exponent != 0xFE) & ((exponent != 0) | (mantissa > 0x400000))
    code = exponent + round_up.to(tl.int32)
    code = tl.where(v == float("inf"), 0xFE, code)
    code = tl.where(v != v, 0xFF, code)
    return code.to(tl.uint8)


@triton.jit
def e8m0_to_float(code, NEGATE: tl.constexpr):
    """FP32 2^(code - 127) (``NEGATE``: 2^(127 - code), the quantization multiplier); code 255 -> NaN.
    Both ends are FP32 subnormals (2^-127: bit 22 alone), so they are built from bits."""
    c = code.to(tl.int32)
    if NEGATE:
        c = tl.where(c == 255, 255, 254 - c)
    bits = tl.where(c == 0, 0x400000, c << 23)
    value = bits.to(tl.float32, bitcast=True)
    return tl.where(c == 255, float("nan"), value)


@triton.jit
def mx_scale(amax, MAX_NORM_RCP: tl.constexpr):
    """(E8M0 code, quantization multiplier 2^(127 - code)) of NaN-free ``amax`` >= 0."""
    rcp = tl.full(amax.shape, MAX_NORM_RCP, tl.float32)
    code = e8m0_encode(amax * rcp)
    return code, e8m0_to_float(code, True)


@triton.jit
def mx_dequant_scale(code):
    """2^(code - 127) for the GEMMs' FP32 promotion (codes from the quantizers are never 255)."""
    c = code.to(tl.int32)
    return tl.where(c == 0, 0x400000, c << 23).to(tl.float32, bitcast=True)


@triton.jit
def expand_bf16(v, codes, ROWS: tl.constexpr, COLS: tl.constexpr, UPCAST: tl.constexpr):
    """FP8 tile ``v`` [ROWS, COLS] times its E8M0 scales ``codes`` [ROWS, COLS / 32] (one per 32
    consecutive columns), in BF16: exact, since an FP8 value (4 significant bits) times a power of
    two fits BF16's 8 (down to BF16's smallest subnormal, 2^-133). FP32 under the interpreter."""
    x = tl.reshape(v.to(tl.float32), (ROWS, COLS // 32, 32)) * mx_dequant_scale(codes)[:, :, None]
    x = tl.reshape(x, (ROWS, COLS))
    if UPCAST:
        return x
    return x.to(tl.bfloat16)


@triton.jit
def decode_fp8(codes, MANT: tl.constexpr):
    """FP32 values of the uint8 FP8 codes our encoder writes (``encode_fp8``: satfinite, so no
    infinities; NaN as 0x7F). The interpreter reads E4M3 as having no NaN, hence the select there."""
    if MANT == 3:
        v = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        v = codes.to(tl.float8e5, bitcast=True).to(tl.float32)
    if not NATIVE_CVT:
        v = tl.where((codes & 0x7F) == 0x7F, float("nan"), v)
    return v
