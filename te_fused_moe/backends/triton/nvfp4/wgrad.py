"""NVFP4 weight gradients: ``dW[e] = G_e^T @ X_e`` reduced over expert ``e``'s tokens, from the
columnwise copies of ``G`` [T, N] and ``X`` [T, K] (16-token blocks restarting at each expert,
Hadamard-transformed along the tokens unless the recipe disables RHT: the transform is orthogonal,
so the product of two transformed operands is the product of the originals; layout in
:mod:`.quantize`: schedule tile ``t`` owns packed columns ``[64 t, 64 t + 64)`` of ``data_t`` and
scale rows ``[8 t, 8 t + 8)``).

Each step reads one tile slot (128 tokens: 64 bytes per row) of both operands, expands them
exactly to BF16 with their E4M3 block scales, as even and odd tokens (``codec.e2m1_expand_halves``),
and runs one BF16 wgmma per half into the FP32 accumulator; or, with ``BF16``, reads both operands'
BF16 values expanded before the GEMM (``quantize.with_values``: the same halves, stored in slots
of 128 values), a slot or (``NVWgradConfig.block_t = 64``, ``HALF_STEPS``; :data:`VALUES_HALF_SLOT`) one
half of a slot per step: the same dots in the same order, so the same sums, in half the shared memory per
stage. The two per-expert tensor factors ``amax_t / 2688`` multiply the result. Slots hold zeros past the
expert's rows (and past its last 16-token block), so no masking is needed. Experts with no tokens
store zeros.

By default (``autograd.VALUES_WGRAD_KERNEL``, since run 42) the BF16-valued wgrads run on cuBLAS's grouped GEMM
instead, with x's values carrying the tensor factors (``quantize.expand_values(tensor_scales=)``); this kernel runs
them where that route does not apply (not sm_90, dW not BF16, operands expanded in the K loop).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from ..act_math import to_output
from ..block_scaled_launch import wgrad_operands
from ..grouped_gemm import interpreting
from ..operand_tiles import k_block
from ..schedule import swizzle
from . import gemm as nv_gemm
from .codec import DEQUANT_FACTOR
from .gemm import operand_halves
from .quantize import TILE, NVRows

HALF_SLOT = TILE // 2  # tokens per step of the BF16-valued wgrad's half-slot loop
# The BF16-valued default config at half a slot per step (``NVWgradConfig.block_t``): on since run 42 (H100, DSv3:
# dW1 3.87 -> 3.45 ms, dW2 1.90 -> 1.74 ms with 16-tile column groups, bitwise equal to a slot per step).
VALUES_HALF_SLOT = True


@dataclass(frozen=True)
class NVWgradConfig:
    block_n: int = 64
    block_k: int = 128
    group_n: int = 8
    num_warps: int = 4
    num_stages: int = 3
    # tokens per step with both operands BF16 values: None = a tile slot (128, two dots), 64 = one of its halves
    # (one dot): at DSv3 each expert's 1024 tokens are 8 slots, so the pipeline's fill and the tile's store weigh
    # on every program; a half slot per stage fits 3 stages in 96 KB, two programs per SM (MXFP8's values wgrad,
    # run 37a: 3.85 -> 3.51 ms for dW1)
    block_t: Optional[int] = None


def default_config(bf16_operands: bool = False) -> NVWgradConfig:
    """Expanding in the K loop: 64 (N) x 128 (K) tiles at 4 warps, 3 stages (MXFP8's expansion wgrad
    default on the H200). Reading BF16 values: 128 x 128 at 8 warps, 3 stages (run 15 at DSv3: 512
    TFLOP/s; 357-389 with 2 stages or 4-warp 64-wide tiles), half a slot per step with :data:`VALUES_HALF_SLOT`."""
    block_t = HALF_SLOT if bf16_operands and VALUES_HALF_SLOT else None
    if interpreting():
        return NVWgradConfig(block_n=64, block_k=128, group_n=2, num_warps=4, num_stages=1, block_t=block_t)
    if bf16_operands:
        # 16-tile column groups at half a slot: run 42, 3.54 -> 3.45 ms (dW1) against 8
        return NVWgradConfig(block_n=128, block_k=128, group_n=16 if block_t else 8, num_warps=8, num_stages=3,
                             block_t=block_t)
    return NVWgradConfig()


@triton.jit
def nv_wgrad_kernel(
    g_src, stride_gn, gs_ptr, stride_gsb, amax_g_ptr,
    x_src, stride_xk, xs_ptr, stride_xsb, amax_x_ptr,
    dw_ptr, stride_dw_e, stride_dw_n,
    sched_ptr, N, K, NUM_GROUPS,
    USE_TMA: tl.constexpr, UPCAST: tl.constexpr, BF16: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    BT: tl.constexpr, GROUP_N: tl.constexpr, HALF_STEPS: tl.constexpr = False,
):
    pid = tl.program_id(0)
    expert = tl.program_id(1)
    pid_n, pid_k = swizzle(pid, tl.cdiv(N, BN), tl.cdiv(K, BK), GROUP_N)

    tile_start = tl.load(sched_ptr + 0 * NUM_GROUPS + expert)
    row_start = tl.load(sched_ptr + 2 * NUM_GROUPS + expert)
    row_end = tl.load(sched_ptr + 3 * NUM_GROUPS + expert)
    cols_n = pid_n * BN + tl.arange(0, BN)
    cols_k = pid_k * BK + tl.arange(0, BK)
    n_in = tl.minimum(cols_n, N - 1)
    k_in = tl.minimum(cols_k, K - 1)
    if USE_TMA:  # the descriptors address the tiles
        g_ptrs = g_src
        x_ptrs = x_src
    else:
        toks = tl.arange(0, BT // 2)
        g_ptrs = g_src + n_in.to(tl.int64)[:, None] * stride_gn + toks[None, :]
        x_ptrs = x_src + k_in.to(tl.int64)[:, None] * stride_xk + toks[None, :]
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    if HALF_STEPS:  # BF16 values, one half slot (64 columns: even tokens, then odd) per step
        for half in range(2 * tile_start, 2 * (tile_start + tl.cdiv(row_end - row_start, BT))):
            g = k_block(g_ptrs, pid_n * BN, half * (BT // 2), USE_TMA)
            x = k_block(x_ptrs, pid_k * BK, half * (BT // 2), USE_TMA)
            if UPCAST:
                g = g.to(tl.float32)
                x = x.to(tl.float32)
            acc = tl.dot(g, tl.trans(x), acc)
    else:
        blk = tl.arange(0, BT // 16)  # a slot's 16-token scale blocks
        for t in range(0, tl.cdiv(row_end - row_start, BT)):
            slot = tile_start + t
            sblk = slot * (BT // 16) + blk
            g_even, g_odd = operand_halves(g_src, g_ptrs, pid_n * BN, slot, gs_ptr + n_in, sblk, stride_gsb,
                                           USE_TMA, UPCAST, BF16, BN, BT)
            x_even, x_odd = operand_halves(x_src, x_ptrs, pid_k * BK, slot, xs_ptr + k_in, sblk, stride_xsb,
                                           USE_TMA, UPCAST, BF16, BK, BT)
            acc = tl.dot(g_even, tl.trans(x_even), acc)
            acc = tl.dot(g_odd, tl.trans(x_odd), acc)

    factor = (tl.load(amax_g_ptr + expert) * DEQUANT_FACTOR) * (tl.load(amax_x_ptr + expert) * DEQUANT_FACTOR)
    acc = acc * tl.where(row_end > row_start, factor, 0.0)
    mask = (cols_n < N)[:, None] & (cols_k < K)[None, :]
    dw_ptrs = dw_ptr + expert.to(tl.int64) * stride_dw_e + cols_n.to(tl.int64)[:, None] * stride_dw_n + cols_k[None, :]
    tl.store(dw_ptrs, to_output(acc, dw_ptr.dtype.element_ty, UPCAST), mask=mask)


def nv_grouped_wgrad(g: NVRows, x: NVRows, schedule: torch.Tensor, dw: torch.Tensor,
                     config: Optional[NVWgradConfig] = None) -> None:
    """``dw[e] = G_e^T @ X_e`` ([E, N, K]) from the columnwise copies of ``g`` [T, N] and ``x`` [T, K]."""
    num_experts, n, k = dw.shape
    bf16 = g.values_t is not None
    cfg = config or default_config(bf16)
    if bf16 != (x.values_t is not None):
        raise ValueError("g, x: give both operands' BF16 values (values_t, from quantize.with_values) or neither")
    if cfg.block_t not in (None, TILE, HALF_SLOT) or (cfg.block_t == HALF_SLOT and not bf16):
        raise ValueError(f"config: block_t={cfg.block_t} must be None or {TILE} (a tile slot per step), or "
                         f"{HALF_SLOT} (half a slot) with both operands as BF16 values")
    if bf16:  # the kernel reads the values in place of the packed codes (same slots, twice the width)
        g, x = (dataclasses.replace(q, data_t=q.values_t) for q in (g, x))
    # TMA boxes of 64 along the tokens: one slot of 128 packed codes, or half a slot of BF16 values
    use_tma, operands = wgrad_operands(g, x, dw, cfg.block_n, cfg.block_k, TILE // 2, nv_gemm.USE_TMA_DEFAULT)
    grid = (triton.cdiv(n, cfg.block_n) * triton.cdiv(k, cfg.block_k), num_experts)
    nv_wgrad_kernel[grid](
        *operands[:4], g.amax_t, *operands[4:8], x.amax_t, *operands[8:],  # each operand's tensor amax after it
        schedule, n, k, num_experts + 1,
        USE_TMA=use_tma, UPCAST=interpreting(), BF16=bf16, BN=cfg.block_n, BK=cfg.block_k, BT=TILE, GROUP_N=cfg.group_n,
        HALF_STEPS=cfg.block_t == HALF_SLOT, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
