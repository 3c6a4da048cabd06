"""Device side of ``block_scaled_launch.operand_sources``: where a K step of the block-scaled grouped
GEMM kernels (FP8 block and MXFP8 ``gemm.launch``) reads its A and B tiles, by TMA from the
descriptors or through pointer tiles, so that each K loop reads one name per operand."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def operand_tiles(a_src, b_src, rows_in, cols_in, e64, stride_am, stride_be, stride_bn, BK: tl.constexpr,
                  USE_TMA: tl.constexpr):
    """What :func:`k_block` reads A and B from: the TMA descriptors themselves, or (not ``USE_TMA``) the
    pointer tiles of A's rows ``rows_in`` and expert ``e64``'s B rows ``cols_in`` at K offset 0."""
    a_tiles, b_tiles = a_src, b_src
    if not USE_TMA:
        offs_k = tl.arange(0, BK)
        a_tiles = a_src + rows_in[:, None] * stride_am + offs_k[None, :]
        b_tiles = b_src + e64 * stride_be + cols_in.to(tl.int64)[:, None] * stride_bn + offs_k[None, :]
    return a_tiles, b_tiles


@triton.jit
def k_block(tiles, row, k0, USE_TMA: tl.constexpr, row_offset=0):
    """The operand tile at K offset ``k0`` from ``tiles`` (:func:`operand_tiles`): by TMA at descriptor row
    ``row``, or through the pointer tile moved down by ``row_offset`` elements (a later row block of the
    same operand, e.g. gated FC1's up half)."""
    if USE_TMA:
        tile = tiles.load([row, k0])
    else:
        tile = tl.load(tiles + row_offset + k0)
    return tile
