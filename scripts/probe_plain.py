"""Where the plain Gluon FP8 block GEMM loses to cuBLAS: ablations of its per-block promotion (a
measurement tool: every variant but ``base`` computes wrong results on purpose).

Run 31 timed our four token GEMMs at 1.09-1.27x cuBLAS FP8 (per-tensor scales) at their DSv3 shapes;
run 30's ncu saw our tensor pipe 75% busy against cuBLAS's 93%. Is the gap the 1x128 promotion (an
FFMA per accumulator element per K block and the three register tiles it keeps live), or the
kernel's structure around it (128x128 tiles, ring, producer, stores), which no promotion change fixes?

Variants, each in its own process (a Gluon kernel's dependencies are fixed at its first compile),
``wgmma_gemm``'s helpers replaced before the first launch:
- ``base``: the kernel as it ships (``_promoted_mainloop``).
- ``ring_scales`` / ``load_scales``: ``base`` with ``wgmma_ws.RING_SCALES`` on (the producer loads each
  block's scales by TMA with its stage) / off (the consumers load them from global memory one block
  ahead; the kernel before run 32). The same results.
- ``add_only``: the promotion an FADD (``acc + part``) instead of an FFMA by the block's scales: the
  scales' loads are dead and dropped; the same three register tiles and one FP32 op per element.
- ``chained``: no promotion: one wgmma chain accumulating over all K blocks into one register tile
  (as cuBLAS with ``use_fast_accum`` does), each block's stage handed back once the next block's
  wgmma is issued and the block's is done. Same ring, producer, tiles, schedule and stores.
The ``base`` process also times cuBLAS (``torch._scaled_mm``, E4M3, per-tensor scales, BF16 out) at
the same shapes, with its own FP32 promotion and with fast accumulation (``bench_ceiling``).

Shapes: DSv3's four token GEMMs over 32768 routed rows in 32 balanced experts, (N, K) of FC1's GEMM
(4096, 7168), FC2 (7168, 2048), the dGLU's GEMM (2048, 7168) and FC1's dgrad (7168, 4096), each as
the plain kernel (``gemm.launch("fc2")``) reading a weight [E, N, K].

  usage: python scripts/probe_plain.py [--out DIR] [--variants A,B]   (each in a subprocess)
         python scripts/probe_plain.py --variant NAME   (one, prints JSON)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from probe_results import write_and_print
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from te_fused_moe.backends.triton.fp8_block import wgmma_gemm as W

VARIANTS = ("base", "ring_scales", "load_scales", "add_only", "chained")
ROUTED, EXPERTS = 32768, 32
SHAPES = {"fc1": (4096, 7168), "fc2": (7168, 2048), "dglu_gemm": (2048, 7168), "fc1_dgrad": (7168, 4096)}


@gluon.jit
def promote_by_add(acc, part, row_scale, col_scale, OUTER: gl.constexpr):
    return gl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=r,r,r", [part, acc], dtype=gl.float32,
                                     is_pure=False, pack=1)


@gluon.jit
def chained_mainloop(ring, used, k_first, k_tiles, row_scales, stride_row_scales, col_scales, stride_col_scales,
                     mma: gl.constexpr, NUM_STAGES: gl.constexpr, OUTER: gl.constexpr, BAND: gl.constexpr,
                     BANDS: gl.constexpr, RING_SCALES: gl.constexpr = False):
    """``_promoted_mainloop``'s contract without the scales: sum over the K blocks of ``dot(A, B^T)`` in
    one wgmma chain; block ``k``'s stage goes back once block ``k + 1``'s wgmma is issued and ``k``'s done."""
    BLOCK_M: gl.constexpr = ring[2].shape[1] // BANDS
    BLOCK_N: gl.constexpr = ring[3].shape[1]
    b_bufs, ready = ring[3], ring[4]
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
    stage, phase = W.ring_slot(used, NUM_STAGES)
    mbarrier.wait(ready.index(stage), phase)
    token = warpgroup_mma(W._a_tile(ring, stage, BAND, BANDS), b_bufs.index(stage).permute((1, 0)), acc,
                          use_acc=False, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=1, deps=(token,))  # a tensor again (the loop carries one)
    for k in range(1, k_tiles):
        stage, phase = W.ring_slot(used + k, NUM_STAGES)
        mbarrier.wait(ready.index(stage), phase)
        token = warpgroup_mma(W._a_tile(ring, stage, BAND, BANDS), b_bufs.index(stage).permute((1, 0)), acc,
                              use_acc=True, is_async=True)
        acc, _ = W._retire(ring, token, 1, used + k - 1, NUM_STAGES, False)
    acc, _ = W._retire(ring, acc, 0, used + k_tiles - 1, NUM_STAGES, False)
    return acc


def _patch(variant: str) -> None:
    from te_fused_moe.backends.triton.fp8_block import wgmma_ws

    if variant in ("ring_scales", "load_scales"):
        wgmma_ws.RING_SCALES = variant == "ring_scales"
    elif variant == "add_only":
        W._promote = promote_by_add
    elif variant == "chained":
        W._promoted_mainloop = chained_mainloop


def run_variant(variant: str) -> dict:
    import torch

    from te_fused_moe import bench_ceiling
    from te_fused_moe.bench import do_bench_ms
    from te_fused_moe.bench_recipes import recipe_kernels
    from te_fused_moe.backends.triton.schedule import build_schedule

    _patch(variant)
    torch.manual_seed(0)
    kernels, spec = recipe_kernels("fp8_block")
    counts = torch.full((EXPERTS,), ROUTED // EXPERTS, dtype=torch.int32, device="cuda")
    sched = build_schedule(counts, ROUTED, kernels.tile)
    out = {}
    for name, (n, k) in SHAPES.items():
        a = torch.randn(ROUTED, k, device="cuda", dtype=torch.bfloat16)
        aq = kernels.quantize_rows(a, sched, EXPERTS, spec, rowwise=True, colwise=False)
        wq = kernels.quantize_weight(torch.randn(EXPERTS, n, k, device="cuda", dtype=torch.bfloat16) * 0.02, spec,
                                     transposed=False)
        c = torch.empty(ROUTED, n, device="cuda", dtype=torch.bfloat16)
        fn = lambda: kernels.gemm.launch("fc2", aq.data, aq.scale, wq.data, wq.scale, n, sched, EXPERTS, spec, c=c)
        fn()
        flops = 2.0 * ROUTED * n * k
        ms = do_bench_ms(fn)
        out[name] = {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1)}
        if variant == "base":
            for key, fast in (("cublas", False), ("cublas_fast_accum", True)):
                cms = bench_ceiling.time_cublas_fp8([(ROUTED, n, k)], fast_accum=fast)
                out[name][key] = {"ms": round(cms, 4), "tflops": round(flops / cms / 1e9, 1)}
        torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", choices=VARIANTS)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args.variant)))
        return
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        p.error(f"--variants: expected names from {', '.join(VARIANTS)}, got {', '.join(unknown)}")
    results = {}
    for variant in variants:
        proc = subprocess.run([sys.executable, __file__, "--variant", variant], capture_output=True, text=True)
        results[variant] = ({"error": proc.stderr[-2000:]} if proc.returncode
                            else json.loads(proc.stdout.strip().splitlines()[-1]))
        print(variant, json.dumps(results[variant])[:600], flush=True)
    base = results.get("base", {})
    for variant, res in results.items():
        for shape, r in res.items():
            if isinstance(r, dict) and "ms" in r and shape in base and "ms" in base[shape]:
                r["vs_base"] = round(base[shape]["ms"] / r["ms"], 3)
                for key in ("cublas", "cublas_fast_accum"):
                    if key in base[shape]:
                        r[f"over_{key}"] = round(r["ms"] / base[shape][key]["ms"], 3)
    write_and_print(results, args.out, "probe_plain.json")


if __name__ == "__main__":
    main()
