"""MXFP8's fused FC1 at DSv3 (32768 routed rows in 32 balanced experts, H 7168, F 2048, swiglu, bias, probs;
both operands BF16 values, as the values path reads them; h saved in BF16, ``a`` written rowwise as values
and columnwise as codes, as the fused path writes them) at a few configs of MXFP8's kernel
(``gemm.MXGemmConfig``: N tile, K step, stages), against its GEMM alone (plain, on the BF16 persistent
kernel since run 35) and the BF16 backend's FC1 (``grouped_gemm``, GEMM + GLU writing h and ``a`` in
BF16, persistent, 128 x 256 tiles). A measurement tool, not a test: configs that do not build or launch
are recorded with their error.

Why: since run 35 the unfused path's FC1 is a plain GEMM on the BF16 persistent kernel (~690 TFLOP/s),
while the fused FC1 (GEMM + GLU + quantize in one kernel) stays on MXFP8's kernel at 128 x (64 + 64)
tiles and BK = 128; a wider N tile at BK = 64 (``MXGemmConfig.block_k``) is what fits its shared memory.

  usage: python scripts/probe_mx_fc1.py [--out DIR]
"""

from __future__ import annotations

from dataclasses import replace

from mx_probe_problem import EXPERTS, FFN, HIDDEN, ROUTED, balanced_problem
from probe_results import run_and_save

# (N tile, K step, stages) of MXFP8's fused FC1; the first is the shipped config
FC1_CONFIGS = [(64, None, 3), (128, 64, 3), (128, 64, 4), (64, 64, 4), (64, 64, 6), (128, None, 2)]


def run() -> dict:
    import torch

    from te_fused_moe.backends.triton import grouped_gemm
    from te_fused_moe.backends.triton.mxfp8 import gemm, quantize as Q
    from te_fused_moe.bench import do_bench_ms

    _, sched, spec, a_scale, b_scale, out = balanced_problem()
    x = torch.randn(ROUTED, HIDDEN, device="cuda", dtype=torch.bfloat16)
    w1 = torch.randn(EXPERTS, 2 * FFN, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
    b1 = torch.randn(EXPERTS, 2 * FFN, device="cuda", dtype=torch.bfloat16) * 0.1
    probs = torch.rand(ROUTED, device="cuda")
    h = torch.empty(ROUTED, 2 * FFN, device="cuda", dtype=torch.bfloat16)
    flops = 2.0 * ROUTED * HIDDEN * 2 * FFN

    def record(label, fn):
        try:
            ms = do_bench_ms(fn)
            out[label] = {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1)}
        except Exception as e:  # a config that does not fit shared memory fails at its build or launch
            out[label] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(label, out[label], flush=True)

    shipped = gemm.default_config("fc1", True)
    for block_n, block_k, stages in FC1_CONFIGS:
        cfg = replace(shipped, block_n=block_n, block_k=block_k, num_stages=stages)
        aq = Q.new_rows(ROUTED, FFN, x, spec, EXPERTS, True, True, row_values=True, col_values=False)
        record(f"mx_fc1_bn{block_n}_bk{block_k or gemm.EXPAND_BLOCK_K}_s{stages}",
               lambda: gemm.launch("fc1", x, a_scale, w1, b_scale, FFN, sched, EXPERTS, spec, q=aq, h=h,
                                   h_up_offset=FFN, b_up_rows=FFN, bias=b1, bias_up_offset=FFN, probs=probs,
                                   activation="swiglu", gated=True, config=cfg))
    record("plain_gemm_h_only", lambda: gemm.launch("fc2", x, a_scale, w1, b_scale, 2 * FFN, sched, EXPERTS, spec,
                                                    c=h))
    a_bf16 = torch.empty(ROUTED, FFN, device="cuda", dtype=torch.bfloat16)
    bf16_cfg = replace(grouped_gemm.default_config("fc1", FFN, HIDDEN), block_m=Q.TILE)
    record("bf16_backend_fc1_h_and_a", lambda: grouped_gemm.launch_scheduled(
        "fc1", x, w1, (w1.stride(0), w1.stride(2), w1.stride(1)), FFN, HIDDEN, a_bf16, sched, EXPERTS, bf16_cfg,
        b_up_rows=FFN, h=h, h_up_offset=FFN, bias=b1, bias_up_offset=FFN, probs=probs, activation="swiglu",
        gated=True))
    return out


if __name__ == "__main__":
    run_and_save(run, __doc__.splitlines()[0], "probe_mx_fc1.json")
