"""MXFP8 weight gradients: ``dW[e] = G_e^T @ X_e`` reduced over expert ``e``'s tokens, from the
columnwise (transposed) copies of ``G`` [T, N] and ``X`` [T, K]: 32-token blocks that restart at
each expert's first row (layout in :mod:`.quantize`: tile ``t`` owns columns ``[128 t, 128 t + 128)``
of ``data_t`` and scale rows ``[4 t, 4 t + 4)``). Three loops, as in :mod:`.gemm`: one tile slot
per step with both operands expanded exactly to BF16 in registers (``expand_bf16``, the default
config), or read as BF16 values expanded before the wgrad (``data_t`` of dtype bfloat16, from
``quantize.expand_values``); or one 32-token block per step with both operands' E8M0 scales promoted
in FP32 (exact: powers of two), ``acc += dot(g, x^T) * gs[:, None] * xs[None, :]``, which reads
only the expert's ``cdiv(rows, 32)`` blocks. Experts with no tokens store zeros. ``db1``/``db2`` reuse ``fp8_block.wgrad``'s per-tile
column sums (:func:`~..fp8_block.wgrad.tile_sums_to_experts`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from ..act_math import to_output
from ..block_scaled_launch import wgrad_operands
from ..grouped_gemm import interpreting
from ..schedule import swizzle
from . import gemm as mx_gemm
from .codec import expand_bf16, mx_dequant_scale
from .quantize import MX, TILE, MXRows


@dataclass(frozen=True)
class MXWgradConfig:
    block_n: int = 128
    block_k: int = 128
    group_n: int = 8
    num_warps: int = 8
    num_stages: int = 4
    expand_bf16: bool = False  # BF16 wgmma on operands expanded exactly in registers (see gemm.expand_bf16)
    # tokens per step with both operands BF16 values (no scales read): None = a tile slot (128). At DSv3 each
    # expert's 1024 tokens are 8 steps of 128, so the pipeline's fill and the tile's store weigh on every
    # program; 64 halves a stage (3 stages in 96 KB: two programs per SM). Run 37a (H100, DSv3,
    # scripts/probe_mx_wgrad.py), dw1 / dw2 ms: 128 tokens 3.850 / 1.867; 64 at 3 stages 3.508 / 1.806 (the
    # default since), at 4 stages 3.783 / 1.877, with 4 warps 3.522 / 1.912, GROUP_N 16 3.420 / 1.946; 32 at 4
    # stages 3.897 / 2.199; the BF16 backend's wgrad 3.416 / 1.749, cuBLAS 3.071 / 1.586.
    block_t: Optional[int] = None
    # with X's FP8 codes expanded in the K loop (G as values): X's values as the wgmma's A operand from
    # registers (dW's tile accumulated transposed), instead of written to shared memory for a B operand
    x_as_a: bool = False


# The x-codes wgrad (G's values, X's FP8 codes expanded in the K loop): X's values as the wgmma's A operand
# from registers (``MXWgradConfig.x_as_a``) or through shared memory as the B operand. Run 38a (H100, DSv3):
# dW1 4.63 against 4.71 ms, dW2 2.51 against 2.20 (the values path: 3.50 and 1.78 after their expansion passes,
# 0.30 and 0.09); the MLP with either is slower than the values path (``autograd.X_CODES_IN_WGRAD``).
X_CODES_AS_A = False


def default_config(bf16_operands: bool = False, x_codes: bool = False) -> MXWgradConfig:
    """64 (N) x 128 (K) tiles at 4 warps, 3 stages: several CTAs per SM overlap one's operand expansion
    (or FP32 promotion) with another's wgmma. On the H200 (run 13) as fast as 128x128 at 8 warps with
    the expand loop (3.69 vs 3.73 ms at DSv3), and 1.35x faster for fp8_block's promotion loop.
    Reading BF16 values expanded before the GEMM: 128 x 128 at 8 warps, 3 stages (NVFP4's BF16-valued
    wgrad on the H200, run 15: 512 TFLOP/s vs 380 at 64 x 128, 4 warps), 64 tokens a step (run 37a: 5.31
    against 5.72 ms for both wgrads at DSv3 on an H100, ``MXWgradConfig.block_t``). ``x_codes``: that
    config with X's FP8 codes expanded in its K loop (:data:`X_CODES_AS_A`)."""
    expand = mx_gemm.EXPAND_BF16_DEFAULT
    if interpreting():
        return MXWgradConfig(block_n=64, block_k=128, group_n=2, num_warps=4, num_stages=1,
                             expand_bf16=expand or bf16_operands)
    if bf16_operands:
        return MXWgradConfig(block_n=128, block_k=128, num_warps=8, num_stages=3, expand_bf16=True, block_t=64,
                             x_as_a=x_codes and X_CODES_AS_A)
    return MXWgradConfig(block_n=64, block_k=128, num_warps=4, num_stages=3, expand_bf16=expand)


@triton.jit
def _step_scales(s_ptr, stride_sb, cols_in, tok, t, rows_total, BT: tl.constexpr, MX_BLOCK: tl.constexpr):
    """E8M0 scales ``[len(cols_in), BT / 32]`` of the 32-token blocks of step ``t`` (first token ``tok``) of a
    columnwise copy; blocks past the expert's end (zeros) read as 1.0, so nothing else there can matter."""
    sub = tl.arange(0, BT // MX_BLOCK)
    valid = (t * BT + sub * MX_BLOCK < rows_total)[None, :]
    return tl.where(valid, tl.load(s_ptr + (tok // MX_BLOCK + sub)[None, :] * stride_sb + cols_in[:, None]), 127)


@triton.jit
def mx_wgrad_kernel(
    g_src, stride_gn, gs_ptr, stride_gsb,
    x_src, stride_xk, xs_ptr, stride_xsb,
    dw_ptr, stride_dw_e, stride_dw_n,
    sched_ptr, N, K, NUM_GROUPS,
    USE_TMA: tl.constexpr, UPCAST: tl.constexpr, EXPAND: tl.constexpr, BF16: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr, BT: tl.constexpr, TILE_M: tl.constexpr, MX_BLOCK: tl.constexpr, GROUP_N: tl.constexpr,
    X_CODES: tl.constexpr = False, X_AS_A: tl.constexpr = False,
):
    """``BF16``: G read as BF16 values, and X too unless ``X_CODES`` (X's FP8 codes expanded in registers
    with its scales: the saved copy needs no expansion pass, :data:`.autograd.X_CODES_IN_WGRAD`); ``X_AS_A``:
    those values as the wgmma's A operand straight from registers, accumulating dW's tile transposed."""
    pid = tl.program_id(0)
    expert = tl.program_id(1)
    pid_n, pid_k = swizzle(pid, tl.cdiv(N, BN), tl.cdiv(K, BK), GROUP_N)

    tile_start = tl.load(sched_ptr + 0 * NUM_GROUPS + expert)
    row_start = tl.load(sched_ptr + 2 * NUM_GROUPS + expert)
    row_end = tl.load(sched_ptr + 3 * NUM_GROUPS + expert)
    first_block = tile_start * (TILE_M // BT)
    last_block = first_block + tl.cdiv(row_end - row_start, BT)

    cols_n = pid_n * BN + tl.arange(0, BN)
    cols_k = pid_k * BK + tl.arange(0, BK)
    n_in = tl.minimum(cols_n, N - 1)
    k_in = tl.minimum(cols_k, K - 1)
    if not USE_TMA:
        toks = tl.arange(0, BT)
        g_ptrs = g_src + n_in.to(tl.int64)[:, None] * stride_gn + toks[None, :]
        x_ptrs = x_src + k_in.to(tl.int64)[:, None] * stride_xk + toks[None, :]
    if X_AS_A:
        acc = tl.zeros((BK, BN), dtype=tl.float32)
    else:
        acc = tl.zeros((BN, BK), dtype=tl.float32)
    if EXPAND:
        # BT = TILE_M: one tile slot (four 32-token blocks) per step, expanded exactly to BF16, one
        # BF16 wgmma into the loop-carried accumulator (BF16 values: BT may be a part of a slot). Blocks
        # past the expert's end hold zeros; their scales are read as 1.0 so that nothing else in the slot
        # can matter. The expert's slots are consecutive: its tokens run on from its first slot's first.
        rows_total = row_end - row_start
        for t in range(0, tl.cdiv(rows_total, BT)):
            tok = tile_start * TILE_M + t * BT
            if USE_TMA:
                g = g_src.load([pid_n * BN, tok])
                x = x_src.load([pid_k * BK, tok])
            else:
                g = tl.load(g_ptrs + tok)
                x = tl.load(x_ptrs + tok)
            if BF16:  # values expanded before the GEMM (zeros past the expert's end, like the codes)
                if UPCAST:
                    g = g.to(tl.float32)
                if X_CODES:
                    x = expand_bf16(x, _step_scales(xs_ptr, stride_xsb, k_in, tok, t, rows_total, BT, MX_BLOCK),
                                    BK, BT, UPCAST)
                elif UPCAST:
                    x = x.to(tl.float32)
                if X_AS_A:
                    acc = tl.dot(x, tl.trans(g), acc)
                else:
                    acc = tl.dot(g, tl.trans(x), acc)
            else:
                gs = _step_scales(gs_ptr, stride_gsb, n_in, tok, t, rows_total, BT, MX_BLOCK)
                xs = _step_scales(xs_ptr, stride_xsb, k_in, tok, t, rows_total, BT, MX_BLOCK)
                acc = tl.dot(expand_bf16(g, gs, BN, BT, UPCAST), tl.trans(expand_bf16(x, xs, BK, BT, UPCAST)), acc)
    else:  # the promotion loop: one 32-token block per step
        for blk in range(first_block, last_block):
            if USE_TMA:
                g = g_src.load([pid_n * BN, blk * BT])
                x = x_src.load([pid_k * BK, blk * BT])
            else:
                g = tl.load(g_ptrs + blk * BT)
                x = tl.load(x_ptrs + blk * BT)
            gs = mx_dequant_scale(tl.load(gs_ptr + blk * stride_gsb + n_in))
            xs = mx_dequant_scale(tl.load(xs_ptr + blk * stride_xsb + k_in))
            if UPCAST:
                g = g.to(tl.float32)
                x = x.to(tl.float32)
            acc += tl.dot(g, tl.trans(x)) * (gs[:, None] * xs[None, :])

    mask = (cols_n < N)[:, None] & (cols_k < K)[None, :]
    dw_ptrs = dw_ptr + expert.to(tl.int64) * stride_dw_e + cols_n.to(tl.int64)[:, None] * stride_dw_n + cols_k[None, :]
    if X_AS_A:
        acc = tl.trans(acc)
    tl.store(dw_ptrs, to_output(acc, dw_ptr.dtype.element_ty, UPCAST), mask=mask)


def mx_grouped_wgrad(g: MXRows, x: MXRows, schedule: torch.Tensor, dw: torch.Tensor,
                     config: Optional[MXWgradConfig] = None) -> None:
    """``dw[e] = G_e^T @ X_e`` ([E, N, K]) from the columnwise copies of ``g`` [T, N] and ``x`` [T, K]: both
    FP8, both BF16 values, or ``g``'s values with ``x``'s FP8 codes, which the K loop expands (the copies
    kept for backward as they were saved, :data:`.autograd.X_CODES_IN_WGRAD`)."""
    num_experts, n, k = dw.shape
    bf16 = g.data_t is not None and g.data_t.dtype == torch.bfloat16
    x_values = x.data_t is not None and x.data_t.dtype == torch.bfloat16
    if x.data_t is None or (x_values and not bf16):
        raise ValueError("g, x: both columnwise copies FP8 (data_t), both their BF16 values "
                         "(quantize.expand_values), or g's values with x's FP8 codes (expanded in the K loop)")
    x_codes = bf16 and not x_values
    cfg = config or default_config(bf16, x_codes=x_codes)
    if bf16 and not cfg.expand_bf16:
        raise ValueError("config: BF16 operands need the expand_bf16 loop (BF16 wgmma)")
    block_t = TILE if cfg.expand_bf16 else MX  # tokens per step
    if cfg.block_t is not None:
        if not bf16 or cfg.block_t not in (32, 64, TILE):
            raise ValueError(f"config: block_t={cfg.block_t} needs g's columnwise copy as BF16 values and one of "
                             f"32, 64, {TILE} (a part of a tile slot)")
        block_t = cfg.block_t
    grid = (triton.cdiv(n, cfg.block_n) * triton.cdiv(k, cfg.block_k), num_experts)
    use_tma, operands = wgrad_operands(g, x, dw, cfg.block_n, cfg.block_k, block_t, mx_gemm.USE_TMA_DEFAULT)
    mx_wgrad_kernel[grid](
        *operands,
        schedule, n, k, num_experts + 1,
        USE_TMA=use_tma, UPCAST=interpreting(), EXPAND=cfg.expand_bf16, BF16=bf16, BN=cfg.block_n, BK=cfg.block_k, BT=block_t,
        TILE_M=TILE, MX_BLOCK=MX,
        GROUP_N=cfg.group_n, X_CODES=x_codes, X_AS_A=cfg.x_as_a and x_codes,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
