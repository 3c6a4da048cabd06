"""The NVFP4 expert MLP on the Triton backend (``NVFP4BlockScaling`` on Hopper).

Forward:  weights from the per-step cache (16x16 tiles) ; x: amax pass, quantize pass (rowwise
          for FC1, columnwise + RHT for w1's wgrad) -> FC1 (+b1, act, x probs; h saved; ``a`` in
          FP32) -> ``a``: amax pass, quantize pass (rowwise for FC2, columnwise + RHT for w2's
          wgrad) -> FC2 (+b2) -> y.
Backward: dy: amax, quantize (stochastic rounding; rowwise for the dgrad, columnwise + RHT for
          w2's wgrad; per-tile column sums for db2) -> FC2 dgrad with the dGLU epilogue (``dh`` in
          FP32, dprob partials) -> dh: amax, quantize (stochastic; per-tile column sums for db1)
          -> FC1 dgrad (dx) -> wgrad of w2 and of w1.

Numerics are the reference backend's (``backends/reference/gemm.py``) for the same recipe: every
expert slice of every GEMM operand is its own NVFP4 tensor, quantized along that GEMM's reduction
axis; ``a`` and ``dh`` are quantized from FP32. Differences: FP32 summation order (the GEMMs' and,
with RHT, the transform's; the reference transforms in FP64), which can move a value next to an
E2M1 rounding boundary by one step; ``h`` saved in ``block_scaled.H_DTYPE``; and the stochastic
rounding draws its bits from Philox on the device instead of PyTorch's generator (same
distribution, different draws).

Every GEMM reads exact BF16 expansions of its operands (codes times block scales), written by an
expansion pass just before it and dropped after it (``EXPAND_BEFORE_GEMM``; saved tensors and the
weight cache stay packed), or expands the packed codes in its K loop (``gemm`` module doc).

Sizes off the 128 tile (GPT-OSS's 2880) run in the same Function on zero-padded operands: weights
padded at the end of each dimension in the cache (blocks stay where TE puts them on the unpadded
weight; zeros change no amax), ``x`` / ``dy`` quantized as if zero-padded to the tile (``width=``),
``a`` / ``dh`` zero past their columns, and every GEMM storing only the columns of its result, so
``y``, ``dx``, ``dw1``, ``dw2`` come in their own sizes. The weight scales are per row, so FC1 and the
dGLU find the up half at row F of w1 wherever it falls.

Why the activations are not quantized in the GEMM epilogues as the FP8 recipes do: NVFP4's
per-tensor scale needs the amax of the expert's whole slice before any element is encoded, so each
of ``x``, ``a``, ``dy``, ``dh`` costs one FP32 write (``a``, ``dh``), an amax read and a quantize read.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton

from .. import block_scaled, library_wgrad
from ..block_scaled import backward_needs, empty_input_grads, expert_sums, keep_for_backward, mlp_sizes, new_buffer
from ..padded import padded_size
from ..fp8_block.wgrad import tile_sums_to_experts
from ..schedule import build_schedule, max_m_tiles
from . import gemm
from .quantize import TILE, WEIGHT_CACHE, NVSpec, quantize_rows, quantize_weight, with_values, with_weight_values
from .wgrad import nv_grouped_wgrad


# How the GEMMs read NVFP4 operands (Hopper has no FP4 tensor cores; an E2M1 code times its E4M3
# block scale is exact in BF16). True: an expansion pass writes each operand's BF16 values just
# before the GEMM that reads them, and the GEMM runs as a BF16 GEMM (the values are transient: the
# saved tensors and the weight cache stay packed). False: each GEMM expands its packed operands in
# its K loop, which on the H200 bounds those loops (run 14: 90-190 TFLOP/s).
EXPAND_BEFORE_GEMM = True
# The weight cache also keeps BF16 expansions of the weights, at twice the BF16 weights' bytes.
BF16_WEIGHT_VALUES = False
# Where the wgrads on BF16 values run. "triton" = ``wgrad.nv_grouped_wgrad``: exact products, both tensor scales
# applied to the FP32 sums, one rounding. "cublas" = cuBLAS's grouped GEMM (``library_wgrad``; sm_90 and a BF16 dW,
# else the Triton kernel), which takes no per-expert factor: x's (a's) columnwise values carry both tensor scales,
# each value rounded to BF16 once more (<= 2^-8 of it: far below E2M1's own steps). Run 42 (H100, DSv3): dW1 / dW2
# 2.94 / 1.49 ms on cuBLAS against 3.45 / 1.74 on the Triton kernel at half a slot per step; the MLP 24.56 against
# 25.65 ms under sustained load.
VALUES_WGRAD_KERNEL = "cublas"


def gemm_rows(q, expand: bool, rowwise: bool = False, colwise: bool = False):
    """``q`` as the next GEMM reads it: with transient BF16 values of the asked copies if ``expand``."""
    return with_values(q, rowwise, colwise, block_scaled.ALLOC) if expand else q


def gemm_weight(w, expand: bool, transposed: bool):
    """The weight ``w`` as the next GEMM reads it (``transposed``: its ``data_t`` copy)."""
    return with_weight_values(w, transposed, block_scaled.ALLOC) if expand else w


def weight_grad(gq, xq, schedule, w: torch.Tensor, expand: bool) -> torch.Tensor:
    """``dW [E, N, K]`` of the columnwise copies of ``gq`` [T, N] and ``xq`` [T, K] (where: see
    :data:`VALUES_WGRAD_KERNEL`)."""
    if expand and VALUES_WGRAD_KERNEL == "cublas" and w.dtype == torch.bfloat16 and library_wgrad.runs_on(w):
        g = with_values(gq, colwise=True, alloc=block_scaled.ALLOC)
        x = with_values(xq, colwise=True, alloc=block_scaled.ALLOC, colwise_scaled_by=(gq, schedule))
        return library_wgrad.values_wgrad(g.values_t, x.values_t, schedule, w.shape)
    dw = new_buffer(w.shape, w)
    nv_grouped_wgrad(gemm_rows(gq, expand, colwise=True), gemm_rows(xq, expand, colwise=True), schedule, dw)
    return dw


def specs_of(recipe):
    """(activations, gradients, weights) specs of an NVFP4BlockScaling recipe."""
    rht = not recipe.disable_rht
    return (NVSpec(stochastic=False, rht=rht),
            NVSpec(stochastic=not recipe.disable_stochastic_rounding, rht=rht),
            NVSpec(stochastic=False, rht=False, block_2d=not recipe.disable_2d_quantization,
                   bf16_values=BF16_WEIGHT_VALUES))


def zeros_past(t: torch.Tensor, cols: int) -> torch.Tensor:
    """``t`` with its columns from ``cols`` on set to zero (none where ``cols`` is its width): ``a`` and
    ``dh`` at sizes off the tile, whose epilogues write only their own columns before the quantize pass
    reads the padded width."""
    if cols < t.shape[1]:
        t[:, cols:].zero_()
    return t


class NVFP4ExpertMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tokens_per_expert, w1, w2, b1, b2, probs, activation, specs):
        spec, grad_spec, weight_spec = specs
        need = ctx.needs_input_grad
        num_rows, hidden, num_experts, n1, ffn = mlp_sizes(x.shape, w1, w2)
        hidden_p, n1_p, ffn_p = (padded_size(size, TILE) for size in (hidden, n1, ffn))
        act = activation.launch_args
        y = new_buffer((num_rows, hidden), x)
        ctx.act, ctx.grad_spec = act, grad_spec
        ctx.expand = expand = EXPAND_BEFORE_GEMM  # backward reads its operands the same way
        ctx.empty = num_rows == 0
        if ctx.empty:
            ctx.save_for_backward(x, w1, w2, probs)
            return y
        schedule = build_schedule(tokens_per_expert, num_rows, TILE)
        w1q = WEIGHT_CACHE.get(w1, weight_spec, padded_to=(num_experts, n1_p, hidden_p))
        w2q = WEIGHT_CACHE.get(w2, weight_spec, padded_to=(num_experts, hidden_p, ffn_p))
        xq = quantize_rows(x, schedule, num_experts, spec, rowwise=True, colwise=need[2], alloc=block_scaled.ALLOC,
                           width=hidden_p)
        h = new_buffer((num_rows, n1_p), x, block_scaled.H_DTYPE or x.dtype)
        a = zeros_past(new_buffer((num_rows, ffn_p), x, torch.float32), ffn)
        gemm.launch("fc1", gemm_rows(xq, expand, rowwise=True), gemm_weight(w1q, expand, False), ffn, schedule,
                    num_experts, c=a, h=h, h_up_offset=ffn, b_up_rows=ffn, bias=b1, bias_up_offset=ffn, probs=probs,
                    **act)
        aq = quantize_rows(a, schedule, num_experts, spec, rowwise=True, colwise=need[3], alloc=block_scaled.ALLOC)
        gemm.launch("fc2", gemm_rows(aq, expand, rowwise=True), gemm_weight(w2q, expand, False), hidden, schedule,
                    num_experts, c=y, bias=b2)
        keep_for_backward(ctx, x, w1, w2, probs, h, schedule, w1q, w2q)
        ctx.xq, ctx.aq = xq, aq  # backward reads their columnwise copies
        return y

    @staticmethod
    def backward(ctx, dy):
        need = ctx.needs_input_grad  # x, counts, w1, w2, b1, b2, probs, activation, specs
        if ctx.empty:
            return empty_input_grads(need, *ctx.saved_tensors)[:9]
        w1, w2, probs, h = ctx.saved_tensors
        spec, schedule, alloc, expand = ctx.grad_spec, ctx.schedule, block_scaled.ALLOC, ctx.expand
        dy = dy.contiguous()
        num_rows, hidden, num_experts, n1, ffn = mlp_sizes(ctx.x_shape, w1, w2)
        hidden_p, n1_p = padded_size(hidden, TILE), padded_size(n1, TILE)
        m_tiles = max_m_tiles(num_rows, num_experts, TILE)
        want_dprob, need_dact = backward_needs(need, probs)
        dx = dw1 = dw2 = db1 = db2 = dprobs = dhq = None

        db2_parts = new_buffer((m_tiles, hidden_p), w1, torch.float32) if need[5] else None
        dyq = quantize_rows(dy, schedule, num_experts, spec, rowwise=need_dact, colwise=need[3], alloc=alloc,
                            col_sums=db2_parts, width=hidden_p)
        if need_dact:
            dh = zeros_past(new_buffer((num_rows, n1_p), w1, torch.float32), n1)
            cfg = gemm.default_config("dact", expand)
            dprob_buf = new_buffer((triton.cdiv(ffn, cfg.block_n), num_rows), w1, torch.float32) if want_dprob else None
            gemm.launch("dact", gemm_rows(dyq, expand, rowwise=True), gemm_weight(ctx.w2q, expand, True), ffn,
                        schedule, num_experts, b_transposed=True, c=dh, c_up_offset=ffn, h=h, h_up_offset=ffn,
                        probs=probs, dprob=dprob_buf, config=cfg, **ctx.act)
            if want_dprob:
                dprobs = dprob_buf.sum(0).to(probs.dtype)
            db1_parts = new_buffer((m_tiles, n1_p), w1, torch.float32) if need[4] else None
            dhq = quantize_rows(dh, schedule, num_experts, spec, rowwise=need[0], colwise=need[2], alloc=alloc,
                                col_sums=db1_parts)
            if need[4]:
                db1 = expert_sums(tile_sums_to_experts, db1_parts, schedule, num_experts, w1)[:, :n1]
        if need[0]:
            dx = new_buffer((num_rows, hidden), w1)
            gemm.launch("dgrad", gemm_rows(dhq, expand, rowwise=True), gemm_weight(ctx.w1q, expand, True), hidden,
                        schedule, num_experts, b_transposed=True, c=dx)
        if need[3]:
            dw2 = weight_grad(dyq, ctx.aq, schedule, w2, expand)
        if need[5]:
            db2 = expert_sums(tile_sums_to_experts, db2_parts, schedule, num_experts, w1)[:, :hidden]
        if need[2]:
            dw1 = weight_grad(dhq, ctx.xq, schedule, w1, expand)
        return dx, None, dw1, dw2, db1, db2, dprobs, None, None


class NVFP4Kernels:
    """What the Triton backend asks of a quantized recipe's kernels (as ``block_scaled.RecipeKernels``)."""

    recipe_name = "NVFP4BlockScaling"
    tile = TILE
    weight_cache = WEIGHT_CACHE
    quantize_weight = staticmethod(quantize_weight)

    @staticmethod
    def unsupported(recipe) -> Optional[str]:
        return None  # every NVFP4BlockScaling option (RHT, stochastic rounding, 1D/2D weights) is implemented

    @staticmethod
    def expert_mlp(args) -> torch.Tensor:
        return NVFP4ExpertMLP.apply(args.x, args.tokens_per_expert, args.w1, args.w2, args.b1, args.b2, args.probs,
                                    args.activation, specs_of(args.recipe))


KERNELS = NVFP4Kernels()
