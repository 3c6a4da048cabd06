"""The FP8 block recipe (Float8BlockScaling) on the Triton backend, on the GPU (Hopper sm_90).

Run on the device machine: ``pytest -m gpu tests/gpu/test_triton_fp8_block_gpu.py -s`` (``-s`` prints the
measured errors). The checks are those of tests/test_triton_fp8_block_interpreter.py, on CUDA:

- codec, quantize kernels and weight cache: bytes and scales bit-exact vs quantize/fp8_block.py;
- every kernel on integer data: h, quantized a / dh (rowwise + columnwise) bit-exact; y, dx, dw within
  2^-8 |ref| + 2^-12 (|A| @ |B|) (BF16 output rounding + FP32 / FP8-wgmma sums);
- the whole MLP forward + backward vs the reference backend's emulation of the recipe over random
  data and routings (balanced, Zipf, empty experts, all on one), under
  ``torch.cuda.set_sync_debug_mode("error")``. Bound: norm-relative <= 2e-2 per output. Why not
  tighter: Hopper's FP8 wgmma accumulates one 128-block with reduced precision (~14 bits,
  DeepSeek-V3 report; Triton's default on sm_90), so a requantized value (a, dh) that sits next to
  an FP8 rounding boundary can land one FP8 step (6-12%) away from the reference's; ~1% of them do
  at most, which moves the outputs by ~1e-2 in norm. vs the FP64 fake-quantized ground truth: <= 3e-2.
  With h saved in BF16 (the default) both bounds are 4e-2 (dh also sees h rounded to BF16);
- a CUDA graph of forward + backward replayed with three routings, and after an in-place weight
  update (the graph re-quantizes the weights on replay: the weight cache is bypassed while capturing).
"""

import json

import pytest
import torch

from block_scaled_checks import assert_dispatch, assert_within, no_host_syncs
from moe_reference import graph_replay_errors

import test_triton_fp8_block_interpreter as checks
from te_fused_moe.recipes import Float8BlockScaling

pytestmark = pytest.mark.gpu

GPU_BOUND, GPU_FP64_BOUND = 2e-2, 3e-2
HBF16_BOUND = 4e-2  # h saved in BF16 (the default): dh also sees h rounded (1.1e-2 seen under the interpreter)


def test_codec_bit_exact_on_gpu():
    for key, bad in checks.check_codec("cuda").items():
        assert bad["codes"] == 0 and bad["scale"] == 0 and bad["inv"] == 0, (key, bad)


def test_quantize_kernels_bit_exact_on_gpu():
    for key, bad in checks.check_quantize_kernels("cuda").items():
        assert all(v == 0 for v in bad.values()), (key, bad)


def test_weight_cache_on_gpu():
    c = checks.check_weight_cache("cuda")
    assert c["same_object"] and c["misses_before"] == 1 and c["refreshed"] and c["misses_after"] == 2, c
    assert c["fresh_bad"] == 0 and c["nbytes"] == c["expected_nbytes"], c
    assert c["stale_without_step"] and c["refreshed_after_step"] and c["hit_after_step"], c


@pytest.mark.parametrize("tma,seed,split,epilogue", [(True, 0, None, "auto"), (True, 1, None, "auto"),
                                                      (False, 0, None, "auto"), (True, 2, True, "auto"),
                                                      (True, 3, None, "fused"), (True, 4, False, "fused")],
                         ids=["tma-empty", "tma", "ptr-empty", "split-alone", "fused", "fused-unsplit"])
def test_every_kernel_exact_on_integer_data_gpu(tma, seed, split, epilogue):
    """On sm_90 "auto" runs FC1 and the dGLU as the Gluon GEMM + the epilogue alone (whole by default,
    ``split``: in halves); "fused" as one kernel each (in halves by default)."""
    bad = checks.check_kernels_exact("cuda", seed=seed, use_tma=tma, split_epilogue=split, epilogue=epilogue)
    print("FP8_EXACT", json.dumps(bad))
    for name in ("h", "a_row", "a_col", "y", "dh_row", "dh_col", "dx", "dw1", "dw2", "db1", "dprob"):
        assert bad[name] == 0, (name, bad)


def test_separate_epilogues_read_bf16_h_and_da_exactly_gpu():
    """The default on sm_90 with h saved in BF16: FC1's Gluon GEMM writes h itself, the epilogue alone
    acts on it; the dGLU's GEMM writes da in BF16. Exact against those rounded values."""
    bad = checks.check_kernels_exact("cuda", seed=5, epilogue="separate", h_dtype=torch.bfloat16)
    print("FP8_EXACT_BF16_H", json.dumps(bad))
    for name in ("h", "a_row", "a_col", "y", "dh_row", "dh_col", "dx", "dw1", "dw2", "db1", "dprob"):
        assert bad[name] == 0, (name, bad)
    assert bad["h_rounded"] > 0 and bad["da_rounded"] > 0, bad


# (id, T, H, F, E, activation, bias, probs, routing, padding, h_fp32, f32_scales, tma, frozen)
GPU_CASES = [  # few, because each activation / option combination compiles its own kernels
    ("swiglu-balanced", 4096, 512, 256, 8, "swiglu", True, True, "balanced", 17, True, False, True, ()),
    ("gptoss-empty-frozenx", 4096, 512, 256, 16, "gpt_oss_swiglu", True, True, "empty", 100, True, False, True,
     ("x",)),
    ("geglu-one-ptr-f32scales", 2048, 384, 256, 4, "geglu", True, False, "one", 3, True, True, False, ()),
    ("swiglu-zipf-hbf16-hybrid", 8192, 512, 256, 32, "swiglu", True, True, "zipf", 9, False, False, True, (),
     "HYBRID"),
    # GPT-OSS's widths (2880 = 22.5 tiles): the zero-padded path (padded.py), its w1 blocks straddling gate / up
    ("gptoss-2880-padded", 4096, 2880, 2880, 8, "gpt_oss_swiglu", True, True, "zipf", 31, True, False, True, ()),
]


@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_mlp_matches_reference_emulation_gpu(case):
    res = checks.run_mlp_case(case, "cuda", poison=True, triton_context=no_host_syncs)
    print("FP8_MLP", case[0], json.dumps({k: res[k] for k in ("err", "far", "fp64")}))
    bound, fp64_bound = (GPU_BOUND, GPU_FP64_BOUND) if case[10] else (HBF16_BOUND, HBF16_BOUND)
    assert_within(case[0], res, bound, fp64_bound)


def test_mlp_with_one_kernel_epilogues_gpu():
    """FC1 and the dGLU as one kernel each (the default before run 16; "auto" separates them on sm_90)."""
    case = GPU_CASES[0]
    res = checks.run_mlp_case(case, "cuda", poison=True, triton_context=no_host_syncs, epilogues="fused")
    print("FP8_MLP_FUSED_EPILOGUES", case[0], json.dumps({k: res[k] for k in ("err", "far", "fp64")}))
    assert_within(case[0], res, GPU_BOUND, GPU_FP64_BOUND)


@pytest.mark.parametrize("hidden,ffn", [(512, 256), (320, 200)], ids=["aligned", "padded"])
def test_cuda_graph_replay_with_changing_routing_fp8(hidden, ffn):
    for label, errors in graph_replay_errors(Float8BlockScaling(), H=hidden, F=ffn).items():
        print("FP8_GRAPH", hidden, ffn, label, json.dumps(errors))
        bad = {k: v for k, v in errors.items() if not v <= GPU_BOUND}
        assert not bad, f"{label}: graph replay differs from the reference emulation: {bad}"


def test_sizes_off_the_tile_run_zero_padded_on_gpu():
    d = checks.check_dispatch("cuda")
    print("FP8_DISPATCH", json.dumps(d))
    assert_dispatch(d, "Float8BlockScaling", checks.LOOSE)


def test_dglu_off_the_tile_equals_the_passes_on_gpu():
    """padded.py's one-pass dGLU (both launch orders) writes the bytes and scales of the GLU pass +
    quantize pass on CUDA as under the interpreter (tests/test_padded.py)."""
    import test_padded

    for case, r in test_padded.check_dglu_off_tile("cuda").items():
        print("FP8_DGLU_OFF_TILE", case, json.dumps(r))
        assert all(r[k] == 0 for k in ("data", "scale", "data_t", "scale_t", "unwritten", "nonzero_past_units",
                                       "nan")), (case, r)
        assert r["dprob"] <= 1e-6 and r["db1"] <= 1e-6, (case, r)
