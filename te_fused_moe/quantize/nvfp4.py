"""NVFP4: E2M1 values, one E4M3 scale per 16 consecutive elements along ``axis`` (or per 16x16
tile with ``block_2d``), and one float32 scale per tensor.

Rules (TE's CUDA kernels ``transformer_engine/common/cast/nvfp4/core_nvfp4.cuh`` and
``quantize_transpose_nvfp4.cuh``; TE's PyTorch reference
``transformer_engine/pytorch/custom_recipes/reference_nvfp4.py`` computes the same numbers):

1. The input is rounded to float32. ``global_amax`` = max |x| over the whole tensor, NaN skipped
   (or the caller's ``global_amax``). Tensor encode scale
   ``S_enc = 448 * 6 / global_amax`` (float32 division), capped at FLT_MAX, and ``S_enc = 1``
   when ``global_amax`` is 0 or Inf (``compute_global_encode_scaling_factor_FP4``);
   ``S_dec = 1 / S_enc`` (float32).
2. Block decode scale: ``s = e4m3(min(block_amax * (S_enc * fp32(1/6)), FLT_MAX))`` — two float32
   multiplies in that order, then the E4M3 cast (round to nearest even, satfinite: > 448 -> 448;
   ``compute_decoding_scaling_factor``). block_amax skips NaN; 2D tiles take the amax of the
   16x16 tile and every row of the tile shares the scale.
3. Block encode multiplier ``r = min(1 / (float(s) * S_dec), FLT_MAX)`` (float32; ``s == 0``
   gives FLT_MAX), elements ``e2m1(x * r)``: round to nearest even, satfinite to ±6, NaN -> +6,
   sign of zero kept (``cvt.rn.satfinite.e2m1x2.f32``). With stochastic rounding the E2M1 step is
   TE's ``stochastic_round_fp4_e2m1`` (``common/util/ptx.cuh``) fed with 8 random bits per element
   (``random_bits``, or drawn from ``generator``); TE draws its bits from Philox, so only the
   distribution, not the draw, matches TE.

Lengths not a multiple of 16 (and, for 2D tiles, row counts not a multiple of 16) end with a
short block: zero padding, which never changes an amax.

Layout: ``data`` is uint8 with the input's shape except ``axis``, which holds ``ceil(n/2)``
bytes: element ``2j`` along ``axis`` is the low nibble (bits 0-3) of byte ``j`` and element
``2j+1`` the high nibble (bits 4-7), as TE packs FP4 pairs; an odd ``n`` leaves a zero high
nibble. Codes: bit 3 sign, bits 2-1 exponent, bit 0 mantissa. ``scale`` (torch.float8_e4m3fn)
has the input's shape with ``axis`` divided by 16 (rounded up); with ``block_2d`` (2-D input
only) both dimensions are divided by 16. ``global_scale`` is ``S_dec`` (float32 scalar tensor) and
``global_amax`` the amax used.

Per-row tensor scales (``row_global_amax``, 2-D input): TE quantizes each expert's slice of a
grouped operand as its own tensor, with its own ``global_amax``. Passing one amax per row (every
row of a group carries its group's amax) applies rules 1-3 above with that row's ``S_enc``: a 1x16
block along the rows (``axis=1``) reads its row's value; a block along the columns (``axis=0``)
and a 16x16 tile read the value of their first row, so groups must start on 16-row boundaries
(the caller's contract; the grouped layouts start groups on 256-row boundaries). With a constant
``row_global_amax`` the result is bit-identical to passing that value as ``global_amax``.
``global_amax``/``global_scale`` of the result are then per-row ``[rows]`` tensors.

Dequantize follows TE's ``dequantize_nvfp4.cuh``: ``e2m1 * (float(s) * global_amax *
fp32(1/2688))`` in float32; in float64 the same product is formed without float32 rounding.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

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

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0


@dataclasses.dataclass
class NVFP4Tensor:
    data: torch.Tensor  # uint8, two E2M1 codes per byte along axis (low nibble first)
    scale: torch.Tensor  # float8_e4m3fn block decode scales
    global_scale: torch.Tensor  # float32 scalar: S_dec = 1 / S_enc
    global_amax: torch.Tensor  # float32 scalar the scales were computed from
    axis: int
    shape: Tuple[int, ...]
    block_2d: bool = False


# Scalar constants are made with torch.full on the input's device: torch.tensor(..., device=cuda)
# copies from the host and synchronizes (flagged by torch.cuda.set_sync_debug_mode).


def global_encode_scale(global_amax: torch.Tensor) -> torch.Tensor:
    """``S_enc`` for a float32 ``global_amax`` (rule 1 of the module doc)."""
    s_enc = torch.full((), E4M3_MAX * E2M1_MAX, dtype=torch.float32, device=global_amax.device) / global_amax
    s_enc = torch.clamp(s_enc, max=formats.FLOAT32_MAX)
    degenerate = (global_amax == 0) | (s_enc == 0)
    return torch.where(degenerate, torch.ones_like(s_enc), s_enc)


def quantize(
    t: torch.Tensor,
    axis: int = -1,
    block_2d: bool = False,
    stochastic_rounding: bool = False,
    generator: Optional[torch.Generator] = None,
    global_amax: Optional[torch.Tensor] = None,
    *,
    random_bits: Optional[torch.Tensor] = None,
    row_global_amax: Optional[torch.Tensor] = None,
) -> NVFP4Tensor:
    """NVFP4-quantize ``t`` along ``axis`` (rules in the module doc).

    ``global_amax``: float32 scalar tensor (or float) to use instead of max |t| — e.g. the amax
    of a whole tensor when quantizing a slice. ``random_bits``: uint8 tensor of ``t``'s shape with
    the 8 stochastic-rounding bits of each element; drawn from ``generator`` when omitted.
    ``row_global_amax``: float32 ``[rows]`` tensor, one tensor amax per row of a 2-D ``t`` (its
    group's), instead of one for the whole tensor (module doc, "Per-row tensor scales")."""
    x = float32_input("t", t)
    axis = normalize_axis("axis", axis, x.dim())
    if block_2d and x.dim() != 2:
        raise ValueError(f"t: 2D 16x16 blocks need a 2-D tensor, got shape {tuple(x.shape)}")
    if row_global_amax is None:
        amax = _global_amax(x, global_amax)
        s_enc = global_encode_scale(amax)
    else:
        if global_amax is not None:
            raise ValueError("row_global_amax: pass either global_amax or row_global_amax, not both")
        amax = _row_global_amax(x, row_global_amax)
        s_enc = _block_broadcast(global_encode_scale(amax), axis, block_2d)
    s_dec = torch.full((), 1.0, dtype=torch.float32, device=x.device) / s_enc

    if block_2d:
        tiles = to_blocks_2d(x, axis, BLOCK)  # (rb, 16, cb, 16)
        block_amax = formats.nan_ignoring_amax(tiles, dim=(1, 3))[:, None, :, None]
    else:
        tiles = to_blocks_1d(x, axis, BLOCK)  # (..., nb, 16)
        block_amax = formats.nan_ignoring_amax(tiles, dim=-1).unsqueeze(-1)

    multiplier = s_enc * torch.full((), 1.0 / E2M1_MAX, dtype=torch.float32, device=x.device)
    decode_scale = torch.clamp(block_amax * multiplier, max=formats.FLOAT32_MAX)
    scale_codes = formats.encode(decode_scale, formats.E4M3)
    scale_values = formats.decode(scale_codes, formats.E4M3)
    encode_multiplier = torch.clamp(1.0 / (scale_values * s_dec), max=formats.FLOAT32_MAX)
    scaled = tiles * encode_multiplier

    if stochastic_rounding:
        bits = _random_bits(x, axis, block_2d, generator, random_bits)
        codes = formats.stochastic_round_e2m1(scaled, bits)
    else:
        if random_bits is not None:
            raise ValueError("random_bits: only used with stochastic_rounding=True")
        codes = formats.encode(scaled, formats.E2M1)

    n = x.shape[axis]
    if block_2d:
        moved_rows = x.shape[1 - axis]
        codes = from_blocks_2d(codes, axis, moved_rows, n)
        scale = scale_codes[:, 0, :, 0]  # (row tiles, col tiles) of the moved layout
        scale = scale.movedim(-1, axis)
    else:
        codes = from_blocks_1d(codes, axis, n)
        scale = scale_codes.squeeze(-1).movedim(-1, axis)
    if row_global_amax is not None:  # report S_dec per row, like the amax
        s_dec = torch.full((), 1.0, dtype=torch.float32, device=x.device) / global_encode_scale(amax)
    return NVFP4Tensor(
        data=pack_e2m1(codes, axis),
        scale=formats.codes_to_fp8(scale.contiguous(), formats.E4M3),
        global_scale=s_dec,
        global_amax=amax,
        axis=axis,
        shape=tuple(x.shape),
        block_2d=block_2d,
    )


def _global_amax(x: torch.Tensor, global_amax) -> torch.Tensor:
    if global_amax is None:
        if x.numel() == 0:
            return torch.zeros((), dtype=torch.float32, device=x.device)
        return formats.nan_ignoring_amax(x.reshape(-1), dim=0)
    if isinstance(global_amax, (int, float)) and not isinstance(global_amax, bool):
        return torch.full((), float(global_amax), dtype=torch.float32, device=x.device)
    if not isinstance(global_amax, torch.Tensor) or global_amax.numel() != 1:
        raise ValueError("global_amax: expected a float or a one-element tensor")
    if global_amax.device != x.device:
        raise ValueError(f"global_amax: expected a tensor on {x.device}, got one on {global_amax.device}")
    return global_amax.reshape(()).to(torch.float32)


def _row_global_amax(x: torch.Tensor, row_global_amax) -> torch.Tensor:
    if x.dim() != 2:
        raise ValueError(f"row_global_amax: needs a 2-D t (one amax per row), got shape {tuple(x.shape)}")
    if not isinstance(row_global_amax, torch.Tensor) or tuple(row_global_amax.shape) != (x.shape[0],):
        raise ValueError(f"row_global_amax: expected a tensor of shape ({x.shape[0]},), one amax per row of t")
    if row_global_amax.device != x.device:
        raise ValueError(f"row_global_amax: expected a tensor on {x.device}, got one on {row_global_amax.device}")
    if not row_global_amax.is_floating_point():
        raise TypeError(f"row_global_amax: expected a float tensor, got {row_global_amax.dtype}")
    return row_global_amax.to(torch.float32)


def _first_row_of_blocks(per_row: torch.Tensor) -> torch.Tensor:
    """``[rows]`` -> ``[ceil(rows/16)]``: the value of each 16-row block's first row."""
    return per_row[::BLOCK]


def _block_broadcast(per_row: torch.Tensor, axis: int, block_2d: bool) -> torch.Tensor:
    """A per-row value shaped to broadcast against the blocks :func:`quantize` builds."""
    if block_2d:  # tiles (rb, 16, cb, 16) of x moved so that axis is last
        first = _first_row_of_blocks(per_row)
        return first[:, None, None, None] if axis == 1 else first[None, None, :, None]
    if axis == 1:  # blocks (rows, nb, 16): each block lies in one row
        return per_row[:, None, None]
    return _first_row_of_blocks(per_row)[None, :, None]  # blocks (cols, nb, 16) along the rows


def _random_bits(x, axis, block_2d, generator, random_bits) -> torch.Tensor:
    if random_bits is None:
        random_bits = torch.randint(0, 256, x.shape, generator=generator, dtype=torch.uint8, device=x.device)
    elif not isinstance(random_bits, torch.Tensor) or random_bits.dtype != torch.uint8 or random_bits.shape != x.shape:
        raise ValueError(f"random_bits: expected a uint8 tensor of shape {tuple(x.shape)}")
    elif random_bits.device != x.device:
        raise ValueError(f"random_bits: expected a tensor on {x.device}, got one on {random_bits.device}")
    # Padded elements are zeros and round to zero whatever their bits are.
    if block_2d:
        return to_blocks_2d(random_bits, axis, BLOCK)
    return to_blocks_1d(random_bits, axis, BLOCK)


def pack_e2m1(codes: torch.Tensor, axis: int) -> torch.Tensor:
    """Pack uint8 E2M1 codes two per byte along ``axis`` (element 2j low nibble)."""
    moved = codes.movedim(axis, -1)
    if moved.shape[-1] % 2:
        moved = torch.nn.functional.pad(moved, (0, 1))
    packed = moved[..., 0::2] | (moved[..., 1::2] << 4)
    return packed.movedim(-1, axis).contiguous()


def unpack_e2m1(data: torch.Tensor, axis: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_e2m1`: uint8 codes, ``n`` along ``axis``."""
    moved = data.movedim(axis, -1)
    codes = torch.stack((moved & 0xF, moved >> 4), dim=-1).reshape(*moved.shape[:-1], -1)
    return codes[..., :n].movedim(-1, axis)


def dequantize(q: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values of ``q`` in ``dtype`` (float32 or float64), TE's ``dequantize_nvfp4.cuh`` formula."""
    if not isinstance(q, NVFP4Tensor):
        raise TypeError(f"q: expected an NVFP4Tensor, got {type(q).__name__}")
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype: expected torch.float32 or torch.float64, got {dtype}")
    axis, n = q.axis, q.shape[q.axis]
    expected = expected_scale_shape(q.shape, axis, q.block_2d)
    if tuple(q.scale.shape) != expected:
        raise ValueError(f"q.scale: expected shape {expected} for a tensor of shape {q.shape}, got {tuple(q.scale.shape)}")
    values = formats.decode(unpack_e2m1(q.data, axis, n), formats.E2M1, dtype)
    scale = formats.decode(q.scale.view(torch.uint8), formats.E4M3, dtype)
    amax = q.global_amax
    if amax.dim() == 1:  # per-row tensor amax: the scale's rows are rows (axis 1) or 16-row blocks
        amax = (amax if (axis == 1 and not q.block_2d) else _first_row_of_blocks(amax))[:, None]
    if dtype == torch.float32:
        factor = torch.full((), 1.0 / (E2M1_MAX * E4M3_MAX), dtype=torch.float32, device=values.device)
        block_factor = scale * amax.to(torch.float32) * factor
    else:
        block_factor = scale * amax.to(torch.float64) / (E2M1_MAX * E4M3_MAX)
    if q.block_2d:
        tiles = to_blocks_2d(values, axis, BLOCK)
        moved_factor = block_factor.movedim(axis, -1)[:, None, :, None]
        return from_blocks_2d(tiles * moved_factor, axis, q.shape[1 - axis], n).contiguous()
    blocks = to_blocks_1d(values, axis, BLOCK)
    return from_blocks_1d(blocks * block_factor.movedim(axis, -1).unsqueeze(-1), axis, n).contiguous()


def expected_scale_shape(shape, axis: int, block_2d: bool) -> Tuple[int, ...]:
    out = list(shape)
    out[axis] = ceil_div(shape[axis], BLOCK)
    if block_2d:
        out[1 - axis] = ceil_div(shape[1 - axis], BLOCK)
    return tuple(out)
