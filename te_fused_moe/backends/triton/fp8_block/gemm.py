"""FP8 grouped GEMMs with per-128-K-block scale promotion and the quantizing MoE epilogues.

``C[rows of expert e] = A_e @ B_e^T`` with ``A`` [T, K] FP8 rowwise (1x128 scales ``sa`` [T, K/128])
and ``B_e`` [N, K] FP8, K-major, in 128x128 tiles (scales ``sb`` [E, N/128, K/128]). Every K step is
one 128-wide scale block: ``acc += dot(a, b^T) * sa[:, None] * sb[None, :]`` with the FP32 ``acc``
outside the dot (DeepGEMM's promotion; Hopper's FP8 wgmma accumulates with reduced precision, so
its partial sums never run longer than one block).

Modes (``MODE``):

- ``PLAIN``: ``C = A @ B^T (+ bias)`` in the output dtype: FC2 forward (``a_q``, ``w2``), FC1 dgrad
  (``dh_q``, ``w1^T``).
- ``FC1``: ``h = x_q @ w1^T + b1`` (saved, in ``h``'s dtype), ``a = act(h) * p`` quantized from its
  FP32 value: rowwise (FC2's fprop operand) and columnwise, transposed (FC2's wgrad operand), with
  the amax taken in the epilogue (no extra pass).
- ``DACT``: ``da = dy_q @ (w2^T)^T``; ``dh = d act(h) * (da * p)`` quantized likewise (rowwise for FC1
  dgrad, columnwise for w1's wgrad); ``dprob`` partial row sums of ``da * act(h)`` (one per N tile,
  summed later in a fixed order) and, with ``WRITE_DBIAS``, per-tile column sums of the FP32 ``dh``
  (for ``db1``).

The quantizing modes need ``BM = BN = 128`` and tiles that start at each expert's first row (the
schedule with ``block_m = 128``): a tile's rows are then exactly one columnwise block (one expert's
128 tokens) and its 128 columns one rowwise block. Numerics are the reference backend's
quantize->dequantize emulation up to the order of the FP32 sums (and the reduced precision of the
FP8 wgmma inside one 128-block on the GPU); quantized outputs use :mod:`.codec`, bit-exact with
:mod:`te_fused_moe.quantize.fp8_block` on the same FP32 values.

Interpreter: ``UPCAST`` (``TRITON_INTERPRET=1`` only) converts the FP8 tiles to FP32 before the dot;
products of FP8 values are exact in FP32, so this changes nothing but the summation order.
"""

from __future__ import annotations

import functools
import importlib
import re
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import triton
import triton.language as tl

from ..act_math import ACT_IDS, act_backward, act_forward, load_gate_up, to_output
from ..block_scaled_launch import (GEMM_MODES, MODE_FC1, MODE_PLAIN, kernel_operands, operand_sources,
                                   quantized_copies, separate_epilogue, tiled_width, tma_allowed)
from ..grouped_gemm import interpreting, register_cap
from ..operand_tiles import k_block, operand_tiles
from ..schedule import max_m_tiles, swizzle, tile_rows, total_tiles
from .codec import block_scale, encode_fp8, nan_free_abs
from .quantize import BLOCK, FLOAT32_MAX, FP8Spec, row_block

# Tests flip this to cover the pointer-load path under the interpreter as well.
USE_TMA_DEFAULT = True
# Which kernel runs the plain GEMMs (FC2, FC1 dgrad) by default: "auto" = the warp-specialised Gluon
# kernel of :mod:`.wgmma_ws` on sm_90 (promotion under the next wgmma, a producer warp loading), this
# module's Triton kernel elsewhere and under the interpreter; "triton" / "gluon" force one (benchmarks
# compare both in one process). At DSv3 (run 19a-b): FC2 0.97 ms, FC1 dgrad 1.83, FC1's GEMM 1.71,
# the dGLU's 0.87 (~1000-1130 TFLOP/s; the Gluon load-cursor kernel before them: 1.06 / 2.07 / 1.90 /
# 1.06)
PLAIN_ENGINE = "auto"
# How the FC1 and dGLU kernels run: "fused" = one kernel (K loop, then the activation + quantize
# epilogue); "separate" = the plain GEMM writes its output (see EPILOGUE_INPUT_DTYPE), then the same
# kernel with ``ACC_IN`` runs the epilogue alone on it. "auto" separates where the plain GEMM runs on
# the Gluon kernel. Why:
# at DSv3 on the H200 the dGLU GEMM alone takes ~1.05 ms and the fused dGLU kernel 2.86 ms (run 16b:
# its 255-register, one-CTA-per-SM epilogue stalls on instruction fetch and latency with nothing to
# overlap it); FC1 2.0-2.1 ms alone vs 2.85 fused.
# How the Gluon plain GEMM stores its tiles: True = whole tiles through a shared-memory staging tile
# and a TMA store that runs under the next tile's mainloop (an expert's last, partial tile is read
# back from the staging tile and stored masked); False = masked stores from registers, which the
# consumers wait for before their next tile
PLAIN_TMA_STORE = True
# ...and its consumer partitions: 1 = both warpgroups in one partition; 2 = a warpgroup per half of
# each tile's rows, each handing its stages back and storing its half on its own, not in step with
# the other. Per kernel even at DSv3 (runs 19e, 20b-c, 22c: within ~2% either way), but the MLP was
# faster with two in all five calls that timed both: 10.99 / 11.07 / 10.83 / 10.72 / 10.67 ms vs
# 11.01 / 11.16 / 10.93 / 10.84 / 10.75 with one (20c, 22a-d; 22c in 9 interleaved rounds)
PLAIN_CONSUMERS = 2
FC1_EPILOGUE = "auto"
DACT_EPILOGUE = "auto"
# What the separate epilogues read. None: their GEMM's output in h's dtype (x's unless
# block_scaled.H_DTYPE says otherwise), as TE's GEMMs write BF16 for its activation kernels: FC1's
# GEMM writes h itself (b1 added in FP32 first) and the epilogue computes act(h) from it, writing no
# second copy; the dGLU's GEMM writes da in h's dtype. torch.float32: the FP32 accumulator, a
# transient [T, N] copy, through the same code as the fused kernel, so the same bytes as it (and, with
# H_DTYPE = float32, exactly what the reference emulates). At DSv3 the FP32 way moves 537 MB more
# through FC1 ([T, 2F] written and read as FP32, h written again) and 134 MB more through the dGLU.
EPILOGUE_INPUT_DTYPE: Optional[torch.dtype] = None
# The epilogue alone runs at 16 warps (128 registers): dGLU 1.98 -> 1.75 ms at DSv3 vs 8 warps, FC1
# unchanged (run 16c); 1.75 + the GEMM vs 2.86 ms for the fused dGLU kernel.
EPILOGUE_ALONE_WARPS = 16
# ...and its register cap (None: the compiler's choice; a cap lets more CTAs share an SM)
EPILOGUE_ALONE_MAXNREG: Optional[int] = None


@dataclass(frozen=True)
class FP8GemmConfig:
    block_n: int = 128
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    use_tma: bool = True
    # FC1 and dGLU epilogues in two 64-column halves (register pressure); None: split in the fused
    # kernels, whole in the epilogue alone (at 16 warps: FC1 -0.18 ms, dGLU -0.12 ms at DSv3, run 17)
    split_epilogue: Optional[bool] = None
    plain_engine: Optional[str] = None  # FC2 / FC1 dgrad: "auto", "gluon" or "triton"; None = PLAIN_ENGINE
    epilogue: Optional[str] = None  # FC1 / dGLU: "auto", "separate" or "fused"; None = FC1_ / DACT_EPILOGUE
    alone_warps: Optional[int] = None  # the epilogue alone: warps, register cap; None = EPILOGUE_ALONE_*
    alone_maxnreg: Optional[int] = None
    # the Gluon plain GEMM: persistent programs per SM (one: 12 warps at 168 registers fill an SM's)
    ctas_per_sm: int = 1
    consumers: Optional[int] = None  # ...its consumer partitions (see PLAIN_CONSUMERS); None = PLAIN_CONSUMERS
    tma_store: Optional[bool] = None  # ...its stores by TMA (see PLAIN_TMA_STORE); None = PLAIN_TMA_STORE


def default_config(kind: str, bf16_operands: bool = False) -> FP8GemmConfig:
    """BM = BK = 128 always (token blocks, scale blocks). FC1/DACT: BN = 128 (one rowwise block per
    tile; gated FC1 keeps a second 128-wide accumulator for the up half). The plain GEMMs use
    BN = 128 too (see below). ``bf16_operands`` is refused: these GEMMs run FP8 wgmma."""
    if bf16_operands:
        raise ValueError("bf16_operands: the FP8 block GEMMs read FP8 operands (FP8 wgmma with FP32 promotion)")
    if interpreting():
        return FP8GemmConfig(block_n=128, group_m=2, num_warps=4, num_stages=1)
    if kind in ("fc1", "dact"):
        return FP8GemmConfig(block_n=128, num_stages=3)
    if kind in ("fc2", "dgrad"):
        # BN=128: the promoted accumulator and the dot's fresh result are both live (2 x 64 registers
        # per thread at 8 warps; 3 x 64 in the Gluon kernel); BN=256 would need 2 x 128 and spill.
        # Bands of 16 M tiles instead of 8: within the run-to-run spread (runs 16a-b)
        return FP8GemmConfig(block_n=128, num_stages=4)
    raise ValueError(f"kind: expected 'fc1', 'fc2', 'dact' or 'dgrad', got {kind!r}")


@triton.jit
def _store_quantized(v, row0, row_ok, col0, tile, q_ptr, stride_qm, qs_ptr, stride_qsm, stride_qsk, qt_ptr, stride_qtn,
                     qts_ptr, stride_qtst, value_for_inf, ROWWISE: tl.constexpr, COLWISE: tl.constexpr,
                     MANT: tl.constexpr, EBIAS: tl.constexpr, FP8_MAX: tl.constexpr, POW2: tl.constexpr):
    """Quantize the FP32 tile ``v`` [128 rows from ``row0``, 128 columns from ``col0``]: rowwise (one
    block per row) and/or columnwise over the valid rows (one block per column), stored transposed."""
    mask = row_ok[:, None]
    if ROWWISE:
        scale, inv = block_scale(tl.max(nan_free_abs(v), axis=1), FP8_MAX, POW2, value_for_inf)
        local = tl.arange(0, 128)
        tl.store(row_block(q_ptr, row0, stride_qm, col0, 128) + tl.arange(0, 128)[None, :],
                 encode_fp8(v * scale[:, None], MANT, EBIAS, FP8_MAX), mask=mask)
        tl.store(qs_ptr + row0 * stride_qsm + (col0 // 128) * stride_qsk + local * stride_qsm, inv, mask=row_ok)
    if COLWISE:
        _store_colwise(v, row_ok, col0, tile, qt_ptr, stride_qtn, qts_ptr, stride_qtst, value_for_inf,
                       MANT, EBIAS, FP8_MAX, POW2)


@triton.jit
def _store_colwise(v, row_ok, col0, tile, qt_ptr, stride_qtn, qts_ptr, stride_qtst, value_for_inf,
                   MANT: tl.constexpr, EBIAS: tl.constexpr, FP8_MAX: tl.constexpr, POW2: tl.constexpr):
    """Columnwise blocks of ``v`` [128 rows, columns from ``col0``]: one per column over the tile's valid
    rows, stored transposed into the tile's own 128-column slot of ``data_t`` (see quantize.py)."""
    WIDTH: tl.constexpr = v.shape[1]
    mask = row_ok[:, None]
    amax_c = tl.max(tl.where(mask, nan_free_abs(v), 0.0), axis=0)
    scale_c, inv_c = block_scale(amax_c, FP8_MAX, POW2, value_for_inf)
    # zeros past the group's end: selected in FP32 (code 0x00), one select per value, not per unpacked byte
    codes_c = encode_fp8(tl.where(mask, v * scale_c[None, :], 0.0), MANT, EBIAS, FP8_MAX)
    slot_ptrs = row_block(qt_ptr, col0.to(tl.int64), stride_qtn, tile * 128, WIDTH)
    tl.store(slot_ptrs + tl.arange(0, 128)[None, :], tl.trans(codes_c))
    tl.store(qts_ptr + tile * stride_qtst + col0 + tl.arange(0, WIDTH), inv_c)


@triton.jit
def _store_quantized_halves(v_lo, v_hi, row0, row_ok, col0, tile, q_ptr, stride_qm, qs_ptr, stride_qsm,
                            stride_qsk, qt_ptr, stride_qtn, qts_ptr, stride_qtst, value_for_inf,
                            ROWWISE: tl.constexpr, COLWISE: tl.constexpr, MANT: tl.constexpr, EBIAS: tl.constexpr,
                            FP8_MAX: tl.constexpr, POW2: tl.constexpr):
    """:func:`_store_quantized` of a 128-column block held as two 64-column halves (the rowwise amax
    spans both; columnwise blocks are per column anyway)."""
    mask = row_ok[:, None]
    if ROWWISE:
        amax = tl.maximum(tl.max(nan_free_abs(v_lo), axis=1), tl.max(nan_free_abs(v_hi), axis=1))
        scale, inv = block_scale(amax, FP8_MAX, POW2, value_for_inf)
        row_ptrs = row_block(q_ptr, row0, stride_qm, col0, 128) + tl.arange(0, 64)[None, :]
        tl.store(row_ptrs, encode_fp8(v_lo * scale[:, None], MANT, EBIAS, FP8_MAX), mask=mask)
        tl.store(row_ptrs + 64, encode_fp8(v_hi * scale[:, None], MANT, EBIAS, FP8_MAX), mask=mask)
        local = tl.arange(0, 128)
        tl.store(qs_ptr + row0 * stride_qsm + (col0 // 128) * stride_qsk + local * stride_qsm, inv, mask=row_ok)
    if COLWISE:
        _store_colwise(v_lo, row_ok, col0, tile, qt_ptr, stride_qtn, qts_ptr, stride_qtst, value_for_inf,
                       MANT, EBIAS, FP8_MAX, POW2)
        _store_colwise(v_hi, row_ok, col0 + 64, tile, qt_ptr, stride_qtn, qts_ptr, stride_qtst, value_for_inf,
                       MANT, EBIAS, FP8_MAX, POW2)


@triton.jit
def _dact_half(da, row0, row_ok, col0, N, p, h_ptr, stride_hm, h_up_offset, alpha, limit, is_padding,
               ACT: tl.constexpr, GATED: tl.constexpr):
    """d act for a block of columns: (dg, du) zeroed on the padding group, the row sums of
    ``da * act(h)`` (dprob) and the column sums of dg and du over the valid rows (db1)."""
    WIDTH: tl.constexpr = da.shape[1]
    cols = col0 + tl.arange(0, WIDTH)
    mask = row_ok[:, None] & (cols < N)[None, :]
    h_ptrs = row_block(h_ptr, row0, stride_hm, col0, 128) + tl.arange(0, WIDTH)[None, :]
    g, u = load_gate_up(h_ptrs, h_up_offset, mask, GATED)
    dg, du, value = act_backward(g, u, da * p[:, None], alpha, limit, ACT)
    part = tl.sum(tl.where(mask, da * value, 0.0), axis=1)
    dg = tl.where(is_padding, 0.0, dg)
    du = tl.where(is_padding, 0.0, du)
    return dg, du, part, tl.sum(tl.where(mask, dg, 0.0), axis=0), tl.sum(tl.where(mask, du, 0.0), axis=0)


@triton.jit
def fp8_grouped_gemm_kernel(
    a_src, stride_am, as_ptr, stride_asm, stride_ask,
    b_src, stride_be, stride_bn, bs_ptr, stride_bse, stride_bsn, stride_bsk, B_ROWS, b_up_rows,
    c_ptr, stride_cm,
    q_ptr, stride_qm, qs_ptr, stride_qsm, stride_qsk, qt_ptr, stride_qtn, qts_ptr, stride_qtst, q_up_offset,
    h_ptr, stride_hm, h_up_offset,
    bias_ptr, stride_bias_e, bias_up_offset,
    probs_ptr, dprob_ptr, stride_dprob_part,
    dbias_ptr, stride_dbias_t,
    sched_ptr,
    T, N, K, alpha, limit, value_for_inf, MAX_M_TILES, NUM_GROUPS,
    MODE: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_PROBS: tl.constexpr, WRITE_DPROB: tl.constexpr, WRITE_DBIAS: tl.constexpr,
    ROWWISE: tl.constexpr, COLWISE: tl.constexpr, USE_TMA: tl.constexpr, UPCAST: tl.constexpr, ACC_IN: tl.constexpr,
    ACC_IS_H: tl.constexpr, SPLIT_EPILOGUE: tl.constexpr, MANT: tl.constexpr, EBIAS: tl.constexpr, FP8_MAX: tl.constexpr, POW2: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
):
    # --- which tile: GROUP_M swizzle for L2 reuse of B, then (group, row block) on the device
    pid_m, pid_n = swizzle(tl.program_id(0), MAX_M_TILES, tl.cdiv(N, BN), GROUP_M)
    if pid_m >= total_tiles(sched_ptr, NUM_GROUPS):
        return
    group, a_row, row_end = tile_rows(sched_ptr, pid_m, BM, NUM_GROUPS)
    is_padding = group == NUM_GROUPS - 1
    expert = tl.minimum(group, NUM_GROUPS - 2)
    rows = a_row + tl.arange(0, BM)
    row_ok = rows < row_end
    rows_in = tl.minimum(rows, T - 1).to(tl.int64)  # scale loads (and pointer loads) stay in the tensor
    cols_in = tl.minimum(pid_n * BN + tl.arange(0, BN), N - 1)
    b_row = expert * B_ROWS + pid_n * BN
    e64 = expert.to(tl.int64)
    if BN <= 128:
        # the tile's columns share one 128-row block of B (N % 128 == 0, BN divides 128): a scalar
        # scale per K step, so the promotion multiplies by a per-row vector, not a [BM, BN] outer
        # product whose 64 registers per thread (per accumulator) made gated FC1's loop spill
        sb_ptrs = bs_ptr + e64 * stride_bse + ((pid_n * BN) // 128) * stride_bsn
    else:
        sb_ptrs = bs_ptr + e64 * stride_bse + (cols_in // 128) * stride_bsn
    a_tiles, b_tiles = operand_tiles(a_src, b_src, rows_in, cols_in, e64, stride_am, stride_be, stride_bn, BK, USE_TMA)
    if GATED and MODE == 1:
        sb_up_ptrs = sb_ptrs + (b_up_rows // 128) * stride_bsn

    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if GATED and MODE == 1:
        acc_up = tl.zeros((BM, BN), dtype=tl.float32)
    if ACC_IN:
        # the epilogue alone, on the output another kernel wrote ([T, B's rows] in c; with ACC_IS_H, c
        # is h itself, bias included)
        # (columns masked at N: FC1 at an F off the tile, whose up half starts at column F of h)
        acc_ptrs = row_block(c_ptr, a_row.to(tl.int64), stride_cm, pid_n * BN, BM) + tl.arange(0, BN)[None, :]
        acc_mask = row_ok[:, None] & (pid_n * BN + tl.arange(0, BN) < N)[None, :]
        acc = tl.load(acc_ptrs, mask=acc_mask, other=0.0).to(tl.float32)
        if GATED and MODE == 1:
            acc_up = tl.load(acc_ptrs + b_up_rows, mask=acc_mask, other=0.0).to(tl.float32)
    else:
        k_tiles = tl.where(is_padding, 0, K // BK)
        for kt in range(0, k_tiles):
            k0 = kt * BK
            a = k_block(a_tiles, a_row, k0, USE_TMA)
            b = k_block(b_tiles, b_row, k0, USE_TMA)
            sa = tl.load(as_ptr + rows_in * stride_asm + kt * stride_ask)
            sb = tl.load(sb_ptrs + kt * stride_bsk)
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            if BN <= 128:
                acc += tl.dot(a, tl.trans(b)) * (sa * sb)[:, None]
            else:
                acc += tl.dot(a, tl.trans(b)) * (sa[:, None] * sb[None, :])
            if GATED and MODE == 1:
                b_up = k_block(b_tiles, b_row + b_up_rows, k0, USE_TMA, b_up_rows * stride_bn)
                sb_up = tl.load(sb_up_ptrs + kt * stride_bsk)
                if UPCAST:
                    b_up = b_up.to(tl.float32)
                if BN <= 128:
                    acc_up += tl.dot(a, tl.trans(b_up)) * (sa * sb_up)[:, None]
                else:
                    acc_up += tl.dot(a, tl.trans(b_up)) * (sa[:, None] * sb_up[None, :])

    # --- epilogue, FP32 (column indices are made here: the K loop needs none)
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < N
    # row indices made again here (operand order unlike the loop's copy): fewer of gated FC1's spills
    # land in its K loop (sm_90a ptxas: 20/26 -> 15/18 STL/LDL per step)
    rows = tl.arange(0, BM) + a_row
    row_ok = rows < row_end
    out_mask = row_ok[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)
    row0 = a_row.to(tl.int64)
    bias_mask = col_ok & (group < NUM_GROUPS - 1)
    if MODE == 0:
        if HAS_BIAS:
            bias = tl.load(bias_ptr + expert * stride_bias_e + cols, mask=bias_mask, other=0.0)
            acc += bias.to(tl.float32)[None, :]
        tl.store(row_block(c_ptr, row0, stride_cm, pid_n * BN, BM) + tl.arange(0, BN)[None, :],
                 to_output(acc, c_ptr.dtype.element_ty, UPCAST), mask=out_mask)
    elif MODE == 1:
        h_ptrs = row_block(h_ptr, row0, stride_hm, pid_n * BN, BM) + tl.arange(0, BN)[None, :]
        if HAS_BIAS:
            bias = tl.load(bias_ptr + expert * stride_bias_e + cols, mask=bias_mask, other=0.0)
            acc += bias.to(tl.float32)[None, :]
            if GATED:
                bias_up = tl.load(bias_ptr + expert * stride_bias_e + bias_up_offset + cols, mask=bias_mask, other=0.0)
                acc_up += bias_up.to(tl.float32)[None, :]
        if not ACC_IS_H:
            tl.store(h_ptrs, to_output(acc, h_ptr.dtype.element_ty, UPCAST), mask=out_mask)
            if GATED:
                tl.store(h_ptrs + h_up_offset, to_output(acc_up, h_ptr.dtype.element_ty, UPCAST), mask=out_mask)
        if GATED:
            value = act_forward(acc, acc_up, alpha, limit, ACT)
        else:
            value = act_forward(acc, acc, alpha, limit, ACT)
        if HAS_PROBS:
            p = tl.load(probs_ptr + rows64, mask=row_ok, other=0.0).to(tl.float32)
            value = value * p[:, None]
        value = tl.where(is_padding, 0.0, value)
        if ACC_IN:
            value = tl.where(col_ok[None, :], value, 0.0)  # zero codes past an F off the tile
        if SPLIT_EPILOGUE:
            # quantize in two 64-column halves (columnwise blocks are per column; the rowwise amax
            # spans both): less live FP32 state next to the transposed store
            v_lo, v_hi = tl.split(tl.permute(tl.reshape(value, (BM, 2, BN // 2)), (0, 2, 1)))
            _store_quantized_halves(v_lo, v_hi, row0, row_ok, pid_n * BN, pid_m, q_ptr, stride_qm,
                                    qs_ptr, stride_qsm, stride_qsk, qt_ptr, stride_qtn, qts_ptr, stride_qtst,
                                    value_for_inf, ROWWISE, COLWISE, MANT, EBIAS, FP8_MAX, POW2)
        else:
            _store_quantized(value, row0, row_ok, pid_n * BN, pid_m, q_ptr, stride_qm, qs_ptr, stride_qsm, stride_qsk,
                             qt_ptr, stride_qtn, qts_ptr, stride_qtst, value_for_inf, ROWWISE, COLWISE, MANT, EBIAS,
                             FP8_MAX, POW2)
    else:
        # acc = da, the gradient of act(h) * p
        if HAS_PROBS:
            p = tl.load(probs_ptr + rows64, mask=row_ok, other=0.0).to(tl.float32)
        else:
            p = tl.full((BM,), 1.0, tl.float32)
        if SPLIT_EPILOGUE:
            # two 64-column halves in turn (as the BF16 dGLU kernel does): da, gate, up and their
            # gradients for the whole 128-wide tile at once would spill registers
            acc_lo, acc_hi = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))
            cols_lo = pid_n * BN + tl.arange(0, BN // 2)
            cols_hi = cols_lo + BN // 2
            dg_lo, du_lo, part, dbg_lo, dbu_lo = _dact_half(acc_lo, row0, row_ok, pid_n * BN, N, p, h_ptr, stride_hm,
                                                            h_up_offset, alpha, limit, is_padding, ACT, GATED)
            dg_hi, du_hi, part_hi, dbg_hi, dbu_hi = _dact_half(acc_hi, row0, row_ok, pid_n * BN + BN // 2, N, p, h_ptr,
                                                               stride_hm, h_up_offset, alpha, limit, is_padding, ACT,
                                                               GATED)
            if WRITE_DPROB:
                tl.store(dprob_ptr + pid_n * stride_dprob_part + rows64, part + part_hi, mask=row_ok)
            if WRITE_DBIAS:
                db_ptrs = dbias_ptr + pid_m * stride_dbias_t
                tl.store(db_ptrs + cols_lo, dbg_lo)
                tl.store(db_ptrs + cols_hi, dbg_hi)
                if GATED:
                    tl.store(db_ptrs + h_up_offset + cols_lo, dbu_lo)
                    tl.store(db_ptrs + h_up_offset + cols_hi, dbu_hi)
            _store_quantized_halves(dg_lo, dg_hi, row0, row_ok, pid_n * BN, pid_m, q_ptr, stride_qm, qs_ptr,
                                    stride_qsm, stride_qsk, qt_ptr, stride_qtn, qts_ptr, stride_qtst, value_for_inf,
                                    ROWWISE, COLWISE, MANT, EBIAS, FP8_MAX, POW2)
            if GATED:
                _store_quantized_halves(du_lo, du_hi, row0, row_ok, pid_n * BN + q_up_offset, pid_m, q_ptr, stride_qm,
                                        qs_ptr, stride_qsm, stride_qsk, qt_ptr, stride_qtn, qts_ptr, stride_qtst,
                                        value_for_inf, ROWWISE, COLWISE, MANT, EBIAS, FP8_MAX, POW2)
        else:
            h_ptrs = h_ptr + rows64[:, None] * stride_hm + cols[None, :]
            g, u = load_gate_up(h_ptrs, h_up_offset, out_mask, GATED)
            dg, du, value = act_backward(g, u, acc * p[:, None], alpha, limit, ACT)
            if WRITE_DPROB:
                part = tl.sum(tl.where(out_mask, acc * value, 0.0), axis=1)
                tl.store(dprob_ptr + pid_n * stride_dprob_part + rows64, part, mask=row_ok)
            if WRITE_DBIAS:
                db_ptrs = dbias_ptr + pid_m * stride_dbias_t + cols
                tl.store(db_ptrs, tl.sum(tl.where(out_mask, dg, 0.0), axis=0), mask=col_ok)
                if GATED:
                    tl.store(db_ptrs + h_up_offset, tl.sum(tl.where(out_mask, du, 0.0), axis=0), mask=col_ok)
            dg = tl.where(is_padding, 0.0, dg)
            _store_quantized(dg, row0, row_ok, pid_n * BN, pid_m, q_ptr, stride_qm, qs_ptr, stride_qsm, stride_qsk,
                             qt_ptr, stride_qtn, qts_ptr, stride_qtst, value_for_inf, ROWWISE, COLWISE, MANT, EBIAS,
                             FP8_MAX, POW2)
            if GATED:
                du = tl.where(is_padding, 0.0, du)
                _store_quantized(du, row0, row_ok, pid_n * BN + q_up_offset, pid_m, q_ptr, stride_qm, qs_ptr,
                                 stride_qsm, stride_qsk, qt_ptr, stride_qtn, qts_ptr, stride_qtst, value_for_inf,
                                 ROWWISE, COLWISE, MANT, EBIAS, FP8_MAX, POW2)


def launch(kind: str, a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, n: int,
           schedule: torch.Tensor, num_experts: int, spec: FP8Spec, *, c: Optional[torch.Tensor] = None,
           q=None, q_up_offset: int = 0, h: Optional[torch.Tensor] = None, h_up_offset: int = 0,
           b_up_rows: int = 0, bias: Optional[torch.Tensor] = None, bias_up_offset: int = 0,
           probs: Optional[torch.Tensor] = None, dprob: Optional[torch.Tensor] = None,
           dbias: Optional[torch.Tensor] = None, activation: str = "swiglu", alpha: float = 1.702,
           limit: float = 7.0, gated: bool = False, config: Optional[FP8GemmConfig] = None):
    """One FP8 grouped GEMM. ``a`` [T, K] FP8 + ``a_scale`` [T, K/128]; ``b`` [E, rows, K] FP8 K-major
    (contiguous) + ``b_scale`` [E, rows/128, K/128] (any strides); ``n`` output columns (the gate
    half for gated FC1/DACT; a plain GEMM's may be off the tile where B's rows cover the last one:
    its columns past ``n`` are computed, not stored; FC1's may be too, B's rows padded to whole tiles
    with the up half at ``b_up_rows`` = n: its epilogue then runs alone and writes zero codes past
    ``n``, padded.py). ``q`` (FC1/DACT): a
    :class:`~.quantize.QuantizedRows` whose present copies are written. ``dprob``: FP32 ``[cdiv(n, BN), T]`` partials; ``dbias``: FP32
    ``[max_m_tiles, width]`` per-tile column sums of ``dh``."""
    mode = GEMM_MODES[kind]
    cfg = config or default_config(kind)
    num_rows, k = a.shape
    # FC1 with F off the tile (padded.py): the GEMM over all of B's rows, then the epilogue alone
    fc1_off_tile = mode == MODE_FC1 and n % BLOCK != 0
    if k % BLOCK or tiled_width(mode, n, b.shape[1], BLOCK) % BLOCK:
        raise ValueError(f"FP8 block GEMM: K={k} and N={n} must be multiples of {BLOCK}")
    if mode != MODE_PLAIN and cfg.block_n != BLOCK:
        raise ValueError(f"config: the quantizing epilogues need block_n={BLOCK}, got {cfg.block_n}")
    if fc1_off_tile and (cfg.epilogue or FC1_EPILOGUE) == "fused":
        raise ValueError(f"config: FC1 with N={n} off the {BLOCK} tile runs its epilogue alone; epilogue='fused' "
                         "cannot (its K loop finds the up half's weight blocks at whole tiles only)")
    if mode == MODE_PLAIN and _plain_on_gluon(cfg, a, b):
        from .wgmma_ws import launch_plain

        return launch_plain(a, a_scale, b, b_scale, n, schedule, num_experts, c, bias, group_m=cfg.group_m,
                            num_stages=cfg.num_stages, ctas_per_sm=cfg.ctas_per_sm,
                            consumers=PLAIN_CONSUMERS if cfg.consumers is None else cfg.consumers,
                            tma_store=PLAIN_TMA_STORE if cfg.tma_store is None else cfg.tma_store)
    acc_in = mode != MODE_PLAIN and (fc1_off_tile or _separate_epilogue(kind, cfg, a, b))
    acc_is_h = False
    if acc_in:
        # the GEMM alone (all of B's rows: FC1's gate and up halves) with the fastest plain kernel,
        # then this kernel's epilogue on its output
        c, acc_is_h = _separate_gemm_output(mode, num_rows, b, h, h_up_offset, b_up_rows, bias, bias_up_offset)
        launch("fc2", a, a_scale, b, b_scale, b.shape[1], schedule, num_experts, spec, c=c,
               bias=bias if acc_is_h else None)
        if acc_is_h:
            bias = None  # added by the GEMM
    m_tiles = max_m_tiles(num_rows, num_experts, BLOCK)
    grid = (m_tiles * triton.cdiv(n, cfg.block_n),)
    rowwise, colwise = quantized_copies(q)
    use_tma = cfg.use_tma and USE_TMA_DEFAULT and tma_allowed(a, b) and not acc_in
    a_src, b_src = operand_sources(a, b, BLOCK, cfg.block_n, BLOCK, use_tma)
    return fp8_grouped_gemm_kernel[grid](
        *kernel_operands(a_src, a, a_scale, b_src, b, b_scale, b_up_rows, c, q, q_up_offset, h, h_up_offset, bias,
                         bias_up_offset, probs, dprob, dbias),
        schedule,
        num_rows, n, k, float(alpha), float(limit), FLOAT32_MAX, m_tiles, num_experts + 1,
        MODE=mode, ACT=ACT_IDS[activation], GATED=gated,
        HAS_BIAS=bias is not None, HAS_PROBS=probs is not None, WRITE_DPROB=dprob is not None,
        WRITE_DBIAS=dbias is not None, ROWWISE=rowwise, COLWISE=colwise, USE_TMA=use_tma, UPCAST=interpreting(),
        ACC_IN=acc_in, ACC_IS_H=acc_is_h, SPLIT_EPILOGUE=mode != MODE_PLAIN and _split(cfg, acc_in),
        **spec.constexprs(), BM=BLOCK, BN=cfg.block_n, BK=BLOCK, GROUP_M=cfg.group_m,
        **_launch_shape(cfg, acc_in),
    )


def _separate_gemm_output(mode: int, num_rows: int, b: torch.Tensor, h: torch.Tensor, h_up_offset: int,
                          b_up_rows: int, bias, bias_up_offset: int):
    """``(c, c_is_h)``: where a separate epilogue's GEMM writes (see ``EPILOGUE_INPUT_DTYPE``). FC1's
    GEMM writes ``h`` itself where ``h`` holds B's rows as its columns (the up half at B's up rows,
    and b1's likewise); otherwise a transient [T, B's rows] buffer."""
    dtype = EPILOGUE_INPUT_DTYPE or h.dtype
    whole_h = (h.shape[1] == b.shape[1] and h.stride(1) == 1 and h_up_offset == b_up_rows
               and (bias is None or (bias.shape[1] == b.shape[1] and bias_up_offset == b_up_rows)))
    if mode == MODE_FC1 and dtype == h.dtype and whole_h:
        return h, True
    return torch.empty((num_rows, b.shape[1]), device=b.device, dtype=dtype), False


def _split(cfg: FP8GemmConfig, acc_in: bool) -> bool:
    """Whether the FC1 / dGLU epilogue works in two 64-column halves (see ``split_epilogue``)."""
    return cfg.split_epilogue if cfg.split_epilogue is not None else not acc_in


def _launch_shape(cfg: FP8GemmConfig, acc_in: bool) -> dict:
    """Warps, stages and register cap of a launch: the epilogue alone has no K loop to pipeline."""
    if not acc_in:
        return dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return dict(num_warps=cfg.alone_warps or EPILOGUE_ALONE_WARPS, num_stages=1,
                **register_cap(cfg.alone_maxnreg or EPILOGUE_ALONE_MAXNREG))


def gluon_kernels_available() -> Optional[str]:
    """None if this Triton has the Gluon API the kernels of :mod:`.wgmma_ws` are written against
    (Triton 3.6 on; the names later releases changed are resolved in :mod:`.gluon_names`), else why
    not. Asked on every launch: the answer is cached per Triton version."""
    return _gluon_check(triton.__version__)


@functools.lru_cache(maxsize=None)
def _gluon_check(version: str) -> Optional[str]:
    major, minor = (int(v) for v in re.findall(r"\d+", version)[:2])
    if (major, minor) < (3, 6):
        return f"the Gluon kernels need triton>=3.6 (Gluon's Hopper API), found {version}"
    try:
        importlib.import_module(".wgmma_ws", __package__)
    except ImportError as exc:
        return f"triton.experimental.gluon did not import: {exc}"
    return None


def on_gluon(engine: str, option: str, runs_here: Callable[[], bool], why_not_here: Callable[[], str]) -> bool:
    """Resolves an engine switch ("auto", "gluon" or "triton", named ``option`` in errors): "auto" is
    Gluon where ``runs_here()`` (and the Gluon API, and no interpreter), "gluon" is Gluon or an error
    saying why not (``why_not_here()`` when the API is there but the operands or GPU are not)."""
    if engine == "triton" or (engine == "auto" and interpreting()):
        return False
    if engine not in ("auto", "gluon"):
        raise ValueError(f"{option}: expected 'auto', 'gluon' or 'triton', got {engine!r}")
    missing = gluon_kernels_available()
    if missing is None:
        if runs_here():
            return True
        missing = why_not_here()
    if engine == "gluon":
        raise ValueError(f"{option}='gluon': {missing}")
    return False


def engines_on(device: torch.device) -> dict:
    """Which kernels the FP8 block recipe runs on ``device`` with the current defaults, and why not the
    Gluon ones where not (``te-fused-moe env``)."""
    from . import wgrad

    why_not = gluon_kernels_available()
    if why_not is None and not (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9):
        why_not = f"the Gluon kernels are written for sm_90 (Hopper); this is {device}"
    if why_not is None and interpreting():
        why_not = "TRITON_INTERPRET=1 (Gluon has no interpreter)"
    gluon = why_not is None and PLAIN_ENGINE != "triton"
    separate = {kind: how == "separate" or (how == "auto" and gluon)
                for kind, how in (("fc1", FC1_EPILOGUE), ("dact", DACT_EPILOGUE))}
    wgrad_gluon = wgrad.WGRAD_ENGINE in ("gluon", "auto") and why_not is None
    return {
        "plain GEMMs": "gluon, warp-specialised" if gluon else f"triton ({why_not or 'PLAIN_ENGINE'})",
        "FC1 / dGLU": ", ".join(f"{k}: {'GEMM + epilogue alone' if v else 'one kernel'}" for k, v in separate.items()),
        "wgrad": "gluon, warp-specialised" if wgrad_gluon else f"triton ({why_not or 'WGRAD_ENGINE'})",
    }


def _plain_on_gluon(cfg: FP8GemmConfig, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a plain GEMM runs the Gluon kernel: "auto" where it can, "gluon" or an error."""
    def usable() -> bool:
        from .wgmma_gemm import usable

        return usable(a, b)

    return on_gluon(cfg.plain_engine or PLAIN_ENGINE, "plain_engine", usable,
                    lambda: ("the Gluon FP8 block GEMM needs an sm_90 GPU and FP8 operands with TMA-legal layouts "
                             f"(got {a.dtype} on {a.device}, b {b.dtype}, contiguous={b.is_contiguous()})"))


def _separate_epilogue(kind: str, cfg: FP8GemmConfig, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether FC1 / the dGLU run as the plain GEMM + the epilogue alone (see ``FC1_EPILOGUE``)."""
    return separate_epilogue(cfg.epilogue or (FC1_EPILOGUE if kind == "fc1" else DACT_EPILOGUE),
                             lambda: _plain_on_gluon(default_config("fc2"), a, b))
