"""NVFP4 grouped GEMMs with the MoE epilogues.

``C[rows of expert e] = A_e @ B_e^T`` with ``A`` [T, K] NVFP4 (packed ``[T, K/2]``, 1x16 E4M3
scales ``sa`` [T, K/16], one tensor amax per group ``amax_a`` [E + 1]) and ``B_e`` [N, K] NVFP4,
K-major (``[E, N, K/2]``, scales ``[E, N, K/16]``, ``amax_b`` [E]).

Hopper has neither FP4 nor block-scaled tensor cores. An E2M1 code times its E4M3 block scale is
exact in BF16 (2 + 4 significant bits fit 8), so every GEMM runs BF16 wgmma on exact expansions,
taken per operand one of two ways (``A_BF16`` / ``B_BF16``):

- read as BF16 values that an expansion pass wrote just before the GEMM (``quantize.expand_values``;
  the default, ``autograd.EXPAND_BEFORE_GEMM``) or that the weight cache holds (``NVSpec.bf16_values``):
  the K loop is a plain BF16 GEMM's (run 15 on the H200: 365-620 TFLOP/s);
- expanded from packed codes in the K loop, per K step of 128, as two halves (even and odd elements:
  ``codec.e2m1_expand_halves``), one BF16 wgmma per half: no extra bytes, but the expansion in the
  MMA warps bounds the loop (run 14: 90-190 TFLOP/s).

Expanded values are stored in the same split order (each 128-wide K block even elements first), so
any mix of the two pairs the halves alike. The two tensor scales are one FP32 factor per tile,
``(amax_a / 2688) * (amax_b / 2688)``, applied in the epilogue. That is
the Blackwell block-scaled MMA's product up to the order of FP32 sums (the reference dequantizes
each element with the factor rounded in; the difference is FP32 rounding).

Where both operands are BF16 values, every GEMM runs on the BF16 backend's persistent grouped GEMM instead
(``VALUES_ON_BF16_KERNEL``, ``NVGemmConfig.bf16_kernel``), on this recipe's schedule, with the factor per group
(:func:`group_factors`) multiplying its FP32 sums before the same epilogues, and a K step of 64: each 128-wide
K block's even half, then its odd half, the order this kernel sums them in.

Unlike the FP8 recipes, the FC1 and dGLU epilogues write ``a`` / ``dh`` in FP32 rather than
quantized: their tensor scale needs the amax of the whole expert slice first (``quantize`` runs
the amax and quantize passes after the GEMM).

Modes (``MODE``): ``PLAIN`` ``C = A @ B^T (+ bias)`` (FC2 forward, FC1 dgrad); ``FC1`` h saved and
``a = act(h) * p`` (``grouped_gemm.fc1_epilogue``); ``DACT`` ``dh = d act(h) * (da * p)`` and
dprob partials (``grouped_gemm.dact_epilogue``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch
import triton
import triton.language as tl

from ..act_math import ACT_IDS, to_output
from ..block_scaled_launch import GEMM_MODES, MODE_DACT, operand_sources, or_dummy, tma_allowed
from ..grouped_gemm import (column_halves, dact_epilogue, fc1_epilogue, interpreting, store_activation,
                            store_gate_up_grads)
from ..padded import padded_size
from ..schedule import max_m_tiles, swizzle, tile_rows, total_tiles
from .codec import DEQUANT_FACTOR, e2m1_expand_halves
from .quantize import TILE

BLOCK_K = 128  # elements per K step: 64 bytes of packed codes, eight scale blocks
USE_TMA_DEFAULT = True  # tests flip it to cover the pointer-load path under the interpreter
# Where both operands are BF16 values, every GEMM (FC1 with a in FP32, FC2, the dGLU with dh in FP32, FC1's dgrad)
# runs on the BF16 backend's persistent grouped GEMM, the two tensor scales one FP32 factor per group on its sums
# (as MXFP8's values path does since runs 35-36; run 41). False: this module's kernel for every GEMM.
VALUES_ON_BF16_KERNEL = True


@dataclass(frozen=True)
class NVGemmConfig:
    block_n: int = 128
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    split_epilogue: bool = True  # dGLU epilogue in two 64-column halves (register pressure)
    # run on the BF16 backend's kernel (both operands BF16 values); block_n is then that kernel's N tile, which
    # sets the dGLU's dprob partials (one row per N tile)
    bf16_kernel: bool = False


def default_config(kind: str, bf16_operands: bool = False) -> NVGemmConfig:
    """``kind``'s config. With both operands as BF16 values (``bf16_operands``) and ``VALUES_ON_BF16_KERNEL``: the
    BF16 backend's kernel at its N tile for ``kind`` (:func:`bf16_kernel_config`); else :func:`own_config`."""
    if bf16_operands and VALUES_ON_BF16_KERNEL:
        return NVGemmConfig(block_n=bf16_kernel_config(kind, TILE, TILE).block_n, bf16_kernel=True)
    return own_config(kind, bf16_operands)


def own_config(kind: str, bf16_operands: bool = False) -> NVGemmConfig:
    """This module's kernel: BM = 128 (schedule tiles), BK = 128, 8 warps (at 4, FC2 and the dgrad spilled in
    their K loops: offline sm_90a build, run 14). Expanding in the K loop: FC1 at BN = 128 (as MXFP8's expansion
    loop measured best, ``mxfp8.gemm.default_config``), the others at BN = 64. Reading BF16 values
    (``bf16_operands``), measured at DSv3 on the H200 (run 15): FC2 / FC1 dgrad at BN = 128, 3 stages
    (577 / 618 TFLOP/s; 380-430 at BN = 64 or 256 or 2 stages); FC1 at BN = 64, 3 stages (527; 448 at
    BN = 128, where its two B tiles leave shared memory for two stages only); the dGLU at BN = 64,
    4 stages (365; at 128 its epilogue spills: sm_90a ptxas)."""
    if kind not in ("fc1", "fc2", "dact", "dgrad"):
        raise ValueError(f"kind: expected 'fc1', 'fc2', 'dact' or 'dgrad', got {kind!r}")
    if interpreting():
        return NVGemmConfig(block_n=64, group_m=2, num_warps=4, num_stages=1)
    if bf16_operands:
        if kind == "fc1":
            return NVGemmConfig(block_n=64, num_warps=8, num_stages=3)
        if kind == "dact":
            return NVGemmConfig(block_n=64, num_warps=8, num_stages=4)
        return NVGemmConfig(block_n=128, num_warps=8, num_stages=3)
    if kind == "fc1":
        return NVGemmConfig(block_n=128, num_warps=8, num_stages=3)
    return NVGemmConfig(block_n=64, num_warps=8, num_stages=4)


@triton.jit
def operand_halves(src, ptrs, row, kt, s_ptrs, kb, stride_sk, USE_TMA: tl.constexpr, UPCAST: tl.constexpr,
                   BF16: tl.constexpr, ROWS: tl.constexpr, BK: tl.constexpr):
    """An operand's K step ``kt`` (``ROWS`` rows from ``row``) as (even, odd) [ROWS, BK / 2] halves: two
    loads of BF16 values stored even elements first in each BK block (``quantize.expand_values``), or
    one load of packed codes expanded here with their scales (``s_ptrs``: the rows' scale pointers)."""
    if BF16:
        if USE_TMA:
            even = src.load([row, kt * BK])
            odd = src.load([row, kt * BK + BK // 2])
        else:
            even = tl.load(ptrs + kt * BK)
            odd = tl.load(ptrs + kt * BK + BK // 2)
        if UPCAST:
            return even.to(tl.float32), odd.to(tl.float32)
        else:
            return even, odd
    else:
        if USE_TMA:
            packed = src.load([row, kt * (BK // 2)])
        else:
            packed = tl.load(ptrs + kt * (BK // 2))
        return e2m1_expand_halves(packed, tl.load(s_ptrs[:, None] + kb[None, :] * stride_sk), ROWS, BK, UPCAST)


@triton.jit
def nv_grouped_gemm_kernel(
    a_src, stride_am, as_ptr, stride_asm, stride_ask, amax_a_ptr,
    b_src, stride_be, stride_bn, bs_ptr, stride_bse, stride_bsn, stride_bsk, amax_b_ptr, B_ROWS, b_up_rows,
    c_ptr, stride_cm, c_up_offset,
    h_ptr, stride_hm, h_up_offset,
    bias_ptr, stride_bias_e, bias_up_offset,
    probs_ptr, dprob_ptr, stride_dprob_part,
    sched_ptr,
    T, N, K, alpha, limit, MAX_M_TILES, NUM_GROUPS,
    MODE: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_PROBS: tl.constexpr, WRITE_DPROB: tl.constexpr,
    USE_TMA: tl.constexpr, UPCAST: tl.constexpr, SPLIT_EPILOGUE: tl.constexpr, A_BF16: tl.constexpr,
    B_BF16: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
):
    # --- which tile: GROUP_M swizzle for L2 reuse of B, then (group, row block) on the device
    pid_m, pid_n = swizzle(tl.program_id(0), MAX_M_TILES, tl.cdiv(N, BN), GROUP_M)
    if pid_m >= total_tiles(sched_ptr, NUM_GROUPS):
        return
    group, a_row, row_end = tile_rows(sched_ptr, pid_m, BM, NUM_GROUPS)
    is_padding = group == NUM_GROUPS - 1
    expert = tl.minimum(group, NUM_GROUPS - 2)
    rows_in = tl.minimum(a_row + tl.arange(0, BM), T - 1).to(tl.int64)  # scale (and pointer) loads stay inside
    cols_in = tl.minimum(pid_n * BN + tl.arange(0, BN), N - 1)
    offs_k = tl.arange(0, BK // 2)  # bytes of packed codes, or BF16 values of one half of a K step
    b_row = expert * B_ROWS + pid_n * BN
    e64 = expert.to(tl.int64)
    sa_ptrs = as_ptr + rows_in * stride_asm
    sb_ptrs = bs_ptr + e64 * stride_bse + cols_in * stride_bsn
    if USE_TMA:
        a_ptrs = 0  # unused: the descriptors address the tiles
        b_ptrs = 0
    else:
        a_ptrs = a_src + rows_in[:, None] * stride_am + offs_k[None, :]
        b_ptrs = b_src + e64 * stride_be + cols_in.to(tl.int64)[:, None] * stride_bn + offs_k[None, :]

    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if GATED and MODE == 1:
        acc_up = tl.zeros((BM, BN), dtype=tl.float32)
    for kt in range(0, tl.where(is_padding, 0, K // BK)):
        kb = kt * (BK // 16) + tl.arange(0, BK // 16)
        a_even, a_odd = operand_halves(a_src, a_ptrs, a_row, kt, sa_ptrs, kb, stride_ask, USE_TMA, UPCAST, A_BF16, BM,
                                       BK)
        b_even, b_odd = operand_halves(b_src, b_ptrs, b_row, kt, sb_ptrs, kb, stride_bsk, USE_TMA, UPCAST, B_BF16,
                                       BN, BK)
        acc = tl.dot(a_even, tl.trans(b_even), acc)
        acc = tl.dot(a_odd, tl.trans(b_odd), acc)
        if GATED and MODE == 1:
            up_even, up_odd = operand_halves(b_src, b_ptrs + b_up_rows * stride_bn, b_row + b_up_rows, kt,
                                             sb_ptrs + b_up_rows * stride_bsn, kb, stride_bsk, USE_TMA, UPCAST,
                                             B_BF16, BN, BK)
            acc_up = tl.dot(a_even, tl.trans(up_even), acc_up)
            acc_up = tl.dot(a_odd, tl.trans(up_odd), acc_up)

    # --- epilogue, FP32: the two tensor scales (padding tiles have no K loop and may hold any amax)
    factor = (tl.load(amax_a_ptr + group) * DEQUANT_FACTOR) * (tl.load(amax_b_ptr + expert) * DEQUANT_FACTOR)
    factor = tl.where(is_padding, 0.0, factor)
    acc = acc * factor
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < N
    rows = tl.arange(0, BM) + a_row
    row_ok = rows < row_end
    rows64 = rows.to(tl.int64)
    bias_mask = col_ok & (group < NUM_GROUPS - 1)
    if MODE == 0:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + expert * stride_bias_e + cols, mask=bias_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(c_ptr + rows64[:, None] * stride_cm + cols[None, :], to_output(acc, c_ptr.dtype.element_ty, UPCAST),
                 mask=row_ok[:, None] & col_ok[None, :])
    elif MODE == 1:
        # a in the output dtype (grouped_gemm.store_activation), quantized by a pass after this GEMM
        if GATED:
            fc1_epilogue(acc, acc_up * factor, rows64, row_ok, cols, col_ok, bias_mask,
                         bias_ptr + expert * stride_bias_e, bias_up_offset, h_ptr, stride_hm, h_up_offset, c_ptr,
                         stride_cm, probs_ptr, is_padding, pid_m, (), alpha, limit, ACT, GATED, HAS_BIAS, HAS_PROBS,
                         UPCAST, store_activation, ())
        else:
            fc1_epilogue(acc, acc, rows64, row_ok, cols, col_ok, bias_mask, bias_ptr + expert * stride_bias_e,
                         bias_up_offset, h_ptr, stride_hm, h_up_offset, c_ptr, stride_cm, probs_ptr, is_padding,
                         pid_m, (), alpha, limit, ACT, GATED, HAS_BIAS, HAS_PROBS, UPCAST, store_activation, ())
    else:
        # acc = da, the gradient of act(h) * p; dh is written for padding rows too (as zeros: da = 0)
        if HAS_PROBS:
            p = tl.load(probs_ptr + rows64, mask=row_ok, other=0.0).to(tl.float32)
        else:
            p = tl.full((BM,), 1.0, tl.float32)
        if SPLIT_EPILOGUE:
            acc_lo, acc_hi = column_halves(acc, BM, BN // 2)
            cols_lo = pid_n * BN + tl.arange(0, BN // 2)
            part = dact_epilogue(acc_lo, rows64, row_ok, cols_lo, N, p, h_ptr, stride_hm, h_up_offset, c_ptr,
                                 stride_cm, c_up_offset, is_padding, pid_m, (), alpha, limit, ACT, GATED, UPCAST,
                                 store_gate_up_grads, ())
            part += dact_epilogue(acc_hi, rows64, row_ok, cols_lo + BN // 2, N, p, h_ptr, stride_hm, h_up_offset,
                                  c_ptr, stride_cm, c_up_offset, is_padding, pid_m, (), alpha, limit, ACT, GATED,
                                  UPCAST, store_gate_up_grads, ())
        else:
            part = dact_epilogue(acc, rows64, row_ok, cols, N, p, h_ptr, stride_hm, h_up_offset, c_ptr, stride_cm,
                                 c_up_offset, is_padding, pid_m, (), alpha, limit, ACT, GATED, UPCAST,
                                 store_gate_up_grads, ())
        if WRITE_DPROB:
            tl.store(dprob_ptr + pid_n * stride_dprob_part + rows64, part, mask=row_ok)


def launch(kind: str, a, b, n: int, schedule: torch.Tensor, num_experts: int, *, c: torch.Tensor,
           c_up_offset: int = 0, h: Optional[torch.Tensor] = None, h_up_offset: int = 0, b_transposed: bool = False,
           b_up_rows: int = 0, bias: Optional[torch.Tensor] = None, bias_up_offset: int = 0,
           probs: Optional[torch.Tensor] = None, dprob: Optional[torch.Tensor] = None, activation: str = "swiglu",
           alpha: float = 1.702, limit: float = 7.0, gated: bool = False, config: Optional[NVGemmConfig] = None):
    """One NVFP4 grouped GEMM. ``a``: a rowwise ``quantize.NVRows`` ([T, K]); ``b``: a
    ``quantize.NVWeight`` read as ``[E, n_rows, K]`` (``b_transposed``: its ``data_t`` / ``scale_t``
    copy); ``n`` output columns (the gate half for gated FC1/DACT; off the tile where B's rows are
    zero-padded to it, padded.py: only columns before ``n`` are stored). ``c``: the output (``y`` / ``dx``
    in PLAIN mode, FP32 ``a`` for FC1, FP32 ``dh`` for DACT, its up half at ``c_up_offset``).
    ``dprob``: FP32 ``[n / block_n, T]`` partials."""
    mode = GEMM_MODES[kind]
    a_data, a_scale = a.data, a.scale
    b_data, b_scale = (b.data_t, b.scale_t) if b_transposed else (b.data, b.scale)
    b_values = b.values_t if b_transposed else b.values
    both_values = a.values is not None and b_values is not None
    cfg = config or (default_config(kind, True) if both_values else own_config(kind, a.values is not None))
    if a_data is None or b_data is None:
        raise ValueError("a, b: the GEMM needs a's rowwise copy and b's copy along the reduction axis")
    num_rows, k = a_data.shape[0], 2 * a_data.shape[1]
    # N may end inside the last tile (padded.py: B's rows zero-padded to it): every store is masked at n
    if k % BLOCK_K or b_data.shape[1] < padded_size(n, TILE) or b_data.shape[2] * 2 != k:
        raise ValueError(f"NVFP4 GEMM: K={k} (b: {2 * b_data.shape[2]}) must match and be a multiple of {BLOCK_K}, "
                         f"and b's {b_data.shape[1]} rows cover N={n} in whole tiles of {TILE}")
    # exact BF16 expansions written before the GEMM (or held by the weight cache): no expansion in the K loop
    if a.values is not None:
        a_data = a.values
    if b_values is not None:
        b_data = b_values
    if dprob is not None and dprob.shape[0] != triton.cdiv(n, cfg.block_n):
        raise ValueError(f"dprob: expected one row of partials per N tile, {triton.cdiv(n, cfg.block_n)} at "
                         f"block_n={cfg.block_n}, got {tuple(dprob.shape)} (size it with default_config('dact', ...))")
    if cfg.bf16_kernel:
        if a.values is None or b_values is None:
            raise ValueError("config: bf16_kernel (the BF16 backend's kernel) needs both operands as BF16 values")
        return _on_bf16_kernel(kind, a_data, b_data, n, k, schedule, num_experts, group_factors(a.amax, b.amax,
                               num_experts), cfg.block_n, c=c, c_up_offset=c_up_offset, h=h, h_up_offset=h_up_offset,
                               b_up_rows=b_up_rows, bias=bias, bias_up_offset=bias_up_offset, probs=probs, dprob=dprob,
                               activation=activation, alpha=alpha, limit=limit, gated=gated)
    if TILE % cfg.block_n:
        raise ValueError(f"config: block_n={cfg.block_n} must divide {TILE}")
    m_tiles = max_m_tiles(num_rows, num_experts, TILE)
    grid = (m_tiles * triton.cdiv(n, cfg.block_n),)
    use_tma = USE_TMA_DEFAULT and tma_allowed(a_data, b_data)
    # boxes of 64 bytes of codes (one K step), or of 64 BF16 values (half a K step)
    a_src, b_src = operand_sources(a_data, b_data, TILE, cfg.block_n, BLOCK_K // 2, use_tma)
    dummy = a.amax
    return nv_grouped_gemm_kernel[grid](
        a_src, a_data.stride(0), a_scale, a_scale.stride(0), a_scale.stride(1), a.amax,
        b_src, b_data.stride(0), b_data.stride(1), b_scale, b_scale.stride(0), b_scale.stride(1), b_scale.stride(2),
        b.amax, b_data.shape[1], b_up_rows,
        c, c.stride(0), c_up_offset,
        *or_dummy(h, dummy, 0), h_up_offset,
        *or_dummy(bias, dummy, 0), bias_up_offset,
        probs if probs is not None else dummy, *or_dummy(dprob, dummy, 0),
        schedule,
        num_rows, n, k, float(alpha), float(limit), m_tiles, num_experts + 1,
        MODE=mode, ACT=ACT_IDS[activation], GATED=gated, HAS_BIAS=bias is not None, HAS_PROBS=probs is not None,
        WRITE_DPROB=dprob is not None, USE_TMA=use_tma, UPCAST=interpreting(),
        SPLIT_EPILOGUE=mode == MODE_DACT and cfg.split_epilogue, A_BF16=a.values is not None,
        B_BF16=b_values is not None, BM=TILE,
        BN=cfg.block_n, BK=BLOCK_K,
        GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def group_factors(amax_a: torch.Tensor, amax_b: torch.Tensor, num_experts: int) -> torch.Tensor:
    """FP32 ``[E + 1]``: ``(amax_a[g] / 2688) * (amax_b[g] / 2688)`` per group, rounded as this module's kernel
    rounds it (FP32 products, each amax times FP32 1/2688 first), 0 for the padding group."""
    dequant = DEQUANT_FACTOR.value  # a Python scalar (no host-to-device copy), taken in FP32 by FP32 products
    factors = (amax_a[:num_experts].float() * dequant) * (amax_b[:num_experts].float() * dequant)
    return torch.cat([factors, factors.new_zeros(1)])


def bf16_kernel_config(kind: str, n: int, k: int):
    """The BF16 backend's ``kind`` config at 128-row tiles (this recipe's schedule) and a K step of half this
    module's: its sums then run in this kernel's order (each 128-wide K block's even half, then its odd half, as
    the values are stored), under the interpreter too. FC1 at 3 stages: its FP32 ``a`` is staged for the store
    as MXFP8's FP32 h is, which 4 stages leave no room for (``mxfp8.gemm.fc1_values_config``). The dGLU at 64
    columns and 5 stages: its FP32 dh epilogue at the BF16 dGLU's 128 spilled ~800 instructions inside the
    flattened loop (offline sm_90a build), at 64 none (139 KB of shared memory)."""
    from .. import grouped_gemm

    cfg = replace(grouped_gemm.default_config(kind, n, k), block_m=TILE, block_k=BLOCK_K // 2,
                  use_tma=USE_TMA_DEFAULT)
    if kind == "fc1" and not interpreting():
        cfg = replace(cfg, num_stages=3)
    if kind == "dact" and not interpreting():
        cfg = replace(cfg, block_n=64, num_stages=5)
    return cfg


def _on_bf16_kernel(kind: str, a: torch.Tensor, b: torch.Tensor, n: int, k: int, schedule: torch.Tensor,
                    num_experts: int, factors: torch.Tensor, block_n: int, *, c: torch.Tensor, c_up_offset: int, h,
                    h_up_offset: int, b_up_rows: int, bias, bias_up_offset: int, probs, dprob, activation: str,
                    alpha: float, limit: float, gated: bool):
    """``kind`` on BF16 values ``a`` [T, K] and ``b`` [E, rows, K] by the BF16 backend's grouped GEMM at ``block_n``
    columns, ``factors`` (:func:`group_factors`) on its FP32 sums."""
    from .. import grouped_gemm

    strides = (b.stride(0), b.stride(2), b.stride(1))  # K-major [E, rows, K] read as [E, K, rows]
    cfg = replace(bf16_kernel_config(kind, n, k), block_n=block_n)
    act = dict(h=h, h_up_offset=h_up_offset, probs=probs, activation=activation, alpha=alpha, limit=limit, gated=gated)
    if kind == "fc1":
        epilogue = dict(act, b_up_rows=b_up_rows, bias=bias, bias_up_offset=bias_up_offset)
    elif kind == "dact":  # dh (FP32) at c and c_up_offset; dprob: partials per N tile
        epilogue = dict(act, c_up_offset=c_up_offset, dprob=dprob)
    else:  # FC2, FC1's dgrad: C = A @ B^T (+ bias)
        epilogue = dict(bias=bias)
    return grouped_gemm.launch_scheduled(kind, a, b, strides, n, k, c, schedule, num_experts, cfg, scale=factors,
                                         **epilogue)
