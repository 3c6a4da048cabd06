#!/usr/bin/env bash
# What the device machine runs for the block-scaled recipes (runs 22 on): their GPU tests, then the
# recipe benchmark at DSv3 (MLP in interleaved rounds + each kernel alone, same process). Logs under
# $OUT; each step's exit code, seconds and wall-clock span in $OUT/times.txt (CLOCKS=1: the GPU's clocks in
# $OUT/clocks.csv).
#   usage: scripts/device_recipes.sh [fp8_tests] [mxfp8_tests] [nvfp4_tests] [wgmma_tests] [other_tests] [fp8_bench] [mxfp8_bench] [nvfp4_bench]
#          [mxfp8_weights_bench] [mxfp8_values] [ring_check] [ring_tests] [ring_debug] [ring_bisect] [mxfp8_exact] [mx_plain_probe] [mx_plain_bench] [mx_fc1_probe] [mx_fc1_bench] [mx_dglu_bench] [mx_wgrad_probe] [mx_wgrad_bench] [nv_probe] [bf16_tests] [nv_rht] [mx_cublas_wgrad] [mx_profile] [mx_keep_values] [mx_expand_probe] [host_probe] [mx_quantize_probe] [mx_dglu_probe] [dglu_bench] [prefetch_bench] [plain_probe] [wgrad_probe] [ptxas_tests] [ptxas_probe] [ptxas_bench] [padded_tests] [padded_bench] [padded_profile]
# ptxas_*: the FP8 block GPU tests, the wgrad probe and the FP8 block benchmark under the CUDA toolkit's
# ptxas (TE_FUSED_MOE_PTXAS=toolkit: FFMA yield hints interleaved), the probe and bench against Triton's
# own in the same call (the bench in separate processes, toolkit / triton / toolkit / triton). The probe
# also times its factor_by_fma variant (the promotion as FFMAs only, so that the yields cover all of it).
# padded_*: sizes off the 128 tile (PADDED_RECIPES, PADDED_ONLY: bench_recipes' --recipes / --implementations) (backends/triton/padded.py): the FP8 block and MXFP8 GPU tests of that path
# (GPT-OSS's 2880, graph replay, dispatch), then the recipes' MLP benchmark at the GPT-OSS shape (the
# per-kernel timings call the kernels at unpadded sizes, so they are off); padded_profile: the kernels of that
# MLP (both recipes and BF16 fused) under torch.profiler (scripts/profile_mlp.py).
# ring_check: wgmma_ws.RING_SCALES' GPU check (ring against loads, bitwise), the plain probe's ring_scales and
# load_scales variants, then the MLP with and without it (no kernel table). ring_tests: the FP8 block GPU tests
# with it on.
# plain_probe: the plain FP8 block GEMM at DSv3's four token GEMM shapes as it ships, with its promotion an FADD,
# and with no promotion (one wgmma chain), against cuBLAS FP8 (scripts/probe_plain.py).
# mxfp8_values: MXFP8's quantize passes and epilogues writing BF16 values (autograd.QUANTIZE_TO_VALUES): its GPU
# tests, then the MLP at DSv3 with and without it and with the chunked dGLU epilogue, each with and without the
# weight cache's BF16 values, against both unfused paths (interleaved rounds, no kernel table).
# mx_plain_probe: MXFP8's plain GEMMs on BF16 values at DSv3, on its kernel and on the BF16 path's persistent one,
# against cuBLAS (scripts/probe_mx_plain.py). mx_plain_bench: the MXFP8 MLP at DSv3 with those GEMMs on either
# kernel (gemm.PLAIN_VALUES_KERNEL: "bf16", the default since run 35, and "mx"), fused and unfused, interleaved
# rounds, no kernel table.
# mx_fc1_probe: MXFP8's fused FC1 at DSv3 on its kernel and on the BF16 backend's persistent kernel with its
# quantizing store of a (gemm.FC1_VALUES_KERNEL), a few configs of the latter, the bytes of both compared,
# against its GEMM alone and the BF16 backend's FC1 (scripts/probe_mx_fc1.py). mx_fc1_bench: the MXFP8 MLP at
# DSv3, fused with either FC1 kernel and unfused, interleaved rounds, no kernel table. mxfp8_tests: MXFP8_K, a
# pytest -k selection of them (run 36 split the file over four calls with it). mx_wgrad_probe: MXFP8's two
# BF16-valued wgrads at DSv3 at the shipped config and fewer tokens per step (MXWgradConfig.block_t), against
# the BF16 backend's wgrad and cuBLAS (scripts/probe_mx_wgrad.py), then with x's saved FP8 codes expanded in
# the K loop (autograd.X_CODES_IN_WGRAD) next to the expansion pass it replaces. mx_wgrad_bench: the MXFP8 MLP at
# DSv3, fused with and without X_CODES_IN_WGRAD (through shared memory, and as the wgmma's A operand), and
# unfused, interleaved rounds, no kernel table.
# mx_cublas_wgrad: the BF16-valued wgrads on cuBLAS's grouped GEMM (library_wgrad.py): its GPU tests, the wgrad
# probe (cuBLAS on the columnwise copies as kept, "cublas_slots", next to the shipped kernel), then the MXFP8 MLP at
# DSv3 fused and unfused, each with its wgrads on either kernel (autograd.VALUES_WGRAD_KERNEL: cuBLAS since run 39a, and
# the Triton kernel), interleaved rounds.
# sustained: forward + backward of SUSTAINED_IMPLS after 2 s back to back (the GPU at its power limit), the SM
# clock sampled beside each timing, interleaved rounds, SUSTAINED_RATIOS (te_fused_moe/bench_sustained.py).
# mx_profile: the MXFP8 MLP's kernels at DSv3 under torch.profiler (scripts/profile_mlp.py; PROFILE_IMPLS, by default
# fused and unfused, each with its wgrads on cuBLAS and on the Triton kernel; PROFILE_ARGS=--as-do-bench: each call
# as do_bench times it, the host profiled too, Chrome traces). mx_keep_values: the forward keeping x's
# and a's columnwise copies as BF16 values (autograd.KEEP_COLUMNWISE_VALUES): its GPU tests, then the MLP at DSv3
# with and without it against the unfused path, interleaved rounds (with the memory each holds after its forward).
# mx_expand_probe: MXFP8's four weight expansions at DSv3 at a few launches against a copy of the same bytes
# (scripts/probe_mx_expand.py).
# host_probe: HOST_IMPLS' forward + backward timed call by call and ten calls queued behind a sleep kernel, and their
# host calls' CPU time behind a sleep kernel with cProfile's top functions (scripts/probe_host_overhead.py).
# mx_expand_probe also times the weight cache's refresh (quantize.quantize_weight).
# nv_probe: NVFP4's two BF16-valued wgrads at DSv3 at a slot and half a slot per step and a few variants, against the
# packed-code K loop and cuBLAS on the same values (scripts/probe_nv_wgrad.py); then its weight refresh with the
# transposed copy's codes transposed or encoded again (scripts/probe_nv_refresh.py). bf16_tests: the BF16 backend's GPU
# tests (tests/gpu/test_triton_gpu.py, test_triton_persistent_gpu.py). nv_rht: NVFP4's quantize kernels (their
# BF16-input RHT on tensor cores among them, quantize.RHT_TENSOR_CORES), its MLP cases with it and the default
# swiglu-x16 case, x's and dy's quantize and amax passes at DSv3 both ways (scripts/probe_nv_rht.py), then the MLP at
# DSv3 with and without it (interleaved rounds, no kernel table).
# mx_dglu_probe: MXFP8's separate dGLU at DSv3, its GEMM alone and with each epilogue kernel and config, then
# fused on the BF16 backend's kernel with its quantizing store of dh at a few configs (scripts/probe_mx_dglu.py).
# mx_dglu_bench: the MXFP8 MLP at DSv3, fused with the separate dGLU (shipped) and with the dGLU on the BF16
# backend's kernel (gemm.DGLU_VALUES_KERNEL = "bf16"), and unfused, interleaved rounds, no kernel table (run 37b
# ran it with the route as the default: its "mxfp8_fused" row is the route, "mxfp8_fused_separate_dglu" the
# separate dGLU, the variant's name then). ring_debug: RING_SCALES' bitwise test at K = 4096 (the scalar box within the
# weight scales' width), then at K = 512 under compute-sanitizer's memcheck where the image has it.
# ring_bisect: RING_SCALES' plain GEMM in a process per variant (the consumers' shared-memory reads of the scales
# swapped for constants, one or both; the scalar's descriptor over another tensor or with a wider box;
# scripts/probe_ring_debug.py): which part dies.
# mxfp8_exact: the MXFP8 GPU tests that failed in run 34b on the chunked dGLU epilogue's launch check (the
# integer-exact checks with 128-column dGLU tiles; fixed after the call) and the GEMM kernel's epilogue case.
# mx_quantize_probe: MXFP8's quantize pass at DSv3's x at a few launch configs, codes and values
# (scripts/probe_mx_quantize.py).
# mxfp8_weights_bench: MXFP8 fused and unfused at DSv3, each with and without the weight cache keeping BF16
# values (mxfp8.autograd.BF16_WEIGHT_VALUES), interleaved rounds, no kernel table.
# dglu_bench: FP8 block's one-pass dGLU alone at GPT-OSS (scripts/bench_dglu_rows.py: both launch orders,
# the passes it replaces).
# nvfp4_bench: NVFP4 fused vs BF16 unfused at DSv3 with its kernels (the quantize passes with and without
# stochastic rounding among them).
# prefetch_bench: the FP8 block kernels at DSv3 with and without wgmma_ws.TILE_PREFETCH (each kernel alone),
# then the MLP with and without it against BF16 unfused in interleaved rounds.
# nvfp4_tests: the NVFP4 GPU file (27 tests: 277 s for 24 on an H100 in run 42b, hence its 380 s limit).
# wgmma_tests: the Gluon GEMMs' GPU tests (over 240 s on a cold H100 in run 28: hence its 420 s limit;
# WGMMA_K: a pytest -k selection of them). fp8_bench: FP8_ONLY, bench_recipes' --implementations.
# other_tests: every other GPU test file (those needing TE, Megatron or SM100 skip where those are absent).
set -u
OUT=${OUT:-/tmp/device_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
STEPS=${*:-fp8_tests mxfp8_tests fp8_bench mxfp8_bench}
if [ -n "${CLOCKS:-}" ]; then  # the SM clock, power and clock-limit reasons every 100 ms, beside the steps' times
  reasons=clocks_event_reasons.active
  nvidia-smi --query-gpu=$reasons --format=csv > /dev/null 2>&1 || reasons=clocks_throttle_reasons.active
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,$reasons \
    --format=csv,nounits -lms 100 > "$OUT/clocks.csv" 2>&1 &
  trap "kill $! 2> /dev/null" EXIT
fi
python -c "import torch, triton; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)" \
  > "$OUT/env.txt" 2>&1
step() {  # name, timeout, command...
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  local began; began=$(date +%T.%N)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? $((SECONDS - start)) s ($began to $(date +%T.%N))" | tee -a "$OUT/times.txt"
  tail -3 "$OUT/$name.log"
}
for s in $STEPS; do
  case $s in
    fp8_tests) step pytest_fp8_block "${FP8_TESTS_TIMEOUT:-150}" python -m pytest -m gpu -q -p no:cacheprovider \
                 tests/gpu/test_triton_fp8_block_gpu.py;;
    nvfp4_tests) step pytest_nvfp4 "${NVFP4_TESTS_TIMEOUT:-380}" python -m pytest -m gpu -q -p no:cacheprovider \
                   tests/gpu/test_triton_nvfp4_gpu.py;;
    mxfp8_tests) step pytest_mxfp8 "${MXFP8_TESTS_TIMEOUT:-260}" python -m pytest -m gpu -q -p no:cacheprovider \
                   tests/gpu/test_triton_mxfp8_gpu.py ${MXFP8_K:+-k "$MXFP8_K"};;
    wgmma_tests) step pytest_wgmma "${WGMMA_TESTS_TIMEOUT:-420}" python -m pytest -m gpu -q -p no:cacheprovider \
                   tests/gpu/test_fp8_block_wgmma_gpu.py ${WGMMA_K:+-k "$WGMMA_K"};;
    other_tests) step pytest_other "${OTHER_TESTS_TIMEOUT:-420}" python -m pytest -m gpu -q -p no:cacheprovider -rs \
                   tests/gpu --ignore=tests/gpu/test_triton_fp8_block_gpu.py --ignore=tests/gpu/test_triton_mxfp8_gpu.py;;
    fp8_bench) step recipes_fp8_block "${FP8_BENCH_TIMEOUT:-170}" python scripts/bench_recipes.py --recipes fp8_block \
                 --shapes dsv3-e32 --rounds "${ROUNDS:-3}" ${FP8_ONLY:+--implementations "$FP8_ONLY"} \
                 --out "$OUT/recipes_fp8_block";;
    ring_check) step pytest_ring_scales "${WGMMA_TESTS_TIMEOUT:-240}" python -m pytest -m gpu -q -p no:cacheprovider \
                  tests/gpu/test_fp8_block_wgmma_gpu.py -k ring_scales
                step probe_plain_ring "${PROBE_TIMEOUT:-200}" python scripts/probe_plain.py \
                  --variants ring_scales,load_scales --out "$OUT/probe_plain_ring"
                step recipes_ring "${FP8_BENCH_TIMEOUT:-170}" python scripts/bench_recipes.py --recipes fp8_block \
                  --shapes dsv3-e32 --no-kernels --rounds "${ROUNDS:-5}" \
                  --implementations fp8_block_fused,fp8_block_fused_ring_scales --out "$OUT/recipes_ring";;
    ring_tests) step pytest_fp8_block_ring "${FP8_TESTS_TIMEOUT:-200}" python -c "import sys, pytest
import te_fused_moe.backends.triton.fp8_block.wgmma_ws as ws
ws.RING_SCALES = True
sys.exit(pytest.main(['-m', 'gpu', '-q', '-p', 'no:cacheprovider', 'tests/gpu/test_triton_fp8_block_gpu.py']))";;
    plain_probe) step probe_plain "${PROBE_TIMEOUT:-240}" python scripts/probe_plain.py --out "$OUT/probe_plain";;
    wgrad_probe) step probe_wgrad "${PROBE_TIMEOUT:-240}" python scripts/probe_wgrad.py --out "$OUT/probe_wgrad";;
    ptxas_tests) TE_FUSED_MOE_PTXAS=toolkit step pytest_ptxas_toolkit "${FP8_TESTS_TIMEOUT:-270}" python -m pytest \
                   -m gpu -q -p no:cacheprovider tests/gpu/test_triton_fp8_block_gpu.py tests/gpu/test_fp8_block_wgmma_gpu.py;;
    ptxas_probe) step probe_wgrad_ptxas "${PROBE_TIMEOUT:-300}" python scripts/probe_wgrad.py \
                   --variants base,factor_by_fma --ptxas triton,toolkit,triton,toolkit --out "$OUT/probe_wgrad_ptxas";;
    ptxas_bench) for i in 1 2; do for p in toolkit triton; do
                   TE_FUSED_MOE_PTXAS=$p step "recipes_fp8_block_${p}_$i" "${FP8_BENCH_TIMEOUT:-170}" python \
                     scripts/bench_recipes.py --recipes fp8_block --shapes dsv3-e32 --rounds "${ROUNDS:-3}" \
                     --out "$OUT/recipes_fp8_block_${p}_$i"; done; done;;
    padded_tests) step pytest_padded "${PADDED_TESTS_TIMEOUT:-300}" python -m pytest -m gpu -q -p no:cacheprovider \
                    tests/gpu/test_triton_fp8_block_gpu.py tests/gpu/test_triton_mxfp8_gpu.py -k "padded";;
    padded_bench) step recipes_gpt_oss "${PADDED_BENCH_TIMEOUT:-240}" python scripts/bench_recipes.py \
                    --recipes "${PADDED_RECIPES:-fp8_block,mxfp8,nvfp4}" --shapes gpt-oss --no-kernels --rounds "${ROUNDS:-3}" \
                    ${PADDED_ONLY:+--implementations "$PADDED_ONLY"} --out "$OUT/recipes_gpt_oss";;
    host_probe) step probe_host_overhead "${PROBE_TIMEOUT:-200}" python scripts/probe_host_overhead.py \
                  --impls "${HOST_IMPLS:-mxfp8_fused,mxfp8_unfused,bf16_unfused}" --out "$OUT/probe_host_overhead";;
    mx_expand_probe) step probe_mx_expand "${PROBE_TIMEOUT:-120}" python scripts/probe_mx_expand.py --out "$OUT/probe_mx_expand";;
    sustained) step sustained "${SUSTAINED_TIMEOUT:-300}" python scripts/bench_sustained.py --rounds "${ROUNDS:-5}" \
                 --impls "${SUSTAINED_IMPLS:-bf16_unfused,mxfp8_unfused,mxfp8_fused}" \
                 --ratios "${SUSTAINED_RATIOS:-mxfp8_fused:mxfp8_unfused,mxfp8_fused:bf16_unfused}" --out "$OUT/sustained";;
    mx_profile) step profile_mxfp8 "${PROFILE_TIMEOUT:-200}" python scripts/profile_mlp.py --iterations 3 --impls \
                  "${PROFILE_IMPLS:-mxfp8_fused,mxfp8_unfused,mxfp8_fused_triton_wgrad,mxfp8_unfused_triton_wgrad}" \
                  --shape dsv3-e32 ${PROFILE_ARGS:-} --out "$OUT/profile_mxfp8";;
    mx_keep_values) step pytest_keep_values "${KEEP_TESTS_TIMEOUT:-150}" python -m pytest -m gpu -q -p no:cacheprovider \
                      tests/gpu/test_triton_mxfp8_gpu.py -k "keep"
                    step recipes_mxfp8_keep_values "${MXFP8_BENCH_TIMEOUT:-240}" python scripts/bench_recipes.py \
                      --recipes mxfp8 --shapes dsv3-e32 --no-kernels --rounds "${ROUNDS:-5}" --implementations \
                      mxfp8_fused,mxfp8_unfused,mxfp8_fused_keep_values --out "$OUT/recipes_mxfp8_keep_values";;
    padded_profile) step profile_gpt_oss "${PROFILE_TIMEOUT:-150}" python scripts/profile_mlp.py \
                      --impls fp8_block_fused,mxfp8_fused,bf16_fused --shape gpt-oss --out "$OUT/profile_gpt_oss";;
    nvfp4_bench) step recipes_nvfp4 "${NVFP4_BENCH_TIMEOUT:-150}" python scripts/bench_recipes.py --recipes nvfp4 \
                   --shapes dsv3-e32 --implementations nvfp4_fused --out "$OUT/recipes_nvfp4";;
    dglu_bench) step bench_dglu_rows "${DGLU_BENCH_TIMEOUT:-240}" python scripts/bench_dglu_rows.py --out "$OUT/dglu_rows";;
    prefetch_bench) step variants_prefetch "${PREFETCH_BENCH_TIMEOUT:-200}" python scripts/bench_recipes.py \
                      --variants fp8_block --only gluon_no_tile_prefetch --shapes dsv3-e32 --out "$OUT/variants_prefetch"
                    step recipes_prefetch "${PREFETCH_BENCH_TIMEOUT:-200}" python scripts/bench_recipes.py \
                      --recipes fp8_block --shapes dsv3-e32 --no-kernels --rounds "${ROUNDS:-5}" \
                      --implementations fp8_block_fused,fp8_block_fused_no_tile_prefetch --out "$OUT/recipes_prefetch";;
    mxfp8_values) step pytest_mxfp8_values "${MXFP8_TESTS_TIMEOUT:-200}" python -m pytest -m gpu -q -p no:cacheprovider \
                    tests/gpu/test_triton_mxfp8_gpu.py -k "values or codes or no_host_syncs or graph"
                  step recipes_mxfp8_values "${MXFP8_BENCH_TIMEOUT:-240}" python scripts/bench_recipes.py \
                    --recipes mxfp8 --shapes dsv3-e32 --no-kernels --rounds "${ROUNDS:-3}" --implementations \
                    mxfp8_fused,mxfp8_unfused,mxfp8_fused_codes,mxfp8_fused_gemm_dglu_epilogue,mxfp8_fused_bf16_weights,mxfp8_unfused_bf16_weights,mxfp8_fused_bf16_weights_codes \
                    --out "$OUT/recipes_mxfp8_values";;
    mx_plain_probe) step probe_mx_plain "${PROBE_TIMEOUT:-150}" python scripts/probe_mx_plain.py --out "$OUT/probe_mx_plain";;
    mx_plain_bench) step recipes_mxfp8_plain "${MXFP8_BENCH_TIMEOUT:-240}" python scripts/bench_recipes.py \
                      --recipes mxfp8 --shapes dsv3-e32 --no-kernels --rounds "${ROUNDS:-3}" --implementations \
                      mxfp8_fused,mxfp8_unfused,mxfp8_fused_mx_plain_kernel,mxfp8_unfused_mx_plain_kernel \
                      --out "$OUT/recipes_mxfp8_plain";;
    mx_fc1_bench) step recipes_mxfp8_fc1 "${MXFP8_BENCH_TIMEOUT:-240}" python scripts/bench_recipes.py \
                    --recipes mxfp8 --shapes dsv3-e32 --no-kernels --rounds "${ROUNDS:-3}" --implementations \
                    bf16_fused,mxfp8_fused,mxfp8_unfused,mxfp8_fused_fc1_mx_kernel --out "$OUT/recipes_mxfp8_fc1";;
    mx_dglu_bench) step recipes_mxfp8_dglu "${MXFP8_BENCH_TIMEOUT:-240}" python scripts/bench_recipes.py \
                    --recipes mxfp8 --shapes dsv3-e32 --no-kernels --rounds "${ROUNDS:-3}" --implementations \
                    bf16_fused,mxfp8_fused,mxfp8_unfused,mxfp8_fused_dglu_bf16_kernel --out "$OUT/recipes_mxfp8_dglu";;
    mx_wgrad_bench) step recipes_mxfp8_wgrad "${MXFP8_BENCH_TIMEOUT:-240}" python scripts/bench_recipes.py \
                      --recipes mxfp8 --shapes dsv3-e32 --no-kernels --rounds "${ROUNDS:-3}" --implementations \
                      mxfp8_fused,mxfp8_unfused,mxfp8_fused_x_codes_in_wgrad,mxfp8_fused_x_codes_in_wgrad_as_a \
                      --out "$OUT/recipes_mxfp8_wgrad";;
    mx_cublas_wgrad) step pytest_library_wgrad "${LIBRARY_TESTS_TIMEOUT:-120}" python -m pytest -m gpu -q -p no:cacheprovider \
                       tests/gpu/test_library_wgrad_gpu.py -s
                     step probe_mx_wgrad "${PROBE_TIMEOUT:-150}" python scripts/probe_mx_wgrad.py --out "$OUT/probe_mx_wgrad"
                     step recipes_mxfp8_cublas_wgrad "${MXFP8_BENCH_TIMEOUT:-240}" python scripts/bench_recipes.py \
                       --recipes mxfp8 --shapes dsv3-e32 --no-kernels --rounds "${ROUNDS:-5}" --implementations \
                       bf16_fused,mxfp8_fused,mxfp8_unfused,mxfp8_fused_triton_wgrad,mxfp8_unfused_triton_wgrad \
                       --out "$OUT/recipes_mxfp8_cublas_wgrad";;
    nv_probe) step probe_nv_wgrad "${PROBE_TIMEOUT:-200}" python scripts/probe_nv_wgrad.py --out "$OUT/probe_nv_wgrad"
              step probe_nv_refresh "${PROBE_TIMEOUT:-200}" python scripts/probe_nv_refresh.py \
                --out "$OUT/probe_nv_refresh";;
    bf16_tests) step pytest_bf16 "${BF16_TESTS_TIMEOUT:-300}" python -m pytest -m gpu -q -p no:cacheprovider \
                  tests/gpu/test_triton_gpu.py tests/gpu/test_triton_persistent_gpu.py;;
    nv_rht) step pytest_nv_rht "${NVFP4_TESTS_TIMEOUT:-200}" python -m pytest -m gpu -v -p no:cacheprovider \
              tests/gpu/test_triton_nvfp4_gpu.py -k "quantize_kernels or rhtmma or swiglu-x16"
            step probe_nv_rht "${PROBE_TIMEOUT:-150}" python scripts/probe_nv_rht.py --out "$OUT/probe_nv_rht"
            step recipes_nv_rht "${NVFP4_BENCH_TIMEOUT:-170}" python scripts/bench_recipes.py --recipes nvfp4 \
              --shapes dsv3-e32 --no-kernels --rounds "${ROUNDS:-3}" --implementations nvfp4_fused,nvfp4_fused_rht_mma \
              --out "$OUT/recipes_nv_rht";;
    mx_wgrad_probe) step probe_mx_wgrad "${PROBE_TIMEOUT:-150}" python scripts/probe_mx_wgrad.py --out "$OUT/probe_mx_wgrad";;
    mx_fc1_probe) step probe_mx_fc1 "${PROBE_TIMEOUT:-150}" python scripts/probe_mx_fc1.py --out "$OUT/probe_mx_fc1";;
    mx_dglu_probe) step probe_mx_dglu "${PROBE_TIMEOUT:-150}" python scripts/probe_mx_dglu.py --out "$OUT/probe_mx_dglu";;
    ring_debug) step pytest_ring_k4096 "${WGMMA_TESTS_TIMEOUT:-150}" python -m pytest -m gpu -q -p no:cacheprovider \
                  tests/gpu/test_fp8_block_wgmma_gpu.py -k "ring_scales and 4096"
                if command -v compute-sanitizer > /dev/null; then
                  step sanitizer_ring "${SANITIZER_TIMEOUT:-240}" compute-sanitizer --tool memcheck --print-limit 20 --show-backtrace device \
                    python -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_fp8_block_wgmma_gpu.py \
                    -k "ring_scales and 512 and 1-"
                fi;;
    ring_bisect) step probe_ring_debug "${PROBE_TIMEOUT:-300}" python scripts/probe_ring_debug.py --out "$OUT/probe_ring_debug";;
    mxfp8_exact) step pytest_mxfp8_exact "${MXFP8_TESTS_TIMEOUT:-200}" python -m pytest -m gpu -q -p no:cacheprovider \
                   tests/gpu/test_triton_mxfp8_gpu.py -k "every_kernel_exact or bf16_da or promotion_loop or gemm-kernel";;
    mx_quantize_probe) step probe_mx_quantize "${PROBE_TIMEOUT:-120}" python scripts/probe_mx_quantize.py \
                         --out "$OUT/probe_mx_quantize";;
    mxfp8_weights_bench) step recipes_mxfp8_bf16_weights "${MXFP8_BENCH_TIMEOUT:-240}" python scripts/bench_recipes.py \
                           --recipes mxfp8 --shapes dsv3-e32 --no-kernels --rounds "${ROUNDS:-3}" --implementations \
                           mxfp8_fused,mxfp8_unfused,mxfp8_fused_bf16_weights,mxfp8_unfused_bf16_weights \
                           --out "$OUT/recipes_mxfp8_bf16_weights";;
    mxfp8_bench) step recipes_mxfp8 "${MXFP8_BENCH_TIMEOUT:-150}" python scripts/bench_recipes.py --recipes mxfp8 \
                   --shapes dsv3-e32 --out "$OUT/recipes_mxfp8";;
  esac
done
