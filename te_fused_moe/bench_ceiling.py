"""What the expert MLP's GEMMs would cost on cuBLAS FP8 with per-tensor scales, at their own shapes.

The recipe benchmark's "of FP8 peak" divides by cuBLAS at one square shape (8192^3); the MLP's GEMMs
have other shapes, and its wgrads are one short-K GEMM per expert (cuBLAS runs DSv3's at ~900 TFLOP/s
against ~1270 for its token GEMMs, run 31). Here each of the six GEMMs of one forward + backward is
timed on ``torch._scaled_mm`` (FP8 E4M3 operands, one scale per tensor, BF16 out) at the shape our
kernel computes:

- the token GEMMs (FC1, FC2, the dGLU's GEMM, FC1's dgrad) as one dense GEMM over all routed rows
  (grouping splits its M tiles at the experts' boundaries, which costs cuBLAS nothing here);
- the wgrads as one GEMM per expert, its K the expert's tokens (rounded up to 16, cuBLAS's FP8
  minimum), launched back to back.

No block scaling: that is the point. The sum over the six is the time an FP8 MLP whose GEMMs ran at
cuBLAS per-tensor speed would spend in GEMMs; with our other kernels (quantize passes, epilogues) added
it is what our fused path would take if block scaling cost its GEMMs nothing (:func:`mlp_model`).
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

# our per-kernel timing (bench_recipes.bench_kernels) that runs each GEMM without its epilogue
OUR_GEMM_KERNEL = {
    "fc1": "fc1_gemm_only",
    "fc2": "fc2",
    "dglu_gemm": "fc2_dgrad_gemm_only",
    "fc1_dgrad": "fc1_dgrad",
    "wgrad_w2": "wgrad_w2",
    "wgrad_w1": "wgrad_w1",
}
CUBLAS_FP8_K_MULTIPLE = 16


def gemm_shapes(counts: Sequence[int], hidden: int, ffn: int, n1: int) -> Dict[str, List[Tuple[int, int, int]]]:
    """The MLP's six GEMMs as lists of (M, N, K) that cuBLAS computes for them: one dense GEMM over
    the ``sum(counts)`` routed rows for each token GEMM, one per expert with tokens for each wgrad (K
    rounded up to :data:`CUBLAS_FP8_K_MULTIPLE`). ``n1``: w1's rows (2 * ``ffn`` for gated activations)."""
    counts = [int(c) for c in counts]
    if any(c < 0 for c in counts):
        raise ValueError(f"counts: expected tokens per expert >= 0, got {counts}")
    for name, size in (("hidden", hidden), ("ffn", ffn), ("n1", n1)):
        if size <= 0 or size % CUBLAS_FP8_K_MULTIPLE:
            raise ValueError(f"{name}: expected a positive multiple of {CUBLAS_FP8_K_MULTIPLE} "
                             f"(cuBLAS FP8's K), got {size}")
    routed = sum(counts)
    if routed == 0:
        raise ValueError("counts: no routed tokens, nothing to time")
    per_expert_k = [-(-c // CUBLAS_FP8_K_MULTIPLE) * CUBLAS_FP8_K_MULTIPLE for c in counts if c]
    return {
        "fc1": [(routed, n1, hidden)],              # h = x w1^T
        "fc2": [(routed, hidden, ffn)],             # y = a w2^T
        "dglu_gemm": [(routed, ffn, hidden)],       # da = dy w2
        "fc1_dgrad": [(routed, hidden, n1)],        # dx = dh w1
        "wgrad_w2": [(hidden, ffn, k) for k in per_expert_k],  # dw2[e] = dy_e^T a_e
        "wgrad_w1": [(n1, hidden, k) for k in per_expert_k],   # dw1[e] = dh_e^T x_e
    }


def gemm_flops(shapes: List[Tuple[int, int, int]]) -> float:
    return float(sum(2 * m * n * k for m, n, k in shapes))


def time_cublas_fp8(shapes: List[Tuple[int, int, int]], fast_accum: bool = False, device="cuda") -> float:
    """Milliseconds of ``shapes``' GEMMs back to back on ``torch._scaled_mm`` (E4M3, per-tensor scales,
    BF16 out), each on its own random operands and output, as each expert's wgrad reads its own tokens
    (shared ones would stay in L2 from one GEMM to the next). ``fast_accum``: cuBLAS accumulates in the
    tensor cores only, never promoting their partial sums to FP32 registers (less exact than any
    recipe here: the ceiling of the tensor cores alone)."""
    from .bench import do_bench_ms

    def views(sizes):
        """Consecutive [rows, cols] views of one flat random FP8 buffer."""
        flat = torch.randn(sum(r * c for r, c in sizes), device=device).to(torch.float8_e4m3fn)
        starts = [0]
        for r, c in sizes:
            starts.append(starts[-1] + r * c)
        return [flat[s:s + r * c].view(r, c) for s, (r, c) in zip(starts, sizes)]

    lhs = views([(m, k) for m, _, k in shapes])
    rhs = views([(n, k) for _, n, k in shapes])  # K-major [N, K]: cuBLAS's column-major B once transposed
    outs = [torch.empty(m, n, device=device, dtype=torch.bfloat16) for m, n, _ in shapes]
    one = torch.ones((), device=device)

    def run():
        for a, b, out in zip(lhs, rhs, outs):
            torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16, out=out,
                             use_fast_accum=fast_accum)

    return do_bench_ms(run)


def measure(counts: Sequence[int], hidden: int, ffn: int, n1: int,
            fast_accum: bool = False) -> Dict[str, Dict[str, float]]:
    """Each GEMM of :func:`gemm_shapes` on cuBLAS FP8 (:func:`time_cublas_fp8`): ms and TFLOP/s."""
    out = {}
    for name, shapes in gemm_shapes(counts, hidden, ffn, n1).items():
        ms = time_cublas_fp8(shapes, fast_accum)
        out[name] = {"ms": ms, "tflops": gemm_flops(shapes) / ms / 1e9, "gemms": len(shapes)}
        torch.cuda.empty_cache()
    return out


def mlp_model(cublas: Dict[str, Dict[str, float]], our_kernels: Dict[str, Dict[str, float]], fused_ms: float,
              baseline_ms: float) -> Dict[str, float]:
    """Splits our fused MLP's ``fused_ms`` into its GEMMs (our kernels of :data:`OUR_GEMM_KERNEL`, each
    timed alone) and the rest, and puts cuBLAS's GEMM times in the place of ours:

    - ``ours_gemm_ms`` / ``cublas_gemm_ms``: the six GEMMs, ours and cuBLAS's;
    - ``rest_ms``: ``fused_ms`` less our GEMMs (quantize passes, epilogues, whatever runs between);
    - ``with_cublas_gemms_ms``: ``rest_ms`` + cuBLAS's GEMMs, and its speedup over ``baseline_ms``;
    - ``gemms_only_speedup``: ``baseline_ms`` over cuBLAS's GEMMs alone (nothing else costing time);
    - ``fused_speedup``: ``baseline_ms`` over ``fused_ms``, as measured.
    """
    missing = [name for name, ours in OUR_GEMM_KERNEL.items() if "ms" not in our_kernels.get(ours, {})
               or "ms" not in cublas.get(name, {})]
    if missing:
        raise ValueError(f"our_kernels / cublas: no time for {missing} (a recipe whose kernel table times "
                         f"no GEMM without its epilogue cannot be modelled)")
    ours = sum(our_kernels[OUR_GEMM_KERNEL[name]]["ms"] for name in OUR_GEMM_KERNEL)
    theirs = sum(cublas[name]["ms"] for name in OUR_GEMM_KERNEL)
    rest = fused_ms - ours
    return {"ours_gemm_ms": ours, "cublas_gemm_ms": theirs, "rest_ms": rest,
            "with_cublas_gemms_ms": rest + theirs, "with_cublas_gemms_speedup": baseline_ms / (rest + theirs),
            "gemms_only_speedup": baseline_ms / theirs, "fused_speedup": baseline_ms / fused_ms}
