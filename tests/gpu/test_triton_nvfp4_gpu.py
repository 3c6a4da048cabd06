"""The NVFP4 recipe (NVFP4BlockScaling) on the Triton backend, on the GPU (Hopper sm_90).

Run on the device machine: ``pytest -q -m gpu tests/gpu/test_triton_nvfp4_gpu.py -s`` (``-s`` prints
the measured errors). The checks are those of tests/test_triton_nvfp4_interpreter.py, on CUDA:

- codec, quantize kernels (RHT on integer-valued data, where the FP32 transform is exact; stochastic
  rounding with given bits), weights (16x16 and 1x16) and weight cache: bit-exact vs quantize/nvfp4.py
  (the E4M3 scale cast is the hardware ``cvt`` here);
- Philox stochastic rounding: draws differ, the mean of 64 draws is >= 4x closer than one draw;
  the random bytes are those of one Philox4x32-10 call per 16 columns (a host implementation);
- the whole MLP forward + backward vs the reference backend's emulation (stochastic rounding off;
  GPT-OSS's 2880 too, on zero-padded operands), under ``torch.cuda.set_sync_debug_mode("error")``,
  every buffer NaN-poisoned. Bounds: 2e-2 with
  ``h`` in FP32 (the wgmma's FP32 sums differ from the reference's in order, so a requantized
  ``a`` / ``dh`` value next to an E2M1 midpoint can move a whole step; 5e-3 in the interpreter, whose
  sums match the reference's more closely; seen on the H200: <= 1.1e-3), 6e-2 with ``h`` in BF16
  (the default);
- every GEMM on the BF16 backend's kernel (``gemm.VALUES_ON_BF16_KERNEL``) against NVFP4's own;
- no host syncs after warm-up; a CUDA graph replayed with four routings and a weight update; with
  stochastic rounding on, two replays of the same inputs give different gradients (the seed is drawn
  inside the graph) and the same ``y``.
"""

import json

import pytest
import torch

from block_scaled_checks import assert_no_host_syncs_after_warmup, assert_within, no_host_syncs
from moe_reference import capture_cuda_graph, graph_replay_errors, random_problem

import test_triton_nvfp4_interpreter as checks
from te_fused_moe import fused_moe_mlp
from te_fused_moe.recipes import NVFP4BlockScaling

pytestmark = pytest.mark.gpu

GPU_BOUND, HBF16_BOUND = 2e-2, 6e-2


def test_codec_bit_exact_on_gpu():
    c = checks.check_codec("cuda")
    assert c["rne"] == 0 and c["stochastic"] == 0 and c["e4m3_decode"] == 0 and c["expand"] == 0, c


def test_quantize_kernels_bit_exact_on_gpu():
    # three times: an earlier build of these kernels (run 14) gave codes that changed from one
    # build to the next, a sign of a layout miscompile rather than of the rules
    for attempt in range(3):
        out = checks.check_quantize_kernels("cuda")
        print("NVFP4_QUANTIZE", attempt, json.dumps(out))
        for key, bad in out.items():
            assert all(v == 0 for v in bad.values()), (attempt, key, bad)


def test_gemms_on_the_bf16_kernel_match_the_nvfp4_kernel_gpu():
    """FC2, FC1's dgrad, FC1 and the dGLU on the BF16 backend's kernel against this recipe's: both sum each K
    block's halves in the same wgmma order and scale the sums by the same FP32 factor, so every element is written
    and bitwise equal (run 41 on an H100, as run 35a saw MXFP8's analogue); dprob as sums of partials, within
    FP32 rounding where the kernels' N tiles differ."""
    routed = checks.check_routed_gemms("cuda")
    print("NVFP4_ROUTED", json.dumps(routed))
    assert set(routed) == {"fc2_y", "dgrad_dx", "fc1_a", "fc1_h", "dact_dh", "dact_dprob"}, routed
    for name, r in routed.items():
        if name == "dact_dprob":
            assert r["rel_diff"] <= 1e-6, (name, r)
        else:
            assert r["bitwise"] and r["rel_diff"] == 0.0, (name, r)


def test_wgrad_half_slot_steps_match_slot_steps_gpu():
    """The BF16-valued wgrad at half a slot per step (``wgrad.VALUES_HALF_SLOT``, the default since run 42) against a
    slot per step and the packed-code K loop: the same dots in the same order, so bitwise equal on the GPU too, every
    element written."""
    r = checks.check_wgrad_steps("cuda")
    print("NVFP4_WGRAD_STEPS", json.dumps(r))
    assert r["empty_expert_zero"], r
    for name in ("half_slot", "half_slot_pointers", "slot"):
        assert r[name]["bitwise"] and r[name]["rel_diff"] == 0.0, (name, r)
    assert r["packed_codes"]["rel_diff"] <= 1e-6, r  # wgmma on expanded registers: an order the build may change


def test_wgrad_on_library_folds_the_tensor_scales_gpu():
    """cuBLAS's wgrad route on the GPU (see the CPU test of the same name)."""
    r = checks.check_library_wgrad("cuda")
    print("NVFP4_LIBRARY_WGRAD", json.dumps(r))
    checks.assert_library_wgrad(r)


def test_stochastic_rounding_unbiased_on_gpu():
    s = checks.check_stochastic_rounding("cuda")
    print("NVFP4_SR", json.dumps(s))
    assert s["draws_differ"] and s["mean_err"] < s["one_draw_err"] / 4, s


def test_random_bytes_are_philox_per_16_columns_on_gpu():
    r = checks.check_random_bytes("cuda")
    assert r["bad"] == 0 and r["distinct"] > 200, r


def test_weight_cache_on_gpu():
    c = checks.check_weight_cache("cuda")
    assert c["same_object"] and c["misses_before"] == 1 and c["refreshed"] and c["misses_after"] == 2, c
    assert c["fresh_bad"] == 0 and c["nbytes"] == c["expected_nbytes"], c
    assert c["stale_without_step"] and c["refreshed_after_step"], c


# (id, T, H, F, E, activation, bias, probs, counts or routing, padding, h_fp32, tma, frozen, recipe options)
GPU_CASES = [
    ("swiglu-x16", 4096, 512, 256, 8, "swiglu", True, True, [512, 256, 768, 0, 1024, 512, 256, 496], 272, True, True,
     (), {}),
    ("gptoss-ragged-frozenx", 4096, 512, 256, 16, "gpt_oss_swiglu", True, True, "empty", 100, True, True, ("x",), {}),
    ("srelu-one-ptr-1d-norht", 2048, 384, 256, 4, "srelu", True, False, "one", 3, True, False, (),
     dict(disable_rht=True, disable_2d_quantization=True)),
    ("swiglu-zipf-hbf16", 8192, 512, 256, 32, "swiglu", True, True, "zipf", 9, False, True, (), {}),
    ("gptoss-ragged-bf16w", 4096, 512, 256, 8, "gpt_oss_swiglu", True, True, "balanced", 30, True, True, (), {}),
    # the GEMMs expanding packed operands in their K loops (autograd.EXPAND_BEFORE_GEMM off), TMA and pointers
    ("swiglu-zipf-kloop", 4096, 512, 256, 16, "swiglu", True, True, "zipf", 40, True, True, (), {}),
    ("geglu-ragged-ptr-kloop", 2048, 384, 256, 4, "geglu", True, True, "balanced", 3, True, False, ("x",), {}),
    # GPT-OSS's widths (2880 = 22.5 tiles): zero-padded operands, gate and up sharing w1's tile at 2880
    ("gptoss-2880-padded", 4096, 2880, 2880, 8, "gpt_oss_swiglu", True, True, "zipf", 31, True, True, (), {}),
    # the wgrads on cuBLAS's grouped GEMM (autograd.VALUES_WGRAD_KERNEL = "cublas", the default since run 42; whatever
    # the default), one at GPT-OSS's widths; and on NVFP4's Triton kernel
    ("swiglu-zipf-cublaswgrad", 4096, 512, 256, 16, "swiglu", True, True, "zipf", 40, True, True, (), {}),
    ("gptoss-2880-cublaswgrad", 4096, 2880, 2880, 8, "gpt_oss_swiglu", True, True, "zipf", 31, True, True, (), {}),
    ("swiglu-zipf-tritonwgrad", 4096, 512, 256, 16, "swiglu", True, True, "zipf", 40, True, True, (), {}),
    # x's and dy's RHT on BF16 tensor cores (quantize.RHT_TENSOR_CORES, opt-in)
    ("swiglu-zipf-rhtmma", 4096, 512, 256, 16, "swiglu", True, True, "zipf", 40, True, True, (), {}),
    ("gptoss-2880-rhtmma", 4096, 2880, 2880, 8, "gpt_oss_swiglu", True, True, "zipf", 31, True, True, (), {}),
]


@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_mlp_matches_reference_emulation_gpu(case):
    res = checks.run_mlp_case(case, "cuda", poison=True, triton_context=no_host_syncs)
    print("NVFP4_MLP", case[0], json.dumps({k: res[k] for k in ("err", "far", "fp64")}))
    bound = GPU_BOUND if case[10] else HBF16_BOUND
    assert_within(case[0], res, bound, max(bound, 3e-2))
    assert res["library_wgrads"] == checks.library_wgrads_expected(case[0], "cuda"), res["library_wgrads"]


def test_mlp_with_stochastic_rounding_gpu():
    res = checks.run_mlp_case(checks.SR_CASE, "cuda", poison=True, triton_context=no_host_syncs)
    print("NVFP4_MLP_SR", json.dumps(res["err"]))
    assert res["err"]["y"] <= GPU_BOUND, res["err"]
    assert all(res["nan"][k] == 0 and e <= checks.SR_NOISE for k, e in res["err"].items()), res


def test_no_host_syncs_after_warmup():
    assert_no_host_syncs_after_warmup(NVFP4BlockScaling())


def test_cuda_graph_replay_with_changing_routing_nvfp4():
    for label, errors in graph_replay_errors(NVFP4BlockScaling(disable_stochastic_rounding=True)).items():
        print("NVFP4_GRAPH", label, json.dumps(errors))
        bad = {k: v for k, v in errors.items() if not v <= HBF16_BOUND}  # h saved in BF16 (the default)
        assert not bad, f"{label}: graph replay differs from the reference emulation: {bad}"


def test_stochastic_rounding_redraws_on_each_graph_replay():
    T, H, F, E = 2048, 256, 256, 4
    p = random_problem(T, H, F, E, dtype=torch.bfloat16, device="cuda", seed=12)
    w1 = p["w1"].clone().requires_grad_(True)
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)

    def step():
        y = fused_moe_mlp(p["x"], p["tokens_per_expert"], w1, p["w2"], recipe=NVFP4BlockScaling(), backend="triton")
        return (y,) + torch.autograd.grad(y, [w1], dy)

    graph, out = capture_cuda_graph(step)
    graph.replay()
    y1, dw1 = (t.clone() for t in out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[0], y1)  # the forward pass has no stochastic rounding
    assert not torch.equal(out[1], dw1)  # dy and dh were rounded with fresh bits
    assert float((out[1].float() - dw1.float()).norm() / dw1.float().norm()) < checks.SR_NOISE


def test_auto_picks_triton_at_every_size_on_gpu():
    d = checks.check_dispatch("cuda")
    print("NVFP4_DISPATCH", json.dumps(d))
    checks.test_every_size_runs_on_triton_and_auto_picks_it({"dispatch": d})


def test_bench_unfused_baseline_is_the_same_recipe_gpu():
    errs = checks.check_bench_baseline("cuda")
    print("NVFP4_BENCH_BASELINE", json.dumps(errs))
    assert set(errs) == {"y", "x", "w1", "w2"} and errs["y"] < 5e-2, errs
    assert all(0 < e < checks.SR_NOISE for e in errs.values()), errs
