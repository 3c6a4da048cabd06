"""The MXFP8 recipe (MXFP8BlockScaling) on the Triton backend, on the GPU (Hopper sm_90).

Run on the device machine: ``pytest -q -m gpu tests/gpu/test_triton_mxfp8_gpu.py -s`` (``-s`` prints the
measured errors). The checks are those of tests/test_triton_mxfp8_interpreter.py, on CUDA:

- E8M0 codec, quantize kernels and weight cache: bytes and scales bit-exact vs quantize/mxfp8.py (the
  FP8 bytes come from the hardware ``cvt`` here; FP32 subnormal inputs and the 2^-127 scale are in
  the edge values, so a flush-to-zero anywhere would show);
- every kernel on integer data: h, quantized a / dh (rowwise + columnwise) bit-exact; y, dx, dw within
  2^-8 |ref| + 2^-12 (|A| @ |B|);
- the whole MLP forward + backward vs the reference backend's emulation of the recipe over random
  data and routings (balanced, Zipf, empty experts, all on one, padding rows), under
  ``torch.cuda.set_sync_debug_mode("error")``, every buffer NaN-poisoned. Bound: norm-relative
  <= 2e-2 per output (vs FP64 fake-quantized truth <= 3e-2); 4e-2 for both with h saved in BF16 (the
  default). Why not the interpreter's 2e-3: the FP8 wgmma sums each 32-product block with reduced
  precision, so a requantized value (a, dh) next to an FP8 rounding boundary can land one FP8 step
  away from the reference's (the FP8-block GPU test's reasoning and bounds);
- no host syncs after warm-up (sync-debug mode 'error' around a second fwd+bwd);
- a CUDA graph of forward + backward replayed with four routings, the last after an in-place weight
  update (the graph re-quantizes the weights on replay: the weight cache is bypassed while capturing).
"""

import json

import pytest
import torch

from block_scaled_checks import (assert_bench_baseline, assert_dispatch, assert_no_host_syncs_after_warmup, assert_within,
                                  check_bench_baseline, no_host_syncs)
from moe_reference import graph_replay_errors

import test_triton_mxfp8_interpreter as checks
from te_fused_moe.backends.triton.mxfp8 import autograd
from te_fused_moe.recipes import Format, MXFP8BlockScaling

pytestmark = pytest.mark.gpu

GPU_BOUND, GPU_FP64_BOUND = 2e-2, 3e-2
HBF16_BOUND = 4e-2  # h saved in BF16 (the default): dh also sees h rounded (1.1e-2 seen under the interpreter)


def test_e8m0_codec_bit_exact_on_gpu():
    c = checks.check_codec("cuda")
    for fmt in ("e4m3", "e5m2"):
        assert all(v == 0 for v in c[fmt].values()), (fmt, c[fmt])


def test_quantize_kernels_bit_exact_on_gpu():
    for key, bad in checks.check_quantize_kernels("cuda").items():
        assert all(v == 0 for v in bad.values()), (key, bad)


def test_weight_cache_on_gpu():
    c = checks.check_weight_cache("cuda")
    assert c["same_object"] and c["misses_before"] == 1 and c["refreshed"] and c["misses_after"] == 2, c
    assert c["fresh_bad"] == 0 and c["nbytes"] == c["expected_nbytes"], c
    assert c["stale_without_step"] and c["refreshed_after_step"] and c["hit_after_step"], c
    assert all(v == 0 for v in c["values_bad"].values()) and c["values_dtype"] == "torch.bfloat16", c
    assert c["values_nbytes"] == c["values_expected_nbytes"] and c["plain_entry_has_no_values"], c


def test_cached_weight_values_replace_the_expansions_gpu():
    checks.assert_weight_reads(checks.check_weight_reads("cuda"))


def test_quantize_passes_write_the_values_their_gemms_read_gpu():
    checks.assert_values_in_pass(checks.check_values_in_pass("cuda"))


@pytest.mark.parametrize("as_a", [False, True], ids=["shared", "as_a"])
def test_wgrads_expand_the_saved_codes_without_a_pass_gpu(as_a):
    checks.assert_saved_codes_in_wgrad(checks.check_saved_codes_in_wgrad("cuda", as_a))


def test_forward_keeps_the_values_the_wgrads_read_gpu():
    checks.assert_kept_values(checks.check_kept_values("cuda"))


@pytest.mark.parametrize("tma,fmt,dglu", [(True, "e4m3", "fused"), (False, "e5m2", "separate")],
                         ids=["tma", "ptr-e5m2-dglu-separate"])
def test_written_values_exact_on_integer_data_gpu(tma, fmt, dglu):
    # the quantize passes and epilogues writing the BF16 values the GEMMs of their pass read
    bad = checks.check_kernels_exact("cuda", seed=10, use_tma=tma, fmt=fmt, values=True, written_values=True,
                                     epilogue=dict(epilogue=dglu))
    print("MXFP8_EXACT_WRITTEN_VALUES", json.dumps(bad))
    for name in ("h", "a_row", "a_col", "y", "dh_row", "dh_col", "dx", "dw1", "dw2", "db1", "dprob"):
        assert bad[name] == 0, (name, bad)
    assert bad["written_values"] == 6, bad


def test_separate_dglu_reads_bf16_da_exactly_gpu():
    """The dGLU's GEMM writes da in h's dtype (BF16 here) for the epilogue alone; exact against it."""
    bad = checks.check_kernels_exact("cuda", seed=9, H=512, h_dtype=torch.bfloat16, epilogue=dict(epilogue="separate"))
    print("MXFP8_EXACT_BF16_H", json.dumps(bad))
    for name in ("h", "a_row", "a_col", "y", "dh_row", "dh_col", "dx", "dw1", "dw2", "db1", "dprob"):
        assert bad[name] == 0, (name, bad)
    assert bad["h_rounded"] > 0 and bad["da_rounded"] > 0, bad


@pytest.mark.parametrize("tma,seed,fmt,epilogue", [(True, 0, "e4m3", None), (True, 1, "e4m3", None),
                                                   (False, 0, "e4m3", None), (True, 2, "e5m2", None),
                                                   (True, 3, "e4m3", dict(block_n=128, split_epilogue=False))],
                         ids=["tma-empty", "tma", "ptr-empty", "tma-e5m2", "bn128-unsplit"])
def test_every_kernel_exact_on_integer_data_gpu(tma, seed, fmt, epilogue):
    # the bn128 case also runs FC2 / dgrad with 128x128 tiles at 8 warps and wgrad with 128x128 tiles
    wide = dict(plain=dict(block_n=128, num_warps=8), wgrad=dict(block_n=128, num_warps=8, num_stages=4)) \
        if epilogue else {}
    bad = checks.check_kernels_exact("cuda", seed=seed, use_tma=tma, fmt=fmt, epilogue=epilogue, **wide)
    print("MXFP8_EXACT", json.dumps(bad))
    for name in ("h", "a_row", "a_col", "y", "dh_row", "dh_col", "dx", "dw1", "dw2", "db1", "dprob"):
        assert bad[name] == 0, (name, bad)


def test_promotion_loop_exact_on_integer_data_gpu():
    # the other inner loop than the default (FP8 wgmma per 32-K block + FP32 promotion vs BF16 expansion)
    from te_fused_moe.backends.triton.mxfp8 import gemm

    other = dict(expand_bf16=not gemm.EXPAND_BF16_DEFAULT)
    bad = checks.check_kernels_exact("cuda", seed=4, epilogue=other, plain=other, wgrad=other)
    print("MXFP8_EXACT_OTHER_LOOP", json.dumps(bad))
    for name in ("h", "a_row", "a_col", "y", "dh_row", "dh_col", "dx", "dw1", "dw2", "db1", "dprob"):
        assert bad[name] == 0, (name, bad)


@pytest.mark.parametrize("tma,fmt,dglu,kernel", [(True, "e4m3", "fused", None), (False, "e5m2", "fused", None),
                                                 (True, "e4m3", "separate", None), (False, "e5m2", "separate", None),
                                                 (True, "e4m3", "separate", "gemm")],
                         ids=["tma", "ptr-e5m2", "dglu-separate", "dglu-separate-ptr-e5m2",
                              "dglu-separate-gemm-kernel"])
def test_bf16_values_exact_on_integer_data_gpu(tma, fmt, dglu, kernel):
    # every GEMM reading the BF16 values an expansion pass wrote before it (the fused path's default);
    # the dGLU as one kernel or as its GEMM + the epilogue alone (gemm.DACT_EPILOGUE), that epilogue on its
    # chunked kernel (the default) or the GEMM kernel (gemm.SEPARATE_DGLU_KERNEL)
    bad = checks.check_kernels_exact("cuda", seed=5, use_tma=tma, fmt=fmt, values=True, epilogue=dict(epilogue=dglu),
                                     dglu_kernel=kernel)
    print("MXFP8_EXACT_VALUES", json.dumps(bad))
    for name in ("h", "a_row", "a_col", "y", "dh_row", "dh_col", "dx", "dw1", "dw2", "db1", "dprob"):
        assert bad[name] == 0, (name, bad)


@pytest.mark.parametrize("tma,fmt", [(True, "e4m3"), (False, "e5m2")], ids=["tma", "ptr-e5m2"])
def test_dglu_on_bf16_kernel_exact_on_integer_data_gpu(tma, fmt):
    # the dGLU on BF16 values fused on the BF16 backend's kernel with this recipe's quantizing store of dh
    # (gemm.DGLU_VALUES_KERNEL = "bf16"), the other GEMMs as the values path runs them
    bad = checks.check_kernels_exact("cuda", seed=6, use_tma=tma, fmt=fmt, values=True, written_values=True,
                                     dglu_route=True)
    print("MXFP8_EXACT_DGLU_BF16_KERNEL", json.dumps(bad))
    assert bad["dglu_on_bf16_kernel"] == 1, bad
    for name in ("h", "a_row", "a_col", "y", "dh_row", "dh_col", "dx", "dw1", "dw2", "db1", "dprob"):
        assert bad[name] == 0, (name, bad)


# (id, T, H, F, E, activation, bias, probs, routing, padding, h_fp32, tma, frozen, fp8_format)
GPU_CASES = [  # few, because each activation / option combination compiles its own kernels
    ("swiglu-balanced", 4096, 512, 256, 8, "swiglu", True, True, "balanced", 17, True, True, (), "E4M3"),
    ("gptoss-empty-frozenx", 4096, 512, 256, 16, "gpt_oss_swiglu", True, True, "empty", 100, True, True, ("x",),
     "E4M3"),
    ("geglu-one-ptr", 2048, 384, 256, 4, "geglu", True, False, "one", 3, True, False, (), "E4M3"),
    ("swiglu-zipf-hbf16-hybrid", 8192, 512, 256, 32, "swiglu", True, True, "zipf", 9, False, True, (), "HYBRID"),
    # the GEMMs expanding FP8 operands in their K loops (autograd.EXPAND_BEFORE_GEMM off)
    ("swiglu-balanced-kloop", 4096, 512, 256, 8, "swiglu", True, True, "balanced", 17, True, True, (), "E4M3"),
    # the weight cache keeping the weights' BF16 values (autograd.BF16_WEIGHT_VALUES), padded and not
    ("swiglu-zipf-hybrid-bf16w", 4096, 512, 256, 8, "swiglu", True, True, "zipf", 13, True, True, (), "HYBRID"),
    ("gptoss-2880-padded-bf16w", 2048, 2880, 2880, 4, "gpt_oss_swiglu", True, True, "zipf", 7, True, True, (), "E4M3"),
    # the dGLU as its GEMM + the epilogue alone (the default on the GPU, as the other cases run it too), the
    # epilogue on its chunked kernel (the default), at GPT-OSS's padded widths too, or on the GEMM kernel
    ("swiglu-balanced-sepdglu", 4096, 512, 256, 8, "swiglu", True, True, "balanced", 17, True, True, (), "E4M3"),
    ("gptoss-empty-hybrid-sepdglu", 4096, 512, 256, 16, "gpt_oss_swiglu", True, True, "empty", 100, True, True, (),
     "HYBRID"),
    ("gptoss-2880-padded-sepdglu", 2048, 2880, 2880, 4, "gpt_oss_swiglu", True, True, "zipf", 7, True, True, (),
     "E4M3"),
    ("swiglu-balanced-sepdglu-gemm", 4096, 512, 256, 8, "swiglu", True, True, "balanced", 17, True, True, (), "E4M3"),
    # the dGLU on BF16 values fused on the BF16 backend's kernel (gemm.DGLU_VALUES_KERNEL = "bf16")
    ("swiglu-zipf-hybrid-bf16dglu", 4096, 512, 256, 8, "swiglu", True, True, "zipf", 13, True, True, (), "HYBRID"),
    # the dGLU on BF16 values as one kernel of this recipe's (gemm.DACT_EPILOGUE = "fused"), h in FP32 and BF16
    ("swiglu-balanced-mxdglu", 4096, 512, 256, 8, "swiglu", True, True, "balanced", 17, True, True, (), "E4M3"),
    ("swiglu-zipf-hbf16-hybrid-mxdglu", 8192, 512, 256, 32, "swiglu", True, True, "zipf", 9, False, True, (),
     "HYBRID"),
    # the plain GEMMs on BF16 values on this recipe's kernel (gemm.PLAIN_VALUES_KERNEL = "mx"; the other cases
    # run them on the BF16 backend's persistent kernel)
    ("swiglu-balanced-sepdglu-mxplain", 4096, 512, 256, 8, "swiglu", True, True, "balanced", 17, True, True, (),
     "E4M3"),
    # FC1 on BF16 values on this recipe's kernel (gemm.FC1_VALUES_KERNEL = "mx"; the other cases run it on the
    # BF16 backend's persistent kernel with this recipe's quantizing store of a), h in FP32 and BF16
    ("swiglu-balanced-sepdglu-fc1mx", 4096, 512, 256, 8, "swiglu", True, True, "balanced", 17, True, True, (),
     "E4M3"),
    ("swiglu-zipf-hbf16-hybrid-fc1mx", 8192, 512, 256, 32, "swiglu", True, True, "zipf", 9, False, True, (),
     "HYBRID"),
    # the quantize passes and epilogues writing codes, expanded before each GEMM (QUANTIZE_TO_VALUES off)
    ("swiglu-zipf-hybrid-bf16w-codes", 4096, 512, 256, 8, "swiglu", True, True, "zipf", 13, True, True, (), "HYBRID"),
    # the wgrads reading x's and a's columnwise copies as saved (FP8 codes), expanded in their K loops
    # (autograd.X_CODES_IN_WGRAD) through shared memory or as the wgmma's A operand (wgrad.X_CODES_AS_A)
    ("swiglu-zipf-hybrid-xcodes", 4096, 512, 256, 8, "swiglu", True, True, "zipf", 13, True, True, (), "HYBRID"),
    ("swiglu-balanced-hbf16-xcodesa", 4096, 512, 256, 8, "swiglu", True, True, "balanced", 17, False, True, (),
     "E4M3"),
    ("gptoss-2880-padded-xcodesa", 2048, 2880, 2880, 4, "gpt_oss_swiglu", True, True, "zipf", 7, True, True, (),
     "E4M3"),
    # the BF16-valued wgrads on cuBLAS's grouped GEMM (autograd.VALUES_WGRAD_KERNEL), or on this recipe's wgrad
    # kernel where cuBLAS is the default: empty experts, padding rows, GPT-OSS's zero-padded copies
    ("swiglu-empty-hybrid-cublaswgrad", 4096, 512, 256, 16, "swiglu", True, True, "empty", 100, True, True, (),
     "HYBRID"),
    ("gptoss-2880-padded-cublaswgrad", 2048, 2880, 2880, 4, "gpt_oss_swiglu", True, True, "zipf", 7, True, True,
     (), "E4M3"),
    ("swiglu-zipf-hbf16-tritonwgrad", 4096, 512, 256, 8, "swiglu", True, True, "zipf", 13, False, True, (), "E4M3"),
    # the forward keeping x's and a's columnwise copies as BF16 values (autograd.KEEP_COLUMNWISE_VALUES), h in FP32
    # and BF16
    ("swiglu-empty-hybrid-keepvalues", 4096, 512, 256, 16, "swiglu", True, True, "empty", 100, True, True, (),
     "HYBRID"),
    ("swiglu-zipf-hbf16-keepvalues", 4096, 512, 256, 8, "swiglu", True, True, "zipf", 13, False, True, (), "E4M3"),
    # GPT-OSS's widths (2880 = 22.5 tiles): the zero-padded path (padded.py)
    ("gptoss-2880-padded", 4096, 2880, 2880, 8, "gpt_oss_swiglu", True, True, "zipf", 31, True, True, (), "E4M3"),
]


@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_mlp_matches_reference_emulation_gpu(case):
    res = checks.run_mlp_case(case, "cuda", poison=True, triton_context=no_host_syncs)
    print("MXFP8_MLP", case[0], json.dumps({k: res[k] for k in ("err", "far", "fp64")}))
    bound, fp64_bound = (GPU_BOUND, GPU_FP64_BOUND) if case[10] else (HBF16_BOUND, HBF16_BOUND)
    assert_within(case[0], res, bound, fp64_bound)
    cublas = "-cublaswgrad" in case[0] or (autograd.VALUES_WGRAD_KERNEL == "cublas" and not
                                           any(tag in case[0] for tag in ("-tritonwgrad", "-xcodes", "-kloop")))
    assert res["library_wgrads"] == (2 - len(set(case[12]) & {"w1", "w2"}) if cublas else 0), res["library_wgrads"]


def test_no_host_syncs_after_warmup():
    assert_no_host_syncs_after_warmup(MXFP8BlockScaling(fp8_format=Format.HYBRID))


@pytest.mark.parametrize("hidden,ffn", [(512, 256), (320, 224)], ids=["aligned", "padded"])
def test_cuda_graph_replay_with_changing_routing_mxfp8(hidden, ffn):
    for label, errors in graph_replay_errors(MXFP8BlockScaling(), H=hidden, F=ffn).items():
        print("MXFP8_GRAPH", hidden, ffn, label, json.dumps(errors))
        bad = {k: v for k, v in errors.items() if not v <= HBF16_BOUND}  # h saved in BF16 (the default)
        assert not bad, f"{label}: graph replay differs from the reference emulation: {bad}"


def test_sizes_off_the_tile_run_zero_padded_on_gpu():
    d = checks.check_dispatch("cuda")
    print("MXFP8_DISPATCH", json.dumps(d))
    assert_dispatch(d, "MXFP8BlockScaling", checks.LOOSE)


def test_bench_unfused_baseline_is_the_same_recipe_gpu():
    res = check_bench_baseline("mxfp8", "cuda")  # tile-aligned and off-tile sizes (block_scaled_checks)
    print("MXFP8_BENCH_BASELINE", json.dumps(res))
    assert_bench_baseline(res)
