"""MXFP8: FP8 values (E4M3 or E5M2) with one E8M0 power-of-two scale per 32 consecutive elements
along ``axis``.

Rules (TE's CUDA kernel ``transformer_engine/common/cast/mxfp8/quantize_mxfp8.cuh``; helpers in
``common/util/ptx.cuh``, ``common/util/ptx_arch_spec.cuh``, ``common/utils.cuh``):

1. The input is rounded to float32. ``amax`` = max |x| of the block, NaN skipped (``fmaxf`` /
   ``__hmax``); a block of zeros/NaN has amax 0.
2. Scale: ``e = float_to_e8m0(amax * max_norm_rcp)`` where ``max_norm_rcp`` is the float32
   ``1/448`` (E4M3) or ``1/57344`` (E5M2) and the product is a float32 multiply; E8M0 rounds the
   power of two **up**, satfinite (0 -> 2^-127, Inf -> 2^127, NaN -> 255): see
   :func:`formats.e8m0_encode`.
3. Elements: ``cast(x * exp2f_rcp(e))`` — a float32 multiply by ``2^(127-e)`` then FP8 round to
   nearest even, **satfinite** (±Inf -> ±max), NaN -> NaN (``0x7F``). (TE's BF16-input variants
   multiply in BF16; a power-of-two multiply is exact there too, except in BF16's subnormal
   range, where the FP8 result is ±0 either way.)

Because the scale rounds up, every finite element lands within rounding distance of the FP8
range, so in practice only ±Inf saturates. A length along ``axis`` that is not a multiple of 32 ends with a short block (zero
padding, which never changes amax).

Layout: ``data`` has the shape of the input (torch float8 dtype); ``scale`` (uint8 E8M0 biased
exponents) has the input's shape with ``axis`` divided by 32, rounded up. Dequantized value =
``fp8(data) * 2^(scale-127)`` (TE's ``dequantize_mxfp8.cuh``), one rounding in float32 (none in
float64).
"""

from __future__ import annotations

import dataclasses

import torch

from . import formats
from .blocks import ceil_div, float32_input, from_blocks_1d, normalize_axis, to_blocks_1d

BLOCK = 32


@dataclasses.dataclass
class MXFP8Tensor:
    data: torch.Tensor  # torch.float8_e4m3fn / float8_e5m2, shape of the input
    scale: torch.Tensor  # uint8 E8M0 exponents, input shape with axis -> ceil(n / 32)
    axis: int
    fp8_format: str  # "e4m3" or "e5m2"


def _max_norm_rcp(fmt: formats.ElementFormat, device) -> torch.Tensor:
    # TE: static constexpr float max_norm_rcp = 1.0 / max_norm (double division, then float).
    # torch.full, not torch.tensor(..., device=): no host-to-device copy (sync-debug mode flags those)
    return torch.full((), 1.0 / fmt.max_value, dtype=torch.float32, device=device)


def quantize(t: torch.Tensor, axis: int = -1, fp8_format: str = "e4m3") -> MXFP8Tensor:
    """MXFP8-quantize ``t`` with 1x32 blocks along ``axis`` (see the module doc for the rules)."""
    x = float32_input("t", t)
    axis = normalize_axis("axis", axis, x.dim())
    fmt = formats.fp8_format(fp8_format)
    blocks = to_blocks_1d(x, axis, BLOCK)  # (..., nb, 32)
    amax = formats.nan_ignoring_amax(blocks, dim=-1)
    scale = formats.e8m0_encode(amax * _max_norm_rcp(fmt, x.device))
    scaled = blocks * formats.e8m0_reciprocal(scale).unsqueeze(-1)
    codes = formats.encode(scaled, fmt)
    data = formats.codes_to_fp8(from_blocks_1d(codes, axis, x.shape[axis]).contiguous(), fmt)
    return MXFP8Tensor(data=data, scale=scale.movedim(-1, axis).contiguous(), axis=axis, fp8_format=fmt.name)


def dequantize(q: MXFP8Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``fp8(data) * 2^(scale - 127)`` in ``dtype`` (float32 or float64)."""
    if not isinstance(q, MXFP8Tensor):
        raise TypeError(f"q: expected an MXFP8Tensor, got {type(q).__name__}")
    _check_out_dtype(dtype)
    fmt = formats.fp8_format(q.fp8_format)
    n = q.data.shape[q.axis]
    expected = list(q.data.shape)
    expected[q.axis] = ceil_div(n, BLOCK)
    if list(q.scale.shape) != expected:
        raise ValueError(f"q.scale: expected shape {tuple(expected)} for data {tuple(q.data.shape)}, got {tuple(q.scale.shape)}")
    values = to_blocks_1d(formats.decode(formats.fp8_to_codes(q.data), fmt, dtype), q.axis, BLOCK)
    scale = formats.e8m0_decode(q.scale.movedim(q.axis, -1), dtype).unsqueeze(-1)
    return from_blocks_1d(values * scale, q.axis, n).contiguous()


def _check_out_dtype(dtype: torch.dtype) -> None:
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype: expected torch.float32 or torch.float64, got {dtype}")
