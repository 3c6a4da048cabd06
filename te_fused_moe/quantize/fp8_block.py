"""FP8 with block scales (DeepSeek-V3 style, TE's ``Float8BlockScaling``): FP8 values and one
float32 scale per 1x128 block along ``axis`` or per 128x128 tile.

Rules (TE's CUDA kernels ``transformer_engine/common/transpose/quantize_transpose_vector_blockwise.cu``
(1x128) and ``quantize_transpose_square_blockwise.cu`` (128x128), scale from
``compute_scale_from_amax`` in ``transformer_engine/common/recipe/recipe_common.cuh``):

1. The input is rounded to float32; ``amax`` = max |x| of the block, NaN skipped (``fmaxf``).
2. ``scale = fp8_max / amax`` (float32 division, ``__fdiv_rn``; fp8_max 448 for E4M3, 57344 for
   E5M2); ``scale = 1`` when amax is 0, Inf or NaN (the CUDA rule; TE's PyTorch current-scaling
   reference ``pytorch/custom_recipes/reference_current_scaling.py`` uses 0 for an Inf amax);
   an Inf quotient (amax tiny) becomes the largest finite value of the *input* dtype
   (``value_for_inf``: float32 max, or bfloat16/float16 max for those inputs). With ``power_2_scale`` (TE's default, ``use_f32_scales=False``) the
   mantissa bits of the scale are cleared, i.e. the scale rounds **down** to a power of two, so
   ``amax * scale <= fp8_max`` still holds.
3. Elements: ``cast(x * scale)`` — float32 multiply, FP8 round to nearest even, satfinite
   (±Inf -> ±max), NaN -> NaN (``0x7F``).
4. Stored scale (``scale`` field here, TE's ``scale_inv``) = ``1 / scale`` (float32); dequantized
   value = ``fp8(data) * scale_inv``.

Lengths not a multiple of 128 (and, for 128x128 tiles, row counts) end with a short block (zero
padding, which never changes amax).

Layout: ``data`` (torch float8 dtype) has the input's shape; ``scale`` (float32) has the input's
shape with ``axis`` divided by 128 (rounded up), and for 128x128 tiles (2-D input only) the other
dimension divided by 128 too. ``block`` is ``(rows, elements along axis)``: ``(1, 128)`` or
``(128, 128)``.
"""

from __future__ import annotations

import dataclasses
from typing import Tuple

import torch

from . import formats
from .blocks import (
    ceil_div,
    float32_input,
    from_blocks_1d,
    from_blocks_2d,
    normalize_axis,
    to_blocks_1d,
    to_blocks_2d,
)

BLOCK = 128
BLOCK_SHAPES = ((1, BLOCK), (BLOCK, BLOCK))


@dataclasses.dataclass
class FP8BlockTensor:
    data: torch.Tensor  # torch float8 dtype, shape of the input
    scale: torch.Tensor  # float32 dequantization multipliers (TE's scale_inv), one per block
    axis: int
    block: Tuple[int, int]
    fp8_format: str
    shape: Tuple[int, ...] = ()


def compute_scale(amax: torch.Tensor, fp8_max: float, power_2_scale: bool, value_for_inf: float) -> torch.Tensor:
    """Quantization multiplier from a float32 block amax (rule 2 of the module doc)."""
    degenerate = (amax == 0) | torch.isinf(amax) | torch.isnan(amax)
    scale = torch.full((), fp8_max, dtype=torch.float32, device=amax.device) / amax  # no host-to-device copy
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, value_for_inf), scale)
    scale = torch.where(degenerate, torch.ones_like(scale), scale)
    if power_2_scale:
        bits = scale.contiguous().view(torch.int32) & torch.tensor(-0x800000, dtype=torch.int32)  # 0xFF800000
        scale = bits.view(torch.float32)
    return scale


def _value_for_inf(dtype: torch.dtype) -> float:
    if dtype in (torch.bfloat16, torch.float16):
        return float(torch.finfo(dtype).max)
    return formats.FLOAT32_MAX


def quantize(
    t: torch.Tensor,
    block: Tuple[int, int] = (1, BLOCK),
    axis: int = -1,
    power_2_scale: bool = True,
    fp8_format: str = "e4m3",
) -> FP8BlockTensor:
    """Quantize ``t`` with 1x128 or 128x128 blocks along ``axis`` (rules in the module doc)."""
    x = float32_input("t", t)
    axis = normalize_axis("axis", axis, x.dim())
    block = _check_block(block)
    if block[0] != 1 and x.dim() != 2:
        raise ValueError(f"t: 128x128 blocks need a 2-D tensor, got shape {tuple(x.shape)}")
    fmt = formats.fp8_format(fp8_format)
    two_d = block[0] != 1
    if two_d:
        tiles = to_blocks_2d(x, axis, BLOCK)
        amax = formats.nan_ignoring_amax(tiles, dim=(1, 3))[:, None, :, None]
    else:
        tiles = to_blocks_1d(x, axis, BLOCK)
        amax = formats.nan_ignoring_amax(tiles, dim=-1).unsqueeze(-1)
    scale = compute_scale(amax, fmt.max_value, bool(power_2_scale), _value_for_inf(t.dtype))
    codes = formats.encode(tiles * scale, fmt)
    scale_inv = 1.0 / scale
    n = x.shape[axis]
    if two_d:
        codes = from_blocks_2d(codes, axis, x.shape[1 - axis], n)
        scale_inv = scale_inv[:, 0, :, 0].movedim(-1, axis)
    else:
        codes = from_blocks_1d(codes, axis, n)
        scale_inv = scale_inv.squeeze(-1).movedim(-1, axis)
    return FP8BlockTensor(
        data=formats.codes_to_fp8(codes.contiguous(), fmt),
        scale=scale_inv.contiguous(),
        axis=axis,
        block=block,
        fp8_format=fmt.name,
        shape=tuple(x.shape),
    )


def dequantize(q: FP8BlockTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``fp8(data) * scale`` in ``dtype`` (float32 or float64)."""
    if not isinstance(q, FP8BlockTensor):
        raise TypeError(f"q: expected an FP8BlockTensor, got {type(q).__name__}")
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype: expected torch.float32 or torch.float64, got {dtype}")
    fmt = formats.fp8_format(q.fp8_format)
    values = formats.decode(formats.fp8_to_codes(q.data), fmt, dtype)
    scale = q.scale.to(dtype)
    axis, n = q.axis, q.data.shape[q.axis]
    if q.block[0] != 1:
        tiles = to_blocks_2d(values, axis, BLOCK)
        out = tiles * scale.movedim(axis, -1)[:, None, :, None]
        return from_blocks_2d(out, axis, q.data.shape[1 - axis], n).contiguous()
    blocks = to_blocks_1d(values, axis, BLOCK)
    return from_blocks_1d(blocks * scale.movedim(axis, -1).unsqueeze(-1), axis, n).contiguous()


def _check_block(block) -> Tuple[int, int]:
    try:
        block = tuple(int(b) for b in block)
    except TypeError:
        raise TypeError(f"block: expected (1, 128) or (128, 128), got {block!r}") from None
    if block not in BLOCK_SHAPES:
        raise ValueError(f"block: expected (1, 128) or (128, 128), got {block!r}")
    return block


def expected_scale_shape(shape, axis: int, block) -> Tuple[int, ...]:
    out = list(shape)
    out[axis] = ceil_div(shape[axis], BLOCK)
    if tuple(block)[0] != 1:
        out[1 - axis] = ceil_div(shape[1 - axis], BLOCK)
    return tuple(out)
