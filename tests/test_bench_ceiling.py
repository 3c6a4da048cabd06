"""The cuBLAS FP8 ceiling of the recipe benchmark (``te_fused_moe/bench_ceiling.py``): the GEMM shapes it
times and the MLP model it reports are CPU-only logic; the timing itself is a GPU test."""

import random

import pytest
import torch

from te_fused_moe import bench_ceiling as C
from te_fused_moe.bench import SHAPES, forward_flops
from te_fused_moe.bench_recipes import _ceiling_lines


def _random_counts(rng, experts, multiple=1):
    counts = [rng.randrange(0, 40) * multiple for _ in range(experts)]
    counts[rng.randrange(experts)] = 0  # an expert without tokens
    counts[rng.randrange(experts)] += rng.randrange(1, 8) * multiple  # and at least one with tokens
    return counts


def test_shapes_cover_the_mlps_flops_and_each_expert_with_tokens():
    rng = random.Random()
    shape = SHAPES["dsv3-e32"]
    counts = _random_counts(rng, 9, multiple=16)
    routed = sum(counts)
    shapes = C.gemm_shapes(counts, shape.hidden, shape.ffn, 2 * shape.ffn)
    assert set(shapes) == set(C.OUR_GEMM_KERNEL)
    # K a multiple of 16 everywhere: forward's FLOPs, three times over (forward, dgrad, wgrad)
    total = sum(C.gemm_flops(s) for s in shapes.values())
    assert total == pytest.approx(3 * forward_flops(shape, routed))
    with_tokens = [c for c in counts if c]
    assert [k for _, _, k in shapes["wgrad_w1"]] == with_tokens
    assert shapes["wgrad_w2"] == [(shape.hidden, shape.ffn, c) for c in with_tokens]
    assert shapes["fc1"] == [(routed, 2 * shape.ffn, shape.hidden)]
    assert shapes["fc1_dgrad"] == [(routed, shape.hidden, 2 * shape.ffn)]


def test_wgrad_k_rounds_up_to_cublas_minimum():
    rng = random.Random()
    counts = _random_counts(rng, 6)
    shapes = C.gemm_shapes(counts, 256, 128, 128)
    ks = [k for _, _, k in shapes["wgrad_w2"]]
    assert ks == [-(-c // 16) * 16 for c in counts if c]
    assert all(k % 16 == 0 and k >= c for k, c in zip(ks, [c for c in counts if c]))


@pytest.mark.parametrize("bad, match", [
    (dict(counts=[4, -1, 3]), "counts: expected tokens per expert >= 0"),
    (dict(counts=[0, 0]), "counts: no routed tokens"),
    (dict(hidden=100), "hidden: expected a positive multiple of 16"),
    (dict(ffn=0), "ffn: expected a positive multiple of 16"),
    (dict(n1=24), "n1: expected a positive multiple of 16"),
])
def test_bad_arguments_are_named(bad, match):
    args = dict(counts=[32, 16], hidden=64, ffn=32, n1=64) | bad
    with pytest.raises(ValueError, match=match):
        C.gemm_shapes(**args)


def _kernels(rng):
    return {ours: {"ms": rng.uniform(0.5, 3.0)} for ours in C.OUR_GEMM_KERNEL.values()} | {
        "quantize_x_row_col": {"ms": rng.uniform(0.2, 0.5)}}


def test_mlp_model_puts_cublas_gemms_in_place_of_ours():
    rng = random.Random()
    kernels = _kernels(rng)
    cublas = {name: {"ms": rng.uniform(0.3, 2.0), "tflops": 1.0} for name in C.OUR_GEMM_KERNEL}
    ours = sum(v["ms"] for k, v in kernels.items() if k in C.OUR_GEMM_KERNEL.values())
    theirs = sum(v["ms"] for v in cublas.values())
    rest = rng.uniform(0.5, 2.0)
    baseline = rng.uniform(10.0, 20.0)
    m = C.mlp_model(cublas, kernels, ours + rest, baseline)
    assert m["ours_gemm_ms"] == pytest.approx(ours) and m["cublas_gemm_ms"] == pytest.approx(theirs)
    assert m["rest_ms"] == pytest.approx(rest)  # the quantize kernel is not a GEMM: it stays in the rest
    assert m["with_cublas_gemms_ms"] == pytest.approx(rest + theirs)
    assert m["with_cublas_gemms_speedup"] == pytest.approx(baseline / (rest + theirs))
    assert m["gemms_only_speedup"] == pytest.approx(baseline / theirs)
    assert m["fused_speedup"] == pytest.approx(baseline / (ours + rest))


def test_mlp_model_names_what_is_missing():
    rng = random.Random()
    kernels = _kernels(rng)
    kernels["wgrad_w1"] = {"error": "RuntimeError: boom"}
    cublas = {name: {"ms": 1.0} for name in C.OUR_GEMM_KERNEL}
    with pytest.raises(ValueError, match=r"no time for \['wgrad_w1'\]"):
        C.mlp_model(cublas, kernels, 10.0, 15.0)
    del cublas["fc2"]
    with pytest.raises(ValueError, match=r"\['fc2', 'wgrad_w1'\]"):
        C.mlp_model(cublas, _kernels(rng) | {"wgrad_w1": {"error": "x"}}, 10.0, 15.0)


def test_summary_lines_report_the_ceiling_and_failures():
    rng = random.Random()
    cublas = {name: {"ms": rng.uniform(0.3, 2.0), "tflops": rng.uniform(900, 1500)} for name in C.OUR_GEMM_KERNEL}
    kernels = _kernels(rng)
    model = C.mlp_model(cublas, kernels, 11.0, 15.0)
    lines = _ceiling_lines({"cublas_fp8": cublas, "with_cublas_gemms": {"fp8_block": model,
                                                                        "mxfp8": {"error": "no time for ['fc2']"}}})
    assert f"sum {sum(v['ms'] for v in cublas.values()):.2f} ms" in lines[0]
    assert f"with cuBLAS's GEMMs {model['with_cublas_gemms_ms']:.2f} ms" in lines[1]
    assert "mxfp8_fused with cuBLAS's GEMMs: no time for ['fc2']" in lines[2]
    assert _ceiling_lines({"cublas_fp8": {"error": "RuntimeError: no FP8"}}) == [
        "  cuBLAS FP8 at these GEMMs: failed: RuntimeError: no FP8"]
    assert _ceiling_lines({}) == []


@pytest.mark.gpu
def test_cublas_times_every_gemm_of_a_ragged_routing():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need sm_89+")
    rng = random.Random()
    counts = _random_counts(rng, 5, multiple=16) + [rng.randrange(1, 200)]  # one K off the multiple
    out = C.measure(counts, 512, 256, 512)
    assert set(out) == set(C.OUR_GEMM_KERNEL)
    for name, v in out.items():
        assert v["ms"] > 0 and v["tflops"] > 0, name
    assert out["wgrad_w1"]["gemms"] == sum(1 for c in counts if c)
    fast = C.measure(counts, 512, 256, 512, fast_accum=True)
    assert all(fast[name]["ms"] > 0 for name in C.OUR_GEMM_KERNEL)
