"""Element formats (E4M3, E5M2, E2M1, E8M0) bit-exact against the pure-Python oracle."""

import math

import pytest
import torch

import quant_oracle as oracle
from quant_data import fresh_seed, generator, grid_and_midpoints
from te_fused_moe.quantize import formats

FORMATS = [(formats.E4M3, oracle.E4M3), (formats.E5M2, oracle.E5M2), (formats.E2M1, oracle.E2M1)]


def _probe_values(ofmt: oracle.Format, seed: int) -> torch.Tensor:
    """Every value and tie of the format, float32 neighbours of each, values beyond the maximum,
    specials, fp32 subnormals and random values over the whole range, both signs."""
    base = torch.tensor(grid_and_midpoints(ofmt), dtype=torch.float32)
    up = torch.nextafter(base, torch.tensor(float("inf")))
    down = torch.nextafter(base, torch.tensor(0.0))
    beyond = torch.tensor([ofmt.max * 1.0001, ofmt.max * 1.5, ofmt.max * 2, ofmt.max * 1e6, 3.0e38])
    specials = torch.tensor([0.0, float("inf"), float("nan"), 1e-45, 1e-40, 1.17e-38])
    g = generator(seed)
    rand = torch.randn(2000, generator=g) * torch.exp2(torch.randint(-25, 20, (2000,), generator=g).float())
    x = torch.cat([base, up, down, beyond, specials, rand])
    return torch.cat([x, -x])


@pytest.mark.parametrize("fmt,ofmt", FORMATS, ids=lambda f: getattr(f, "name", ""))
def test_encode_matches_oracle_bit_exact(fmt, ofmt):
    seed = fresh_seed()
    x = _probe_values(ofmt, seed)
    codes = formats.encode(x, fmt).tolist()
    for v, c in zip(x.tolist(), codes):
        expected = ofmt.round_code(v)
        assert c == expected, f"seed={seed} {fmt.name}: encode({v!r}) = {c:#x}, oracle {expected:#x}"


@pytest.mark.parametrize("fmt", [formats.E4M3, formats.E5M2], ids=lambda f: f.name)
def test_fp8_encode_matches_torch_cast_after_clamp(fmt):
    # A third opinion: torch's own RNE cast (which does not saturate, hence the clamp).
    seed = fresh_seed()
    x = _probe_values(oracle.FORMATS[fmt.name], seed)
    x = x[~torch.isnan(x)]
    ref = x.clamp(-fmt.max_value, fmt.max_value).to(fmt.torch_dtype).view(torch.uint8)
    mismatch = (formats.encode(x, fmt) != ref).nonzero()
    assert mismatch.numel() == 0, f"seed={seed}: first mismatch at {x[mismatch[0]].tolist()}"


@pytest.mark.parametrize("fmt,ofmt", FORMATS, ids=lambda f: getattr(f, "name", ""))
def test_decode_table_every_code(fmt, ofmt):
    table = formats.decode_table(fmt, torch.device("cpu")).tolist()
    for code, v in enumerate(table):
        expected = ofmt.value(code)
        assert (math.isnan(v) and math.isnan(expected)) or v == expected, f"{fmt.name} code {code:#x}: {v} vs {expected}"
        if not math.isnan(v):
            assert math.copysign(1.0, v) == math.copysign(1.0, expected)
    # encode(decode(c)) == c for every non-NaN code (-0 and +0 included).
    codes = torch.arange(2 * fmt.sign_bit, dtype=torch.uint8)
    values = formats.decode(codes, fmt)
    finite = ~torch.isnan(values) & ~torch.isinf(values)
    assert torch.equal(formats.encode(values[finite], fmt), codes[finite])


def test_saturation_and_nan_rules():
    x = torch.tensor([1e30, -1e30, float("inf"), -float("inf"), float("nan"), -float("nan"), -0.0, -1e-30])
    assert formats.encode(x, formats.E4M3).tolist() == [0x7E, 0xFE, 0x7E, 0xFE, 0x7F, 0x7F, 0x80, 0x80]
    assert formats.encode(x, formats.E5M2).tolist() == [0x7B, 0xFB, 0x7B, 0xFB, 0x7F, 0x7F, 0x80, 0x80]
    assert formats.encode(x, formats.E2M1).tolist() == [0x7, 0xF, 0x7, 0xF, 0x7, 0x7, 0x8, 0x8]


def test_e8m0_encode_matches_oracle():
    seed = fresh_seed()
    g = generator(seed)
    powers = torch.exp2(torch.arange(-149, 128, dtype=torch.float64)).to(torch.float32)
    probes = torch.cat(
        [
            powers,
            torch.nextafter(powers, torch.tensor(float("inf"))),
            torch.nextafter(powers, torch.tensor(0.0)),
            torch.tensor([0.0, float("inf"), float("nan"), 3.4e38, 2.0**-127 * 1.5, 2.0**-127 * 0.75]),
            torch.rand(500, generator=g) * torch.exp2(torch.randint(-140, 128, (500,), generator=g).float()),
        ]
    )
    codes = formats.e8m0_encode(probes).tolist()
    for v, c in zip(probes.tolist(), codes):
        assert c == oracle.e8m0_round_up(v), f"seed={seed}: e8m0({v!r}) = {c}, oracle {oracle.e8m0_round_up(v)}"


def test_e8m0_decode_and_reciprocal_every_code():
    codes = torch.arange(256, dtype=torch.uint8)
    dec = formats.e8m0_decode(codes, torch.float64).tolist()
    rcp = formats.e8m0_reciprocal(codes).tolist()
    for c in range(255):
        assert dec[c] == 2.0 ** (c - 127)
        assert rcp[c] == 2.0 ** (127 - c)  # 2^-127 (code 254) is a float32 subnormal, still exact
    assert math.isnan(dec[255]) and math.isnan(rcp[255])


def test_stochastic_rounding_matches_oracle():
    seed = fresh_seed()
    g = generator(seed)
    grid = torch.tensor(grid_and_midpoints(oracle.E2M1), dtype=torch.float32)
    x = torch.cat(
        [
            torch.rand(3000, generator=g) * 7.0,
            grid,
            torch.nextafter(grid, torch.tensor(0.0)),
            torch.tensor([0.0, -0.0, 6.5, 100.0, float("inf"), -float("inf"), float("nan"), 1e-40, 2.0**-9 - 2.0**-33]),
        ]
    )
    x = torch.cat([x, -x])
    bits = torch.randint(0, 256, x.shape, generator=g, dtype=torch.uint8)
    codes = formats.stochastic_round_e2m1(x, bits).tolist()
    for v, b, c in zip(x.tolist(), bits.tolist(), codes):
        expected = oracle.sr_e2m1_code(v, b)
        assert c == expected, f"seed={seed}: SR({v!r}, bits={b}) = {c:#x}, oracle {expected:#x}"


def test_stochastic_rounding_neighbours_and_unbiased():
    seed = fresh_seed()
    g = generator(seed)
    x = torch.rand(64, generator=g) * 6.0 * torch.where(torch.rand(64, generator=g) < 0.5, -1.0, 1.0)
    draws = 4000
    xs = x.repeat(draws, 1)
    bits = torch.randint(0, 256, xs.shape, generator=g, dtype=torch.uint8)
    q = formats.decode(formats.stochastic_round_e2m1(xs, bits), formats.E2M1)
    grid = torch.tensor(oracle.E2M1.sorted_values)
    a = x.abs()
    lo = grid[torch.searchsorted(grid, a, right=True) - 1]
    hi = grid[torch.clamp(torch.searchsorted(grid, a, right=False), max=len(grid) - 1)]
    qa = q.abs()
    assert bool(((qa == lo) | (qa == hi)).all()), f"seed={seed}: SR left the two neighbours"
    assert bool((torch.sign(q) * torch.sign(x) >= 0).all()), f"seed={seed}: SR flipped a sign"
    # E[q] = x up to TE's 8-bit quantisation of the probability (< step/256) plus sampling noise.
    step = hi - lo
    bias_bound = step / 256 + 5 * step * 0.5 / math.sqrt(draws)
    err = (q.mean(0) - x).abs()
    assert bool((err <= bias_bound + 1e-7).all()), f"seed={seed}: SR mean error {err.max()} > {bias_bound.max()}"
    # Round-to-nearest is biased per value; SR's average bias must be far smaller.
    rne_bias = (formats.decode(formats.encode(x, formats.E2M1), formats.E2M1) - x).abs().mean()
    assert float(err.mean()) < 0.25 * float(rne_bias), f"seed={seed}: SR bias {err.mean()} vs RNE {rne_bias}"


def test_bad_inputs_raise():
    with pytest.raises(TypeError, match="x"):
        formats.encode(torch.zeros(3, dtype=torch.float64), formats.E4M3)
    with pytest.raises(ValueError, match="fp8_format"):
        formats.fp8_format("e3m4")
    with pytest.raises(ValueError, match="random_bits"):
        formats.stochastic_round_e2m1(torch.zeros(3), torch.zeros(4, dtype=torch.uint8))
