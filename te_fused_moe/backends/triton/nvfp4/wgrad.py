"""NVFP4 weight gradients: ``dW[e] = G_e^T @ X_e`` reduced over expert ``e``'s tokens, from the
columnwise copies of ``G`` [T, N] and ``X`` [T, K] (16-token blocks restarting at each expert,
Hadamard-transformed along the tokens unless the recipe disables RHT: the transform is orthogonal,
so the product of two transformed operands is the product of the originals; layout in
:mod:`.quantize`: schedule tile ``t`` owns packed columns ``[64 t, 64 t + 64)`` of ``data_t`` and
scale rows ``[8 t, 8 t + 8)``).

Each step reads one tile slot (128 tokens: 64 bytes per row) of both operands, expands them
exactly to BF16 with their E4M3 block scales, as even and odd tokens (``codec.e2m1_expand_halves``),
and runs one BF16 wgmma per half into the FP32 accumulator;
the two per-expert tensor factors ``amax_t / 2688`` multiply the result. Slots hold zeros past the
expert's rows (and past its last 16-token block), so no masking is needed. Experts with no tokens
store zeros.
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
from . import gemm as nv_gemm
from .codec import DEQUANT_FACTOR, e2m1_expand_halves
from .quantize import TILE, NVRows


@dataclass(frozen=True)
class NVWgradConfig:
    block_n: int = 64
    block_k: int = 128
    group_n: int = 8
    num_warps: int = 4
    num_stages: int = 3


def default_config() -> NVWgradConfig:
    """64 (N) x 128 (K) tiles at 4 warps, 3 stages: MXFP8's expansion wgrad default on the H200."""
    if interpreting():
        return NVWgradConfig(block_n=64, block_k=128, group_n=2, num_warps=4, num_stages=1)
    return NVWgradConfig()


@triton.jit
def nv_wgrad_kernel(
    g_src, stride_gn, gs_ptr, stride_gsb, amax_g_ptr,
    x_src, stride_xk, xs_ptr, stride_xsb, amax_x_ptr,
    dw_ptr, stride_dw_e, stride_dw_n,
    sched_ptr, N, K, NUM_GROUPS,
    USE_TMA: tl.constexpr, UPCAST: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
    GROUP_N: tl.constexpr,
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
    if not USE_TMA:
        toks = tl.arange(0, BT // 2)
        g_ptrs = g_src + n_in.to(tl.int64)[:, None] * stride_gn + toks[None, :]
        x_ptrs = x_src + k_in.to(tl.int64)[:, None] * stride_xk + toks[None, :]
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    blk = tl.arange(0, BT // 16)
    for t in range(0, tl.cdiv(row_end - row_start, BT)):
        slot = tile_start + t
        sblk = slot * (BT // 16) + blk
        if USE_TMA:
            g = g_src.load([pid_n * BN, slot * (BT // 2)])
        else:
            g = tl.load(g_ptrs + slot * (BT // 2))
        g_even, g_odd = e2m1_expand_halves(g, tl.load(gs_ptr + n_in[:, None] + sblk[None, :] * stride_gsb), BN, BT,
                                           UPCAST)
        if USE_TMA:
            x = x_src.load([pid_k * BK, slot * (BT // 2)])
        else:
            x = tl.load(x_ptrs + slot * (BT // 2))
        x_even, x_odd = e2m1_expand_halves(x, tl.load(xs_ptr + k_in[:, None] + sblk[None, :] * stride_xsb), BK, BT,
                                           UPCAST)
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
    cfg = config or default_config()
    # TMA boxes of 64 bytes along the tokens: one slot of 128 packed codes
    use_tma, operands = wgrad_operands(g, x, dw, cfg.block_n, cfg.block_k, TILE // 2, nv_gemm.USE_TMA_DEFAULT)
    grid = (triton.cdiv(n, cfg.block_n) * triton.cdiv(k, cfg.block_k), num_experts)
    nv_wgrad_kernel[grid](
        *operands[:4], g.amax_t, *operands[4:8], x.amax_t, *operands[8:],  # each operand's tensor amax after it
        schedule, n, k, num_experts + 1,
        USE_TMA=use_tma, UPCAST=interpreting(), BN=cfg.block_n, BK=cfg.block_k, BT=TILE, GROUP_N=cfg.group_n,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
