"""Corner cases found in review of the op's Python orchestration (CPU, no interpreter needed)."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("counts", [[5, -3, 4], [-5, 3, 4], [-7, -1, 30], [12, -20, 2]])
def test_schedule_row_ranges_stay_inside_x_for_negative_counts(counts):
    """Bad counts are caught only in debug mode; outside it the schedule must still keep every
    kernel inside ``[0, T)``. A negative count used to give a row range starting below zero
    (``[-5, 3, 4]`` gave expert 1 rows ``[-5, -2)``), i.e. writes before the start of the output."""
    from te_fused_moe.backends.triton.schedule import build_schedule, max_m_tiles, schedule_table

    num_rows, block_m, experts = 10, 4, len(counts)
    flat = build_schedule(torch.tensor(counts), num_rows=num_rows, block_m=block_m)
    tile_start, tile_end, row_start, row_end = schedule_table(flat, experts).tolist()
    assert min(row_start) >= 0 and max(row_end) <= num_rows
    assert all(s <= e for s, e in zip(row_start, row_end)), (row_start, row_end)
    # groups are consecutive and disjoint, and together cover exactly the T rows
    assert row_start[0] == 0 and row_end[-1] == num_rows
    assert all(row_end[g] == row_start[g + 1] for g in range(experts))
    assert tile_end[-1] <= max_m_tiles(num_rows, experts, block_m)
