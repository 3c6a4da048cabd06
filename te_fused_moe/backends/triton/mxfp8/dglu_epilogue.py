"""MXFP8's dGLU epilogue alone, 32 rows at a time: what ``gemm.mx_grouped_gemm_kernel`` does with
``ACC_IN`` (the dGLU GEMM's output ``da`` read back, then ``dh = d act(h) * (da * p)`` quantized rowwise
and columnwise, dprob partials, db1 per-tile sums), restructured as the quantize pass's chunked kernel is
(:func:`.quantize.quantize_chunks_kernel`): each 32-row chunk of an M tile is one 32-token block of the
columnwise copies, reduced over its rows with no reshape along the tokens.

Why: that epilogue is a pass over [T, 2F] like the quantize pass, and built the same way as the
quantize pass's "tiles" kernel (3-D reshapes for the 32-token blocks), which run 33 measured at 1.5-2.5x
the chunked kernel's time. The same bytes and sums as the GEMM kernel's epilogue, except the order of
the FP32 column sums (db1: four chunk sums added) and of the dprob row sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..act_math import ACT_IDS, act_backward, load_gate_up
from ..block_scaled_launch import copies_arguments, or_dummy, quantized_copies
from ..grouped_gemm import interpreting, register_cap
from ..schedule import max_m_tiles, tile_rows, total_tiles
from .quantize import TILE, MXSpec, store_mx_chunk

# Columns per program, warps, and Triton's unroll factor of the loop over a tile's four chunks (4: unrolled,
# as tl.static_range; 1: one chunk's values live at a time). Every config builds to 142-255 registers
# offline (sm_90a): a handful of warps per SM hide the loads' latency, so the config is found by timing.
# Run 34 on an H100, DSv3 (scripts/probe_mx_dglu.py: the separate dGLU less its GEMM alone, 1.65 ms):
# 64 columns, 4 warps, not unrolled 0.73 ms; unrolled 0.77; 128 columns, 4 warps 0.77 (not unrolled) and
# 1.77 (unrolled: run 33's launch, which made the MLP slower); 8 warps 1.03-1.34; the GEMM kernel's
# epilogue (SEPARATE_DGLU_KERNEL = "gemm") 1.18. Run 36a (H100, same probe): 4 warps 0.666 ms, **2 warps
# 0.559** (255 registers and 24 stack bytes offline, four programs per SM against two at 4 warps).
COLS, WARPS, UNROLL = 64, 2, 1
# A register cap per thread at launch (None: ptxas's choice). Run 36a (H100) at 4 warps: 0.697 ms capped at
# 168, 0.613 at 128, against 0.666 uncapped; 2 warps uncapped (0.559) beat them all. At 2 warps offline
# (sm_90a) the launch builds to 255 registers uncapped (four programs per SM), 168 with 40 stack bytes (six)
# and 128 with 216 (eight); run 38a (H100, same probe): 0.550 ms uncapped, **0.518 at 168**, 0.647 at 128.
MAXNREG = 168


@triton.jit
def dglu_chunks_kernel(
    da_ptr, stride_dam, h_ptr, stride_hm, h_up_offset, probs_ptr,
    dprob_ptr, stride_dprob_part, dbias_ptr, stride_dbias_t,
    q_ptr, stride_qm, qs_ptr, stride_qsm, stride_qsk, qt_ptr, stride_qtn, qts_ptr, stride_qtsb, q_up_offset,
    sched_ptr, N, alpha, limit, NUM_GROUPS,
    ACT: tl.constexpr, GATED: tl.constexpr, HAS_PROBS: tl.constexpr, WRITE_DPROB: tl.constexpr,
    WRITE_DBIAS: tl.constexpr, ROWWISE: tl.constexpr, COLWISE: tl.constexpr, MANT: tl.constexpr,
    EBIAS: tl.constexpr, FP8_MAX: tl.constexpr, MAX_NORM_RCP: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
    PART: tl.constexpr, UNROLL: tl.constexpr,
):
    """One program per (schedule M tile, ``BK`` gate columns): the tile's rows 32 at a time. dprob
    partials per ``PART`` columns (the GEMM kernel's N tile: row ``col // PART`` of ``dprob``)."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    if pid_m >= total_tiles(sched_ptr, NUM_GROUPS):
        return
    group, row0, row_end = tile_rows(sched_ptr, pid_m, BM, NUM_GROUPS)
    cols = pid_k * BK + tl.arange(0, BK)
    col_ok = cols < N
    chunk = tl.arange(0, 32)
    dg_sum = tl.zeros((BK,), tl.float32)
    du_sum = tl.zeros((BK,), tl.float32)
    for j in tl.range(0, BM // 32, loop_unroll_factor=UNROLL):
        first = row0.to(tl.int64) + j * 32  # the chunk's first row: one 64-bit base, 32-bit offsets
        row_ok = (row0 + j * 32 + chunk) < row_end
        mask = row_ok[:, None] & col_ok[None, :]
        da = tl.load(da_ptr + first * stride_dam + (chunk * stride_dam)[:, None] + cols[None, :], mask=mask,
                     other=0.0).to(tl.float32)
        g, u = load_gate_up(h_ptr + first * stride_hm + (chunk * stride_hm)[:, None] + cols[None, :], h_up_offset,
                            mask, GATED)
        if HAS_PROBS:
            p = tl.load(probs_ptr + first + chunk, mask=row_ok, other=0.0).to(tl.float32)
        else:
            p = tl.full((32,), 1.0, tl.float32)
        dg, du, value = act_backward(g, u, da * p[:, None], alpha, limit, ACT)
        if WRITE_DPROB:
            part = tl.sum(tl.reshape(tl.where(mask, da * value, 0.0), (32, BK // PART, PART)), axis=2)
            parts = pid_k * (BK // PART) + tl.arange(0, BK // PART)
            tl.store(dprob_ptr + parts[None, :] * stride_dprob_part + (first + chunk)[:, None], part,
                     mask=row_ok[:, None])
        if WRITE_DBIAS:
            dg_sum += tl.sum(tl.where(mask, dg, 0.0), axis=0)
            du_sum += tl.sum(tl.where(mask, du, 0.0), axis=0)
        # zeros past the group's end (the columnwise block's) and on the padding group
        keep = mask & (group != NUM_GROUPS - 1)
        block = pid_m * (BM // 32) + j
        store_mx_chunk(tl.where(keep, dg, 0.0), first, row_ok, cols, block, q_ptr, stride_qm, qs_ptr, stride_qsm,
                       stride_qsk, qt_ptr, stride_qtn, qts_ptr, stride_qtsb, ROWWISE, COLWISE, MANT, EBIAS, FP8_MAX,
                       MAX_NORM_RCP, BK)
        if GATED:
            store_mx_chunk(tl.where(keep, du, 0.0), first, row_ok, cols + q_up_offset, block, q_ptr, stride_qm,
                           qs_ptr, stride_qsm, stride_qsk, qt_ptr, stride_qtn, qts_ptr, stride_qtsb, ROWWISE, COLWISE,
                           MANT, EBIAS, FP8_MAX, MAX_NORM_RCP, BK)
    if WRITE_DBIAS:
        db_ptrs = dbias_ptr + pid_m * stride_dbias_t + cols
        tl.store(db_ptrs, dg_sum, mask=col_ok)
        if GATED:
            tl.store(db_ptrs + h_up_offset, du_sum, mask=col_ok)


def launch(da: torch.Tensor, h: torch.Tensor, n: int, schedule: torch.Tensor, num_experts: int, spec: MXSpec, q,
           *, q_up_offset: int, h_up_offset: int, probs=None, dprob=None, dbias=None, part: int,
           activation: str, alpha: float, limit: float, gated: bool) -> None:
    """The dGLU epilogue on ``da`` [T, n] (the dGLU GEMM's output) and the saved ``h``: ``q``'s present
    copies (codes or values), ``dprob`` partials [n / part, T] and ``dbias`` per-tile sums where given
    (``gemm.launch``'s arguments of the same names). A program takes :data:`COLS` columns, or ``part``
    where that is wider (its dprob partial sums cover whole parts); ``n`` a multiple of that."""
    num_rows = da.shape[0]
    cols = max(COLS, part)
    if n % cols or cols % part:
        raise ValueError(f"n: the chunked dGLU epilogue needs a multiple of {cols} columns per program, each "
                         f"holding whole {part}-column dprob parts, got n={n}, part={part}")
    rowwise, colwise = quantized_copies(q)
    dummy = da
    m_tiles = max_m_tiles(num_rows, num_experts, TILE)
    dglu_chunks_kernel[(m_tiles, n // cols)](
        da, da.stride(0), h, h.stride(0), h_up_offset, probs if probs is not None else dummy,
        *or_dummy(dprob, dummy, 0), *or_dummy(dbias, dummy, 0),
        *copies_arguments(q, dummy, dummy), q_up_offset,
        schedule, n, float(alpha), float(limit), num_experts + 1,
        ACT=ACT_IDS[activation], GATED=gated, HAS_PROBS=probs is not None, WRITE_DPROB=dprob is not None,
        WRITE_DBIAS=dbias is not None, ROWWISE=rowwise, COLWISE=colwise, **spec.constexprs(), BM=TILE, BK=cols,
        PART=part, UNROLL=UNROLL, num_warps=4 if interpreting() else WARPS, **register_cap(MAXNREG),
    )
