"""Block layout shared by the quantizers: cut a tensor into blocks along one axis (1D blocks) or
along both axes of a matrix (2D blocks), padding the last block with zeros, and put it back.

Zero padding never changes a block's amax (amax >= 0) and padded elements are cropped away
again, so a length that is not a multiple of the block size behaves as if the tensor ended
with a short block.
"""

from __future__ import annotations

import torch


def normalize_axis(name: str, axis, ndim: int) -> int:
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise TypeError(f"{name}: expected an int axis, got {type(axis).__name__}")
    if not -ndim <= axis < ndim:
        raise ValueError(f"{name}: axis {axis} is out of range for a tensor with {ndim} dimensions")
    return axis % ndim


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def to_blocks_1d(x: torch.Tensor, axis: int, block: int) -> torch.Tensor:
    """``x`` with ``axis`` moved last, zero-padded to a multiple of ``block`` and split:
    shape ``(*rest, n_blocks, block)``."""
    moved = x.movedim(axis, -1)
    n = moved.shape[-1]
    pad = ceil_div(n, block) * block - n
    if pad:
        moved = torch.nn.functional.pad(moved, (0, pad))
    return moved.reshape(*moved.shape[:-1], -1, block)


def from_blocks_1d(blocks: torch.Tensor, axis: int, n: int) -> torch.Tensor:
    """Inverse of :func:`to_blocks_1d`: merge blocks, crop to length ``n``, move the axis back."""
    merged = blocks.reshape(*blocks.shape[:-2], -1)[..., :n]
    return merged.movedim(-1, axis)


def to_blocks_2d(x: torch.Tensor, axis: int, block: int) -> torch.Tensor:
    """Matrix ``x`` with ``axis`` moved last, both dims zero-padded to multiples of ``block`` and
    split into square tiles: shape ``(row_blocks, block, col_blocks, block)``."""
    moved = x.movedim(axis, -1)
    rows, cols = moved.shape
    pad_r = ceil_div(rows, block) * block - rows
    pad_c = ceil_div(cols, block) * block - cols
    if pad_r or pad_c:
        moved = torch.nn.functional.pad(moved, (0, pad_c, 0, pad_r))
    return moved.reshape(moved.shape[0] // block, block, moved.shape[1] // block, block)


def from_blocks_2d(tiles: torch.Tensor, axis: int, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`to_blocks_2d` (``rows``/``cols`` are of the moved layout)."""
    merged = tiles.reshape(tiles.shape[0] * tiles.shape[1], tiles.shape[2] * tiles.shape[3])
    return merged[:rows, :cols].movedim(-1, axis)


def float32_input(name: str, t) -> torch.Tensor:
    """``t`` rounded to float32 (TE's kernels compute in float32), after type checks."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise TypeError(f"{name}: expected a float16/bfloat16/float32/float64 tensor, got {t.dtype}")
    if t.dim() == 0:
        raise ValueError(f"{name}: expected a tensor with at least one dimension, got a scalar")
    return t.to(torch.float32)
