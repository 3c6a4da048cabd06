"""MXFP8 grouped GEMMs and the quantizing MoE epilogues.

``C[rows of expert e] = A_e @ B_e^T`` with ``A`` [T, K] FP8 (1x32 E8M0 scales ``sa`` [T, K/32]) and
``B_e`` [N, K] FP8, K-major (1x32 scales along K, ``sb`` [E, N, K/32]). Hopper's wgmma has no MX
scaling; two inner loops (``MXGemmConfig.expand_bf16``):

- **expand** (default): K steps of 128; both FP8 tiles are multiplied by their scales
  ``2^(e8m0 - 127)`` in registers and cast to BF16, which is exact (an FP8 value's 4 significant
  bits times a power of two fit BF16's 8), then one BF16 wgmma accumulates into the loop-carried
  FP32 accumulator. Either operand may also come as those BF16 values, expanded by a pass before
  the GEMM (``quantize.expand_values``; ``autograd.EXPAND_BEFORE_GEMM``): with both, the K loop
  is a plain BF16 GEMM's.
- **promote**: K steps of 32 (one scale block): ``acc += dot(a, b^T) * sa[:, None] * sb[None, :]``
  with FP8 wgmma; the power-of-two promotion is exact too.

Both give the block-scaled product up to the order of FP32 sums. Measured on the H200 (runs 12-13,
``benchmarks/NOTES.md``): expand 150-280 TFLOP/s, promote 100-210: the promotion's per-32-K FP32
pass on the CUDA cores stalls its short wgmma steps, while expansion is bounded by the conversion
work done in the MMA warps (producer warps would lift it: warp specialisation).

Modes (``MODE``), as in ``fp8_block.gemm``:

- ``PLAIN``: ``C = A @ B^T (+ bias)`` in the output dtype (FC2 forward, FC1 dgrad).
- ``FC1``: ``h = x_q @ w1^T + b1`` (saved), ``a = act(h) * p`` quantized from its FP32 value, in
  the epilogue: rowwise (1x32 along F: FC2's fprop operand) and columnwise (32 tokens, FC2's wgrad
  operand), amax in-kernel.
- ``DACT``: ``da = dy_q @ (w2^T)^T``; ``dh = d act(h) * (da * p)`` quantized rowwise (1x32 along
  2F: FC1 dgrad) and columnwise (w1's wgrad); ``dprob`` partial row sums of ``da * act(h)`` (one
  per N tile) and, with ``WRITE_DBIAS``, per-tile column sums of the FP32 ``dh`` (``db1``).

Where both operands are BF16 values, the plain GEMMs and FC1 run on the BF16 backend's persistent kernel
instead (``PLAIN_VALUES_KERNEL``, ``FC1_VALUES_KERNEL``), FC1 with this module's quantizing store of ``a``
(:func:`store_mx_activation`) as that kernel's store: the same bytes, faster host kernel.

The quantizing modes need ``BM = 128``, ``BN`` 64 or 128 and tiles that start at each expert's first row (the
schedule with ``block_m = 128``): a tile's rows then hold four whole 32-token blocks of one expert.
Quantized outputs are bit-exact with :mod:`te_fused_moe.quantize.mxfp8` on the same FP32 values.

Interpreter: ``UPCAST`` (``TRITON_INTERPRET=1`` only) keeps the tiles in FP32 for the dot (the
interpreter's low-precision dots are wrong); products of FP8 values are exact in FP32, so only the
summation order changes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch
import triton
import triton.language as tl

from ..act_math import ACT_IDS, act_backward, act_forward, load_gate_up, to_output
from ..block_scaled_launch import (GEMM_MODES, MODE_DACT, MODE_FC1, MODE_PLAIN, copies_arguments, kernel_operands,
                                   operand_sources, or_dummy, quantized_copies, separate_epilogue, tiled_width,
                                   tma_allowed)
from ..grouped_gemm import column_halves, interpreting
from ..operand_tiles import k_block, operand_tiles
from ..padded import padded_size
from ..schedule import max_m_tiles, swizzle, tile_rows, total_tiles
from . import dglu_epilogue
from .codec import expand_bf16, mx_dequant_scale
from .quantize import MX, TILE, MXSpec, store_mx

EXPAND_BLOCK_K = 128  # K step of the expand_bf16 loop: four scale blocks
# N tile of the dGLU on the BF16 backend's kernel (``DGLU_VALUES_KERNEL``): its dGLU config's
DGLU_VALUES_BLOCK_N = 128
# The GEMMs' default inner loop: BF16 wgmma on exactly expanded operands (True) or FP8 wgmma per 32-K
# block with FP32 promotion (False). Measured on the H200 (benchmarks/NOTES.md, run 13).
EXPAND_BF16_DEFAULT = True
# Tests flip this to cover the pointer-load path under the interpreter as well.
USE_TMA_DEFAULT = True
# How the dGLU runs: "fused" = one kernel; "separate" = this module's plain GEMM writes da ([T, F],
# transient, in EPILOGUE_INPUT_DTYPE), then the same kernel with ``ACC_IN`` runs the dGLU + quantize
# epilogue alone; "auto" (the default) = separate on CUDA, fused under the interpreter (with
# ``DGLU_VALUES_KERNEL = "bf16"``, on BF16 values: fused on the BF16 backend's kernel). At DSv3 on the H200
# the fused dGLU takes 2.84 ms against 1.63 ms for its GEMM alone; separate,
# 2.38-2.42 ms (runs 17d-e), and the MXFP8 MLP 20.99 ms vs 21.26 fused (1.14x its unfused path vs
# 1.11x). FC1 stays fused: 3.25 ms fused vs 2.98 ms for its GEMM alone leaves nothing for a separate
# epilogue to win.
DACT_EPILOGUE = "auto"
# The separate dGLU epilogue's kernel: "chunks" (``dglu_epilogue``: the tile's rows 32 at a time, as the
# quantize pass's chunked kernel) or "gemm" (this module's kernel with ``ACC_IN``; 8 warps at 255 registers,
# one program per SM). At DSv3 on an H100, the epilogue alone: 0.73 ms against 1.18 (run 34,
# ``dglu_epilogue``'s launch); at run 33's chunked launch it was the slower (the MLP 21.82 against 21.25 ms).
SEPARATE_DGLU_KERNEL = "chunks"
# The kernel of a plain GEMM whose operands are both BF16 values (the values path's FC2 forward, FC1
# dgrad and separate dGLU GEMM, in the fused and the unfused path alike): "bf16" = the BF16 backend's
# persistent grouped GEMM (``grouped_gemm.launch_scheduled``, 128 x 256 x 64 tiles, 3 stages); "mx" =
# this module's kernel (one program per tile, BK = 128). The same exact products summed in another
# order. At DSv3 on an H200 (run 35a, scripts/probe_mx_plain.py), ms mx -> bf16 (cuBLAS grouped_mm):
# FC2 1.674 -> 1.393 (1.430), FC1 dgrad 3.220 -> 2.794 (3.038), dGLU GEMM 1.649 -> 1.397 (1.498); the
# outputs bitwise equal on random data. The MXFP8 MLP: fused 18.57 -> 17.60 ms, unfused 22.79 -> 21.09.
# A launch given an explicit ``config`` runs this module's kernel with it.
PLAIN_VALUES_KERNEL = "bf16"
# The kernel of FC1 on BF16 values (x's values, w1's values) at an FFN size on the tile: "bf16" = the BF16
# backend's persistent grouped GEMM (128 x (128 + 128) x 64 tiles, gate and up in one TMA box, 3 stages)
# with its FC1 epilogue storing ``a`` through this module's quantizing store (:func:`store_mx_activation`);
# "mx" = this module's kernel (one program per tile, 128 x (64 + 64) x 128, 3 stages). The same bytes (h,
# a's values, codes and scales). Run 36b, H100, DSv3 (scripts/probe_mx_fc1.py): 3.554 ms on this module's
# kernel, 3.024 on the BF16 backend's at 3 stages (3.142 at its FC1 config's 4, 3.108 not flattened),
# against 2.893 for the BF16 backend's FC1 writing ``a`` in BF16 and 2.837 for the GEMM alone; the MXFP8
# MLP 19.17 -> 18.82 ms at 4 stages (1.24x -> 1.26x its unfused path, 23.69). A launch given an explicit
# ``config`` runs this module's kernel with it.
FC1_VALUES_KERNEL = "bf16"
# The kernel of the dGLU on BF16 values (dy's values, w2's) where its epilogue is "auto" (``DACT_EPILOGUE``):
# "mx" = the separate dGLU (this module's plain GEMM routed as above writing da, then ``dglu_epilogue``'s pass);
# "bf16" = fused on the BF16 backend's persistent grouped GEMM (its dGLU config, 128 x 128 x 64 tiles, the
# epilogue in two 64-column halves) with this module's quantizing store of dh (:func:`store_mx_gate_up_grads`:
# rowwise and columnwise, db1 per-tile sums) as that kernel's store, from the FP32 accumulator. The same bytes
# as this module's kernel running the dGLU as one kernel. Run 37b (H100, DSv3, scripts/probe_mx_dglu.py):
# separate 1.836 ms (GEMM 1.301 + epilogue 0.536); "bf16" 4.394 (4.117-4.549 at 3 stages, not flattened, one
# program per tile, GROUP_M 16), against 1.680 for the BF16 backend's dGLU writing dh in BF16: the quantizing
# store of two FP32 halves next to the 128 x 128 accumulator spills (~1 KB of stack offline, sm_90a), and the
# MLP went 18.14 -> 20.14 ms. Kept as the measured alternative. The route is taken by
# ``default_config("dact", True)`` (``MXGemmConfig.bf16_kernel``), whose N tile is the route's, since the dprob
# partials' count is the caller's (one per N tile).
DGLU_VALUES_KERNEL = "mx"
# The dtype of da for the separate dGLU epilogue. None: h's dtype (x's unless block_scaled.H_DTYPE
# says otherwise), as TE's dgrad GEMM writes BF16 for its dGLU kernel; torch.float32: the FP32
# accumulator, the same values through the same code as the fused kernel, so the same bytes as it.
EPILOGUE_INPUT_DTYPE: Optional[torch.dtype] = None


@dataclass(frozen=True)
class MXGemmConfig:
    block_n: int = 128
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 4
    split_epilogue: bool = True  # FC1 / dGLU epilogues in two independent 64-column halves (register pressure)
    expand_bf16: bool = False  # BF16 wgmma on operands expanded exactly in registers (see expand_bf16)
    epilogue: Optional[str] = None  # dGLU: "auto", "separate" or "fused"; None = DACT_EPILOGUE
    # the K step with both operands BF16 values (no scales read, so any multiple of 32): None = EXPAND_BLOCK_K;
    # 64 halves each stage's bytes, room for BN = 128 (gate and up) at 3-4 stages (scripts/probe_mx_fc1.py)
    block_k: Optional[int] = None
    # dGLU on BF16 values: fused on the BF16 backend's kernel (``DGLU_VALUES_KERNEL``; this config's block_n
    # is its N tile) where the epilogue resolves to "auto"; else this module's kernel with this config
    bf16_kernel: bool = False


def default_config(kind: str, bf16_operands: bool = False) -> MXGemmConfig:
    """BM = 128 always (four 32-token blocks of one expert per tile). BK = 128 with ``expand_bf16``
    (the default, four scale blocks per step), 32 with the promotion loop (one scale block per step).

    Measured at DSv3 on the H200 (runs 12-13, ``benchmarks/NOTES.md``): the BF16 loop beats the
    promotion loop on every GEMM (FC2 3.5 vs 5.3 ms, wgrads 3.7 / 7.4 vs 4.6 / 9.1 ms). FC1: BN = 128
    (7.0 ms vs 9.4 at 64). dGLU: BN = 64 at 8 warps (6.4 vs 6.8 ms at 128). FC2 / FC1 dgrad:
    128x64 tiles at 4 warps (3.5 / 6.8 ms vs 4.2 / 8.1 at 128x128, 8 warps): several CTAs per SM
    overlap one's operand expansion with another's wgmma. With the promotion loop, FC1 at BN = 128
    spills in its K loop (two accumulators plus two fresh dot results).

    ``bf16_operands`` (values expanded before the GEMM: a BF16 GEMM with these epilogues): NVFP4's
    BF16-valued configs on the H200 (run 15): FC1 and dGLU at BN = 64 (3 / 4 stages), FC2 and FC1
    dgrad at 128 x 128, 8 warps, 3 stages."""
    if kind not in ("fc1", "fc2", "dact", "dgrad"):
        raise ValueError(f"kind: expected 'fc1', 'fc2', 'dact' or 'dgrad', got {kind!r}")
    dglu_route = kind == "dact" and bf16_operands and DGLU_VALUES_KERNEL == "bf16"
    if interpreting():  # the GPU's tile shapes
        return MXGemmConfig(block_n=64, group_m=2, num_warps=4, num_stages=1,
                            expand_bf16=EXPAND_BF16_DEFAULT or bf16_operands, bf16_kernel=dglu_route)
    if dglu_route:  # the BF16 backend's dGLU tile; 3 stages where this module's kernel runs it (not "auto"): 4
        # need 262 KB of shared memory at 128 columns (run 37b: the launch failed)
        return MXGemmConfig(block_n=DGLU_VALUES_BLOCK_N, num_warps=8, num_stages=3, expand_bf16=True,
                            bf16_kernel=True)
    if bf16_operands:
        if kind in ("fc1", "dact"):
            return MXGemmConfig(block_n=64, num_warps=8, num_stages=3 if kind == "fc1" else 4, expand_bf16=True)
        return MXGemmConfig(block_n=128, num_warps=8, num_stages=3, expand_bf16=True)
    if kind == "fc1" and EXPAND_BF16_DEFAULT:  # run 13: 7.0 ms at BN = 128 vs 9.4 at 64 (dGLU: 6.8 vs 6.4)
        return MXGemmConfig(block_n=128, num_warps=8, num_stages=3, expand_bf16=True)
    if kind in ("fc1", "dact"):
        return MXGemmConfig(block_n=64, num_warps=8, num_stages=4, expand_bf16=EXPAND_BF16_DEFAULT)
    return MXGemmConfig(block_n=64, num_warps=4, num_stages=4, expand_bf16=EXPAND_BF16_DEFAULT)


@triton.jit
def _fc1_part(acc, acc_up, cols, rows64, row_ok, N, p, expert, is_padding, tile, group, NUM_GROUPS, h_ptr, stride_hm,
              h_up_offset, bias_ptr, stride_bias_e, bias_up_offset, alpha, limit, q_ptr, stride_qm, qs_ptr, stride_qsm,
              stride_qsk, qt_ptr, stride_qtn, qts_ptr, stride_qtsb, ACT: tl.constexpr, GATED: tl.constexpr,
              HAS_BIAS: tl.constexpr, ROWWISE: tl.constexpr, COLWISE: tl.constexpr, UPCAST: tl.constexpr,
              MANT: tl.constexpr, EBIAS: tl.constexpr, FP8_MAX: tl.constexpr, MAX_NORM_RCP: tl.constexpr,
              BM: tl.constexpr, BN: tl.constexpr):
    """FC1 epilogue of a block of columns: + b1, h saved, a = act(h) * p quantized (rowwise + columnwise)."""
    col_ok = cols < N
    out_mask = row_ok[:, None] & col_ok[None, :]
    bias_mask = col_ok & (group < NUM_GROUPS - 1)
    h_ptrs = h_ptr + rows64[:, None] * stride_hm + cols[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_bias_e + cols, mask=bias_mask, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(bias_ptr + expert * stride_bias_e + bias_up_offset + cols, mask=bias_mask,
                              other=0.0).to(tl.float32)[None, :]
    tl.store(h_ptrs, to_output(acc, h_ptr.dtype.element_ty, UPCAST), mask=out_mask)
    if GATED:
        tl.store(h_ptrs + h_up_offset, to_output(acc_up, h_ptr.dtype.element_ty, UPCAST), mask=out_mask)
        value = act_forward(acc, acc_up, alpha, limit, ACT)
    else:
        value = act_forward(acc, acc, alpha, limit, ACT)
    # zeros on the padding group and past N (FC1 at an F off the tile: zero codes there, padded.py)
    value = tl.where(bias_mask[None, :], value * p[:, None], 0.0)
    store_mx(value, rows64, row_ok, cols, tile, q_ptr, stride_qm, qs_ptr, stride_qsm, stride_qsk, qt_ptr, stride_qtn,
             qts_ptr, stride_qtsb, ROWWISE, COLWISE, MANT, EBIAS, FP8_MAX, MAX_NORM_RCP, BM, BN)


@triton.jit
def _dact_part(da, cols, rows64, row_ok, N, p, is_padding, tile, h_ptr, stride_hm, h_up_offset, alpha, limit,
               dbias_ptr, stride_dbias_t, q_up_offset, q_ptr, stride_qm, qs_ptr, stride_qsm, stride_qsk, qt_ptr,
               stride_qtn, qts_ptr, stride_qtsb, ACT: tl.constexpr, GATED: tl.constexpr, WRITE_DBIAS: tl.constexpr,
               ROWWISE: tl.constexpr, COLWISE: tl.constexpr, MANT: tl.constexpr, EBIAS: tl.constexpr,
               FP8_MAX: tl.constexpr, MAX_NORM_RCP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """dGLU epilogue of a block of columns: dh = d act(h) * (da * p) quantized (gate and up halves),
    db1 per-tile column sums; returns the row sums of ``da * act(h)`` (dprob partial)."""
    col_ok = cols < N
    out_mask = row_ok[:, None] & col_ok[None, :]
    h_ptrs = h_ptr + rows64[:, None] * stride_hm + cols[None, :]
    g, u = load_gate_up(h_ptrs, h_up_offset, out_mask, GATED)
    dg, du, value = act_backward(g, u, da * p[:, None], alpha, limit, ACT)
    part = tl.sum(tl.where(out_mask, da * value, 0.0), axis=1)
    if WRITE_DBIAS:
        db_ptrs = dbias_ptr + tile * stride_dbias_t + cols
        tl.store(db_ptrs, tl.sum(tl.where(out_mask, dg, 0.0), axis=0), mask=col_ok)
        if GATED:
            tl.store(db_ptrs + h_up_offset, tl.sum(tl.where(out_mask, du, 0.0), axis=0), mask=col_ok)
    dg = tl.where(is_padding, 0.0, dg)
    store_mx(dg, rows64, row_ok, cols, tile, q_ptr, stride_qm, qs_ptr, stride_qsm, stride_qsk, qt_ptr, stride_qtn,
             qts_ptr, stride_qtsb, ROWWISE, COLWISE, MANT, EBIAS, FP8_MAX, MAX_NORM_RCP, BM, BN)
    if GATED:
        du = tl.where(is_padding, 0.0, du)
        store_mx(du, rows64, row_ok, cols + q_up_offset, tile, q_ptr, stride_qm, qs_ptr, stride_qsm, stride_qsk,
                 qt_ptr, stride_qtn, qts_ptr, stride_qtsb, ROWWISE, COLWISE, MANT, EBIAS, FP8_MAX, MAX_NORM_RCP, BM, BN)
    return part


@triton.jit
def store_mx_activation(value, rows64, row_ok, cols, col_ok, tile, c_ptr, stride_cm, q, CONSTS: tl.constexpr,
                        UPCAST: tl.constexpr):
    """The BF16 backend's FC1 epilogue storing ``a`` [BM, BN] MXFP8-quantized (its ``EPI_STORE``, see
    ``grouped_gemm.launch_scheduled``): rowwise and / or columnwise into the tile's slot (:func:`store_mx`),
    in two halves of the columns, as this module's SPLIT_EPILOGUE (1x32 blocks never span them, and half
    the FP32 state is live next to the quantize). ``q``: ``copies_arguments``' run; ``CONSTS``: (ROWWISE,
    COLWISE, MANT, EBIAS, FP8_MAX, MAX_NORM_RCP). Every column is stored (the caller's N is on the tile);
    ``c_ptr``, ``col_ok`` unused."""
    BM: tl.constexpr = value.shape[0]
    HALF: tl.constexpr = value.shape[1] // 2
    lo, hi = column_halves(value, BM, HALF)
    cols_lo = tl.min(cols, axis=0) + tl.arange(0, HALF)
    _store_mx_packed(lo, rows64, row_ok, cols_lo, tile, q, CONSTS, BM, HALF)
    _store_mx_packed(hi, rows64, row_ok, cols_lo + HALF, tile, q, CONSTS, BM, HALF)


@triton.jit
def store_mx_gate_up_grads(dg, du, rows64, row_ok, cols, mask, is_padding, tile, c_ptr, stride_cm, c_up_offset, q,
                           CONSTS: tl.constexpr, GATED: tl.constexpr, UPCAST: tl.constexpr):
    """The BF16 backend's dGLU epilogue storing dh's FP32 gate and up blocks [BM, BN] MXFP8-quantized (its
    ``EPI_STORE``, see ``grouped_gemm.launch_scheduled``): rowwise and / or columnwise into the tile's slot
    (:func:`store_mx`; zeros on the padding group), the up block ``q_up_offset`` columns on; with
    ``WRITE_DBIAS``, the block's column sums into row ``tile`` of ``dbias`` (db1's per-tile sums, its up
    half as dh's). ``q``: ``copies_arguments``' run, then ``(q_up_offset, dbias, stride_dbias_t)``;
    ``CONSTS``: (ROWWISE, COLWISE, MANT, EBIAS, FP8_MAX, MAX_NORM_RCP, WRITE_DBIAS). Every column is stored
    (the caller's N is on the tile); ``c_ptr``, ``c_up_offset`` unused."""
    BM: tl.constexpr = dg.shape[0]
    BN: tl.constexpr = dg.shape[1]
    if CONSTS[6]:
        db_ptrs = q[10] + tile * q[11] + cols
        tl.store(db_ptrs, tl.sum(tl.where(mask, dg, 0.0), axis=0))
        if GATED:
            tl.store(db_ptrs + q[9], tl.sum(tl.where(mask, du, 0.0), axis=0))
    _store_mx_packed(tl.where(is_padding, 0.0, dg), rows64, row_ok, cols, tile, q, CONSTS, BM, BN)
    if GATED:
        _store_mx_packed(tl.where(is_padding, 0.0, du), rows64, row_ok, cols + q[9], tile, q, CONSTS, BM, BN)


@triton.jit
def _store_mx_packed(v, rows64, row_ok, cols, tile, q, CONSTS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """:func:`store_mx` with its buffers and formats packed as the BF16 kernel's store hooks get them: ``q``
    starting with ``copies_arguments``' nine, ``CONSTS`` with (ROWWISE, COLWISE, MANT, EBIAS, FP8_MAX,
    MAX_NORM_RCP)."""
    store_mx(v, rows64, row_ok, cols, tile, q[0], q[1], q[2], q[3], q[4], q[5], q[6], q[7], q[8], CONSTS[0],
             CONSTS[1], CONSTS[2], CONSTS[3], CONSTS[4], CONSTS[5], BM, BN)


@triton.jit
def as_bf16(tile, s_ptrs, kb, stride_sk, IS_BF16: tl.constexpr, ROWS: tl.constexpr, BK: tl.constexpr,
            UPCAST: tl.constexpr):
    """A loaded K step as the BF16 dot operand: BF16 values expanded before the GEMM as they are, or an
    FP8 tile expanded here with its rows' E8M0 scales (``s_ptrs``, blocks ``kb``)."""
    if IS_BF16:
        if UPCAST:
            return tile.to(tl.float32)
        else:
            return tile
    else:
        return expand_bf16(tile, tl.load(s_ptrs[:, None] + kb[None, :] * stride_sk), ROWS, BK, UPCAST)


@triton.jit
def mx_grouped_gemm_kernel(
    a_src, stride_am, as_ptr, stride_asm, stride_ask,
    b_src, stride_be, stride_bn, bs_ptr, stride_bse, stride_bsn, stride_bsk, B_ROWS, b_up_rows,
    c_ptr, stride_cm,
    q_ptr, stride_qm, qs_ptr, stride_qsm, stride_qsk, qt_ptr, stride_qtn, qts_ptr, stride_qtsb, q_up_offset,
    h_ptr, stride_hm, h_up_offset,
    bias_ptr, stride_bias_e, bias_up_offset,
    probs_ptr, dprob_ptr, stride_dprob_part,
    dbias_ptr, stride_dbias_t,
    sched_ptr,
    T, N, K, alpha, limit, MAX_M_TILES, NUM_GROUPS,
    MODE: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_PROBS: tl.constexpr, WRITE_DPROB: tl.constexpr, WRITE_DBIAS: tl.constexpr,
    ROWWISE: tl.constexpr, COLWISE: tl.constexpr, USE_TMA: tl.constexpr, UPCAST: tl.constexpr, ACC_IN: tl.constexpr,
    SPLIT_EPILOGUE: tl.constexpr, MANT: tl.constexpr, EBIAS: tl.constexpr, FP8_MAX: tl.constexpr, MAX_NORM_RCP: tl.constexpr,
    EXPAND: tl.constexpr, A_BF16: tl.constexpr, B_BF16: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr, GROUP_M: tl.constexpr,
):
    # --- which tile: GROUP_M swizzle for L2 reuse of B, then (group, row block) on the device
    pid_m, pid_n = swizzle(tl.program_id(0), MAX_M_TILES, tl.cdiv(N, BN), GROUP_M)
    if pid_m >= total_tiles(sched_ptr, NUM_GROUPS):
        return
    group, a_row, row_end = tile_rows(sched_ptr, pid_m, BM, NUM_GROUPS)
    is_padding = group == NUM_GROUPS - 1
    expert = tl.minimum(group, NUM_GROUPS - 2)
    rows = a_row + tl.arange(0, BM)
    rows_in = tl.minimum(rows, T - 1).to(tl.int64)  # scale loads (and pointer loads) stay in the tensor
    cols_in = tl.minimum(pid_n * BN + tl.arange(0, BN), N - 1)
    b_row = expert * B_ROWS + pid_n * BN
    e64 = expert.to(tl.int64)
    sa_ptrs = as_ptr + rows_in * stride_asm
    sb_ptrs = bs_ptr + e64 * stride_bse + cols_in * stride_bsn
    a_tiles, b_tiles = operand_tiles(a_src, b_src, rows_in, cols_in, e64, stride_am, stride_be, stride_bn, BK, USE_TMA)

    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if GATED and MODE == 1:
        acc_up = tl.zeros((BM, BN), dtype=tl.float32)
    if ACC_IN:
        # the epilogue alone, on the output another kernel wrote ([T, B's rows] in c)
        acc_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + (pid_n * BN + tl.arange(0, BN))[None, :]
        acc = tl.load(acc_ptrs, mask=(rows < row_end)[:, None], other=0.0).to(tl.float32)
        if GATED and MODE == 1:
            acc_up = tl.load(acc_ptrs + b_up_rows, mask=(rows < row_end)[:, None], other=0.0).to(tl.float32)
    else:
        k_tiles = tl.where(is_padding, 0, K // BK)
        if EXPAND:
            # BK = 128: four scale blocks per step, both operands expanded exactly to BF16 and one BF16
            # wgmma into the loop-carried accumulator (no promotion pass)
            for kt in range(0, k_tiles):
                k0 = kt * BK
                a = k_block(a_tiles, a_row, k0, USE_TMA)
                b = k_block(b_tiles, b_row, k0, USE_TMA)
                kb = kt * (BK // 32) + tl.arange(0, BK // 32)
                a_x = as_bf16(a, sa_ptrs, kb, stride_ask, A_BF16, BM, BK, UPCAST)
                b_x = as_bf16(b, sb_ptrs, kb, stride_bsk, B_BF16, BN, BK, UPCAST)
                acc = tl.dot(a_x, tl.trans(b_x), acc)
                if GATED and MODE == 1:
                    b_up = k_block(b_tiles, b_row + b_up_rows, k0, USE_TMA, b_up_rows * stride_bn)
                    up_x = as_bf16(b_up, sb_ptrs + b_up_rows * stride_bsn, kb, stride_bsk, B_BF16, BN, BK, UPCAST)
                    acc_up = tl.dot(a_x, tl.trans(up_x), acc_up)
            k_tiles = 0  # the promotion loop below does nothing
        for kt in range(0, k_tiles):
            k0 = kt * BK
            a = k_block(a_tiles, a_row, k0, USE_TMA)
            b = k_block(b_tiles, b_row, k0, USE_TMA)
            sa = mx_dequant_scale(tl.load(sa_ptrs + kt * stride_ask))
            sb = mx_dequant_scale(tl.load(sb_ptrs + kt * stride_bsk))
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc += tl.dot(a, tl.trans(b)) * (sa[:, None] * sb[None, :])
            if GATED and MODE == 1:
                b_up = k_block(b_tiles, b_row + b_up_rows, k0, USE_TMA, b_up_rows * stride_bn)
                sb_up = mx_dequant_scale(tl.load(sb_ptrs + b_up_rows * stride_bsn + kt * stride_bsk))
                if UPCAST:
                    b_up = b_up.to(tl.float32)
                acc_up += tl.dot(a, tl.trans(b_up)) * (sa[:, None] * sb_up[None, :])

    # --- epilogue, FP32
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < N
    rows = tl.arange(0, BM) + a_row
    row_ok = rows < row_end
    rows64 = rows.to(tl.int64)
    if MODE == 0:
        out_mask = row_ok[:, None] & col_ok[None, :]
        bias_mask = col_ok & (group < NUM_GROUPS - 1)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + expert * stride_bias_e + cols, mask=bias_mask, other=0.0)
            acc += bias.to(tl.float32)[None, :]
        tl.store(c_ptr + rows64[:, None] * stride_cm + cols[None, :], to_output(acc, c_ptr.dtype.element_ty, UPCAST),
                 mask=out_mask)
    elif MODE == 1:
        if HAS_PROBS:
            p = tl.load(probs_ptr + rows64, mask=row_ok, other=0.0).to(tl.float32)
        else:
            p = tl.full((BM,), 1.0, tl.float32)
        if GATED:
            up = acc_up
        else:
            up = acc
        if SPLIT_EPILOGUE:
            # two 64-column halves in turn: 1x32 blocks never span them, so the halves are independent,
            # and half the FP32 state is live next to the quantize / transpose (register spills)
            acc_lo, acc_hi = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))
            up_lo, up_hi = tl.split(tl.permute(tl.reshape(up, (BM, 2, BN // 2)), (0, 2, 1)))
            cols_lo = pid_n * BN + tl.arange(0, BN // 2)
            _fc1_part(acc_lo, up_lo, cols_lo, rows64, row_ok, N, p, expert, is_padding, pid_m, group, NUM_GROUPS,
                      h_ptr, stride_hm, h_up_offset, bias_ptr, stride_bias_e, bias_up_offset, alpha, limit, q_ptr,
                      stride_qm, qs_ptr, stride_qsm, stride_qsk, qt_ptr, stride_qtn, qts_ptr, stride_qtsb,
                      ACT, GATED, HAS_BIAS, ROWWISE, COLWISE, UPCAST, MANT, EBIAS, FP8_MAX, MAX_NORM_RCP, BM, BN // 2)
            _fc1_part(acc_hi, up_hi, cols_lo + BN // 2, rows64, row_ok, N, p, expert, is_padding, pid_m, group,
                      NUM_GROUPS, h_ptr, stride_hm, h_up_offset, bias_ptr, stride_bias_e, bias_up_offset, alpha, limit,
                      q_ptr, stride_qm, qs_ptr, stride_qsm, stride_qsk, qt_ptr, stride_qtn, qts_ptr, stride_qtsb,
                      ACT, GATED, HAS_BIAS, ROWWISE, COLWISE, UPCAST, MANT, EBIAS, FP8_MAX, MAX_NORM_RCP, BM, BN // 2)
        else:
            _fc1_part(acc, up, cols, rows64, row_ok, N, p, expert, is_padding, pid_m, group, NUM_GROUPS,
                      h_ptr, stride_hm, h_up_offset, bias_ptr, stride_bias_e, bias_up_offset, alpha, limit, q_ptr,
                      stride_qm, qs_ptr, stride_qsm, stride_qsk, qt_ptr, stride_qtn, qts_ptr, stride_qtsb,
                      ACT, GATED, HAS_BIAS, ROWWISE, COLWISE, UPCAST, MANT, EBIAS, FP8_MAX, MAX_NORM_RCP, BM, BN)
    else:
        # acc = da, the gradient of act(h) * p
        if HAS_PROBS:
            p = tl.load(probs_ptr + rows64, mask=row_ok, other=0.0).to(tl.float32)
        else:
            p = tl.full((BM,), 1.0, tl.float32)
        if SPLIT_EPILOGUE:
            acc_lo, acc_hi = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))
            cols_lo = pid_n * BN + tl.arange(0, BN // 2)
            part = _dact_part(acc_lo, cols_lo, rows64, row_ok, N, p, is_padding, pid_m, h_ptr, stride_hm,
                              h_up_offset, alpha, limit, dbias_ptr, stride_dbias_t, q_up_offset, q_ptr, stride_qm,
                              qs_ptr, stride_qsm, stride_qsk, qt_ptr, stride_qtn, qts_ptr, stride_qtsb, ACT, GATED,
                              WRITE_DBIAS, ROWWISE, COLWISE, MANT, EBIAS, FP8_MAX, MAX_NORM_RCP, BM, BN // 2)
            part += _dact_part(acc_hi, cols_lo + BN // 2, rows64, row_ok, N, p, is_padding, pid_m, h_ptr, stride_hm,
                               h_up_offset, alpha, limit, dbias_ptr, stride_dbias_t, q_up_offset, q_ptr, stride_qm,
                               qs_ptr, stride_qsm, stride_qsk, qt_ptr, stride_qtn, qts_ptr, stride_qtsb, ACT, GATED,
                               WRITE_DBIAS, ROWWISE, COLWISE, MANT, EBIAS, FP8_MAX, MAX_NORM_RCP, BM, BN // 2)
        else:
            part = _dact_part(acc, cols, rows64, row_ok, N, p, is_padding, pid_m, h_ptr, stride_hm,
                              h_up_offset, alpha, limit, dbias_ptr, stride_dbias_t, q_up_offset, q_ptr, stride_qm,
                              qs_ptr, stride_qsm, stride_qsk, qt_ptr, stride_qtn, qts_ptr, stride_qtsb, ACT, GATED,
                              WRITE_DBIAS, ROWWISE, COLWISE, MANT, EBIAS, FP8_MAX, MAX_NORM_RCP, BM, BN)
        if WRITE_DPROB:
            tl.store(dprob_ptr + pid_n * stride_dprob_part + rows64, part, mask=row_ok)


def launch(kind: str, a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, n: int,
           schedule: torch.Tensor, num_experts: int, spec: MXSpec, *, c: Optional[torch.Tensor] = None,
           q=None, q_up_offset: int = 0, h: Optional[torch.Tensor] = None, h_up_offset: int = 0,
           b_up_rows: int = 0, bias: Optional[torch.Tensor] = None, bias_up_offset: int = 0,
           probs: Optional[torch.Tensor] = None, dprob: Optional[torch.Tensor] = None,
           dbias: Optional[torch.Tensor] = None, activation: str = "swiglu", alpha: float = 1.702,
           limit: float = 7.0, gated: bool = False, config: Optional[MXGemmConfig] = None):
    """One MXFP8 grouped GEMM. ``a`` [T, K] FP8 + ``a_scale`` [T, K/32] uint8; ``b`` [E, rows, K] FP8
    K-major (contiguous) + ``b_scale`` [E, rows, K/32] uint8 (any strides); either operand may instead
    be its BF16 values (``quantize.expand_values``; its scales are then not read). ``n`` output
    columns (the gate half for gated FC1/DACT; a plain GEMM's may be off the tile where B's rows
    cover the last one: its columns past ``n`` are computed, not stored). ``q`` (FC1/DACT): an
    :class:`~.quantize.MXRows` whose present copies are written with ``spec``'s format (the GEMM
    operands' formats are their dtypes).
    ``dprob``: FP32 ``[n / block_n, T]`` partials; ``dbias``: FP32 ``[max_m_tiles, width]``."""
    mode = GEMM_MODES[kind]
    a_bf16, b_bf16 = a.dtype == torch.bfloat16, b.dtype == torch.bfloat16
    num_rows, k = a.shape
    tiled_n = tiled_width(mode, n, b.shape[1], TILE)
    if k % MX or tiled_n % TILE:
        raise ValueError(f"MXFP8 GEMM: K={k} must be a multiple of {MX} and N={n} of {TILE}")
    if mode == MODE_PLAIN and a_bf16 and b_bf16 and config is None and PLAIN_VALUES_KERNEL == "bf16":
        return _plain_on_bf16_kernel(a, b, n, schedule, num_experts, c, bias)
    if (mode == MODE_FC1 and a_bf16 and b_bf16 and config is None and FC1_VALUES_KERNEL == "bf16" and n % TILE == 0
            and b.shape[1] == (2 if gated else 1) * n and q is not None):
        return _fc1_on_bf16_kernel(a, b, n, schedule, num_experts, spec, q, h, h_up_offset, bias, bias_up_offset,
                                   probs, activation, alpha, limit, gated)
    cfg = config or default_config(kind, a_bf16 and b_bf16)
    if mode == MODE_DACT and cfg.bf16_kernel and (cfg.epilogue or DACT_EPILOGUE) == "auto":
        _check_dglu_route(cfg, a_bf16 and b_bf16, n, q)
        return _dglu_on_bf16_kernel(a, b, n, schedule, num_experts, spec, q, q_up_offset, h, h_up_offset, probs,
                                    dprob, dbias, activation, alpha, limit, gated, cfg.block_n)
    if (a_bf16 or b_bf16) and not cfg.expand_bf16:
        raise ValueError("config: BF16 operands need the expand_bf16 loop (BF16 wgmma)")
    if mode != MODE_PLAIN and cfg.block_n not in (64, 128):
        raise ValueError(f"config: the quantizing epilogues need block_n 64 or 128 (whole 1x32 blocks), got {cfg.block_n}")
    if tiled_n % cfg.block_n:
        raise ValueError(f"config: N={n} must be a multiple of block_n={cfg.block_n}")
    if mode == MODE_FC1:
        cfg = fc1_covering(cfg, n, a_bf16 or b_bf16)
    block_k = EXPAND_BLOCK_K if cfg.expand_bf16 else MX
    if cfg.block_k is not None:
        if not (a_bf16 and b_bf16 and cfg.expand_bf16) or cfg.block_k % MX:
            raise ValueError(f"config: block_k={cfg.block_k} needs both operands as BF16 values (the expand_bf16 "
                             f"loop) and a multiple of {MX}")
        block_k = cfg.block_k
    if k % block_k:
        raise ValueError(f"config: K={k} must be a multiple of the K step {block_k}")
    acc_in = mode == MODE_DACT and _separate_dact(cfg, a)
    if acc_in:
        # the dGLU GEMM alone (this module's plain kernel), then this kernel's epilogue on its output
        c = torch.empty((num_rows, b.shape[1]), device=a.device, dtype=EPILOGUE_INPUT_DTYPE or h.dtype)
        launch("fc2", a, a_scale, b, b_scale, b.shape[1], schedule, num_experts, spec, c=c)
        if SEPARATE_DGLU_KERNEL == "chunks":
            return dglu_epilogue.launch(c, h, n, schedule, num_experts, spec, q, q_up_offset=q_up_offset,
                                        h_up_offset=h_up_offset, probs=probs, dprob=dprob, dbias=dbias,
                                        part=cfg.block_n, activation=activation, alpha=alpha, limit=limit,
                                        gated=gated)
    m_tiles = max_m_tiles(num_rows, num_experts, TILE)
    grid = (m_tiles * triton.cdiv(n, cfg.block_n),)
    rowwise, colwise = quantized_copies(q)
    use_tma = USE_TMA_DEFAULT and tma_allowed(a, b) and not acc_in
    a_src, b_src = operand_sources(a, b, TILE, cfg.block_n, block_k, use_tma)
    return mx_grouped_gemm_kernel[grid](
        *kernel_operands(a_src, a, a_scale, b_src, b, b_scale, b_up_rows, c, q, q_up_offset, h, h_up_offset, bias,
                         bias_up_offset, probs, dprob, dbias),
        schedule,
        num_rows, n, k, float(alpha), float(limit), m_tiles, num_experts + 1,
        MODE=mode, ACT=ACT_IDS[activation], GATED=gated,
        HAS_BIAS=bias is not None, HAS_PROBS=probs is not None, WRITE_DPROB=dprob is not None,
        WRITE_DBIAS=dbias is not None, ROWWISE=rowwise, COLWISE=colwise, USE_TMA=use_tma, UPCAST=interpreting(),
        ACC_IN=acc_in, SPLIT_EPILOGUE=mode != MODE_PLAIN and cfg.split_epilogue, **spec.constexprs(),
        EXPAND=cfg.expand_bf16, A_BF16=a_bf16, B_BF16=b_bf16, BM=TILE, BN=cfg.block_n, BK=block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=1 if acc_in else cfg.num_stages,
    )


def _plain_on_bf16_kernel(a: torch.Tensor, b: torch.Tensor, n: int, schedule: torch.Tensor,
                          num_experts: int, c: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``c = A_e @ B_e^T (+ bias_e)`` on BF16 values by the BF16 backend's grouped GEMM
    (:func:`plain_values_config`), on this recipe's schedule."""
    from .. import grouped_gemm

    k = a.shape[1]
    grouped_gemm.launch_scheduled("fc2", a, b, (b.stride(0), b.stride(2), b.stride(1)), n, k, c, schedule,
                                  num_experts, plain_values_config(n, k, c.dtype), bias=bias)
    return c


def _fc1_on_bf16_kernel(a: torch.Tensor, b: torch.Tensor, n: int, schedule: torch.Tensor, num_experts: int,
                        spec: MXSpec, q, h: torch.Tensor, h_up_offset: int, bias: Optional[torch.Tensor],
                        bias_up_offset: int, probs: Optional[torch.Tensor], activation: str, alpha: float,
                        limit: float, gated: bool):
    """FC1 on BF16 values by the BF16 backend's grouped GEMM (:func:`fc1_values_config`), its epilogue
    saving h and storing ``a`` through :func:`store_mx_activation`, on this recipe's schedule."""
    from .. import grouped_gemm

    k = a.shape[1]
    store = _quantizing_store(store_mx_activation, q, spec, a)
    # h stands in for c: the kernel passes c to the store, which writes q instead
    return grouped_gemm.launch_scheduled("fc1", a, b, (b.stride(0), b.stride(2), b.stride(1)), n, k, h, schedule,
                                         num_experts, fc1_values_config(n, k), b_up_rows=n if gated else 0, h=h,
                                         h_up_offset=h_up_offset, bias=bias, bias_up_offset=bias_up_offset,
                                         probs=probs, activation=activation, alpha=alpha, limit=limit, gated=gated,
                                         epilogue_store=store)


def _quantizing_store(fn, q, spec: MXSpec, a: torch.Tensor, extra_args: tuple = (), extra_consts: tuple = ()) -> tuple:
    """The BF16 backend's epilogue store hook ``(fn, args, constexprs)`` writing ``q``'s copies, packed as
    :func:`_store_mx_packed` reads them: ``copies_arguments``' run (absent copies: ``a``'s bytes) then
    ``extra_args``; (ROWWISE, COLWISE, the spec's formats) then ``extra_consts``."""
    dummy = a.view(torch.uint8)
    return (fn, (*copies_arguments(q, dummy, dummy), *extra_args),
            (*quantized_copies(q), *spec.constexprs().values(), *extra_consts))


def _check_dglu_route(cfg: MXGemmConfig, bf16_operands: bool, n: int, q) -> None:
    """What the dGLU on the BF16 backend's kernel needs (``MXGemmConfig.bf16_kernel``)."""
    if not bf16_operands:
        raise ValueError("config: bf16_kernel (the dGLU on the BF16 backend's kernel) needs both operands as BF16 "
                         "values")
    if q is None or n % cfg.block_n or cfg.block_n % 64:
        raise ValueError(f"config: bf16_kernel needs dh's quantized copies and N={n} a multiple of block_n="
                         f"{cfg.block_n}, itself a multiple of 64 (whole 1x32 blocks in each half)")


def _dglu_on_bf16_kernel(a: torch.Tensor, b: torch.Tensor, n: int, schedule: torch.Tensor, num_experts: int,
                         spec: MXSpec, q, q_up_offset: int, h: torch.Tensor, h_up_offset: int,
                         probs: Optional[torch.Tensor], dprob: Optional[torch.Tensor], dbias: Optional[torch.Tensor],
                         activation: str, alpha: float, limit: float, gated: bool, block_n: int):
    """The dGLU on BF16 values by the BF16 backend's grouped GEMM (:func:`dglu_values_config` at ``block_n``
    columns, the dprob partials' width), its epilogue storing dh through :func:`store_mx_gate_up_grads`,
    on this recipe's schedule."""
    from .. import grouped_gemm

    k = a.shape[1]
    store = _quantizing_store(store_mx_gate_up_grads, q, spec, a, (q_up_offset, *or_dummy(dbias, h, 0)),
                              (dbias is not None,))
    # h stands in for c: the store writes q instead
    return grouped_gemm.launch_scheduled("dact", a, b, (b.stride(0), b.stride(2), b.stride(1)), n, k, h, schedule,
                                         num_experts, dglu_values_config(n, k, block_n), h=h, h_up_offset=h_up_offset,
                                         probs=probs, dprob=dprob, activation=activation, alpha=alpha, limit=limit,
                                         gated=gated, epilogue_store=store)


def dglu_values_config(n: int, k: int, block_n: int):
    """The BF16 backend's dGLU config (:func:`_bf16_kernel_config`) at ``block_n`` columns."""
    return replace(_bf16_kernel_config("dact", n, k), block_n=block_n)


def fc1_values_config(n: int, k: int):
    """The BF16 backend's FC1 config (:func:`_bf16_kernel_config`) at 3 stages: faster than its 4 with this
    store of ``a`` (run 36b: 3.024 against 3.142 ms at DSv3, H100), and what fits where h is FP32 (4 need
    262 KB of shared memory, offline sm_90a build; 3, 213 KB). Under the interpreter 64 + 64 columns (the
    interpreter's MXFP8 FC1 tile)."""
    cfg = _bf16_kernel_config("fc1", n, k)
    return replace(cfg, block_n=64) if interpreting() else replace(cfg, num_stages=3)


def plain_values_config(n: int, k: int, out_dtype: torch.dtype):
    """The BF16 backend's config for a plain GEMM on BF16 values: its FC2 config (the fastest of those run
    35a timed at all three GEMMs; :func:`_bf16_kernel_config`). An FP32 output (da for the separate dGLU
    epilogue when h is FP32) takes 128-column tiles: its 128 x 256 tile staged for the store needs 128 KB
    of shared memory, 278 KB in all at 3 stages (run 36a: the launch failed), against 192 KB at 128 x 128
    x 64 with 4 stages."""
    cfg = _bf16_kernel_config("fc2", n, k)
    if out_dtype == torch.float32 and not interpreting():
        return replace(cfg, block_n=128, num_stages=4)
    return cfg


def _bf16_kernel_config(kind: str, n: int, k: int):
    """The BF16 backend's ``kind`` config at this recipe's 128-row tiles and TMA switch (the tests'
    pointer-load cases). Under the interpreter at this module's K step: the interpreter sums each K step's
    dot as one matmul, so the sums then run in the order of this module's kernel, as both kernels' wgmma
    chains do on the GPU (run 35a: bitwise equal)."""
    from .. import grouped_gemm

    cfg = replace(grouped_gemm.default_config(kind, n, k), block_m=TILE, use_tma=USE_TMA_DEFAULT)
    return replace(cfg, block_k=EXPAND_BLOCK_K) if interpreting() else cfg


def fc1_covering(cfg: MXGemmConfig, n: int, bf16_operands: bool) -> MXGemmConfig:
    """FC1's config for ``n`` columns: ``cfg``, or at an F off the tile (padded.py), one whose N tiles
    reach the tile's end (FC1 writes a's codes there, zeros past F; the kernel makes cdiv(n, block_n)
    N tiles): whole 128-column tiles, in two stages where the operands are BF16 (three such stages
    need 295 KB of shared memory)."""
    if padded_size(n, cfg.block_n) == padded_size(n, TILE):
        return cfg
    return replace(cfg, block_n=TILE, num_stages=2 if bf16_operands else cfg.num_stages)


def _separate_dact(cfg: "MXGemmConfig", a: torch.Tensor) -> bool:
    """Whether the dGLU runs as the plain GEMM + the epilogue alone (see ``DACT_EPILOGUE``)."""
    return separate_epilogue(cfg.epilogue or DACT_EPILOGUE, lambda: a.is_cuda and not interpreting())
