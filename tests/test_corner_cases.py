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


@pytest.mark.parametrize("frozen", ["bias", "weight"])
def test_swap_keeps_frozen_parameters_frozen(frozen):
    """A swapped block's parameters train exactly when the original's did. Frozen biases used to
    come back trainable (only the weights' ``requires_grad`` was carried over)."""
    from test_swap import ExpertBlockStandIn

    from te_fused_moe import swap

    block = ExpertBlockStandIn(3, 8, 16, bias=True)
    for linear in (block.fc1, block.fc2):
        for name, param in linear.named_parameters():
            param.requires_grad_(not name.startswith(frozen))
    fused = swap.fused_from_block(block, backend="reference")
    trainable = {name: p.requires_grad for name, p in fused.named_parameters()}
    expect_weights, expect_biases = (True, False) if frozen == "bias" else (False, True)
    assert trainable == {"weight1": expect_weights, "weight2": expect_weights,
                         "bias1": expect_biases, "bias2": expect_biases}
