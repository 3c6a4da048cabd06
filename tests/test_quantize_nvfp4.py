"""NVFP4 quantizer (1D, 2D tiles, stochastic rounding) and the 16-point RHT: bit-exact against
the pure-Python oracle, layouts, error bounds, SR statistics, RHT orthogonality."""

import math

import pytest
import torch

import quant_oracle as oracle
from quant_data import as_lists, fresh_seed, generator, grid_and_midpoints, nasty_blocks
from te_fused_moe.quantize import formats, hadamard, nvfp4

E2M1_GRID = grid_and_midpoints(oracle.E2M1)


def _codes(q: nvfp4.NVFP4Tensor) -> torch.Tensor:
    return nvfp4.unpack_e2m1(q.data, q.axis, q.shape[q.axis])


def _check_1d(x, q, seed, global_amax=None, bits=None):
    """Compare ``q`` (1D blocks along q.axis) with the oracle, codes, scales and dequantized values."""
    axis = q.axis
    x32 = x.to(torch.float32).movedim(axis, -1)
    rows = as_lists(x32.reshape(-1, x32.shape[-1]))
    gamax = oracle.amax(v for row in rows for v in row) if global_amax is None else global_amax
    s_enc, s_dec = oracle.nvfp4_global(gamax)
    assert float(q.global_scale) == s_dec, f"seed={seed}: S_dec {float(q.global_scale)} vs {s_dec}"
    codes = _codes(q).movedim(axis, -1).reshape(len(rows), -1).tolist()
    scales = q.scale.view(torch.uint8).movedim(axis, -1).reshape(len(rows), -1).tolist()
    deq = nvfp4.dequantize(q).movedim(axis, -1).reshape(len(rows), -1).tolist()
    rb = None if bits is None else bits.movedim(axis, -1).reshape(len(rows), -1).tolist()
    for r, row in enumerate(rows):
        for b in range(0, len(row), 16):
            blk = row[b : b + 16]
            want, scode = oracle.nvfp4_block(blk, oracle.amax(blk), s_enc, s_dec, None if rb is None else rb[r][b : b + 16])
            where = f"seed={seed} axis={axis} row={r} block={b // 16} values={blk}"
            assert scales[r][b // 16] == scode, f"{where}: scale {scales[r][b // 16]:#x} vs oracle {scode:#x}"
            assert codes[r][b : b + 16] == want, f"{where}: codes {codes[r][b:b + 16]} vs oracle {want}"
            for i, c in enumerate(want):
                expected = oracle.nvfp4_value(c, scode, gamax)
                got = deq[r][b + i]
                assert got == expected or (math.isnan(got) and math.isnan(expected)), f"{where}: dequant {got} vs {expected}"


def test_bit_exact_hard_cases_computed_global_amax():
    seed = fresh_seed()
    x = nasty_blocks(10, 16 * 8, 16, 6.0, E2M1_GRID, seed)
    x[0, :3] = torch.tensor([2688.0, -2688.0, 1.0])  # keeps S_enc finite and tame despite the mix
    _check_1d(x, nvfp4.quantize(x), seed)


def test_bit_exact_exact_ties_with_given_global_amax():
    # global_amax = 2688 makes S_enc = 1, so "tie" blocks (amax 6*2^k) hit every E2M1 tie exactly.
    seed = fresh_seed()
    x = nasty_blocks(10, 16 * 8, 16, 6.0, E2M1_GRID, seed)
    q = nvfp4.quantize(x, global_amax=torch.tensor(2688.0))
    _check_1d(x, q, seed, global_amax=2688.0)


def _nudge(v: float, ulps: int) -> float:
    t = torch.tensor(v, dtype=torch.float32)
    direction = torch.tensor(float("inf") if ulps > 0 else 0.0)
    for _ in range(abs(ulps)):
        t = torch.nextafter(t, direction)
    return float(t)


def test_bit_exact_near_rounding_boundaries():
    """Block amaxes a few ulps around the values whose decode scale is an E4M3 tie, and elements
    a few ulps around E2M1 ties after scaling: catches any change in float32 operation order."""
    seed = fresh_seed()
    g = generator(seed)
    big = oracle.f32(2688.0 * (0.3 + 2.7 * float(torch.rand(1, generator=g))))
    s_enc, s_dec = oracle.nvfp4_global(big)
    mult = oracle.f32_mul(s_enc, oracle.f32(1.0 / 6.0))
    e4m3 = [v for v in oracle.E4M3.sorted_values if 2.0**-8 <= v <= 440]
    mids = [(a + b) / 2 for a, b in zip(e4m3, e4m3[1:])]
    rows = [[big] + [0.0] * 15]
    for _ in range(12):
        m = mids[int(torch.randint(0, len(mids), (1,), generator=g))]
        a0 = oracle.f32(m / mult)
        for j in range(-3, 4):
            amax = _nudge(a0, j)
            rows.append([amax] + (torch.rand(15, generator=g) * amax).tolist())
    for _ in range(12):
        amax = oracle.f32(big * float(torch.rand(1, generator=g)))
        _, scode = oracle.nvfp4_block([amax], amax, s_enc, s_dec)
        r = min(oracle.f32_div(1.0, oracle.f32_mul(oracle.E4M3.value(scode), s_dec)), oracle.FLT_MAX)
        ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
        row = [amax]
        while len(row) < 16:
            tie = ties[int(torch.randint(0, len(ties), (1,), generator=g))]
            row.append(-_nudge(oracle.f32(tie / r), int(torch.randint(-2, 3, (1,), generator=g))))
        rows.append(row)
    x = torch.tensor(rows, dtype=torch.float32)
    _check_1d(x, nvfp4.quantize(x), seed)


@pytest.mark.parametrize("axis", [0, 1])
def test_bit_exact_ragged_axis_and_odd_length(axis):
    seed = fresh_seed()
    shape = (37, 6) if axis == 0 else (6, 37)
    x = (torch.randn(shape, generator=generator(seed)) * 5).to(torch.bfloat16)
    q = nvfp4.quantize(x, axis=axis)
    assert q.data.dtype == torch.uint8 and q.data.shape[axis] == 19 and q.data.shape[1 - axis] == 6
    assert q.scale.dtype == torch.float8_e4m3fn and q.scale.shape[axis] == 3
    # Odd length: the last byte's high nibble is padding (zero).
    last = q.data.narrow(axis, 18, 1)
    assert bool(((last >> 4) == 0).all())
    _check_1d(x, q, seed)


def test_nibble_order():
    x = torch.tensor([[0.5, 6.0, -1.0, 0.0] + [0.0] * 12])
    q = nvfp4.quantize(x, global_amax=2688.0)
    assert q.data[0, :2].tolist() == [0x1 | (0x7 << 4), 0xA | (0x0 << 4)]  # element 2j is the low nibble


def test_stochastic_rounding_bit_exact_with_given_bits():
    seed = fresh_seed()
    g = generator(seed)
    x = nasty_blocks(6, 16 * 6, 16, 6.0, E2M1_GRID, seed)
    bits = torch.randint(0, 256, x.shape, generator=g, dtype=torch.uint8)
    q = nvfp4.quantize(x, stochastic_rounding=True, random_bits=bits, global_amax=2688.0)
    _check_1d(x, q, seed, global_amax=2688.0, bits=bits)


def test_stochastic_rounding_unbiased_and_neighbours():
    seed = fresh_seed()
    g = generator(seed)
    x = torch.randn(4, 32, generator=g)
    ref = nvfp4.quantize(x)
    draws = 1500
    xs = x.repeat(draws, 1)
    # Same scales for every draw: the global amax is the same and block amaxes repeat.
    q = nvfp4.quantize(xs, stochastic_rounding=True, generator=g)
    assert torch.equal(q.scale.view(torch.uint8), ref.scale.view(torch.uint8).repeat(draws, 1)), f"seed={seed}"
    dy = formats.decode(_codes(q), formats.E2M1, torch.float64).reshape(draws, 4, 32)
    # Work on the E2M1 grid of each block: y = x * r with r = 1 / (block scale * S_dec).
    s = ref.scale.to(torch.float64).repeat_interleave(16, dim=1)
    r = 1.0 / (s * float(ref.global_scale))
    y = x.double() * r
    inside = y.abs() <= 6.0  # beyond 6 saturates (NVFP4's own clipping, not SR's business)
    step = torch.where(y.abs() >= 4, 2.0, torch.where(y.abs() >= 2, 1.0, 0.5))
    lo = torch.floor(y.abs() / step) * step
    on_grid = (dy.abs() == lo) | (dy.abs() == torch.clamp(lo + step, max=6.0))
    assert bool(on_grid[:, inside].all()), f"seed={seed}: SR left the two E2M1 neighbours"
    mean_err = (dy.mean(0) - y).abs()[inside]
    # TE's 8-bit probability is biased by < step/256; the rest is sampling noise.
    bound = step[inside] / 256 + 5 * step[inside] * 0.5 / math.sqrt(draws)
    assert bool((mean_err <= bound).all()), f"seed={seed}: SR mean error exceeds bound by {float((mean_err - bound).max())}"
    rne_err = (formats.decode(_codes(ref), formats.E2M1, torch.float64) - y).abs()[inside]
    assert float(mean_err.mean()) < 0.25 * float(rne_err.mean()), f"seed={seed}"


def test_stochastic_rounding_generator_reproducible():
    seed = fresh_seed()
    x = torch.randn(8, 64, generator=generator(seed))
    a = nvfp4.quantize(x, stochastic_rounding=True, generator=generator(seed + 1))
    b = nvfp4.quantize(x, stochastic_rounding=True, generator=generator(seed + 1))
    c = nvfp4.quantize(x, stochastic_rounding=True, generator=generator(seed + 2))
    assert torch.equal(a.data, b.data), f"seed={seed}"
    assert not torch.equal(a.data, c.data), f"seed={seed}: two generators gave identical SR draws"


@pytest.mark.parametrize("axis", [0, 1])
def test_2d_tiles_bit_exact_and_shared(axis):
    seed = fresh_seed()
    g = generator(seed)
    x = torch.randn(40, 35, generator=g) * torch.exp2(torch.randint(-10, 10, (40, 1), generator=g).float())
    x[3, 4] = float("nan")
    q = nvfp4.quantize(x, axis=axis, block_2d=True)
    assert q.scale.shape == (3, 3), f"seed={seed}"
    codes = _codes(q)
    scales = q.scale.view(torch.uint8).tolist()
    xs = as_lists(x)
    gamax = oracle.amax(v for row in xs for v in row)
    s_enc, s_dec = oracle.nvfp4_global(gamax)
    deq = nvfp4.dequantize(q)
    for ti in range(3):
        for tj in range(3):
            rows = range(16 * ti, min(40, 16 * ti + 16))
            cols = range(16 * tj, min(35, 16 * tj + 16))
            tile_amax = oracle.amax(xs[r][c] for r in rows for c in cols)
            for r in rows:
                want, scode = oracle.nvfp4_block([xs[r][c] for c in cols], tile_amax, s_enc, s_dec)
                where = f"seed={seed} axis={axis} tile=({ti},{tj}) row={r}"
                assert scales[ti][tj] == scode, f"{where}: scale {scales[ti][tj]:#x} vs {scode:#x}"
                assert codes[r, cols.start : cols.stop].tolist() == want, where
    # The dequantized tensor uses one scale per tile, the same for both axes.
    other = nvfp4.quantize(x, axis=1 - axis, block_2d=True)
    assert torch.equal(other.scale.view(torch.uint8), q.scale.view(torch.uint8)), f"seed={seed}"
    assert torch.equal(nvfp4.dequantize(other).nan_to_num(), deq.nan_to_num()), f"seed={seed}"


def test_round_trip_error_bound():
    seed = fresh_seed()
    g = generator(seed)
    x = torch.randn(32, 128, generator=g) * torch.exp2(torch.randint(-8, 8, (32, 1), generator=g).float())
    q = nvfp4.quantize(x)
    d = nvfp4.dequantize(q)
    # Per block: E2M1 has relative spacing <= 1/2 above 1 (error <= 1/4 of the value) and the
    # E4M3 block scale adds at most 2^-4 relative; below 1x scale, half a step of 0.5*scale.
    blocks = x.reshape(32, 8, 16)
    amax = blocks.abs().amax(-1, keepdim=True)
    scale = amax / 6.0
    bound = torch.maximum(blocks.abs() * 0.25, 0.25 * scale) * (1 + 2.0**-3) + scale * 6 * 2.0**-4
    err = (d.reshape(32, 8, 16) - blocks).abs()
    assert bool((err <= bound).all()), f"seed={seed}: worst excess {float((err - bound).max())}"
    assert float((d - x).norm() / x.norm()) < 0.15, f"seed={seed}"


def test_zero_and_nonfinite_tensors():
    z = nvfp4.quantize(torch.zeros(2, 32))
    assert float(z.global_scale) == 1.0 and bool((z.data == 0).all())
    assert bool((nvfp4.dequantize(z) == 0).all())
    x = torch.ones(1, 32)
    x[0, 5] = float("inf")
    x[0, 20] = float("nan")
    q = nvfp4.quantize(x)
    assert float(q.global_scale) == 1.0  # Inf global amax -> S_enc = 1
    codes = _codes(q)[0].tolist()
    assert codes[5] == 0x7 and codes[20] == 0x7  # Inf saturates; NaN -> +6 (satfinite)


# ------------------------------------------------------------------------------------------ RHT
def test_rht_matrix_matches_oracle_and_is_orthogonal():
    m = hadamard.rht_matrix()
    for i in range(16):
        for j in range(16):
            assert float(m[i, j]) == oracle.rht_entry(i, j)
    assert torch.equal(m @ m.T, torch.eye(16, dtype=torch.float64))
    assert torch.equal(m.T @ m, torch.eye(16, dtype=torch.float64))


@pytest.mark.parametrize("axis", [0, 1])
def test_rht_apply_matches_oracle_and_inverts(axis):
    seed = fresh_seed()
    x = torch.randn(48, 5, generator=generator(seed)) if axis == 0 else torch.randn(5, 48, generator=generator(seed))
    w = hadamard.apply_rht(x, axis)
    assert w.dtype == torch.float32 and w.shape == x.shape
    runs = as_lists(x.movedim(axis, -1).reshape(-1, 16))
    got = as_lists(w.movedim(axis, -1).reshape(-1, 16))
    for v, g in zip(runs, got):
        assert g == [oracle.f32(y) for y in oracle.rht_run(v)], f"seed={seed}"
    back = hadamard.apply_inverse_rht(w.double(), axis, x.shape[axis], torch.float64)
    assert torch.allclose(back, x.double(), rtol=0, atol=1e-6), f"seed={seed}"


def test_rht_preserves_products_and_pads():
    seed = fresh_seed()
    g = generator(seed)
    a, b = torch.randn(37, 6, generator=g, dtype=torch.float64), torch.randn(37, 4, generator=g, dtype=torch.float64)
    ta, tb = hadamard._transform(a, 0, hadamard.rht_matrix()), hadamard._transform(b, 0, hadamard.rht_matrix())
    assert ta.shape == (48, 6)
    assert torch.allclose(ta.T @ tb, a.T @ b, rtol=1e-12, atol=1e-12), f"seed={seed}"
    back = hadamard.apply_inverse_rht(ta, 0, 37, torch.float64)
    assert torch.allclose(back, a, rtol=0, atol=1e-12), f"seed={seed}"


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="2-D"):
        nvfp4.quantize(torch.zeros(2, 3, 16), block_2d=True)
    with pytest.raises(ValueError, match="random_bits"):
        nvfp4.quantize(torch.zeros(2, 16), stochastic_rounding=True, random_bits=torch.zeros(2, 8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="global_amax"):
        nvfp4.quantize(torch.zeros(2, 16), global_amax=torch.zeros(2))
    with pytest.raises(TypeError, match="q"):
        nvfp4.dequantize(torch.zeros(3))


# --------------------------------------------------------------------------- per-row (per-group) tensor scales

def _group_rows(sizes):
    """Row -> group id for groups of the given row counts (each a multiple of 16)."""
    return torch.cat([torch.full((n,), g, dtype=torch.int64) for g, n in enumerate(sizes)])


def _per_group_inputs(seed, sizes, cols):
    g = generator(seed)
    rows = sum(sizes)
    # Each group has its own magnitude, so a shared tensor scale would quantize some groups coarsely.
    mag = torch.exp2(torch.randint(-12, 12, (len(sizes),), generator=g).float())
    x = torch.randn(rows, cols, generator=g) * mag[_group_rows(sizes)][:, None]
    amax = torch.stack([x[_group_rows(sizes) == i].abs().amax() if n else torch.tensor(0.0)
                        for i, n in enumerate(sizes)])
    return x, amax[_group_rows(sizes)], g


@pytest.mark.parametrize("axis,block_2d", [(1, False), (0, False), (1, True), (0, True)])
def test_row_global_amax_equals_quantizing_each_group_alone(axis, block_2d):
    """Per-row amax (one value per group) gives, for every group, exactly the bytes, scales and
    values of quantizing that group's rows alone with its own amax (TE's per-expert tensors)."""
    seed = fresh_seed()
    sizes = [32, 16, 64, 48]
    x, row_amax, _ = _per_group_inputs(seed, sizes, 80)
    q = nvfp4.quantize(x, axis=axis, block_2d=block_2d, row_global_amax=row_amax)
    assert q.global_amax.shape == (x.shape[0],) and q.global_scale.shape == (x.shape[0],)
    deq = nvfp4.dequantize(q)
    deq64 = nvfp4.dequantize(q, dtype=torch.float64)
    start = 0
    for n in sizes:
        rows = slice(start, start + n)
        alone = nvfp4.quantize(x[rows], axis=axis, block_2d=block_2d)  # amax of the group's own rows
        assert float(alone.global_amax) == float(row_amax[start]), seed
        assert torch.equal(q.global_scale[rows], alone.global_scale.expand(n)), seed
        if axis == 1:
            assert torch.equal(q.data[rows], alone.data), seed
        else:
            assert torch.equal(q.data[start // 2:(start + n) // 2], alone.data), seed
        s_rows = rows if (axis == 1 and not block_2d) else slice(start // 16, (start + n) // 16)
        assert torch.equal(q.scale[s_rows].view(torch.uint8), alone.scale.view(torch.uint8)), seed
        assert torch.equal(deq[rows], nvfp4.dequantize(alone)), seed
        assert torch.equal(deq64[rows], nvfp4.dequantize(alone, dtype=torch.float64)), seed
        start += n


def test_row_global_amax_with_one_value_is_the_per_tensor_quantizer():
    seed = fresh_seed()
    x = nasty_blocks(8, 16 * 5, 16, 6.0, E2M1_GRID, seed)
    amax = formats.nan_ignoring_amax(x.reshape(-1), dim=0) * 1.5  # the blocks hold NaN and Inf on purpose
    for axis, block_2d in ((1, False), (0, False), (1, True)):
        a = nvfp4.quantize(x, axis=axis, block_2d=block_2d, global_amax=amax)
        b = nvfp4.quantize(x, axis=axis, block_2d=block_2d, row_global_amax=amax.expand(x.shape[0]).clone())
        assert torch.equal(a.data, b.data) and torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8))
        torch.testing.assert_close(nvfp4.dequantize(a), nvfp4.dequantize(b), rtol=0, atol=0, equal_nan=True)


def test_row_global_amax_stochastic_rounding_with_given_bits_matches_per_group():
    seed = fresh_seed()
    sizes = [16, 48, 32]
    x, row_amax, g = _per_group_inputs(seed, sizes, 32)
    bits = torch.randint(0, 256, x.shape, generator=g, dtype=torch.uint8)
    for axis in (0, 1):
        q = nvfp4.quantize(x, axis=axis, stochastic_rounding=True, random_bits=bits, row_global_amax=row_amax)
        start = 0
        for n in sizes:
            rows = slice(start, start + n)
            alone = nvfp4.quantize(x[rows], axis=axis, stochastic_rounding=True, random_bits=bits[rows].contiguous())
            assert torch.equal(nvfp4.dequantize(q)[rows], nvfp4.dequantize(alone)), (seed, axis)
            start += n


def test_row_global_amax_zero_group_and_bad_inputs():
    x = torch.randn(32, 16, generator=generator(fresh_seed()))
    x[:16] = 0.0
    amax = torch.cat([torch.zeros(16), x[16:].abs().amax().expand(16)])
    q = nvfp4.quantize(x, row_global_amax=amax)
    assert bool((nvfp4.dequantize(q)[:16] == 0).all()) and float(q.global_scale[0]) == 1.0  # S_enc = 1 for amax 0
    with pytest.raises(ValueError, match=r"row_global_amax: expected a tensor of shape \(32,\)"):
        nvfp4.quantize(x, row_global_amax=amax[:16])
    with pytest.raises(ValueError, match="either global_amax or row_global_amax"):
        nvfp4.quantize(x, row_global_amax=amax, global_amax=1.0)
    with pytest.raises(ValueError, match="needs a 2-D t"):
        nvfp4.quantize(x.reshape(2, 16, 16), row_global_amax=amax)
