"""One expert's GEMM ``y = x @ w.T`` with a recipe emulated by quantize -> dequantize.

Each of the three GEMMs of a linear layer (fprop, dgrad, wgrad) reduces over a different dimension,
so each quantizes its operands along that dimension, exactly as a fused kernel reads its rowwise or
columnwise copies. ``axis`` below is always the operand's reduction axis:

    fprop  y  = x  @ w.T    x [n, K] along K (axis 1),   w [N, K] along K (axis 1)
    dgrad  dx = dy @ w      dy [n, N] along N (axis 1),  w [N, K] along N (axis 0)
    wgrad  dw = dy.T @ x    dy [n, N] along n (axis 0),  x [n, K] along n (axis 0)

Called once per expert, so token-dimension blocks (wgrad) restart at each expert's first row, as
they do in a grouped kernel whose groups start on block boundaries. NVFP4's stochastic rounding of
gradients draws from PyTorch's default generator: seed it (``torch.manual_seed``) for repeatable runs.
"""

from __future__ import annotations

import torch

from ...recipes import Recipe


def _fake_quantize(t: torch.Tensor, recipe: Recipe, role: str, axis: int, gemm: str) -> torch.Tensor:
    if not recipe.quantized or t.numel() == 0:
        return t
    # Imported here so that BF16 runs do not depend on the quantizers.
    from ...quantize import fake_quantize

    return fake_quantize(t, recipe, role=role, axis=axis, gemm=gemm).to(t.dtype)


class QuantizedExpertGemm(torch.autograd.Function):
    """``x [n, K] @ w[N, K].T -> [n, N]`` in the dtype of its inputs (FP32 or FP64), with every
    operand of every GEMM fake-quantized by ``recipe``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, recipe: Recipe) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.recipe = recipe
        xq = _fake_quantize(x, recipe, "x", 1, "fprop")
        wq = _fake_quantize(w, recipe, "w", 1, "fprop")
        return xq @ wq.T

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w = ctx.saved_tensors
        recipe = ctx.recipe
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = _fake_quantize(dy, recipe, "grad", 1, "dgrad") @ _fake_quantize(w, recipe, "w", 0, "dgrad")
        if ctx.needs_input_grad[1]:
            dw = _fake_quantize(dy, recipe, "grad", 0, "wgrad").T @ _fake_quantize(x, recipe, "x", 0, "wgrad")
        return dx, dw, None


def expert_gemm(x: torch.Tensor, w: torch.Tensor, recipe: Recipe) -> torch.Tensor:
    return QuantizedExpertGemm.apply(x, w, recipe)
