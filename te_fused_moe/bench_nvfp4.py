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


def fused_bf16_values(x, counts, w1, w2, activation, activations: bool = True):
    """The fused path with the GEMMs reading exact BF16 expansions of the weights (and, with
    ``activations``, of x, a, dy, dh) instead of expanding codes (``autograd.BF16_*_VALUES``)."""
    from .ops import fused_moe_mlp

    autograd = _kernels()[0]
    default = autograd.BF16_WEIGHT_VALUES, autograd.BF16_ACTIVATION_VALUES
    autograd.BF16_WEIGHT_VALUES, autograd.BF16_ACTIVATION_VALUES = True, activations
    try:
        return fused_moe_mlp(x, counts, w1, w2, activation=activation, recipe=NVFP4BlockScaling(), backend="triton")
    finally:
        autograd.BF16_WEIGHT_VALUES, autograd.BF16_ACTIVATION_VALUES = default
