"""Weight gradients: grouped GEMMs whose reduction dimension is each expert's row count.

``dW[e] = G_e^T @ X_e`` with ``G`` [T, N] (the output gradient: dy or dh) and ``X`` [T, K] (the
GEMM input: a or x), reducing over the rows of expert ``e``, whose range is read on the device from
the schedule. Bias gradients ``db[e] = sum of G_e's rows`` come from a separate small kernel
(``bias_grad_kernel``): summing the TMA-loaded G tiles inside the wgrad loop gave wrong, run-to-run
varying dW on the H200 (device runs 4-6, benchmarks/NOTES.md), and a second pass over G costs a
few percent of the wgrad's bytes. Experts with no rows run no loop iteration and store zeros, so
their gradients are exactly zero rather than unwritten memory.

See ``grouped_gemm.py`` for why ``UPCAST`` exists (the CPU interpreter's bf16 dot).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch
import triton
import triton.language as tl

from .act_math import to_output
from . import grouped_gemm as gg
from .grouped_gemm import interpreting


def _tma_allowed(grad_out: torch.Tensor, inputs: torch.Tensor) -> bool:
    elt = grad_out.element_size()
    return all(t.stride(1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * elt) % 16 == 0
               for t in (grad_out, inputs))


@dataclass(frozen=True)
class WgradConfig:
    block_n: int = 128
    block_k: int = 128  # 128x256 was no faster (run 3) and gave WRONG dW on the H200 (run 4): see NOTES.md
    block_m: int = 64  # rows reduced per step
    group_n: int = 8
    num_warps: int = 8
    num_stages: int = 3
    use_tma: bool = True
    # Vectorised loads for an expert's last partial row chunk (else clamped column indices: scalar
    # loads, which made wgrad 1.4-1.8x slower on uneven routings). Runs 4-6 saw wrong dW with it, but
    # only ever together with the bias sum fused into this loop, which raced (the bias sum now has
    # its own kernel); tests/gpu/test_triton_gpu.py checks both settings against FP64 and bitwise.
    vector_tail: bool = True


INTERPRET_WGRAD_CONFIG = WgradConfig(block_n=32, block_k=32, block_m=16, group_n=2, num_warps=4, num_stages=1)


def default_wgrad_config(n: int, k: int) -> WgradConfig:
    """Block sizes for sm_90 (H200 runs 3-8). The vectorised tail only where both dims are whole
    tiles: with a ragged K (GPT-OSS, K=2880) the tail code alone slowed the main loop (run 8: dW1
    2.32 ms vs 1.90 ms clamped, balanced routing where the tail never runs); on whole tiles it is
    as fast or faster (1.5x at DSv3-Zipf, 1.7x with empty experts)."""
    if interpreting():
        return INTERPRET_WGRAD_CONFIG
    cfg = WgradConfig()
    return replace(cfg, vector_tail=n % cfg.block_n == 0 and k % cfg.block_k == 0)


@triton.jit
def _masked_tile(ptr, stride_m, m0, row_end, cols, BM: tl.constexpr):
    rows = m0 + tl.arange(0, BM)
    return tl.load(ptr + rows.to(tl.int64)[:, None] * stride_m + cols[None, :], mask=(rows < row_end)[:, None],
                   other=0.0)


@triton.jit
def _column_indices(cols, N, EVEN: tl.constexpr, VEC8: tl.constexpr):
    """In-bounds column indices that the compiler can still prove contiguous (so loads vectorise)."""
    if EVEN:
        out = cols
    elif VEC8:  # wraps at a multiple of 8: every aligned 8-vector stays contiguous
        out = tl.max_contiguous(tl.multiple_of(cols % N, 8), 8)
    else:
        out = tl.minimum(cols, N - 1)
    return out


@triton.jit
def wgrad_kernel(
    g_src, g_ptr, stride_gm,
    x_src, x_ptr, stride_xm,
    dw_ptr, stride_dw_e, stride_dw_n,
    sched_ptr,
    N, K, NUM_GROUPS,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, N_VEC8: tl.constexpr,
    K_VEC8: tl.constexpr, USE_TMA: tl.constexpr, VECTOR_TAIL: tl.constexpr, UPCAST: tl.constexpr,
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
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    if USE_TMA:
        # whole BM-row chunks by TMA (past-the-edge columns are zero-filled) ...
        full_chunks = (row_end - row_start) // BM
        for i in range(0, full_chunks):
            m0 = row_start + i * BM
            g = g_src.load([m0, pid_n * BN])
            x = x_src.load([m0, pid_k * BK])
            if UPCAST:
                g = g.to(tl.float32)
                x = x.to(tl.float32)
            acc = tl.dot(tl.trans(g), x, acc)
        # ... then the expert's last partial chunk, masked by row (the next rows are another expert's)
        m0 = row_start + full_chunks * BM
        if m0 < row_end:
            if VECTOR_TAIL:
                n_in = _column_indices(cols_n, N, EVEN_N, N_VEC8)
                k_in = _column_indices(cols_k, K, EVEN_K, K_VEC8)
            else:  # clamped columns: scalar loads, slow, but the variant verified on the H200
                n_in = tl.minimum(cols_n, N - 1)
                k_in = tl.minimum(cols_k, K - 1)
            g = _masked_tile(g_ptr, stride_gm, m0, row_end, n_in, BM)
            x = _masked_tile(x_ptr, stride_xm, m0, row_end, k_in, BM)
            if UPCAST:
                g = g.to(tl.float32)
                x = x.to(tl.float32)
            acc = tl.dot(tl.trans(g), x, acc)
    else:
        if VECTOR_TAIL:
            n_in = _column_indices(cols_n, N, EVEN_N, N_VEC8)
            k_in = _column_indices(cols_k, K, EVEN_K, K_VEC8)
        else:
            n_in = tl.minimum(cols_n, N - 1)
            k_in = tl.minimum(cols_k, K - 1)
        for m0 in range(row_start, row_end, BM):
            g = _masked_tile(g_src, stride_gm, m0, row_end, n_in, BM)
            x = _masked_tile(x_src, stride_xm, m0, row_end, k_in, BM)
            if UPCAST:
                g = g.to(tl.float32)
                x = x.to(tl.float32)
            acc = tl.dot(tl.trans(g), x, acc)

    n_ok = cols_n < N
    k_ok = cols_k < K
    dw_ptrs = dw_ptr + expert.to(tl.int64) * stride_dw_e + cols_n[:, None].to(tl.int64) * stride_dw_n + cols_k[None, :]
    tl.store(dw_ptrs, to_output(acc, dw_ptr.dtype.element_ty, UPCAST), mask=n_ok[:, None] & k_ok[None, :])


@triton.jit
def bias_grad_kernel(g_ptr, stride_gm, db_ptr, stride_db_e, sched_ptr, N, NUM_GROUPS,
                     UPCAST: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr):
    """``db[e, cols] = sum over expert e's rows of G[rows, cols]``, in a fixed order (deterministic)."""
    pid_n = tl.program_id(0)
    expert = tl.program_id(1)
    row_start = tl.load(sched_ptr + 2 * NUM_GROUPS + expert)
    row_end = tl.load(sched_ptr + 3 * NUM_GROUPS + expert)
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < N
    acc = tl.zeros((BN,), dtype=tl.float32)
    for m0 in range(row_start, row_end, BM):
        rows = m0 + tl.arange(0, BM)
        g = tl.load(g_ptr + rows.to(tl.int64)[:, None] * stride_gm + cols[None, :],
                    mask=(rows < row_end)[:, None] & col_ok[None, :], other=0.0)
        acc += tl.sum(g.to(tl.float32), axis=0)
    tl.store(db_ptr + expert * stride_db_e + cols, to_output(acc, db_ptr.dtype.element_ty, UPCAST), mask=col_ok)


def grouped_wgrad(grad_out: torch.Tensor, inputs: torch.Tensor, schedule: torch.Tensor, dw: torch.Tensor,
                  db: Optional[torch.Tensor] = None, config: Optional[WgradConfig] = None) -> None:
    """``dw[e] = grad_out_e^T @ inputs_e`` ([E, N, K]) and, if given, ``db[e] = grad_out_e.sum(0)``."""
    num_experts, n, k = dw.shape
    cfg = config or default_wgrad_config(n, k)
    grid = (triton.cdiv(n, cfg.block_n) * triton.cdiv(k, cfg.block_k), num_experts)
    use_tma = cfg.use_tma and gg.USE_TMA_DEFAULT and _tma_allowed(grad_out, inputs)
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        g_src = TensorDescriptor(grad_out, list(grad_out.shape), [grad_out.stride(0), 1], [cfg.block_m, cfg.block_n])
        x_src = TensorDescriptor(inputs, list(inputs.shape), [inputs.stride(0), 1], [cfg.block_m, cfg.block_k])
    else:
        g_src, x_src = grad_out, inputs
    wgrad_kernel[grid](
        g_src, grad_out, grad_out.stride(0),
        x_src, inputs, inputs.stride(0),
        dw, dw.stride(0), dw.stride(1),
        schedule,
        n, k, num_experts + 1,
        EVEN_N=n % cfg.block_n == 0,
        EVEN_K=k % cfg.block_k == 0, N_VEC8=n % 8 == 0, K_VEC8=k % 8 == 0, USE_TMA=use_tma,
        VECTOR_TAIL=cfg.vector_tail, UPCAST=interpreting(),
        BN=cfg.block_n, BK=cfg.block_k, BM=cfg.block_m, GROUP_N=cfg.group_n,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if db is not None:
        block_n, block_m = (32, 16) if interpreting() else (128, 64)
        bias_grad_kernel[(triton.cdiv(n, block_n), num_experts)](
            grad_out, grad_out.stride(0), db, db.stride(0), schedule, n, num_experts + 1,
            UPCAST=interpreting(), BN=block_n, BM=block_m, num_warps=4,
        )
