"""Benchmark hooks of the MXFP8 recipe (``MXFP8BlockScaling``, E4M3) on the Triton backend.

- :func:`mxfp8_fused`: ``fused_moe_mlp(recipe=MXFP8BlockScaling(), backend="triton")``;
- :func:`mxfp8_unfused`: the same recipe without fusion: separate MXFP8 quantize kernels, our MXFP8
  grouped GEMMs with plain BF16 outputs (no epilogue), the activation and its backward as PyTorch
  ops (``a`` and ``dh`` rounded to BF16 before their quantize kernel, which moves a few FP8 codes);
- :func:`mxfp8_kernels`: each kernel of the fused path alone (ms, TFLOP/s or GB/s).

Both MLP functions take ``(x, counts, w1, w2, activation)`` (every row routed, no bias/probs) and
return ``y`` with autograd, like ``bench_recipes``' FP8-block implementations.
"""

from __future__ import annotations

from typing import Dict

import torch

from .activations import ActivationConfig
from .recipes import MXFP8BlockScaling


def mxfp8_fused(x, counts, w1, w2, activation):
    from .ops import fused_moe_mlp

    return fused_moe_mlp(x, counts, w1, w2, activation=activation, recipe=MXFP8BlockScaling(), backend="triton")


class MXFP8Unfused(torch.autograd.Function):
    """MXFP8 without fusion: quantize kernels + plain MXFP8 GEMMs + PyTorch activation."""

    @staticmethod
    def forward(ctx, x, counts, w1, w2, activation):
        from .backends.triton.mxfp8 import gemm
        from .backends.triton.mxfp8.quantize import TILE, WEIGHT_CACHE, MXSpec, quantize_rows
        from .backends.triton.schedule import build_schedule

        spec = MXSpec()
        act = ActivationConfig(activation)
        T, H = x.shape
        E, n1, _ = w1.shape
        sched = build_schedule(counts, T, TILE)
        w1q, w2q = WEIGHT_CACHE.get(w1, spec), WEIGHT_CACHE.get(w2, spec)
        xq = quantize_rows(x, sched, E, spec, rowwise=True, colwise=True)
        h = torch.empty(T, n1, device=x.device, dtype=x.dtype)
        gemm.launch("fc2", xq.data, xq.scale, w1q.data, w1q.scale, n1, sched, E, spec, c=h)
        a = act.forward(h.float()).to(x.dtype)
        aq = quantize_rows(a, sched, E, spec, rowwise=True, colwise=True)
        y = torch.empty(T, H, device=x.device, dtype=x.dtype)
        gemm.launch("fc2", aq.data, aq.scale, w2q.data, w2q.scale, H, sched, E, spec, c=y)
        ctx.save_for_backward(h, w1, w2)
        ctx.state = (sched, w1q, w2q, xq, aq, act, spec)
        return y

    @staticmethod
    def backward(ctx, dy):
        from .backends.triton.mxfp8 import gemm
        from .backends.triton.mxfp8.quantize import quantize_rows
        from .backends.triton.mxfp8.wgrad import mx_grouped_wgrad

        h, w1, w2 = ctx.saved_tensors
        sched, w1q, w2q, xq, aq, act, spec = ctx.state
        dy = dy.contiguous()
        T, H = dy.shape
        E, n1, _ = w1.shape
        F = w2.shape[2]
        dyq = quantize_rows(dy, sched, E, spec, rowwise=True, colwise=True)
        da = torch.empty(T, F, device=dy.device, dtype=dy.dtype)
        gemm.launch("dgrad", dyq.data, dyq.scale, w2q.data_t, w2q.scale_t, F, sched, E, spec, c=da)
        dh = act.backward(h.float(), da.float()).to(dy.dtype)
        dhq = quantize_rows(dh, sched, E, spec, rowwise=True, colwise=True)
        dx = torch.empty(T, H, device=dy.device, dtype=dy.dtype)
        gemm.launch("dgrad", dhq.data, dhq.scale, w1q.data_t, w1q.scale_t, H, sched, E, spec, c=dx)
        dw1, dw2 = torch.empty_like(w1), torch.empty_like(w2)
        mx_grouped_wgrad(dyq, aq, sched, dw2)
        mx_grouped_wgrad(dhq, xq, sched, dw1)
        return dx, None, dw1, dw2, None


def mxfp8_unfused(x, counts, w1, w2, activation):
    return MXFP8Unfused.apply(x, counts, w1, w2, activation)


def mxfp8_kernels(shape, inputs, gemm_config=None, epilogue_config=None, wgrad_config=None,
                  only_gemms: bool = False) -> Dict[str, Dict[str, float]]:
    """Each kernel of the fused MXFP8 path alone on ``inputs`` (``bench.make_inputs(shape)``): ms, and
    TFLOP/s (GEMMs, over routed tokens) or GB/s (quantize: bytes read + written). Optional block
    configs: ``gemm_config`` (FC2, FC1 dgrad), ``epilogue_config`` (FC1, dGLU), ``wgrad_config``."""
    from . import bench
    from .backends.triton.mxfp8 import gemm
    from .backends.triton.mxfp8.quantize import new_rows
    from .backends.triton.mxfp8.quantize import TILE, MXSpec, quantize_rows, quantize_weight
    from .backends.triton.mxfp8.wgrad import mx_grouped_wgrad
    from .backends.triton.schedule import build_schedule

    act = ActivationConfig(shape.activation)
    x, w1, w2, counts, dy = (inputs[k] for k in ("x", "w1", "w2", "counts", "dy"))
    T, H, F, E, n1 = x.shape[0], shape.hidden, shape.ffn, shape.experts, w1.shape[1]
    routed = int(counts.sum())
    spec = MXSpec()
    kw = dict(activation=act.name, alpha=act.alpha, limit=act.limit, gated=act.gated)
    sched = build_schedule(counts, T, TILE)
    w1q, w2q = quantize_weight(w1, spec), quantize_weight(w2, spec)
    xq = quantize_rows(x, sched, E, spec, rowwise=True, colwise=True)
    dyq = quantize_rows(dy, sched, E, spec, rowwise=True, colwise=True)
    h = torch.empty(T, n1, device=x.device, dtype=x.dtype)
    aq = new_rows(T, F, x, spec, E, True, True, alloc=torch.empty)
    dhq = new_rows(T, n1, x, spec, E, True, True, alloc=torch.empty)
    y, dx = torch.empty_like(x), torch.empty_like(x)
    dw1, dw2 = torch.empty_like(w1), torch.empty_like(w2)
    dprob = torch.empty(F // (epilogue_config or gemm.default_config("dact")).block_n, T, device=x.device,
                        dtype=torch.float32)
    probs = torch.rand(T, device=x.device) + 0.05
    gemm.launch("fc1", xq.data, xq.scale, w1q.data, w1q.scale, F, sched, E, spec, q=aq, h=h, h_up_offset=F,
                b_up_rows=F, **kw)
    # bytes: bf16 in, fp8 rowwise + columnwise out (+ scales, 1/32 each)
    q_bytes = lambda n: n * (2.0 + 2 * (1 + 1 / 32))
    kernels = {
        "quantize_x_row_col": (lambda: quantize_rows(x, sched, E, spec, rowwise=True, colwise=True), None,
                               q_bytes(T * H)),
        "quantize_weights": (lambda: (quantize_weight(w1, spec), quantize_weight(w2, spec)), None,
                             q_bytes(w1.numel() + w2.numel())),
        "fc1_glu_quant": (lambda: gemm.launch("fc1", xq.data, xq.scale, w1q.data, w1q.scale, F, sched, E, spec, q=aq,
                                              h=h, h_up_offset=F, b_up_rows=F, config=epilogue_config, **kw),
                          2.0 * routed * H * n1, None),
        "fc2": (lambda: gemm.launch("fc2", aq.data, aq.scale, w2q.data, w2q.scale, H, sched, E, spec, c=y,
                                    config=gemm_config),
                2.0 * routed * F * H, None),
        "quantize_dy_row_col": (lambda: quantize_rows(dy, sched, E, spec, rowwise=True, colwise=True), None,
                                q_bytes(T * H)),
        "fc2_dgrad_dglu_quant": (lambda: gemm.launch("dact", dyq.data, dyq.scale, w2q.data_t, w2q.scale_t, F, sched,
                                                     E, spec, q=dhq, q_up_offset=F, h=h, h_up_offset=F, probs=probs,
                                                     dprob=dprob, config=epilogue_config, **kw),
                                 2.0 * routed * H * F, None),
        "fc1_dgrad": (lambda: gemm.launch("dgrad", dhq.data, dhq.scale, w1q.data_t, w1q.scale_t, H, sched, E, spec,
                                          c=dx, config=gemm_config), 2.0 * routed * n1 * H, None),
        "wgrad_w2": (lambda: mx_grouped_wgrad(dyq, aq, sched, dw2, config=wgrad_config), 2.0 * routed * H * F, None),
        "wgrad_w1": (lambda: mx_grouped_wgrad(dhq, xq, sched, dw1, config=wgrad_config), 2.0 * routed * n1 * H,
                     None),
    }
    if only_gemms:
        kernels = {k: v for k, v in kernels.items() if v[1]}
    out = {}
    for name, (fn, flops, nbytes) in kernels.items():
        try:
            fn()
            ms = bench.do_bench_ms(fn)
            entry = {"ms": ms}
            if flops:
                entry["tflops"] = flops / ms / 1e9
            if nbytes:
                entry["gbps"] = nbytes / ms / 1e6
            out[name] = entry
        except Exception as exc:  # recorded: the other kernels still run
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def mxfp8_variants(shape_name: str = "dsv3-e32") -> Dict[str, Dict]:
    """Per-kernel ms of the MXFP8 GEMMs under a few block configs (the defaults were chosen from an
    offline sm_90a build's register counts, not from timings): pick the fastest per kernel."""
    from . import bench
    from .backends.triton.mxfp8.gemm import MXGemmConfig as G
    from .backends.triton.mxfp8.wgrad import MXWgradConfig as W

    shape = bench.SHAPES[shape_name]
    inputs = bench.make_inputs(shape)
    variants = {
        "default": {},
        "plain_128x128_w8": dict(gemm_config=G(block_n=128, num_warps=8, num_stages=4)),
        "plain_128x64_w4_s6": dict(gemm_config=G(block_n=64, num_warps=4, num_stages=6)),
        "epi_128x128_w8_split": dict(epilogue_config=G(block_n=128, num_warps=8, num_stages=3)),
        "wgrad_128x128_w8": dict(wgrad_config=W(block_n=128, block_k=128, num_warps=8, num_stages=4)),
        "wgrad_64x64_w4": dict(wgrad_config=W(block_n=64, block_k=64, num_warps=4, num_stages=4)),
        "wgrad_128x64_w4": dict(wgrad_config=W(block_n=128, block_k=64, num_warps=4, num_stages=3)),
    }
    return {name: mxfp8_kernels(shape, inputs, only_gemms=True, **cfg) for name, cfg in variants.items()}


def main(argv=None) -> int:
    """``python -m te_fused_moe.bench_mxfp8 [--variants] [shape ...]``: fwd / bwd / fwd+bwd ms of
    bf16_unfused, mxfp8_unfused and mxfp8_fused (ratios to bf16_unfused), then each fused kernel alone;
    with ``--variants`` the GEMM kernels under other block configs instead. JSON lines on stdout."""
    import json
    import sys

    from . import bench

    args = list(argv if argv is not None else sys.argv[1:])
    if "--variants" in args:  # per-kernel block-config comparison instead of the MLP timings
        args.remove("--variants")
        for name in args or ["dsv3-e32"]:
            print(json.dumps({name: mxfp8_variants(name)}), flush=True)
        return 0
    names = args or ["dsv3-e32"]
    peak = bench.measure_ceilings()["bf16_gemm_tflops"]
    impls = {"bf16_unfused": bench.unfused_mlp, "mxfp8_unfused": mxfp8_unfused, "mxfp8_fused": mxfp8_fused}
    report = {}
    for name in names:
        shape = bench.SHAPES[name]
        inputs = bench.make_inputs(shape)
        entry = {}
        for impl, fn in impls.items():
            try:
                entry[impl] = bench.bench_implementation(impl, shape, inputs, peak, fn=fn)
            except Exception as exc:  # recorded, not fatal
                entry[impl] = {"error": f"{type(exc).__name__}: {exc}"}
        base = entry["bf16_unfused"].get("fwd_bwd_ms")
        entry["fwd_bwd_speedup_vs_bf16_unfused"] = {
            impl: base / entry[impl]["fwd_bwd_ms"] for impl in impls if base and "fwd_bwd_ms" in entry[impl]}
        entry["kernels"] = mxfp8_kernels(shape, inputs)
        report[name] = entry
        print(json.dumps({name: entry}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
