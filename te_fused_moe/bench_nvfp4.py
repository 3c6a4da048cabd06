"""The NVFP4 recipe's side of :mod:`te_fused_moe.bench_recipes`: its unfused path (same quantize and
GEMM kernels, no epilogue: activation and its backward as PyTorch ops between them) and the timing
of each kernel of its fused path alone."""

from __future__ import annotations

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
    ``a`` and ``dh`` go through BF16 before their quantize pass, as separate kernels would pass them.
    The GEMMs read their operands as the fused path does (``autograd.EXPAND_BEFORE_GEMM``)."""

    @staticmethod
    def forward(ctx, x, counts, w1, w2, activation):
        from .backends.triton.schedule import build_schedule

        autograd, gemm, quantize, _ = _kernels()
        spec, grad_spec, weight_spec = autograd.specs_of(NVFP4BlockScaling())
        act = ActivationConfig(activation)
        T, H = x.shape
        E, n1, _ = w1.shape
        sched = build_schedule(counts, T, quantize.TILE)
        expand = autograd.EXPAND_BEFORE_GEMM
        rows, weight = autograd.gemm_rows, autograd.gemm_weight
        w1q, w2q = quantize.WEIGHT_CACHE.get(w1, weight_spec), quantize.WEIGHT_CACHE.get(w2, weight_spec)
        xq = quantize.quantize_rows(x, sched, E, spec, rowwise=True, colwise=True)
        h = torch.empty(T, n1, device=x.device, dtype=x.dtype)
        gemm.launch("fc2", rows(xq, expand, rowwise=True), weight(w1q, expand, False), n1, sched, E, c=h)
        a = act.forward(h.float()).to(x.dtype)
        aq = quantize.quantize_rows(a, sched, E, spec, rowwise=True, colwise=True)
        y = torch.empty(T, H, device=x.device, dtype=x.dtype)
        gemm.launch("fc2", rows(aq, expand, rowwise=True), weight(w2q, expand, False), H, sched, E, c=y)
        ctx.save_for_backward(h, w1, w2)
        ctx.state = (sched, w1q, w2q, xq, aq, act, grad_spec, expand)
        return y

    @staticmethod
    def backward(ctx, dy):
        autograd, gemm, quantize, wgrad = _kernels()
        h, w1, w2 = ctx.saved_tensors
        sched, w1q, w2q, xq, aq, act, spec, expand = ctx.state
        rows, weight = autograd.gemm_rows, autograd.gemm_weight
        dy = dy.contiguous()
        T, H = dy.shape
        E, F = w1.shape[0], w2.shape[2]
        dyq = quantize.quantize_rows(dy, sched, E, spec, rowwise=True, colwise=True)
        da = torch.empty(T, F, device=dy.device, dtype=dy.dtype)
        gemm.launch("dgrad", rows(dyq, expand, rowwise=True), weight(w2q, expand, True), F, sched, E,
                    b_transposed=True, c=da)
        dh = act.backward(h.float(), da.float()).to(dy.dtype)
        dhq = quantize.quantize_rows(dh, sched, E, spec, rowwise=True, colwise=True)
        dx = torch.empty(T, H, device=dy.device, dtype=dy.dtype)
        gemm.launch("dgrad", rows(dhq, expand, rowwise=True), weight(w1q, expand, True), H, sched, E,
                    b_transposed=True, c=dx)
        # the fused path's wgrads (autograd.VALUES_WGRAD_KERNEL): nothing in them to fuse
        dw2 = autograd.weight_grad(dyq, aq, sched, w2, expand)
        dw1 = autograd.weight_grad(dhq, xq, sched, w1, expand)
        return dx, None, dw1, dw2, None


def unfused(x, counts, w1, w2, activation):
    return NVFP4Unfused.apply(x, counts, w1, w2, activation)


def bench_kernels(shape: bench.Shape, inputs, fp8_peak: float) -> Dict[str, Dict[str, float]]:
    """Each kernel of the fused NVFP4 path alone: ms, TFLOP/s (GEMMs, and their share of the FP8
    peak) or GB/s (quantize: the input read once by the amax pass and once by the quantize pass;
    expansion: codes and scales read, BF16 values written). GEMMs both ways: expanding packed
    operands in the K loop (``fc1_glu`` ...), and reading BF16 values (``..._values``)."""
    import triton

    from .backends.triton import library_wgrad
    from .backends.triton.schedule import build_schedule

    autograd, gemm, quantize, wgrad = _kernels()
    spec, grad_spec, weight_spec = autograd.specs_of(NVFP4BlockScaling())
    act = ActivationConfig(shape.activation)
    x, w1, w2, counts, dy = (inputs[name] for name in ("x", "w1", "w2", "counts", "dy"))
    T, H, F, E, n1 = x.shape[0], shape.hidden, shape.ffn, shape.experts, w1.shape[1]
    routed = int(counts.sum())
    kw = act.launch_args
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
    # the default path (autograd.EXPAND_BEFORE_GEMM): an expansion pass writes BF16 values just before
    # each GEMM, which then reads them instead of expanding packed codes in its K loop (above)
    values = lambda q: quantize.with_values(q, rowwise=True, colwise=True)
    both_layouts = lambda w: quantize.with_weight_values(quantize.with_weight_values(w, False), True)
    xv, av, dyv, dhv = values(xq), values(aq), values(dyq), values(dhq)
    w1v, w2v = both_layouts(w1q), both_layouts(w2q)
    dprob_v = torch.empty(triton.cdiv(F, gemm.default_config("dact", True).block_n), T, device=x.device,
                          dtype=torch.float32)
    expand_bytes = lambda n: n * (0.5 + 1 / 16 + 2)  # codes and scales read, BF16 written
    kernels.update({
        "expand_x_row_col": (lambda: values(xq), None, 2 * expand_bytes(T * H)),
        "expand_weights": (lambda: (both_layouts(w1q), both_layouts(w2q)), None,
                           2 * expand_bytes(w1.numel() + w2.numel())),
        "fc1_glu_values": (lambda: gemm.launch("fc1", xv, w1v, F, sched, E, c=a, h=h, h_up_offset=F, b_up_rows=F,
                                               **kw), 2.0 * routed * H * n1, None),
        "fc2_values": (lambda: gemm.launch("fc2", av, w2v, H, sched, E, c=y), 2.0 * routed * F * H, None),
        "fc2_dgrad_dglu_values": (lambda: gemm.launch("dact", dyv, w2v, F, sched, E, b_transposed=True, c=dh,
                                                      c_up_offset=F, h=h, h_up_offset=F, probs=probs,
                                                      dprob=dprob_v, **kw), 2.0 * routed * H * F, None),
        "fc1_dgrad_values": (lambda: gemm.launch("dgrad", dhv, w1v, H, sched, E, b_transposed=True, c=dx),
                             2.0 * routed * n1 * H, None),
        "wgrad_w2_values": (lambda: wgrad.nv_grouped_wgrad(dyv, av, sched, dw2), 2.0 * routed * H * F, None),
        "wgrad_w1_values": (lambda: wgrad.nv_grouped_wgrad(dhv, xv, sched, dw1), 2.0 * routed * n1 * H, None),
        # cuBLAS's grouped GEMM on the same values (autograd.VALUES_WGRAD_KERNEL "cublas"; the tensor scales that
        # x's and a's values carry there change nothing in its time)
        "wgrad_w2_values_cublas": (lambda: library_wgrad.values_wgrad(dyv.values_t, av.values_t, sched, dw2.shape),
                                   2.0 * routed * H * F, None),
        "wgrad_w1_values_cublas": (lambda: library_wgrad.values_wgrad(dhv.values_t, xv.values_t, sched, dw1.shape),
                                   2.0 * routed * n1 * H, None),
    })
    # the *_values GEMMs above run on the BF16 backend's kernel (gemm.VALUES_ON_BF16_KERNEL); on NVFP4's own:
    for name in ("fc1_glu_values", "fc2_values", "fc1_dgrad_values"):
        fn, flops, nbytes = kernels[name]
        kernels[name + "_nv_kernel"] = (_on_own_kernel(fn), flops, nbytes)
    dprob_nv = torch.empty(triton.cdiv(F, gemm.own_config("dact", True).block_n), T, device=x.device,
                           dtype=torch.float32)  # its dprob partials: one row per N tile of that kernel
    kernels["fc2_dgrad_dglu_values_nv_kernel"] = (
        _on_own_kernel(lambda: gemm.launch("dact", dyv, w2v, F, sched, E, b_transposed=True, c=dh, c_up_offset=F,
                                           h=h, h_up_offset=F, probs=probs, dprob=dprob_nv, **kw)),
        2.0 * routed * H * F, None)
    return bench.time_kernels(kernels, fp8_peak)


def _on_own_kernel(fn):
    """``fn`` with every NVFP4 GEMM on NVFP4's kernel (``gemm.VALUES_ON_BF16_KERNEL`` off while it runs)."""
    from .bench_recipes import _call_under

    return lambda: _call_under(".backends.triton.nvfp4.gemm", dict(VALUES_ON_BF16_KERNEL=False), fn)
