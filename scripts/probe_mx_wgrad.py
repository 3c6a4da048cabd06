"""MXFP8's two weight gradients at DSv3 as the values path runs them (both columnwise copies as BF16
values, ``[width, 128 * tiles]``, 32768 routed rows balanced over 32 experts: 1024 tokens each) on its
wgrad kernel at the shipped config and a variant, then with X (the copy kept for backward) read as the
FP8 codes it was saved as and expanded in the K loop (``autograd.X_CODES_IN_WGRAD``) at a few configs,
next to the expansion pass that this replaces, against the BF16 backend's wgrad (``wgrad.grouped_wgrad``)
on the same values token-major and ``torch._grouped_mm`` (cuBLAS) on them, and cuBLAS on the columnwise copies
as kept, each expert's K range its tile slots (``library_wgrad``, the default route since run 39; with and
without a copy into a given buffer). A measurement tool, not a
test: it prints ms, TFLOP/s and each output's largest difference from the shipped config's (the same
exact products summed in another order).

Why: the two wgrads take ~5.8 ms of the MXFP8 MLP's 18.5 (run 36c, ~500 TFLOP/s on an H100) in both
paths. At the shipped 128 tokens a step each program runs 8 steps, so the pipeline's fill and the tile's
store weigh on every program, with one 192 KB program per SM; 64 tokens a step at 3 stages is 96 KB, two
programs per SM, one's store under the other's loads.

  usage: python scripts/probe_mx_wgrad.py [--out DIR]
"""

from __future__ import annotations

from dataclasses import replace

from mx_probe_problem import EXPERTS, FFN, HIDDEN, ROUTED, balanced_problem
from probe_results import run_and_save

# name -> (N, K): dW [E, N, K] = G_e^T @ X_e with G [ROUTED, N], X [ROUTED, K]
SHAPES = {"dw1": (2 * FFN, HIDDEN), "dw2": (HIDDEN, FFN)}
# changes of the shipped BF16-valued config (128 x 128 tiles, 64 tokens a step since run 37a, 3 stages, 8 warps);
# run 37a timed 128 tokens, 4 stages, 4 warps, GROUP_N 16, 32 tokens and 2 stages
VARIANTS = {"group16": dict(group_n=16)}
# X (the copy kept for backward: x for dW1, a for dW2) as the FP8 codes it was saved as, expanded in the K loop
# (autograd.X_CODES_IN_WGRAD), against the shipped values path (its expansion pass + the wgrad): through shared
# memory or as the wgmma's A operand (MXWgradConfig.x_as_a), at a few token steps and stage counts
X_CODES_VARIANTS = {"x_codes": {}, "x_codes_as_a": dict(x_as_a=True), "x_codes_s4": dict(num_stages=4),
                    "x_codes_as_a_s4": dict(x_as_a=True, num_stages=4), "x_codes_t128": dict(block_t=128, num_stages=2),
                    "x_codes_as_a_t128": dict(x_as_a=True, block_t=128, num_stages=2),
                    "x_codes_t32_s4": dict(block_t=32, num_stages=4)}


def run() -> dict:
    import torch

    from te_fused_moe.backends.triton import library_wgrad, wgrad as bf16_wgrad
    from te_fused_moe.backends.triton.mxfp8 import quantize as Q, wgrad
    from te_fused_moe.bench import do_bench_ms

    counts, sched, spec, _, _, out = balanced_problem()
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    shipped = wgrad.default_config(True)
    for name, (n, k) in SHAPES.items():
        g_rows = torch.randn(ROUTED, n, device="cuda", dtype=torch.bfloat16)
        x_rows = torch.randn(ROUTED, k, device="cuda", dtype=torch.bfloat16)
        # the columnwise copies' layout: each 128-token tile in its slot, balanced experts fill theirs whole
        g = Q.MXRows(data_t=Q.new_transposed(n, ROUTED, EXPERTS, g_rows, torch.bfloat16, torch.zeros),
                     scale_t=Q.new_col_scales(n, ROUTED, EXPERTS, g_rows, torch.zeros))
        # X's columnwise copy as saved (FP8 codes) and as the values path reads it (expanded by a pass)
        x_codes = Q.quantize_rows(x_rows, sched, EXPERTS, spec, rowwise=False, colwise=True)
        expand_x = lambda: Q.expand_values(x_codes.data_t, x_codes.scale_t.t())
        x = Q.MXRows(data_t=expand_x(), scale_t=x_codes.scale_t)
        x_rows = x.data_t[:, :ROUTED].t().contiguous()  # the values, token-major, for the other kernels
        g.data_t[:, :ROUTED] = g_rows.t()
        flops = 2.0 * ROUTED * n * k
        entry = {}

        def record(label, fn, dw=None, ref=None):
            try:
                ms = do_bench_ms(fn)
                entry[label] = {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1)}
                if dw is not None and ref is not None:
                    entry[label]["max_diff_vs_shipped"] = float((dw.float() - ref.float()).abs().max())
            except Exception as e:  # a config that does not fit shared memory fails at its build or launch
                entry[label] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}

        ref = torch.empty(EXPERTS, n, k, device="cuda", dtype=torch.bfloat16)
        record("shipped", lambda: wgrad.mx_grouped_wgrad(g, x, sched, ref))
        for label, change in VARIANTS.items():
            dw = torch.full((EXPERTS, n, k), float("nan"), device="cuda", dtype=torch.bfloat16)
            cfg = replace(shipped, **change)
            record(label, lambda: wgrad.mx_grouped_wgrad(g, x, sched, dw, config=cfg), dw, ref)
        record("expand_x_pass", expand_x)
        for label, change in X_CODES_VARIANTS.items():
            dw = torch.full((EXPERTS, n, k), float("nan"), device="cuda", dtype=torch.bfloat16)
            cfg = replace(shipped, **change)
            record(label, lambda: wgrad.mx_grouped_wgrad(g, x_codes, sched, dw, config=cfg), dw, ref)
        dw = torch.empty(EXPERTS, n, k, device="cuda", dtype=torch.bfloat16)
        # (it reads only the experts' row ranges from the schedule, whatever its tile height)
        record("bf16_backend_wgrad", lambda: bf16_wgrad.grouped_wgrad(g_rows, x_rows, sched, dw), dw, ref)
        if hasattr(torch, "_grouped_mm"):
            record("cublas_grouped_mm", lambda: torch._grouped_mm(g_rows.t(), x_rows, offs=offsets))
            # on the columnwise copies as the values path keeps them: G^T row-major, X^T read column-major,
            # each expert's K range its tile slots (zeros past its tokens)
            # (library_wgrad.values_wgrad, the shipped route: its offsets from the schedule included)
            dw = torch.full((EXPERTS, n, k), float("nan"), device="cuda", dtype=torch.bfloat16)
            on_slots = lambda: library_wgrad.values_wgrad(g.data_t, x.data_t, sched, (EXPERTS, n, k))
            record("cublas_slots", lambda: dw.copy_(on_slots()), dw, ref)
            record("cublas_slots_no_copy", on_slots)
        out[name] = entry
        print(name, entry, flush=True)
    return out


if __name__ == "__main__":
    run_and_save(run, __doc__.splitlines()[0], "probe_mx_wgrad.json")
