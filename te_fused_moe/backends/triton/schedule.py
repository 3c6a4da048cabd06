"""Sync-free tile schedule of a grouped GEMM, built on the device from ``tokens_per_expert``.

The rows of ``x`` form ``E + 1`` groups: one per expert, then a last *padding group* holding the
rows past ``sum(counts)``. Kernels write zeros for the padding group, so outputs need no separate
memset and padding rows get zero outputs and zero gradients.

Everything here is a handful of tiny torch ops on the device: no host reads, no data-dependent
shapes, so a call captures in a CUDA graph. The kernel grid is sized from the static worst case
(:func:`max_m_tiles`), and each program reads its group from a tile -> group map (one load; a binary
search over ``tile_end`` would cost log2(E) dependent loads before the first GEMM load).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The schedule is one flat int32 tensor: four [E + 1] rows (indices below), then the tile -> group map.
TILE_START, TILE_END, ROW_START, ROW_END = range(4)
NUM_TABLE_ROWS = 4


def max_m_tiles(num_rows: int, num_experts: int, block_m: int) -> int:
    """Upper bound of sum over the E + 1 groups of cdiv(rows_g, block_m)."""
    return -(-num_rows // block_m) + num_experts + 1


def build_schedule(tokens_per_expert: torch.Tensor, num_rows: int, block_m: int) -> torch.Tensor:
    """Flat int32 ``[4 * (E + 1) + max_m_tiles]``: tile_start, tile_end, row_start, row_end of each
    group, then the group of each M tile (``E + 1`` for tiles past the last one).

    Row ranges are clamped to ``[0, num_rows]`` so that a bad ``tokens_per_expert`` (summing to more
    than ``T``, or holding negative counts; caught only in debug mode) cannot make a kernel write out
    of bounds: negative counts count as zero, so the ranges stay ordered and inside the tensor.
    """
    counts = tokens_per_expert.to(torch.int32).clamp(min=0)
    expert_end = torch.cumsum(counts, 0, dtype=torch.int32).clamp_(max=num_rows)
    padding = num_rows - expert_end[-1:]
    row_end = torch.cat([expert_end, expert_end[-1:] + padding])
    row_start = torch.cat([torch.zeros_like(row_end[:1]), row_end[:-1]])
    rows = (row_end - row_start).clamp_(min=0)
    tiles = (rows + (block_m - 1)) // block_m
    tile_end = torch.cumsum(tiles, 0, dtype=torch.int32)
    tile_start = tile_end - tiles
    all_tiles = torch.arange(max_m_tiles(num_rows, counts.shape[0], block_m), device=counts.device, dtype=torch.int32)
    tile_group = torch.searchsorted(tile_end, all_tiles, right=True).to(torch.int32)
    return torch.cat([tile_start, tile_end, row_start, row_end, tile_group])


def schedule_table(schedule: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The ``[4, E + 1]`` part of a schedule (for tests and debugging)."""
    return schedule[: NUM_TABLE_ROWS * (num_experts + 1)].view(NUM_TABLE_ROWS, num_experts + 1)


@triton.jit
def swizzle(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Tile id -> (M tile, N tile): bands of GROUP_M M tiles walked column by column, so that the
    programs running together share B's column blocks in L2."""
    pids_per_band = GROUP_M * num_pid_n
    band = tile_id // pids_per_band
    first_m = band * GROUP_M
    band_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile_id % pids_per_band) % band_m
    pid_n = (tile_id % pids_per_band) // band_m
    return pid_m, pid_n


@triton.jit
def total_tiles(sched_ptr, NUM_GROUPS):
    """How many M tiles the schedule has (programs of the worst-case grid past it exit)."""
    return tl.load(sched_ptr + 1 * NUM_GROUPS + NUM_GROUPS - 1)  # tile_end of the padding group


@triton.jit
def tile_rows(sched_ptr, pid_m, BM: tl.constexpr, NUM_GROUPS):
    """M tile ``pid_m``'s group, its first row and its group's end row (its rows are
    ``[row0, min(row0 + BM, row_end))``)."""
    # rows of the flat schedule (jit code sees literals, not the module's ints): 0 tile_start,
    # 2 row_start, 3 row_end, 4 the tile -> group map
    group = tl.load(sched_ptr + 4 * NUM_GROUPS + pid_m)
    tile_start = tl.load(sched_ptr + 0 * NUM_GROUPS + group)
    row_start = tl.load(sched_ptr + 2 * NUM_GROUPS + group)
    row_end = tl.load(sched_ptr + 3 * NUM_GROUPS + group)
    return group, row_start + (pid_m - tile_start) * BM, row_end
