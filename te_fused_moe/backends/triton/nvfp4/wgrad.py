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
from ..grouped_gemm import interpreting
from ..schedule import swizzle
from . import gemm as nv_gemm
from .codec import DEQUANT_FACTOR, operand_halves
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
    USE_TMA: tl.constexpr, UPCAST: tl.constexpr, G_BF16: tl.constexpr, X_BF16: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr, BT: tl.constexpr, GROUP_N: tl.constexpr,
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
    if USE_TMA:
        g_ptrs = 0  # unused: the descriptors address the tiles
        x_ptrs = 0
    else:
        toks = tl.arange(0, BT // 2)
        g_ptrs = g_src + n_in.to(tl.int64)[:, None] * stride_gn + toks[None, :]
        x_ptrs = x_src + k_in.to(tl.int64)[:, None] * stride_xk + toks[None, :]
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    blk = tl.arange(0, BT // 16)
    for t in range(0, tl.cdiv(row_end - row_start, BT)):
        slot = tile_start + t
        sblk = slot * (BT // 16) + blk
        g_even, g_odd = operand_halves(g_src, g_ptrs, pid_n * BN, slot, gs_ptr + n_in, sblk, stride_gsb, USE_TMA,
                                       UPCAST, G_BF16, BN, BT)
        x_even, x_odd = operand_halves(x_src, x_ptrs, pid_k * BK, slot, xs_ptr + k_in, sblk, stride_xsb, USE_TMA,
                                       UPCAST, X_BF16, BK, BT)
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
    # packed codes + scales, or the exact BF16 values of the quantize pass (even tokens first per slot)
    (g_data, g_scale), (x_data, x_scale) = (
        (t.values_t, t.amax_t[:, None]) if t.values_t is not None else (t.data_t, t.scale_t) for t in (g, x))
    if g_data is None or x_data is None:
        raise ValueError("g, x: the wgrad needs the columnwise (transposed) copies (data_t, scale_t, amax_t)")
    slots = lambda t: t.values_t.shape[1] if t.values_t is not None else 2 * t.data_t.shape[1]
    if g_data.shape[0] != n or x_data.shape[0] != k or slots(g) != slots(x):
        raise ValueError(f"dw: shape {tuple(dw.shape)} does not match g {tuple(g_data.shape)}, x {tuple(x_data.shape)}")
    use_tma = nv_gemm.USE_TMA_DEFAULT and all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (g_data, x_data))
    g_src, x_src = g_data, x_data
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        g_src = TensorDescriptor(g_data, list(g_data.shape), [g_data.shape[1], 1], [cfg.block_n, TILE // 2])
        x_src = TensorDescriptor(x_data, list(x_data.shape), [x_data.shape[1], 1], [cfg.block_k, TILE // 2])
    grid = (triton.cdiv(n, cfg.block_n) * triton.cdiv(k, cfg.block_k), num_experts)
    nv_wgrad_kernel[grid](
        g_src, g_data.stride(0), g_scale, g_scale.stride(0), g.amax_t,
        x_src, x_data.stride(0), x_scale, x_scale.stride(0), x.amax_t,
        dw, dw.stride(0), dw.stride(1),
        schedule, n, k, num_experts + 1,
        USE_TMA=use_tma, UPCAST=interpreting(), G_BF16=g.values_t is not None, X_BF16=x.values_t is not None,
        BN=cfg.block_n, BK=cfg.block_k, BT=TILE, GROUP_N=cfg.group_n,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
