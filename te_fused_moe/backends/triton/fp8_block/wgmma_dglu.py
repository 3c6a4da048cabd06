"""The FP8 block dGLU as one Gluon kernel: the persistent promoted GEMM of :mod:`.wgmma_gemm`
(``da = dy_q @ w2``, per M tile x 128 columns) with the dGLU + quantize epilogue run on its FP32
accumulator in the same program (``gemm.DACT_EPILOGUE = "gluon"``), instead of writing ``da`` in
FP32 for the Triton epilogue alone to read back ("separate").

Why: at DSv3 the dGLU took 1.74 ms as GEMM (1.06) + epilogue alone, the ~0.7 ms of the epilogue
alone being latency-bound (one 16-warp program per SM, run 17 ncu) plus the FP32 round trip of
``da`` (2 x 268 MB). Here the epilogue runs while the load cursor already fetches the next tile's
operands, and ``da`` never leaves the SM.

Numerics: the epilogue is the Triton DACT epilogue's (``gemm.fp8_grouped_gemm_kernel``) on the same
FP32 accumulator, through the same math (``act_math.act_backward``, ``codec.block_scale`` /
``encode_fp8``): quantized bytes and scales are the same; the dprob and db1 partial sums may differ
in the order of their FP32 additions.

Layout: the accumulator goes through shared memory (one 128x128 FP32 tile, 64 KB) and comes back in
two 64-column halves in a blocked layout (16-byte loads of ``h``): da, gate, up and their gradients
of a whole tile would not fit in registers at once (the Triton kernel splits likewise). The
columnwise codes are stored transposed through a layout whose threads hold 8 consecutive rows of a
column (one 8-byte store each).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ..act_math import ACT_IDS, act_backward
from ..block_scaled_launch import or_dummy, quantized_copies
from .codec import block_scale, encode_fp8, nan_free_abs
from .quantize import FLOAT32_MAX, FP8Spec
from .wgmma_gemm import (BM, BN, KIND_PLAIN, NUM_WARPS, STAGES, _operand_ring, _promoted_mainloop, _release, _tile_of,
                         _top_up, descriptors, persistent_grid)

@gluon.jit
def fp8_block_dglu_wgmma_kernel(
    a_desc, as_ptr, stride_asm, stride_ask,
    b_desc, bs_ptr, stride_bse, stride_bsn, stride_bsk, B_ROWS,
    epi, sched_ptr, T, N, K, MAX_M_TILES, NUM_GROUPS, alpha, limit, value_for_inf,
    ACT: gl.constexpr, GATED: gl.constexpr, HAS_PROBS: gl.constexpr, WRITE_DPROB: gl.constexpr,
    WRITE_DBIAS: gl.constexpr, ROWWISE: gl.constexpr, COLWISE: gl.constexpr, MANT: gl.constexpr,
    EBIAS: gl.constexpr, FP8_MAX: gl.constexpr, POW2: gl.constexpr,
    GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr, num_warps: gl.constexpr,
):
    """Persistent over the tiles ``program_id, + grid, ...``: the plain kernel's loop, then the dGLU
    epilogue (:func:`_dglu_epilogue`) on each tile's accumulator (zeros on the padding group)."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BLOCK_N, 32])
    num_pid_n = N // BLOCK_N
    k_tiles = K // BLOCK_K
    total = MAX_M_TILES * num_pid_n
    src = (sched_ptr, total, gl.num_programs(0), MAX_M_TILES, num_pid_n, NUM_GROUPS, B_ROWS, k_tiles)
    ring, cursor = _operand_ring(a_desc, b_desc, a_desc, src, KIND_PLAIN, GROUP_M, NUM_STAGES, False)
    # row r's 2-float vectors XOR-swizzled by r % 16: the wgmma layout's stores (8 rows x 4 lanes of
    # 2 floats per warp) and the halves' 8-float row loads hit distinct banks
    staging = gl.allocate_shared_memory(gl.float32, [BLOCK_M, BLOCK_N], gl.SwizzledSharedLayout(2, 1, 16, [1, 0]))
    used = 0
    for tile in range(gl.program_id(0), total, gl.num_programs(0)):
        pid_m, pid_n, group, row0, row_end, num_tiles = _tile_of(tile, sched_ptr, MAX_M_TILES, num_pid_n, NUM_GROUPS,
                                                                 BLOCK_M, GROUP_M)
        if pid_m < num_tiles:
            if group == NUM_GROUPS - 1:
                staging.store(gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma))  # the padding group: no GEMM
            else:
                rows = gl.minimum(row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma)), T - 1)
                sb_ptr = bs_ptr + group.to(gl.int64) * stride_bse + ((pid_n * BLOCK_N) // 128) * stride_bsn
                cursor = _top_up(ring, cursor, used, src, KIND_PLAIN, GROUP_M, NUM_STAGES, False)
                acc, cursor = _promoted_mainloop(ring, used, 0, k_tiles, cursor, src,
                                                 as_ptr + rows.to(gl.int64) * stride_asm, stride_ask, sb_ptr,
                                                 stride_bsk, mma, NUM_STAGES, False, KIND_PLAIN, GROUP_M)
                used += k_tiles
                staging.store(acc)
            gl.thread_barrier()  # the whole tile is staged before any thread reads its halves
            _dglu_epilogue(staging, epi, pid_m, pid_n, row0, row_end, group == NUM_GROUPS - 1, alpha, limit,
                           value_for_inf, ACT, GATED, HAS_PROBS, WRITE_DPROB, WRITE_DBIAS, ROWWISE, COLWISE, MANT,
                           EBIAS, FP8_MAX, POW2, num_warps)
            gl.thread_barrier()  # ...and read before the next tile overwrites it
    _release(ring, NUM_STAGES)


@gluon.jit(noinline=True)
def _dglu_epilogue(staging, epi, tile, pid_n, row0, row_end, is_padding, alpha, limit, value_for_inf,
                   ACT: gl.constexpr, GATED: gl.constexpr, HAS_PROBS: gl.constexpr, WRITE_DPROB: gl.constexpr,
                   WRITE_DBIAS: gl.constexpr, ROWWISE: gl.constexpr, COLWISE: gl.constexpr, MANT: gl.constexpr,
                   EBIAS: gl.constexpr, FP8_MAX: gl.constexpr, POW2: gl.constexpr, num_warps: gl.constexpr):
    """``dh = d act(h) * (da * p)`` of M tile ``tile`` x N tile ``pid_n`` (``da`` staged in shared memory),
    quantized rowwise and columnwise; dprob's partial row sums of ``da * act(h)`` and db1's per-tile
    column sums of ``dh``. ``epi``: the arguments from ``q_ptr`` to ``stride_dbias_t`` of
    ``gemm.fp8_grouped_gemm_kernel`` without the bias's (see :func:`launch_dglu`)."""
    BLOCK_M: gl.constexpr = staging.shape[0]
    BLOCK_N: gl.constexpr = staging.shape[1]
    HALF: gl.constexpr = BLOCK_N // 2
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    q_up_offset, h_ptr, stride_hm, h_up_offset = epi[9], epi[10], epi[11], epi[12]
    probs_ptr, dprob_ptr, stride_dprob_part, dbias_ptr, stride_dbias_t = epi[13], epi[14], epi[15], epi[16], epi[17]
    rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, blk))
    row_ok = rows < row_end
    rows64 = rows.to(gl.int64)
    col0 = pid_n * BLOCK_N
    cols = gl.arange(0, HALF, layout=gl.SliceLayout(0, blk))
    if HAS_PROBS:
        p = gl.load(probs_ptr + rows64, mask=row_ok, other=0.0).to(gl.float32)
    else:
        p = gl.where(row_ok, 1.0, 1.0)
    dg_lo, du_lo, part, dbg_lo, dbu_lo = _dglu_half(staging.slice(0, HALF, dim=1).load(blk), rows64, row_ok,
                                                    col0 + cols, p, h_ptr, stride_hm, h_up_offset, alpha, limit,
                                                    is_padding, ACT, GATED)
    dg_hi, du_hi, part_hi, dbg_hi, dbu_hi = _dglu_half(staging.slice(HALF, HALF, dim=1).load(blk), rows64, row_ok,
                                                       col0 + HALF + cols, p, h_ptr, stride_hm, h_up_offset, alpha,
                                                       limit, is_padding, ACT, GATED)
    if WRITE_DPROB:
        gl.store(dprob_ptr + pid_n * stride_dprob_part + rows64, part + part_hi, mask=row_ok)
    if WRITE_DBIAS:
        db_ptrs = dbias_ptr + tile * stride_dbias_t + col0 + cols
        gl.store(db_ptrs, dbg_lo)
        gl.store(db_ptrs + HALF, dbg_hi)
        if GATED:
            gl.store(db_ptrs + h_up_offset, dbu_lo)
            gl.store(db_ptrs + h_up_offset + HALF, dbu_hi)
    _quantize_halves(dg_lo, dg_hi, epi, rows64, row_ok, cols, col0, tile, value_for_inf, ROWWISE, COLWISE, MANT,
                     EBIAS, FP8_MAX, POW2, num_warps)
    if GATED:
        _quantize_halves(du_lo, du_hi, epi, rows64, row_ok, cols, col0 + q_up_offset, tile, value_for_inf, ROWWISE,
                         COLWISE, MANT, EBIAS, FP8_MAX, POW2, num_warps)


@gluon.jit
def _dglu_half(da, rows64, row_ok, cols, p, h_ptr, stride_hm, h_up_offset, alpha, limit, is_padding,
               ACT: gl.constexpr, GATED: gl.constexpr):
    """d act for 64 columns (as ``gemm._dact_half``): (dg, du) zeroed on the padding group, the row sums
    of ``da * act(h)`` (dprob) and the column sums of dg and du over the valid rows (db1)."""
    mask = row_ok[:, None]
    h_ptrs = h_ptr + rows64[:, None] * stride_hm + cols[None, :]
    g = gl.load(h_ptrs, mask=mask, other=0.0).to(gl.float32)
    if GATED:
        u = gl.load(h_ptrs + h_up_offset, mask=mask, other=0.0).to(gl.float32)
    else:
        u = g
    dg, du, value = act_backward(g, u, da * p[:, None], alpha, limit, ACT)
    part = gl.sum(gl.where(mask, da * value, 0.0), axis=1)
    dg = gl.where(is_padding, 0.0, dg)
    du = gl.where(is_padding, 0.0, du)
    return dg, du, part, gl.sum(gl.where(mask, dg, 0.0), axis=0), gl.sum(gl.where(mask, du, 0.0), axis=0)


@gluon.jit
def _quantize_halves(lo, hi, epi, rows64, row_ok, cols, col0, tile, value_for_inf, ROWWISE: gl.constexpr,
                     COLWISE: gl.constexpr, MANT: gl.constexpr, EBIAS: gl.constexpr, FP8_MAX: gl.constexpr,
                     POW2: gl.constexpr, num_warps: gl.constexpr):
    """A 128-column block held as two 64-column halves from column ``col0`` (as
    ``gemm._store_quantized_halves``): rowwise (the amax spans both halves) and columnwise."""
    HALF: gl.constexpr = lo.shape[1]
    q_ptr, stride_qm, qs_ptr, stride_qsm, stride_qsk = epi[0], epi[1], epi[2], epi[3], epi[4]
    mask = row_ok[:, None]
    if ROWWISE:
        amax = gl.maximum(gl.max(nan_free_abs(lo), axis=1), gl.max(nan_free_abs(hi), axis=1))
        scale, inv = block_scale(amax, FP8_MAX, POW2, value_for_inf)
        row_ptrs = q_ptr + rows64[:, None] * stride_qm + col0 + cols[None, :]
        gl.store(row_ptrs, encode_fp8(lo * scale[:, None], MANT, EBIAS, FP8_MAX), mask=mask)
        gl.store(row_ptrs + HALF, encode_fp8(hi * scale[:, None], MANT, EBIAS, FP8_MAX), mask=mask)
        gl.store(qs_ptr + rows64 * stride_qsm + (col0 // 128) * stride_qsk, inv, mask=row_ok)
    if COLWISE:
        _store_colwise(lo, epi, row_ok, cols, col0, tile, value_for_inf, MANT, EBIAS, FP8_MAX, POW2, num_warps)
        _store_colwise(hi, epi, row_ok, cols, col0 + HALF, tile, value_for_inf, MANT, EBIAS, FP8_MAX, POW2, num_warps)


@gluon.jit
def _store_colwise(v, epi, row_ok, cols, col0, tile, value_for_inf, MANT: gl.constexpr, EBIAS: gl.constexpr,
                   FP8_MAX: gl.constexpr, POW2: gl.constexpr, num_warps: gl.constexpr):
    """Columnwise blocks of ``v`` [128 rows, 64 columns from ``col0``] over the tile's valid rows, stored
    transposed into the tile's 128-column slot of ``data_t`` (as ``gemm._store_colwise``)."""
    BLOCK_M: gl.constexpr = v.shape[0]
    WIDTH: gl.constexpr = v.shape[1]
    qt_ptr, stride_qtn, qts_ptr, stride_qtst = epi[5], epi[6], epi[7], epi[8]
    mask = row_ok[:, None]
    amax_c = gl.max(gl.where(mask, nan_free_abs(v), 0.0), axis=0)
    scale_c, inv_c = block_scale(amax_c, FP8_MAX, POW2, value_for_inf)
    codes_c = gl.where(mask, encode_fp8(v * scale_c[None, :], MANT, EBIAS, FP8_MAX), 0).to(gl.uint8)
    # each thread: 8 consecutive rows (tokens) of one column, consecutive bytes of a data_t row
    by_column: gl.constexpr = gl.BlockedLayout([8, 1], [16, 2], [1, num_warps], [0, 1])
    codes_t = gl.convert_layout(codes_c, by_column)
    tok = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, by_column))
    col = gl.arange(0, WIDTH, layout=gl.SliceLayout(0, by_column))
    gl.store(qt_ptr + (col0 + col).to(gl.int64)[None, :] * stride_qtn + (tile * BLOCK_M + tok)[:, None], codes_t)
    gl.store(qts_ptr + tile * stride_qtst + col0 + cols, inv_c)


def launch_dglu(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, n: int,
                schedule: torch.Tensor, num_experts: int, spec: FP8Spec, *, q, q_up_offset: int, h: torch.Tensor,
                h_up_offset: int, probs=None, dprob=None, dbias=None, activation: str = "swiglu",
                alpha: float = 1.702, limit: float = 7.0, gated: bool = False, group_m: int = 8,
                num_stages: int = STAGES, ctas_per_sm: int = 1):
    """``gemm.launch("dact", ...)`` as one Gluon kernel (same arguments; ``n`` % 128 == 0 and
    :func:`.wgmma_gemm.usable` checked by the caller)."""
    from ..schedule import max_m_tiles

    num_rows = a.shape[0]
    m_tiles = max_m_tiles(num_rows, num_experts, BM)
    a_desc, b_desc = descriptors(a, b)
    rowwise, colwise = quantized_copies(q)
    dummy = a_scale
    codes = q.data.view(torch.uint8) if rowwise else dummy
    codes_t = q.data_t.view(torch.uint8) if colwise else dummy
    epi = (codes, q.data.stride(0) if rowwise else 0, *or_dummy(q.scale if rowwise else None, dummy, 0, 1),  # 0-4
           codes_t, q.data_t.stride(0) if colwise else 0, *or_dummy(q.scale_t if colwise else None, dummy, 0),  # 5-8
           q_up_offset, h, h.stride(0), h_up_offset,  # 9-12
           probs if probs is not None else dummy, *or_dummy(dprob, dummy, 0), *or_dummy(dbias, dummy, 0))  # 13-17
    fp8_block_dglu_wgmma_kernel[(persistent_grid(m_tiles * (n // BN), a.device, ctas_per_sm),)](
        a_desc, a_scale, a_scale.stride(0), a_scale.stride(1),
        b_desc, b_scale, b_scale.stride(0), b_scale.stride(1), b_scale.stride(2), b.shape[1],
        epi, schedule, num_rows, n, a.shape[1], m_tiles, num_experts + 1, float(alpha), float(limit), FLOAT32_MAX,
        ACT=ACT_IDS[activation], GATED=gated, HAS_PROBS=probs is not None, WRITE_DPROB=dprob is not None,
        WRITE_DBIAS=dbias is not None, ROWWISE=rowwise, COLWISE=colwise, **spec.constexprs(),
        GROUP_M=group_m, NUM_STAGES=num_stages, num_warps=NUM_WARPS,
    )
