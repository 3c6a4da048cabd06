"""The NVFP4 recipe's side of :mod:`te_fused_moe.bench_recipes`: its unfused path (same quantize and
GEMM kernels, no epilogue: activation and its backward as PyTorch ops between them) and the timing
of each kernel of its fused path alone."""

from __future__ import annotations

import dataclasses
from typing import Dict

import torch

from . import bench
from .activations import ActivationConfig
from .recipes import NVFP4BlockScaling


def _kernels():
    from .backends.triton.nvfp4 import autograd, gemm, quantize, wgrad

    return autograd, gemm, quantize, wgrad


class NVFP4Unfused(torch.autograd.Function):
    """NVFP4 without fusion: amax + quantize kernels, plain grouped GEMMs (BF16 out), PyTorch activation.
    ``a`` and ``dh`` go through BF16 before their quantize pass, as separate kernels would pass them."""

    @staticmethod
    def forward(ctx, x, counts, w1, w2, activation):
        from .backends.triton.schedule import build_schedule

        autograd, gemm, quantize, _ = _kernels()
        spec, grad_spec, weight_spec = autograd.specs_of(NVFP4BlockScaling())
        act = ActivationConfig(activation)
        T, H = x.shape
        E, n1, _ = w1.shape
        sched = build_schedule(counts, T, quantize.TILE)
        w1q, w2q = quantize.WEIGHT_CACHE.get(w1, weight_spec), quantize.WEIGHT_CACHE.get(w2, weight_spec)
        xq = quantize.quantize_rows(x, sched, E, spec, rowwise=True, colwise=True)
        h = torch.empty(T, n1, device=x.device, dtype=x.dtype)
        gemm.launch("fc2", xq, w1q, n1, sched, E, c=h)
        a = act.forward(h.float()).to(x.dtype)
        aq = quantize.quantize_rows(a, sched, E, spec, rowwise=True, colwise=True)
        y = torch.empty(T, H, device=x.device, dtype=x.dtype)
        gemm.launch("fc2", aq, w2q, H, sched, E, c=y)
        ctx.save_for_backward(h, w1, w2)
        ctx.state = (sched, w1q, w2q, xq, aq, act, grad_spec)
        return y

    @staticmethod
    def backward(ctx, dy):
        _, gemm, quantize, wgrad = _kernels()
        h, w1, w2 = ctx.saved_tensors
        sched, w1q, w2q, xq, aq, act, spec = ctx.state
        dy = dy.contiguous()
        T, H = dy.shape
        E, F = w1.shape[0], w2.shape[2]
        dyq = quantize.quantize_rows(dy, sched, E, spec, rowwise=True, colwise=True)
        da = torch.empty(T, F, device=dy.device, dtype=dy.dtype)
        gemm.launch("dgrad", dyq, w2q, F, sched, E, b_transposed=True, c=da)
        dh = act.backward(h.float(), da.float()).to(dy.dtype)
        dhq = quantize.quantize_rows(dh, sched, E, spec, rowwise=True, colwise=True)
        dx = torch.empty(T, H, device=dy.device, dtype=dy.dtype)
        gemm.launch("dgrad", dhq, w1q, H, sched, E, b_transposed=True, c=dx)
        dw1, dw2 = torch.empty_like(w1), torch.empty_like(w2)
        wgrad.nv_grouped_wgrad(dyq, aq, sched, dw2)
        wgrad.nv_grouped_wgrad(dhq, xq, sched, dw1)
        return dx, None, dw1, dw2, None


def unfused(x, counts, w1, w2, activation):
    return NVFP4Unfused.apply(x, counts, w1, w2, activation)


def fused_bf16_weights(x, counts, w1, w2, activation):
    """The fused path with the weight cache holding BF16 expansions (``autograd.BF16_WEIGHT_VALUES``)."""
    from .ops import fused_moe_mlp

    autograd = _kernels()[0]
    default, autograd.BF16_WEIGHT_VALUES = autograd.BF16_WEIGHT_VALUES, True
    try:
        return fused_moe_mlp(x, counts, w1, w2, activation=activation, recipe=NVFP4BlockScaling(), backend="triton")
    finally:
        autograd.BF16_WEIGHT_VALUES = default


def bench_kernels(shape: bench.Shape, inputs, fp8_peak: float) -> Dict[str, Dict[str, float]]:
    """Each kernel of the fused NVFP4 path alone: ms, TFLOP/s (GEMMs, and their share of the FP8
    peak) or GB/s (quantize: the input read once by the amax pass and once by the quantize pass)."""
    import triton

    from .backends.triton.schedule import build_schedule

    autograd, gemm, quantize, wgrad = _kernels()
    spec, grad_spec, weight_spec = autograd.specs_of(NVFP4BlockScaling())
    act = ActivationConfig(shape.activation)
    x, w1, w2, counts, dy = (inputs[name] for name in ("x", "w1", "w2", "counts", "dy"))
    T, H, F, E, n1 = x.shape[0], shape.hidden, shape.ffn, shape.experts, w1.shape[1]
    routed = int(counts.sum())
    kw = dict(activation=act.name, alpha=act.alpha, limit=act.limit, gated=act.gated)
    sched = build_schedule(counts, T, quantize.TILE)
    rows = lambda t, s: quantize.quantize_rows(t, sched, E, s, rowwise=True, colwise=True)
    w1q, w2q = quantize.quantize_weight(w1, weight_spec), quantize.quantize_weight(w2, weight_spec)
    xq, dyq = rows(x, spec), rows(dy, grad_spec)
    h = torch.empty(T, n1, device=x.device, dtype=x.dtype)
    a = torch.empty(T, F, device=x.device, dtype=torch.float32)
    dh = torch.empty(T, n1, device=x.device, dtype=torch.float32)
    y, dx = torch.empty_like(x), torch.empty_like(x)
    dw1, dw2 = torch.empty_like(w1), torch.empty_like(w2)
    probs = torch.rand(T, device=x.device) + 0.05
    dprob = torch.empty(triton.cdiv(F, gemm.default_config("dact").block_n), T, device=x.device, dtype=torch.float32)
    gemm.launch("fc1", xq, w1q, F, sched, E, c=a, h=h, h_up_offset=F, b_up_rows=F, **kw)
    aq = rows(a, spec)
    gemm.launch("dact", dyq, w2q, F, sched, E, b_transposed=True, c=dh, c_up_offset=F, h=h, h_up_offset=F,
                probs=probs, dprob=dprob, **kw)
    dhq = rows(dh, grad_spec)
    kernels = {
        "quantize_x_row_col": (lambda: rows(x, spec), None, 2 * T * H * 2.0),
        "quantize_weights": (lambda: (quantize.quantize_weight(w1, weight_spec),
                                      quantize.quantize_weight(w2, weight_spec)), None,
                             2 * (w1.numel() + w2.numel()) * 2.0),
        "fc1_glu": (lambda: gemm.launch("fc1", xq, w1q, F, sched, E, c=a, h=h, h_up_offset=F, b_up_rows=F, **kw),
                    2.0 * routed * H * n1, None),
        "quantize_a_row_col": (lambda: rows(a, spec), None, 2 * T * F * 4.0),
        "fc2": (lambda: gemm.launch("fc2", aq, w2q, H, sched, E, c=y), 2.0 * routed * F * H, None),
        "quantize_dy_row_col_sr": (lambda: rows(dy, grad_spec), None, 2 * T * H * 2.0),
        "fc2_dgrad_dglu": (lambda: gemm.launch("dact", dyq, w2q, F, sched, E, b_transposed=True, c=dh,
                                               c_up_offset=F, h=h, h_up_offset=F, probs=probs, dprob=dprob, **kw),
                           2.0 * routed * H * F, None),
        "quantize_dh_row_col_sr": (lambda: rows(dh, grad_spec), None, 2 * T * n1 * 4.0),
        "fc1_dgrad": (lambda: gemm.launch("dgrad", dhq, w1q, H, sched, E, b_transposed=True, c=dx),
                      2.0 * routed * n1 * H, None),
        "wgrad_w2": (lambda: wgrad.nv_grouped_wgrad(dyq, aq, sched, dw2), 2.0 * routed * H * F, None),
        "wgrad_w1": (lambda: wgrad.nv_grouped_wgrad(dhq, xq, sched, dw1), 2.0 * routed * n1 * H, None),
    }
    # the same GEMMs reading the weights as exact BF16 expansions (NVSpec.bf16_values) instead of codes
    w_bf16 = dataclasses.replace(weight_spec, bf16_values=True)
    w1v, w2v = quantize.quantize_weight(w1, w_bf16), quantize.quantize_weight(w2, w_bf16)
    kernels.update({
        "quantize_weights_bf16_values": (lambda: (quantize.quantize_weight(w1, w_bf16),
                                                  quantize.quantize_weight(w2, w_bf16)), None,
                                         2 * (w1.numel() + w2.numel()) * 2.0),
        "fc1_glu_bf16w": (lambda: gemm.launch("fc1", xq, w1v, F, sched, E, c=a, h=h, h_up_offset=F, b_up_rows=F, **kw),
                          2.0 * routed * H * n1, None),
        "fc2_bf16w": (lambda: gemm.launch("fc2", aq, w2v, H, sched, E, c=y), 2.0 * routed * F * H, None),
        "fc2_dgrad_dglu_bf16w": (lambda: gemm.launch("dact", dyq, w2v, F, sched, E, b_transposed=True, c=dh,
                                                     c_up_offset=F, h=h, h_up_offset=F, probs=probs, dprob=dprob,
                                                     **kw), 2.0 * routed * H * F, None),
        "fc1_dgrad_bf16w": (lambda: gemm.launch("dgrad", dhq, w1v, H, sched, E, b_transposed=True, c=dx),
                            2.0 * routed * n1 * H, None),
    })
    return bench.time_kernels(kernels, fp8_peak)
