"""Test data for the quantizer tests: fresh seeds and small tensors full of hard cases (format
maxima and ties, fp32 subnormals, ±0, ±Inf, NaN, all-zero / all-NaN blocks, huge and tiny
block amax)."""

from __future__ import annotations

import secrets

import torch

import quant_oracle as oracle


def fresh_seed() -> int:
    return secrets.randbelow(2**31)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def grid_and_midpoints(fmt: oracle.Format):
    """Every non-negative value of ``fmt`` and every midpoint between neighbours (the ties)."""
    values = fmt.sorted_values
    mids = [(a + b) / 2 for a, b in zip(values, values[1:])]
    return values + mids


def nasty_blocks(rows: int, cols: int, block: int, fmt_max: float, grid, seed: int) -> torch.Tensor:
    """float32 [rows, cols]: each run of ``block`` along the last dim is one of several kinds.

    ``grid`` lists magnitudes (e.g. values and midpoints of the element format) that land
    exactly on the format's grid when the block's amax is ``fmt_max * 2**k``; "tie" blocks use
    that to hit every rounding tie exactly."""
    g = generator(seed)
    x = torch.randn(rows, cols, generator=g)
    grid_t = torch.tensor(grid, dtype=torch.float32)
    nb = -(-cols // block)
    for r in range(rows):
        for b in range(nb):
            lo, hi = b * block, min(cols, (b + 1) * block)
            n = hi - lo
            kind = int(torch.randint(0, 9, (1,), generator=g))
            k = int(torch.randint(-20, 20, (1,), generator=g))
            if kind == 0:  # exact ties and grid values, amax = fmt_max * 2**k
                idx = torch.randint(0, len(grid), (n,), generator=g)
                signs = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
                vals = grid_t[idx] * signs * 2.0**k
                vals[int(torch.randint(0, n, (1,), generator=g))] = fmt_max * 2.0**k
                x[r, lo:hi] = vals
            elif kind == 1:
                x[r, lo:hi] = 0.0
            elif kind == 2:  # huge amax
                x[r, lo:hi] *= 2.0**100
            elif kind == 3:  # tiny amax, fp32 subnormals included
                x[r, lo:hi] *= 2.0**-135
            elif kind == 4:  # specials sprinkled into ordinary values
                specials = torch.tensor(
                    [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-41, -3e-45, fmt_max, -fmt_max * 2.0**k]
                )
                pos = torch.randint(0, n, (3,), generator=g)
                x[r, lo + pos] = specials[torch.randint(0, len(specials), (3,), generator=g)]
            elif kind == 5:  # all NaN
                x[r, lo:hi] = float("nan")
            elif kind == 6:  # wide dynamic range inside the block (format subnormals after scaling)
                x[r, lo:hi] *= torch.exp2(torch.randint(-30, 1, (n,), generator=g).float())
            else:
                x[r, lo:hi] *= 2.0**k
    return x


def as_lists(t: torch.Tensor):
    return [[float(v) for v in row] for row in t.tolist()]
