"""Weight gradients: grouped GEMMs whose reduction dimension is each expert's row count.

``dW[e] = G_e^T @ X_e`` with ``G`` [T, N] (the output gradient: dy or dh) and ``X`` [T, K] (the
GEMM input: a or x), reducing over the rows of expert ``e``, whose range is read on the device from
the schedule. With a bias, ``db[e] = sum of G_e's rows`` is fused into the programs of the first K
tile (they already load every G tile). Experts with no rows run no loop iteration and store zeros,
so their gradients are exactly zero rather than unwritten memory.

See ``grouped_gemm.py`` for why ``UPCAST`` exists (the CPU interpreter's bf16 dot).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .act_math import to_output
from .grouped_gemm import interpreting


@dataclass(frozen=True)
class WgradConfig:
    block_n: int = 128
    block_k: int = 128
    block_m: int = 64  # rows reduced per step
    group_n: int = 8
    num_warps: int = 8
    num_stages: int = 3


INTERPRET_WGRAD_CONFIG = WgradConfig(block_n=32, block_k=32, block_m=16, group_n=2, num_warps=4, num_stages=1)


def default_wgrad_config(n: int, k: int) -> WgradConfig:
    if interpreting():
        return INTERPRET_WGRAD_CONFIG
    return WgradConfig()


@triton.jit
def wgrad_kernel(
    g_ptr, stride_gm,
    x_ptr, stride_xm,
    dw_ptr, stride_dw_e, stride_dw_n,
    db_ptr, stride_db_e,
    sched_ptr,
    N, K, NUM_GROUPS,
    HAS_BIAS: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr, GROUP_N: tl.constexpr,
):
    pid = tl.program_id(0)
    expert = tl.program_id(1)
    # GROUP_N swizzle over this expert's (n, k) tiles: neighbouring programs share G and X tiles.
    num_pid_n = tl.cdiv(N, BN)
    num_pid_k = tl.cdiv(K, BK)
    pids_per_band = GROUP_N * num_pid_k
    band = pid // pids_per_band
    first_n = band * GROUP_N
    band_n = tl.minimum(num_pid_n - first_n, GROUP_N)
    pid_n = first_n + (pid % pids_per_band) % band_n
    pid_k = (pid % pids_per_band) // band_n

    row_start = tl.load(sched_ptr + 2 * NUM_GROUPS + expert)
    row_end = tl.load(sched_ptr + 3 * NUM_GROUPS + expert)

    cols_n = pid_n * BN + tl.arange(0, BN)
    cols_k = pid_k * BK + tl.arange(0, BK)
    # clamped indices would hide contiguity from the compiler; only clamp where a tile overhangs
    if EVEN_N:
        n_in = cols_n
    else:
        n_in = tl.minimum(cols_n, N - 1)
    if EVEN_K:
        k_in = cols_k
    else:
        k_in = tl.minimum(cols_k, K - 1)
    offs_m = tl.arange(0, BM)

    acc = tl.zeros((BN, BK), dtype=tl.float32)
    bias_acc = tl.zeros((BN,), dtype=tl.float32)
    for m0 in range(row_start, row_end, BM):
        rows = m0 + offs_m
        row_ok = rows < row_end
        rows64 = rows.to(tl.int64)
        g = tl.load(g_ptr + rows64[:, None] * stride_gm + n_in[None, :], mask=row_ok[:, None], other=0.0)
        x = tl.load(x_ptr + rows64[:, None] * stride_xm + k_in[None, :], mask=row_ok[:, None], other=0.0)
        if HAS_BIAS:
            if pid_k == 0:
                bias_acc += tl.sum(g.to(tl.float32), axis=0)
        if UPCAST:
            g = g.to(tl.float32)
            x = x.to(tl.float32)
        acc = tl.dot(tl.trans(g), x, acc)

    n_ok = cols_n < N
    k_ok = cols_k < K
    dw_ptrs = dw_ptr + expert.to(tl.int64) * stride_dw_e + cols_n[:, None].to(tl.int64) * stride_dw_n + cols_k[None, :]
    tl.store(dw_ptrs, to_output(acc, dw_ptr.dtype.element_ty, UPCAST), mask=n_ok[:, None] & k_ok[None, :])
    if HAS_BIAS:
        if pid_k == 0:
            tl.store(db_ptr + expert * stride_db_e + cols_n, to_output(bias_acc, db_ptr.dtype.element_ty, UPCAST), mask=n_ok)


def grouped_wgrad(grad_out: torch.Tensor, inputs: torch.Tensor, schedule: torch.Tensor, dw: torch.Tensor,
                  db: Optional[torch.Tensor] = None, config: Optional[WgradConfig] = None) -> None:
    """``dw[e] = grad_out_e^T @ inputs_e`` ([E, N, K]) and, if given, ``db[e] = grad_out_e.sum(0)``."""
    num_experts, n, k = dw.shape
    cfg = config or default_wgrad_config(n, k)
    grid = (triton.cdiv(n, cfg.block_n) * triton.cdiv(k, cfg.block_k), num_experts)
    return wgrad_kernel[grid](
        grad_out, grad_out.stride(0),
        inputs, inputs.stride(0),
        dw, dw.stride(0), dw.stride(1),
        db if db is not None else dw, db.stride(0) if db is not None else 0,
        schedule,
        n, k, num_experts + 1,
        HAS_BIAS=db is not None, EVEN_N=n % cfg.block_n == 0,
        EVEN_K=k % cfg.block_k == 0, UPCAST=interpreting(),
        BN=cfg.block_n, BK=cfg.block_k, BM=cfg.block_m, GROUP_N=cfg.group_n,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
