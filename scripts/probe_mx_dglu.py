"""MXFP8's dGLU at DSv3 (32768 routed rows in 32 balanced experts, F 2048, swiglu, probs, db1 and dprob,
dh written as values both ways): its GEMM alone, then the whole separate dGLU (the GEMM + its epilogue
alone) with the epilogue on the GEMM kernel (``gemm.SEPARATE_DGLU_KERNEL = "gemm"``) and on the chunked
kernel (``"chunks"``, ``dglu_epilogue``, the default since run 34) at a few launch configs
(``dglu_epilogue.COLS`` / ``WARPS`` / ``UNROLL``). A measurement tool, not a test: both kernels' bytes are
checked by the MXFP8 tests.

Then the dGLU fused on the BF16 backend's persistent kernel with MXFP8's quantizing store of dh
(``gemm.DGLU_VALUES_KERNEL = "bf16"``, opt-in since run 37b) at its config and a few changes of it
(``gemm.dglu_values_config``), and that kernel's own dGLU writing dh in BF16 (no quantize) for scale.

Why: run 33d measured the MLP 0.57 ms slower with the chunked epilogue than with the GEMM kernel's,
though its offline build has 40% fewer instructions per element; run 34 timed the epilogues alone (the
whole minus the GEMM) and found the launch that pays (``dglu_epilogue``'s comment).

  usage: python scripts/probe_mx_dglu.py [--out DIR]
"""

from __future__ import annotations

from dataclasses import replace

from mx_probe_problem import EXPERTS, FFN, HIDDEN, ROUTED, balanced_problem
from probe_results import run_and_save

# (columns per program, warps, unroll factor of the loop over a tile's chunks, register cap): run 34 timed 64 /
# 128 columns at 4 / 8 warps, unrolled (4) and not (1); run 36a the 4-warp launch capped at 168 / 128 registers
# (0.697 / 0.613 ms against 0.666) and 2 warps (0.559); run 37b 128 columns at 2 warps. These: 2 warps
# uncapped (255 registers offline: four programs per SM), capped at 168 (40 stack bytes offline, six programs;
# shipped since run 38a: 0.518 ms against 0.550) and at 128 (216 bytes, eight; 0.647); capped at 192 (no spills,
# five programs) and at 168 with the chunk loop unrolled twice (56 stack bytes)
CHUNK_CONFIGS = [(64, 2, 1, None), (64, 2, 1, 168), (64, 2, 1, 128), (64, 2, 1, 192), (64, 2, 2, 168)]
# changes of the route's config (128 x 128 x 64, 3 stages, persistent, flattened): offline (sm_90a) it builds
# to 255 registers with ~1 KB of stack, the quantizing store in the flattened loop. Run 37b timed 4 stages, not
# flattened, one program per tile and GROUP_M 16 (4.117-4.556 ms against the separate dGLU's 1.836)
ROUTE_VARIANTS = {"shipped": {}}


def run() -> dict:
    import torch

    from te_fused_moe.backends.triton import grouped_gemm
    from te_fused_moe.backends.triton.mxfp8 import dglu_epilogue, gemm, quantize as Q
    from te_fused_moe.backends.triton.schedule import max_m_tiles
    from te_fused_moe.bench import do_bench_ms

    _, sched, spec, a_scale, b_scale, out = balanced_problem()
    dy = Q.expand_values(*_codes(Q, torch.randn(ROUTED, HIDDEN, device="cuda", dtype=torch.bfloat16), sched, spec))
    w2t = torch.randn(EXPERTS, FFN, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02  # w2's transposed copy
    h = torch.randn(ROUTED, 2 * FFN, device="cuda", dtype=torch.bfloat16)
    probs = torch.rand(ROUTED, device="cuda")
    separate = gemm.default_config("dact", True)  # the shipped dGLU's config (64-column tiles)
    shipped_route, gemm.DGLU_VALUES_KERNEL = gemm.DGLU_VALUES_KERNEL, "bf16"
    route = gemm.default_config("dact", True)  # the route's (bf16_kernel: 128 columns, the dprob partials' width)
    gemm.DGLU_VALUES_KERNEL = shipped_route
    dbias = torch.empty(max_m_tiles(ROUTED, EXPERTS, Q.TILE), 2 * FFN, device="cuda")

    def dglu(cfg=separate):
        dh = Q.new_rows(ROUTED, 2 * FFN, h, spec, EXPERTS, True, True, row_values=True, col_values=True)
        dprob = torch.empty(FFN // cfg.block_n, ROUTED, device="cuda")
        gemm.launch("dact", dy, a_scale, w2t, b_scale, FFN, sched, EXPERTS, spec, q=dh, q_up_offset=FFN, h=h,
                    h_up_offset=FFN, probs=probs, dprob=dprob, dbias=dbias, activation="swiglu", gated=True,
                    config=cfg)

    da = torch.empty(ROUTED, FFN, device="cuda", dtype=torch.bfloat16)
    gemm_ms = do_bench_ms(lambda: gemm.launch("fc2", dy, a_scale, w2t, b_scale, FFN, sched, EXPERTS, spec, c=da))
    out["gemm_alone_ms"] = round(gemm_ms, 4)
    shipped = (gemm.DACT_EPILOGUE, gemm.SEPARATE_DGLU_KERNEL, dglu_epilogue.COLS, dglu_epilogue.WARPS,
               dglu_epilogue.UNROLL, dglu_epilogue.MAXNREG)
    gemm.DACT_EPILOGUE = "separate"
    try:
        for name, kernel, launch_config in [("gemm_kernel", "gemm", None)] + [
                (f"chunks_{c}c_{w}w_unroll{u}_maxnreg{r}", "chunks", (c, w, u, r)) for c, w, u, r in CHUNK_CONFIGS]:
            gemm.SEPARATE_DGLU_KERNEL = kernel
            if launch_config:
                dglu_epilogue.COLS, dglu_epilogue.WARPS, dglu_epilogue.UNROLL, dglu_epilogue.MAXNREG = launch_config
            ms = do_bench_ms(dglu)
            out[name] = {"ms": round(ms, 4), "epilogue_ms": round(ms - gemm_ms, 4)}
    finally:
        (gemm.DACT_EPILOGUE, gemm.SEPARATE_DGLU_KERNEL, dglu_epilogue.COLS, dglu_epilogue.WARPS,
         dglu_epilogue.UNROLL, dglu_epilogue.MAXNREG) = shipped
    shipped_config = gemm.dglu_values_config
    try:
        for name, change in ROUTE_VARIANTS.items():
            gemm.dglu_values_config = lambda n, k, block_n: replace(shipped_config(n, k, block_n), **change)
            ms = do_bench_ms(lambda: dglu(route))
            out[f"bf16_kernel_{name}"] = {"ms": round(ms, 4), "epilogue_ms": round(ms - gemm_ms, 4)}
    finally:
        gemm.dglu_values_config = shipped_config
    # the BF16 backend's own dGLU, dh in BF16 (its default store), at the route's config
    dh16 = torch.empty(ROUTED, 2 * FFN, device="cuda", dtype=torch.bfloat16)
    dprob = torch.empty(FFN // route.block_n, ROUTED, device="cuda")
    ms = do_bench_ms(lambda: grouped_gemm.launch_scheduled(
        "dact", dy, w2t, (w2t.stride(0), w2t.stride(2), w2t.stride(1)), FFN, HIDDEN, dh16, sched, EXPERTS,
        gemm.dglu_values_config(FFN, HIDDEN, route.block_n), c_up_offset=FFN, h=h, h_up_offset=FFN, probs=probs,
        dprob=dprob, activation="swiglu", gated=True))
    out["bf16_backend_dglu_bf16_dh"] = {"ms": round(ms, 4), "epilogue_ms": round(ms - gemm_ms, 4)}
    return out


def _codes(Q, x, sched, spec):
    """x's rowwise MXFP8 copy (codes, scales), which the probe then expands to the values the GEMM reads."""
    q = Q.quantize_rows(x, sched, EXPERTS, spec, rowwise=True)
    return q.data, q.scale


if __name__ == "__main__":
    run_and_save(run, __doc__.splitlines()[0], "probe_mx_dglu.json")
