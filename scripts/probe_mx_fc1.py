"""MXFP8's fused FC1 at DSv3 (32768 routed rows in 32 balanced experts, H 7168, F 2048, swiglu, bias, probs;
both operands BF16 values, as the values path reads them; h saved in BF16, ``a`` written rowwise as values
and columnwise as codes, as the fused path writes them) at a few configs of MXFP8's kernel
(``gemm.MXGemmConfig``: N tile, K step, stages), against its GEMM alone (plain, on the BF16 persistent
kernel since run 35) and the BF16 backend's FC1 (``grouped_gemm``, GEMM + GLU writing h and ``a`` in
BF16, persistent, 128 x 256 tiles), and that kernel with MXFP8's quantizing store of ``a``
(``gemm.FC1_VALUES_KERNEL = "bf16"``) at its config and a few others, its h and ``a`` compared bytewise
with MXFP8's kernel's. A measurement tool, not a test: configs that do not build or launch are recorded
with their error.

Why: since run 35 the unfused path's FC1 is a plain GEMM on the BF16 persistent kernel (~690 TFLOP/s),
while the fused FC1 (GEMM + GLU + quantize in one kernel) stays on MXFP8's kernel at 128 x (64 + 64)
tiles and BK = 128; a wider N tile at BK = 64 (``MXGemmConfig.block_k``) is what fits its shared memory.

  usage: python scripts/probe_mx_fc1.py [--out DIR]
"""

from __future__ import annotations

from dataclasses import replace

from mx_probe_problem import EXPERTS, FFN, HIDDEN, ROUTED, balanced_problem
from probe_results import run_and_save

# (N tile, K step, stages) of MXFP8's fused FC1; the first is the shipped config (run 36a, H100: 3.53 ms; BN 128 at
# BK 64 3.76-3.95, BN 64 at BK 64 5.0-5.1, BN 128 at BK 128 with 2 stages 3.85)
FC1_CONFIGS = [(64, None, 3)]
# the BF16 backend's kernel with MXFP8's store of a (gemm.fc1_values_config, then these changes of it)
# (run 36b, H100: 3 stages 3.024 ms, 4 stages 3.142, not flattened at 4 stages 3.108; 3 stages shipped since)
BF16_KERNEL_VARIANTS = {"shipped": {}, "4_stages": dict(num_stages=4), "not_flattened": dict(flatten=False)}


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
    shipped_values_config, shipped_kernel = gemm.fc1_values_config, gemm.FC1_VALUES_KERNEL
    fc1 = lambda q: gemm.launch("fc1", x, a_scale, w1, b_scale, FFN, sched, EXPERTS, spec, q=q, h=h, h_up_offset=FFN,
                                b_up_rows=FFN, bias=b1, bias_up_offset=FFN, probs=probs, activation="swiglu",
                                gated=True)
    try:
        gemm.FC1_VALUES_KERNEL = "bf16"
        for name, change in BF16_KERNEL_VARIANTS.items():
            gemm.fc1_values_config = lambda n, k, change=change: replace(shipped_values_config(n, k), **change)
            record(f"fc1_on_bf16_kernel_{name}", lambda: fc1(aq))
        gemm.fc1_values_config = shipped_values_config
        out["bytes_differing_from_mx_kernel"] = _compare_kernels(gemm, Q, fc1, h, x, spec)
        print("bytes differing", out["bytes_differing_from_mx_kernel"], flush=True)
    finally:
        gemm.fc1_values_config, gemm.FC1_VALUES_KERNEL = shipped_values_config, shipped_kernel
    record("plain_gemm_h_only", lambda: gemm.launch("fc2", x, a_scale, w1, b_scale, 2 * FFN, sched, EXPERTS, spec,
                                                    c=h))
    a_bf16 = torch.empty(ROUTED, FFN, device="cuda", dtype=torch.bfloat16)
    bf16_cfg = replace(grouped_gemm.default_config("fc1", FFN, HIDDEN), block_m=Q.TILE)
    record("bf16_backend_fc1_h_and_a", lambda: grouped_gemm.launch_scheduled(
        "fc1", x, w1, (w1.stride(0), w1.stride(2), w1.stride(1)), FFN, HIDDEN, a_bf16, sched, EXPERTS, bf16_cfg,
        b_up_rows=FFN, h=h, h_up_offset=FFN, bias=b1, bias_up_offset=FFN, probs=probs, activation="swiglu",
        gated=True))
    return out


def _compare_kernels(gemm, Q, fc1, h, x, spec) -> dict:
    """h and ``a``'s four buffers from the BF16 kernel route and from MXFP8's kernel: elements that differ."""
    import torch

    runs = {}
    for kernel in ("bf16", "mx"):
        gemm.FC1_VALUES_KERNEL = kernel
        aq = Q.new_rows(ROUTED, FFN, x, spec, EXPERTS, True, True, torch.zeros, row_values=True, col_values=False)
        h.fill_(float("nan"))
        fc1(aq)
        runs[kernel] = [h.clone().view(torch.int16), aq.data.view(torch.int16), aq.scale, aq.data_t.view(torch.uint8),
                        aq.scale_t]
    torch.cuda.synchronize()
    return {name: int((b != m).sum()) for name, b, m in zip(("h", "a_row", "a_row_scale", "a_col", "a_col_scale"),
                                                            runs["bf16"], runs["mx"])}


if __name__ == "__main__":
    run_and_save(run, __doc__.splitlines()[0], "probe_mx_fc1.json")
