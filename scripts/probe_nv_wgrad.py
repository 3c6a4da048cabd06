"""NVFP4's two weight gradients at DSv3 as its default path runs them (both columnwise copies, Hadamard-transformed
and quantized, then expanded to BF16 values; 32768 routed rows balanced over 32 experts: 1024 tokens each) on its
wgrad kernel at a slot (128 tokens, two dots) per step (the default before run 42) and at half a slot per step
(``wgrad.VALUES_HALF_SLOT``, the default since run 42, with 16-tile column groups) with a few variants, next to the K
loop expanding the packed codes and cuBLAS's grouped GEMM on the same values (``library_wgrad.values_wgrad``, BF16
out: the GEMM of ``autograd.VALUES_WGRAD_KERNEL = "cublas"``, whose x values carry the tensor scales).
A measurement tool, not a test: it prints ms, TFLOP/s (median over interleaved rounds: the GPU runs at its power
cap) and each output's largest difference from the slot-per-step config's (the same dots in the same order: 0).

Why: the two wgrads take 5.8 ms of NVFP4's 26.3 (run 41h, ~500 TFLOP/s), with one 192 KB program per SM at a
slot per step: each program runs 8 steps, so the pipeline's fill and the tile's store weigh on every one. Half a
slot per stage is 96 KB, two programs per SM (MXFP8's values wgrad, run 37a: dW1 3.85 -> 3.51 ms).

  usage: python scripts/probe_nv_wgrad.py [--out DIR]
"""

from __future__ import annotations

from dataclasses import replace

from mx_probe_problem import EXPERTS, FFN, HIDDEN, ROUTED
from probe_results import run_and_save, timed_in_rounds

# name -> (N, K): dW [E, N, K] = G_e^T @ X_e with G [ROUTED, N], X [ROUTED, K]
SHAPES = {"dw1": (2 * FFN, HIDDEN), "dw2": (HIDDEN, FFN)}
# changes of the half-slot config (the values default, 128 x 128 tiles at 8 warps and 3 stages, at 64 tokens a step)
HALF_VARIANTS = {"half_s4": dict(num_stages=4), "half_group8": dict(group_n=8), "half_4w": dict(num_warps=4),
                 "half_64x128_4w": dict(block_n=64, num_warps=4)}
ROUNDS = 3


def run() -> dict:
    import torch

    from te_fused_moe.backends.triton import library_wgrad
    from te_fused_moe.backends.triton.nvfp4 import autograd as A, quantize as Q, wgrad as W
    from te_fused_moe.backends.triton.schedule import build_schedule
    from te_fused_moe.bench_recipes import _call_under
    from te_fused_moe.recipes import NVFP4BlockScaling

    torch.manual_seed(0)
    counts = torch.full((EXPERTS,), ROUTED // EXPERTS, dtype=torch.int32, device="cuda")
    sched = build_schedule(counts, ROUTED, Q.TILE)
    spec, grad_spec, _ = A.specs_of(NVFP4BlockScaling())
    out = {"shape": [ROUTED, HIDDEN, FFN, EXPERTS], "torch": torch.__version__,
           "device": torch.cuda.get_device_name(), "rounds": ROUNDS}
    half = replace(W.default_config(True), block_t=W.HALF_SLOT)
    slot = _call_under(W.__name__, dict(VALUES_HALF_SLOT=False), lambda: W.default_config(True))
    for name, (n, k) in SHAPES.items():
        g_rows = torch.randn(ROUTED, n, device="cuda", dtype=torch.bfloat16)
        x_rows = torch.randn(ROUTED, k, device="cuda", dtype=torch.bfloat16)
        gq = Q.quantize_rows(g_rows, sched, EXPERTS, grad_spec, rowwise=False, colwise=True)
        xq = Q.quantize_rows(x_rows, sched, EXPERTS, spec, rowwise=False, colwise=True)
        gv, xv = Q.with_values(gq, colwise=True), Q.with_values(xq, colwise=True)
        flops = 2.0 * ROUTED * n * k
        ref = torch.empty(EXPERTS, n, k, device="cuda", dtype=torch.bfloat16)
        W.nv_grouped_wgrad(gv, xv, sched, ref, config=slot)
        calls = {"slot": (gv, xv, slot), "half": (gv, xv, half)}
        calls.update({label: (gv, xv, replace(half, **change)) for label, change in HALF_VARIANTS.items()})
        calls["packed_codes"] = (gq, xq, W.default_config(False))
        fns, outputs = {}, {}
        for label, (g, x, cfg) in calls.items():
            outputs[label] = torch.full((EXPERTS, n, k), float("nan"), device="cuda", dtype=torch.bfloat16)
            fns[label] = lambda g=g, x=x, cfg=cfg, dw=outputs[label]: W.nv_grouped_wgrad(g, x, sched, dw, config=cfg)
        fns["cublas_values"] = lambda: library_wgrad.values_wgrad(gv.values_t, xv.values_t, sched, (EXPERTS, n, k))
        entry = timed_in_rounds(fns, ROUNDS)
        for label, timing in entry.items():
            if "ms" in timing:
                timing["tflops"] = round(flops / timing["ms"] / 1e9, 1)
            if label in outputs and "error" not in timing:
                timing["max_diff_vs_slot"] = float((outputs[label].float() - ref.float()).abs().max())
        out[name] = entry
        print(name, entry, flush=True)
    return out


if __name__ == "__main__":
    run_and_save(run, __doc__.splitlines()[0], "probe_nv_wgrad.json")
