"""FP8 block quantizer (1x128 and 128x128, power-of-two or float32 scales): bit-exact against
the pure-Python oracle, layouts, round-trip error."""

import math

import pytest
import torch

import quant_oracle as oracle
from quant_data import as_lists, fresh_seed, generator, grid_and_midpoints, nasty_blocks
from te_fused_moe.quantize import fp8_block

BF16_MAX = float(torch.finfo(torch.bfloat16).max)


def _check_1d(x, q, fmt, power_2, seed, value_for_inf=oracle.FLT_MAX):
    axis = q.axis
    rows = as_lists(x.to(torch.float32).movedim(axis, -1).reshape(-1, x.shape[axis]))
    data = q.data.view(torch.uint8).movedim(axis, -1).reshape(len(rows), -1).tolist()
    scale = q.scale.movedim(axis, -1).reshape(len(rows), -1).tolist()
    for r, row in enumerate(rows):
        for b in range(0, len(row), 128):
            blk = row[b : b + 128]
            codes, scale_inv = oracle.fp8_block_block(blk, oracle.amax(blk), fmt, power_2, value_for_inf)
            where = f"seed={seed} fmt={fmt} pow2={power_2} axis={axis} row={r} block={b // 128}"
            assert scale[r][b // 128] == scale_inv, f"{where}: scale_inv {scale[r][b // 128]!r} vs oracle {scale_inv!r}"
            assert data[r][b : b + 128] == codes, f"{where}: data differs for {blk}"


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("power_2", [True, False])
def test_bit_exact_1x128_hard_cases(fmt, power_2):
    seed = fresh_seed()
    ofmt = oracle.FORMATS[fmt]
    x = nasty_blocks(6, 128 * 3, 128, ofmt.max, grid_and_midpoints(ofmt), seed)
    _check_1d(x, fp8_block.quantize(x, power_2_scale=power_2, fp8_format=fmt), fmt, power_2, seed)


@pytest.mark.parametrize("power_2", [True, False])
def test_bit_exact_amax_ulp_sweeps_and_tiny_amax(power_2):
    # Block amaxes a few ulps around random values (scale = 448/amax rounding, power-of-two floor
    # at 448*2^k) and amaxes so small that 448/amax overflows float32 (value_for_inf).
    seed = fresh_seed()
    g = generator(seed)
    rows = []
    for i in range(16):
        base = 448.0 * 2.0 ** int(torch.randint(-30, 30, (1,), generator=g)) if i % 2 else float(torch.rand(1, generator=g)) * 100
        t = torch.tensor(base, dtype=torch.float32)
        for j in range(-2, 3):
            amax = float(torch.nextafter(t, torch.tensor(float("inf") if j > 0 else 0.0))) if j else float(t)
            rows.append([amax] + (torch.randn(127, generator=g) * amax / 4).clamp(-amax, amax).tolist())
    rows.append([1e-37] + [3e-38] * 127)  # 448/1e-37 overflows float32
    rows.append([2.0**-149] * 128)
    x = torch.tensor(rows, dtype=torch.float32)
    _check_1d(x, fp8_block.quantize(x, power_2_scale=power_2), "e4m3", power_2, seed)


def test_value_for_inf_follows_bfloat16_input():
    x = torch.full((1, 128), 1e-37).to(torch.bfloat16)
    q = fp8_block.quantize(x, power_2_scale=False)
    _check_1d(x, q, "e4m3", False, 0, value_for_inf=BF16_MAX)
    assert float(q.scale[0, 0]) == oracle.f32_div(1.0, BF16_MAX)


@pytest.mark.parametrize("axis", [0, 1])
def test_ragged_length_axis_and_layout(axis):
    seed = fresh_seed()
    shape = (300, 3) if axis == 0 else (3, 300)
    x = torch.randn(shape, generator=generator(seed)) * 10
    q = fp8_block.quantize(x, axis=axis)
    assert q.data.shape == x.shape and q.data.dtype == torch.float8_e4m3fn
    assert q.scale.dtype == torch.float32 and q.scale.shape[axis] == 3 and q.scale.shape[1 - axis] == 3
    _check_1d(x, q, "e4m3", True, seed)


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("power_2", [True, False])
def test_bit_exact_128x128_tiles(axis, power_2):
    seed = fresh_seed()
    g = generator(seed)
    x = torch.randn(130, 150, generator=g) * torch.exp2(torch.randint(-6, 6, (130, 1), generator=g).float())
    x[5, 7] = float("nan")
    x[129, 149] = 1e4
    q = fp8_block.quantize(x, block=(128, 128), axis=axis, power_2_scale=power_2)
    assert q.scale.shape == (2, 2) and q.data.shape == x.shape
    xs = as_lists(x)
    data = q.data.view(torch.uint8).tolist()
    for ti in range(2):
        for tj in range(2):
            rows = range(128 * ti, min(130, 128 * ti + 128))
            cols = range(128 * tj, min(150, 128 * tj + 128))
            tile_amax = oracle.amax(xs[r][c] for r in rows for c in cols)
            for r in rows:
                codes, scale_inv = oracle.fp8_block_block([xs[r][c] for c in cols], tile_amax, "e4m3", power_2)
                where = f"seed={seed} axis={axis} tile=({ti},{tj}) row={r}"
                assert float(q.scale[ti, tj]) == scale_inv, where
                assert data[r][cols.start : cols.stop] == codes, where
    other = fp8_block.quantize(x, block=(128, 128), axis=1 - axis, power_2_scale=power_2)
    assert torch.equal(other.scale, q.scale), f"seed={seed}"
    assert torch.equal(fp8_block.dequantize(other).nan_to_num(), fp8_block.dequantize(q).nan_to_num()), f"seed={seed}"


@pytest.mark.parametrize("fmt,mbits", [("e4m3", 3), ("e5m2", 2)])
@pytest.mark.parametrize("power_2", [True, False])
def test_round_trip_error_bound(fmt, mbits, power_2):
    seed = fresh_seed()
    g = generator(seed)
    x = torch.randn(16, 512, generator=g) * torch.exp2(torch.randint(-30, 30, (16, 1), generator=g).float())
    q = fp8_block.quantize(x, power_2_scale=power_2, fp8_format=fmt)
    d = fp8_block.dequantize(q)
    scale_inv = q.scale.repeat_interleave(128, dim=1)
    min_normal = 2.0 ** (-6 if fmt == "e4m3" else -14)
    bound = torch.maximum(x.abs() * 2.0 ** -(mbits + 1), min_normal * 2.0 ** -(mbits + 1) * scale_inv) * (1 + 1e-6)
    err = (d - x).abs()
    assert bool((err <= bound).all()), f"seed={seed}: worst excess {float((err - bound).max())}"
    # The scale maps amax to at most the format's maximum (float32 rounding of 1/scale aside).
    amax = x.abs().reshape(16, 4, 128).amax(-1).double()
    assert bool((amax / q.scale.double() <= oracle.FORMATS[fmt].max * (1 + 2.0**-22)).all()), f"seed={seed}"
    if power_2:
        assert bool((torch.frexp(q.scale).mantissa == 0.5).all()), f"seed={seed}: scale not a power of two"


def test_dequantize_float64_exact_and_specials():
    x = torch.zeros(2, 128)
    x[0, 0], x[0, 1], x[0, 2] = float("inf"), float("nan"), 3.0
    q = fp8_block.quantize(x)
    assert q.scale.tolist() == [[1.0], [1.0]]  # Inf amax and zero block: scale 1
    assert q.data.view(torch.uint8)[0, :3].tolist() == [0x7E, 0x7F, oracle.E4M3.round_code(3.0)]
    d = fp8_block.dequantize(q, dtype=torch.float64)
    assert d.dtype == torch.float64 and math.isnan(float(d[0, 1])) and float(d[0, 0]) == 448.0


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="block"):
        fp8_block.quantize(torch.zeros(4, 128), block=(1, 64))
    with pytest.raises(ValueError, match="2-D"):
        fp8_block.quantize(torch.zeros(2, 4, 128), block=(128, 128))
    with pytest.raises(ValueError, match="dtype"):
        fp8_block.dequantize(fp8_block.quantize(torch.ones(1, 128)), dtype=torch.bfloat16)
