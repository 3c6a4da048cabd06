"""The recipe benchmark's interleaved rounds (``bench_recipes.median_of_rounds``): CPU-only logic."""

import random

import pytest

from te_fused_moe.bench_recipes import median_of_rounds


def _round(ms: float, flops: float) -> dict:
    return {"fwd_ms": ms / 3, "bwd_ms": 2 * ms / 3, "fwd_bwd_ms": ms, "fwd_tflops": flops / (ms / 3) / 1e9,
            "fwd_bwd_tflops": flops * 3 / ms / 1e9, "fwd_bwd_of_peak": flops * 3 / ms / 1e9 / 800.0,
            "peak_mem_gib": 4.5}


def test_medians_per_field_and_rates_from_the_median_time():
    rng = random.Random()
    times = [rng.uniform(10.0, 20.0) for _ in range(5)]
    flops = rng.uniform(1e12, 1e13)
    out = median_of_rounds([_round(t, flops) for t in times])
    median = sorted(times)[2]
    assert out["fwd_bwd_ms"] == pytest.approx(median)
    assert out["fwd_ms"] == pytest.approx(median / 3) and out["bwd_ms"] == pytest.approx(2 * median / 3)
    assert out["fwd_bwd_tflops"] == pytest.approx(flops * 3 / median / 1e9)
    assert out["fwd_tflops"] == pytest.approx(flops / (median / 3) / 1e9)
    assert out["fwd_bwd_of_peak"] == pytest.approx(flops * 3 / median / 1e9 / 800.0)
    assert out["peak_mem_gib"] == 4.5 and out["fwd_bwd_ms_rounds"] == pytest.approx(times)


def test_one_round_is_returned_as_measured_and_an_error_wins():
    one = _round(12.5, 2e12)
    assert median_of_rounds([one]) is one
    failed = {"error": "RuntimeError: boom", "traceback": "..."}
    assert median_of_rounds([_round(11.0, 2e12), failed, _round(13.0, 2e12)]) is failed
