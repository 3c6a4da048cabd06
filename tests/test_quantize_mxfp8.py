"""MXFP8 quantizer: bit-exact against the pure-Python oracle, layout, round-trip error."""

import math

import pytest
import torch

import quant_oracle as oracle
from quant_data import as_lists, fresh_seed, generator, grid_and_midpoints, nasty_blocks
from te_fused_moe.quantize import mxfp8


def _check_against_oracle(x: torch.Tensor, axis: int, fmt: str, seed: int) -> None:
    q = mxfp8.quantize(x, axis=axis, fp8_format=fmt)
    # Oracle works on rows along the block axis.
    rows = as_lists(x.to(torch.float32).movedim(axis, -1).reshape(-1, x.shape[axis]))
    data = q.data.view(torch.uint8).movedim(axis, -1).reshape(len(rows), -1).tolist()
    scale = q.scale.movedim(axis, -1).reshape(len(rows), -1).tolist()
    for r, row in enumerate(rows):
        for b in range(0, len(row), 32):
            codes, scode = oracle.mxfp8_block(row[b : b + 32], fmt)
            where = f"seed={seed} fmt={fmt} axis={axis} row={r} block={b // 32}"
            assert scale[r][b // 32] == scode, f"{where}: scale {scale[r][b // 32]} vs oracle {scode}"
            assert data[r][b : b + 32] == codes, f"{where}: data {data[r][b:b + 32]} vs oracle {codes} for {row[b:b + 32]}"


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_bit_exact_against_oracle_hard_cases(fmt):
    seed = fresh_seed()
    ofmt = oracle.FORMATS[fmt]
    x = nasty_blocks(12, 32 * 6, 32, ofmt.max, grid_and_midpoints(ofmt), seed)
    _check_against_oracle(x, -1, fmt, seed)


@pytest.mark.parametrize("axis", [0, 1])
def test_bit_exact_ragged_length_and_axis(axis):
    # Length along the axis not a multiple of 32 (short last block), bf16 input.
    seed = fresh_seed()
    shape = (77, 5) if axis == 0 else (5, 77)
    x = (torch.randn(shape, generator=generator(seed)) * 3).to(torch.bfloat16)
    q = mxfp8.quantize(x, axis=axis)
    assert q.data.shape == x.shape and q.data.dtype == torch.float8_e4m3fn
    assert q.scale.dtype == torch.uint8 and q.scale.shape[axis] == 3 and q.scale.shape[1 - axis] == 5
    _check_against_oracle(x, axis, "e4m3", seed)


def test_padding_does_not_change_the_last_block():
    seed = fresh_seed()
    x = torch.randn(3, 40, generator=generator(seed))
    padded = torch.cat([x, torch.zeros(3, 24)], dim=1)
    a, b = mxfp8.quantize(x), mxfp8.quantize(padded)
    assert torch.equal(a.scale, b.scale), f"seed={seed}"
    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)[:, :40]), f"seed={seed}"


def test_three_d_tensor_any_axis():
    seed = fresh_seed()
    x = torch.randn(3, 40, 6, generator=generator(seed))
    q = mxfp8.quantize(x, axis=1)
    assert q.scale.shape == (3, 2, 6)
    ref = mxfp8.quantize(x.movedim(1, -1), axis=-1)
    assert torch.equal(q.data.view(torch.uint8).movedim(1, -1), ref.data.view(torch.uint8)), f"seed={seed}"
    assert torch.equal(mxfp8.dequantize(q).movedim(1, -1), mxfp8.dequantize(ref)), f"seed={seed}"


@pytest.mark.parametrize("fmt,mbits", [("e4m3", 3), ("e5m2", 2)])
def test_round_trip_error_bound(fmt, mbits):
    seed = fresh_seed()
    g = generator(seed)
    x = torch.randn(64, 256, generator=g) * torch.exp2(torch.randint(-40, 40, (64, 1), generator=g).float())
    d = mxfp8.dequantize(mxfp8.quantize(x, fp8_format=fmt))
    q = mxfp8.quantize(x, fp8_format=fmt)
    scale = torch.exp2(q.scale.float() - 127).repeat_interleave(32, dim=1)
    # Normal range: relative error <= 2^-(m+1); below the format's smallest normal the error is
    # at most half a subnormal step, times the block scale.
    min_normal = 2.0 ** (-6 if fmt == "e4m3" else -14)
    half_sub = min_normal * 2.0 ** -(mbits + 1)
    bound = torch.maximum(x.abs() * 2.0 ** -(mbits + 1), half_sub * scale)
    err = (d - x).abs()
    assert bool((err <= bound).all()), f"seed={seed}: worst excess {(err - bound).max()}"
    rel = float((d - x).norm() / x.norm())
    assert rel < 2.0 ** -(mbits + 1), f"seed={seed}: relative error {rel}"


def test_dequantize_float64_is_exact_product():
    seed = fresh_seed()
    x = torch.randn(4, 64, generator=generator(seed))
    q = mxfp8.quantize(x)
    d64 = mxfp8.dequantize(q, dtype=torch.float64)
    expected = q.data.to(torch.float64) * torch.exp2(q.scale.to(torch.float64) - 127).repeat_interleave(32, dim=1)
    assert torch.equal(d64, expected)
    assert torch.equal(mxfp8.dequantize(q), d64.to(torch.float32))  # no underflow here: exact too


def test_specials_end_to_end():
    x = torch.zeros(1, 64)
    x[0, 0], x[0, 1], x[0, 2] = float("inf"), float("nan"), -1.0
    x[0, 32:] = float("nan")
    q = mxfp8.quantize(x)
    assert q.scale.tolist() == [[254, 0]]  # Inf amax -> 2^127; NaN-only block -> amax 0
    codes = q.data.view(torch.uint8)[0].tolist()
    assert codes[0] == 0x7E and codes[1] == 0x7F  # Inf saturates to 448, NaN stays NaN
    assert math.isnan(float(mxfp8.dequantize(q)[0, 1]))


def test_bad_inputs_raise():
    with pytest.raises(TypeError, match="t"):
        mxfp8.quantize(torch.zeros(4, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="axis"):
        mxfp8.quantize(torch.zeros(4, 32), axis=2)
    with pytest.raises(ValueError, match="fp8_format"):
        mxfp8.quantize(torch.zeros(4, 32), fp8_format="e2m1")
    with pytest.raises(TypeError, match="q"):
        mxfp8.dequantize(torch.zeros(3))
