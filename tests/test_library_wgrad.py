"""The BF16-valued wgrads on ``torch._grouped_mm`` (``backends/triton/library_wgrad.py``): each expert's K range
its tile slots of the columnwise copies, offsets from the schedule on the device.

On CPU ``torch._grouped_mm`` runs PyTorch's fallback, so these checks cover the layout, the offsets and the
slicing of zero-padded copies; tests/gpu/test_library_wgrad_gpu.py runs them on cuBLAS. Random BF16 values
(fresh per call), experts with no tokens and with counts off the slot, NaN in every column and row that must
not be read, against an FP64 reference.
"""

import math

import pytest
import torch

from te_fused_moe.backends.triton import library_wgrad
from te_fused_moe.backends.triton.schedule import build_schedule, max_m_tiles, schedule_table

SLOT = library_wgrad.TILE


def slot_copies(counts, n: int, k: int, padded_to: int, padding_rows: int, device: str, seed: int):
    """Columnwise BF16 copies ``g_t [n', slots]``, ``x_t [k', slots]`` (``n'``, ``k'``: n, k rounded up to
    ``padded_to``) as the values path lays them out: each expert's tokens from its first slot's first column,
    zeros to its last slot's end; NaN in the rows past n / k, in the padding group's slots and in the slots
    past the last tile. Returns (g_t, x_t, schedule, the experts' token blocks of G and X in FP64)."""
    gen = torch.Generator().manual_seed(seed)
    num_experts, num_rows = len(counts), sum(counts) + padding_rows
    schedule = build_schedule(torch.tensor(counts, dtype=torch.int32), num_rows, SLOT)
    table = schedule_table(schedule, num_experts)
    slots = SLOT * max_m_tiles(num_rows, num_experts, SLOT)
    rounded = lambda size: -(-size // padded_to) * padded_to
    g_t = torch.full((rounded(n), slots), math.nan, dtype=torch.bfloat16)
    x_t = torch.full((rounded(k), slots), math.nan, dtype=torch.bfloat16)
    blocks = []
    for e, count in enumerate(counts):
        start, end = SLOT * int(table[0, e]), SLOT * int(table[1, e])
        g = torch.randn(n, count, generator=gen).to(torch.bfloat16)
        x = torch.randn(k, count, generator=gen).to(torch.bfloat16)
        g_t[:n, start:end] = 0
        x_t[:k, start:end] = 0
        g_t[:n, start:start + count] = g
        x_t[:k, start:start + count] = x
        blocks.append((g.double(), x.double()))
    return g_t.to(device), x_t.to(device), schedule.to(device), blocks


def check_values_wgrad(device: str, seed: int = 0) -> dict:
    """``values_wgrad`` against FP64 over a few problems: the elements outside BF16 rounding of the FP32 sum
    (bound 2^-8 |ref| + 2^-12 sum |g| |x| over the expert's tokens), NaNs, and experts with no tokens not
    all zeros; plus the dtype and shape of each result."""
    out = {}
    problems = {  # name: (counts, N, K, copies' rows padded to, padding rows)
        "balanced": ([256, 256, 256, 256], 192, 160, 1, 0),
        "ragged-empty": ([300, 0, 17, 129, 0, 40], 256, 128, 1, 9),
        "padded-rows": ([100, 0, 250], 200, 96, 128, 5),
    }
    for name, (counts, n, k, padded_to, padding_rows) in problems.items():
        g_t, x_t, schedule, blocks = slot_copies(counts, n, k, padded_to, padding_rows, device, seed)
        dw = library_wgrad.values_wgrad(g_t, x_t, schedule, (len(counts), n, k)).cpu()
        bad = nan = 0
        for e, (g, x) in enumerate(blocks):
            ref, scale = g @ x.t(), g.abs() @ x.abs().t()
            got = dw[e].double()
            nan += int(torch.isnan(got).sum())
            bad += int(((got - ref).abs() > 2 ** -8 * ref.abs() + 2 ** -12 * scale).sum())
        out[name] = {"bad": bad, "nan": nan, "dtype": str(dw.dtype), "shape": list(dw.shape),
                     "expected_shape": [len(counts), n, k]}
    return out


def assert_values_wgrad(r: dict) -> None:
    for name, c in r.items():
        assert c["bad"] == 0 and c["nan"] == 0, (name, c)
        assert c["dtype"] == "torch.bfloat16" and c["shape"] == c["expected_shape"], (name, c)


def test_values_wgrad_matches_fp64():
    assert_values_wgrad(check_values_wgrad("cpu", seed=int(torch.randint(0, 2 ** 16, ()))))


def test_slot_offsets_are_each_experts_last_slot_end():
    counts = [300, 0, 17, 129, 0, 40]
    schedule = build_schedule(torch.tensor(counts), sum(counts) + 9, SLOT)
    ends, total = [], 0
    for c in counts:
        total += -(-c // SLOT)
        ends.append(SLOT * total)
    offsets = library_wgrad.slot_offsets(schedule, len(counts))
    assert offsets.dtype == torch.int32 and offsets.tolist() == ends


def test_values_wgrad_rejects_what_it_cannot_read():
    g_t, x_t, schedule, _ = slot_copies([128, 64], 64, 32, 1, 0, "cpu", seed=3)
    with pytest.raises(ValueError, match="g_t, x_t"):
        library_wgrad.values_wgrad(g_t.float(), x_t, schedule, (2, 64, 32))
    with pytest.raises(ValueError, match="g_t, x_t"):
        library_wgrad.values_wgrad(g_t, x_t[:, :-128], schedule, (2, 64, 32))
    with pytest.raises(ValueError, match="shape"):
        library_wgrad.values_wgrad(g_t, x_t, schedule, (2, 65, 32))


def test_applies_only_to_bf16_values_on_an_sm90_gpu():
    values = torch.zeros(4, 128, dtype=torch.bfloat16)
    codes = torch.zeros(4, 128, dtype=torch.uint8)
    # on this CPU tensor never; on a GPU the dtype rules are checked by the GPU test
    assert not library_wgrad.applies(values, values, values)
    assert not library_wgrad.applies(values, codes, values)
    assert not library_wgrad.applies(None, values, values)
