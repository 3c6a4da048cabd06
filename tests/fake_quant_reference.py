"""Ground truth for quantized recipes: the FP64 per-expert loop with every GEMM operand
fake-quantized (quantize -> dequantize) as the recipe says, forward and backward written out by hand.

Independent of the reference backend: it shares only ``fake_quantize`` (tested bit-exactly on its
own) and the FP64 activation definitions of tests/moe_reference.py. Each GEMM quantizes its operands
along its own reduction dimension (``axis``):

    fprop  y  = x @ w.T    x along K (axis 1),  w along K (axis 1)
    dgrad  dx = dy @ w     dy along N (axis 1), w along N (axis 0)
    wgrad  dw = dy.T @ x   dy along rows (axis 0, per expert), x along rows (axis 0)
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from moe_reference import GPT_OSS_ALPHA, GPT_OSS_LIMIT, activation_fp64


def _q(t: torch.Tensor, recipe, role: str, axis: int, gemm: str) -> torch.Tensor:
    """Operands are FP32 values in the backends, so they are rounded to FP32 before quantizing."""
    if t.numel() == 0 or not recipe.quantized:
        return t
    from te_fused_moe.quantize import fake_quantize

    return fake_quantize(t.float(), recipe, role=role, axis=axis, gemm=gemm).double()


def _gemm(a, b, recipe):
    """fprop of ``a @ b.T``."""
    return _q(a, recipe, "x", 1, "fprop") @ _q(b, recipe, "w", 1, "fprop").T


def _dgrad(dy, w, recipe):
    return _q(dy, recipe, "grad", 1, "dgrad") @ _q(w, recipe, "w", 0, "dgrad")


def _wgrad(dy, x, recipe):
    return _q(dy, recipe, "grad", 0, "wgrad").T @ _q(x, recipe, "x", 0, "wgrad")


def quantized_expert_mlp_fp64(x, tokens_per_expert, w1, w2, recipe, activation="swiglu", b1=None, b2=None,
                              probs=None, alpha=GPT_OSS_ALPHA, limit=GPT_OSS_LIMIT,
                              dy=None) -> Dict[str, Optional[torch.Tensor]]:
    """Like ``moe_reference.expert_mlp_fp64`` with the recipe's fake quantization on each GEMM operand.

    Returns ``y`` and, with ``dy``, the gradients ``x, w1, w2, b1, b2, probs`` (FP64, on CPU) and, with
    ``probs`` too, ``probs_scale`` (each row's sum of ``|da * act(h)|``, as ``expert_mlp_fp64``).
    """
    d = lambda t: None if t is None else t.detach().double().cpu()
    x, w1, w2, b1, b2, probs = map(d, (x, w1, w2, b1, b2, probs))
    dy = d(dy)
    counts = [int(c) for c in tokens_per_expert.cpu().tolist()]
    y = torch.zeros_like(x)
    grads = {"x": torch.zeros_like(x), "w1": torch.zeros_like(w1), "w2": torch.zeros_like(w2),
             "b1": None if b1 is None else torch.zeros_like(b1), "b2": None if b2 is None else torch.zeros_like(b2),
             "probs": None if probs is None else torch.zeros_like(probs),
             "probs_scale": None if probs is None else torch.zeros_like(probs)}
    start = 0
    for e, n in enumerate(counts):
        rows = slice(start, start + n)
        start += n
        xe = x[rows]
        h = _gemm(xe, w1[e], recipe)
        if b1 is not None:
            h = h + b1[e]
        h = h.requires_grad_(True)
        act = activation_fp64(activation, h, alpha, limit)
        a = act.detach() * probs[rows, None] if probs is not None else act.detach()
        ye = _gemm(a, w2[e], recipe)
        if b2 is not None:
            ye = ye + b2[e]
        y[rows] = ye
        if dy is None or n == 0:
            continue
        dye = dy[rows]
        grads["w2"][e] = _wgrad(dye, a, recipe)
        if b2 is not None:
            grads["b2"][e] = dye.sum(0)
        da = _dgrad(dye, w2[e], recipe)
        if probs is not None:
            grads["probs"][rows] = (da * act.detach()).sum(1)
            grads["probs_scale"][rows] = (da.abs() * act.detach().abs()).sum(1)
            da = da * probs[rows, None]
        (dh,) = torch.autograd.grad(act, h, da)
        if b1 is not None:
            grads["b1"][e] = dh.sum(0)
        grads["w1"][e] = _wgrad(dh, xe, recipe)
        grads["x"][rows] = _dgrad(dh, w1[e], recipe)
    out = {"y": y}
    if dy is not None:
        out.update(grads)
    return out
