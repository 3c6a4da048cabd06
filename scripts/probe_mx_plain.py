"""MXFP8's plain GEMMs at DSv3 as the values path runs them (both operands BF16 values: FC2 forward,
FC1 dgrad, the separate dGLU's GEMM), each on MXFP8's kernel (``mxfp8.gemm``, one program per tile,
BK = 128) and on the BF16 path's persistent grouped GEMM (``grouped_gemm.launch``, the BF16 fused
backend's kernel) at its default config and two neighbours, against ``torch._grouped_mm`` (cuBLAS) on
the same operands. A measurement tool, not a test: it prints ms, TFLOP/s and the largest difference
of each output from MXFP8's kernel (the same exact products summed in another order).

Why: with the values path (``mxfp8.autograd.QUANTIZE_TO_VALUES``) these GEMMs are plain BF16 GEMMs; run
34a timed them at 540-570 TFLOP/s against cuBLAS BF16's ~740. They are ~6.9 of the MXFP8 MLP's 20.8 ms
and run in its unfused path too, so a faster kernel moves both paths (and the ratio, the fused one
being the shorter).

  usage: python scripts/probe_mx_plain.py [--out DIR]
"""

from __future__ import annotations

from dataclasses import replace

from mx_probe_problem import EXPERTS, FFN, HIDDEN, ROUTED, balanced_problem
from probe_results import run_and_save

# name -> (K, N): a [ROUTED, K] times each expert's B [N, K]^T
SHAPES = {"fc2": (FFN, HIDDEN), "fc1_dgrad": (2 * FFN, HIDDEN), "dglu_gemm": (HIDDEN, FFN)}
# the BF16 kernel's configs tried besides its default for the GEMM's kind (fc2 / dgrad)
BF16_VARIANTS = {"bn128_s4": dict(block_n=128, num_stages=4), "bn256_s3": dict(block_n=256, num_stages=3),
                 "bn256_s4": dict(block_n=256, num_stages=4)}


def run() -> dict:
    import torch

    from te_fused_moe.backends.triton import grouped_gemm
    from te_fused_moe.backends.triton.mxfp8 import gemm
    from te_fused_moe.bench import do_bench_ms

    counts, sched, spec, a_scale, b_scale, out = balanced_problem()
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    for name, (k, n) in SHAPES.items():
        a = torch.randn(ROUTED, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(EXPERTS, n, k, device="cuda", dtype=torch.bfloat16) * 0.05
        flops = 2.0 * ROUTED * k * n
        entry = {}

        def record(label, fn):
            ms = do_bench_ms(fn)
            entry[label] = {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1)}

        c_mx = torch.full((ROUTED, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        record("mx_kernel", lambda: gemm.launch("fc2", a, a_scale, b, b_scale, n, sched, EXPERTS, spec, c=c_mx))
        kind = "dgrad" if name == "fc1_dgrad" else "fc2"
        default = grouped_gemm.default_config(kind, n, k)
        for label, cfg in [("bf16_kernel_default", default)] + [
                (f"bf16_kernel_{v}", replace(default, **kw)) for v, kw in BF16_VARIANTS.items()]:
            c = torch.full((ROUTED, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            record(label, lambda: grouped_gemm.launch(kind, a, b, (b.stride(0), b.stride(2), b.stride(1)), n, k, c,
                                                      counts, config=cfg, schedules={cfg.block_m: sched}))
            entry[label]["max_diff_vs_mx"] = float((c.float() - c_mx.float()).abs().max())
            entry[label]["config"] = f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} s{cfg.num_stages} w{cfg.num_warps}"
        if hasattr(torch, "_grouped_mm"):
            bt = b.transpose(1, 2)
            record("cublas_grouped_mm", lambda: torch._grouped_mm(a, bt, offs=offsets))
        out[name] = entry
        print(name, entry, flush=True)
    return out


if __name__ == "__main__":
    run_and_save(run, __doc__.splitlines()[0], "probe_mx_plain.json")
