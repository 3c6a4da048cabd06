"""FP8 block's dGLU at an FFN size off the 128 tile (:mod:`..padded`): ``dh`` formed and quantized in
one pass, from ``da`` and the saved ``h``, without writing it in FP32 first.

Why a kernel of its own: ``dh``'s 1x128 rowwise blocks run along w1's rows, gate gradients in columns
``[0, F)`` then up gradients in ``[F, 2F)``. When F % 128 != 0 a block holds the last gate units and
the first up units, and every up block straddles two chunks of 128 units, so the tile-aligned path's
dGLU epilogue (one tile of units, its gate and up gradients written 128-aligned at column ``c`` and
``F + c``) cannot fill them.

- :func:`dglu_walk_kernel` (gated activations, the default): a program walks chunks of 128 units of
  one M tile in order and differentiates each unit once. Chunk ``i``'s gate gradients are block
  ``i``; its up gradients land at ``F + 128 i``, before position ``s = 128 - F % 128`` in up block
  ``F // 128 + i`` and from there in the next one, so that block is quantized once the next chunk is
  known, from the previous chunk's gradients carried in registers. The block holding both the last
  gate units and the first up units is quantized at the end, chunk 0's up gradients recomputed.
- :func:`dglu_quantize_kernel` (non-gated activations, where a column is one unit; and the walk's
  A/B): a program owns one 128-column block, loads the units of its columns and keeps the gate or up
  gradient per column, so every gated unit is differentiated twice.

Both quantize with the tile-aligned epilogue's rules (:mod:`.gemm`), from the values of the separate
GLU pass (:mod:`..glu_rows`, same :mod:`..act_math`): the bytes are those of that pass followed by the
quantize pass. Also per program: the router probabilities' gradient partial (each unit counted once)
and the tile's column sums of ``dh`` (b1's gradient).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..act_math import ACT_IDS, act_backward, load_gate_up
from ..grouped_gemm import interpreting
from ..glu_rows import program_rows, router_probs
from ..schedule import max_m_tiles, total_tiles
from .codec import block_scale, encode_fp8, nan_free_abs
from .gemm import _store_quantized
from .quantize import BLOCK, FLOAT32_MAX, FP8Spec, new_rows, row_block

# 16 warps: da, gate, up and both gradients of a 128 x 128 block live at once (as the tile-aligned
# dGLU epilogue alone, gemm.EPILOGUE_ALONE_WARPS)
NUM_WARPS = 16
# gated activations walk the units (dglu_walk_kernel) instead of one program per block of dh: off,
# 1.5x slower on an H100 at GPT-OSS (run 27c: 1.61 ms against 1.07; spills, one 16-warp CTA per SM)
WALK_UNITS = False
# chunks of 128 units per walking program: GPT-OSS's 23 in three programs per M tile, which recompute
# one chunk each (the up gradients carried in, and chunk 0's at the end): 3 chunks of 23 extra
CHUNKS_PER_PROGRAM = 8
# the walk holds the previous chunk's up gradients too: at 16 warps (128 registers a thread) it spills
# ~200 values per chunk, at 8 (255 registers) fewer per value but one CTA of 8 warps per SM (sm_90a)
WALK_WARPS = 16


@triton.jit
def dglu_quantize_kernel(
    da_ptr, stride_dam, h_ptr, stride_hm, probs_ptr,
    q_ptr, stride_qm, qs_ptr, stride_qsm, stride_qsk, qt_ptr, stride_qtn, qts_ptr, stride_qtst,
    dprob_ptr, stride_dprob_part, colsum_ptr, stride_cst,
    sched_ptr, F, N1, alpha, limit, value_for_inf, NUM_GROUPS,
    ACT: tl.constexpr, GATED: tl.constexpr, HAS_PROBS: tl.constexpr, WRITE_DPROB: tl.constexpr,
    COLSUM: tl.constexpr, ROWWISE: tl.constexpr, COLWISE: tl.constexpr,
    MANT: tl.constexpr, EBIAS: tl.constexpr, FP8_MAX: tl.constexpr, POW2: tl.constexpr, BM: tl.constexpr,
):
    """One program per (schedule M tile, 128 columns of ``dh``); columns from N1 (2F gated, else F) to
    the block's end are zeros, as are the padding group's rows."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m >= total_tiles(sched_ptr, NUM_GROUPS):
        return
    row0, rows64, in_tile, live = program_rows(sched_ptr, NUM_GROUPS, BM)
    cols = pid_n * 128 + tl.arange(0, 128)
    is_gate = cols < F
    if GATED:
        units = tl.where(is_gate, cols, cols - F)
    else:
        units = cols
    valid = live[:, None] & (cols < N1)[None, :]
    da = tl.load(da_ptr + rows64[:, None] * stride_dam + units[None, :], mask=valid, other=0.0).to(tl.float32)
    g, u = load_gate_up(h_ptr + rows64[:, None] * stride_hm + units[None, :], F, valid, GATED)
    p = router_probs(probs_ptr, rows64, live, HAS_PROBS, BM)
    dg, du, value = act_backward(g, u, da * p[:, None], alpha, limit, ACT)
    if GATED:
        d = tl.where(is_gate[None, :], dg, du)
    else:
        d = dg
    d = tl.where(valid, d, 0.0)
    if WRITE_DPROB:
        part = tl.sum(tl.where(valid & is_gate[None, :], da * value, 0.0), axis=1)
        tl.store(dprob_ptr + pid_n * stride_dprob_part + rows64, part, mask=in_tile)
    if COLSUM:
        tl.store(colsum_ptr + pid_m * stride_cst + cols, tl.sum(d, axis=0))
    _store_quantized(d, row0, in_tile, pid_n * 128, pid_m, q_ptr, stride_qm, qs_ptr, stride_qsm,
                     stride_qsk, qt_ptr, stride_qtn, qts_ptr, stride_qtst, value_for_inf, ROWWISE, COLWISE, MANT,
                     EBIAS, FP8_MAX, POW2)


@triton.jit
def _unit_grads(da_ptr, stride_dam, h_ptr, stride_hm, row0, live, p, unit0, F, alpha, limit, ACT: tl.constexpr,
                FULL: tl.constexpr):
    """(d gate, d up, the row sums of ``da * act(h)``) of the gated units ``unit0 + [0, 128)``, zeros past
    F and on rows without routed tokens. ``FULL``: all 128 units are below F (a mask per row only, not
    one per value: the predicates of 32 values per thread spill into registers)."""
    pos = tl.arange(0, 128)
    if FULL:
        valid = live[:, None] & (pos < 128)[None, :]
    else:
        valid = live[:, None] & (unit0 + pos < F)[None, :]
    da = tl.load(row_block(da_ptr, row0, stride_dam, unit0, 128) + pos[None, :], mask=valid, other=0.0)
    da = da.to(tl.float32)
    g, u = load_gate_up(row_block(h_ptr, row0, stride_hm, unit0, 128) + pos[None, :], F, valid, True)
    dg, du, value = act_backward(g, u, da * p[:, None], alpha, limit, ACT)
    part = tl.sum(tl.where(valid, da * value, 0.0), axis=1)
    return tl.where(valid, dg, 0.0), tl.where(valid, du, 0.0), part


@triton.jit
def _store_block(v, amax, row0, row_ok, tile, block, col_a, split, col_b,
                 q_ptr, stride_qm, qs_ptr, stride_qsm, stride_qsk, qt_ptr, stride_qtn, qts_ptr, stride_qtst,
                 colsum_ptr, stride_cst, value_for_inf, TWO_RUNS: tl.constexpr, COLSUM: tl.constexpr,
                 ROWWISE: tl.constexpr, COLWISE: tl.constexpr, MANT: tl.constexpr, EBIAS: tl.constexpr,
                 FP8_MAX: tl.constexpr, POW2: tl.constexpr):
    """Quantize ``v`` [128 rows, 128 positions], values of dh's 1x128 block ``block`` (row amax
    ``amax``), as :func:`.gemm._store_quantized` does: positions before ``split`` go to columns
    ``col_a + pos``; the others to ``col_b + pos`` (``TWO_RUNS``) or nowhere. Also the column sums."""
    pos = tl.arange(0, 128)
    run_a = pos < split
    run_b = pos >= split
    if ROWWISE:
        scale, inv = block_scale(amax, FP8_MAX, POW2, value_for_inf)
        codes = encode_fp8(v * scale[:, None], MANT, EBIAS, FP8_MAX)
        rows = row_block(q_ptr, row0, stride_qm, 0, 128)
        tl.store(rows + col_a + pos[None, :], codes, mask=row_ok[:, None] & run_a[None, :])
        if TWO_RUNS:
            tl.store(rows + col_b + pos[None, :], codes, mask=row_ok[:, None] & run_b[None, :])
        tl.store(qs_ptr + row0 * stride_qsm + block * stride_qsk + pos * stride_qsm, inv, mask=row_ok)
    if COLWISE:
        # one block per column over the tile's valid rows, stored transposed into the tile's slot
        mask = row_ok[:, None]
        scale_c, inv_c = block_scale(tl.max(tl.where(mask, nan_free_abs(v), 0.0), axis=0), FP8_MAX, POW2,
                                     value_for_inf)
        codes_t = tl.trans(encode_fp8(tl.where(mask, v * scale_c[None, :], 0.0), MANT, EBIAS, FP8_MAX))
        slot = tile * 128 + pos[None, :]
        tl.store(row_block(qt_ptr, tl.cast(col_a, tl.int64), stride_qtn, 0, 128) + slot, codes_t, mask=run_a[:, None])
        tl.store(qts_ptr + tile * stride_qtst + col_a + pos, inv_c, mask=run_a)
        if TWO_RUNS:
            tl.store(row_block(qt_ptr, tl.cast(col_b, tl.int64), stride_qtn, 0, 128) + slot, codes_t, mask=run_b[:, None])
            tl.store(qts_ptr + tile * stride_qtst + col_b + pos, inv_c, mask=run_b)
    if COLSUM:
        sums = tl.sum(v, axis=0)
        tl.store(colsum_ptr + tile * stride_cst + col_a + pos, sums, mask=run_a)
        if TWO_RUNS:
            tl.store(colsum_ptr + tile * stride_cst + col_b + pos, sums, mask=run_b)


@triton.jit
def dglu_walk_kernel(
    da_ptr, stride_dam, h_ptr, stride_hm, probs_ptr,
    q_ptr, stride_qm, qs_ptr, stride_qsm, stride_qsk, qt_ptr, stride_qtn, qts_ptr, stride_qtst,
    dprob_ptr, stride_dprob_part, colsum_ptr, stride_cst,
    sched_ptr, F, up_split, NUM_BLOCKS, alpha, limit, value_for_inf, NUM_GROUPS,
    ACT: tl.constexpr, HAS_PROBS: tl.constexpr, WRITE_DPROB: tl.constexpr, COLSUM: tl.constexpr,
    ROWWISE: tl.constexpr, COLWISE: tl.constexpr, MANT: tl.constexpr, EBIAS: tl.constexpr,
    FP8_MAX: tl.constexpr, POW2: tl.constexpr, BM: tl.constexpr, CHUNKS: tl.constexpr,
):
    """One program per (schedule M tile, ``CHUNKS`` chunks of 128 gated units). ``up_split``: ``128 - F %
    128``, from the host so that Triton sees it a multiple of 16 where it is (the masks split at it
    then allow 16-byte stores; ``F % 128`` in the kernel loses that). ``NUM_BLOCKS``: ``cdiv(2F,
    128)``, dh's width in blocks (columns past 2F get zeros)."""
    pid_m = tl.program_id(0)
    if pid_m >= total_tiles(sched_ptr, NUM_GROUPS):
        return
    row0, rows64, in_tile, live = program_rows(sched_ptr, NUM_GROUPS, BM)
    p = router_probs(probs_ptr, rows64, live, HAS_PROBS, BM)
    pos = tl.arange(0, 128)
    # chunk i's up gradients: positions < s in up block first_up + i, the others in the next one
    s = up_split
    first_up = F // 128
    num_chunks = tl.cdiv(F, 128)
    first = tl.program_id(1) * CHUNKS
    last = tl.minimum(first + CHUNKS, num_chunks)
    # the block of both the last gate units and the first up units (F % 128 != 0) is quantized after
    # the loop, from the last chunk's gate gradients and chunk 0's up gradients
    shared = (s != 128) & (last == num_chunks)
    du_prev = tl.zeros((BM, 128), tl.float32)
    if first > 0:
        _, du_prev, _ = _unit_grads(da_ptr, stride_dam, h_ptr, stride_hm, row0, live, p, (first - 1) * 128, F,
                                    alpha, limit, ACT, True)
    dprob = tl.zeros((BM,), tl.float32)
    for i in range(first, last - shared.to(tl.int32)):
        dg, du, part = _unit_grads(da_ptr, stride_dam, h_ptr, stride_hm, row0, live, p, i * 128, F, alpha, limit,
                                   ACT, True)
        dprob += part
        _store_block(dg, tl.max(nan_free_abs(dg), axis=1), row0, in_tile, pid_m, i, i * 128, 128, 0,
                     q_ptr, stride_qm, qs_ptr, stride_qsm, stride_qsk, qt_ptr, stride_qtn, qts_ptr, stride_qtst,
                     colsum_ptr, stride_cst, value_for_inf, False, COLSUM, ROWWISE, COLWISE, MANT, EBIAS, FP8_MAX,
                     POW2)
        if (i > 0) | (s == 128):
            up = tl.where(pos[None, :] < s, du, du_prev)
            _store_block(up, tl.max(nan_free_abs(up), axis=1), row0, in_tile, pid_m, first_up + i, F + i * 128, s,
                         F + i * 128 - 128, q_ptr, stride_qm, qs_ptr, stride_qsm, stride_qsk, qt_ptr, stride_qtn,
                         qts_ptr, stride_qtst, colsum_ptr, stride_cst, value_for_inf, True, COLSUM, ROWWISE,
                         COLWISE, MANT, EBIAS, FP8_MAX, POW2)
        du_prev = du
    if shared:
        i = num_chunks - 1
        dg, du, part = _unit_grads(da_ptr, stride_dam, h_ptr, stride_hm, row0, live, p, i * 128, F, alpha, limit,
                                   ACT, False)
        dprob += part
        if i > 0:
            up = tl.where(pos[None, :] < s, du, du_prev)
            _store_block(up, tl.max(nan_free_abs(up), axis=1), row0, in_tile, pid_m, first_up + i, F + i * 128, s,
                         F + i * 128 - 128, q_ptr, stride_qm, qs_ptr, stride_qsm, stride_qsk, qt_ptr, stride_qtn,
                         qts_ptr, stride_qtst, colsum_ptr, stride_cst, value_for_inf, True, COLSUM, ROWWISE,
                         COLWISE, MANT, EBIAS, FP8_MAX, POW2)
        _, du0, _ = _unit_grads(da_ptr, stride_dam, h_ptr, stride_hm, row0, live, p, 0, F, alpha, limit, ACT, False)
        du0 = tl.where(pos[None, :] < s, du0, 0.0)
        amax = tl.maximum(tl.max(nan_free_abs(dg), axis=1), tl.max(nan_free_abs(du0), axis=1))
        # the gate units at i * 128 (positions < F % 128), the up units at F (positions < s)
        _store_block(dg, amax, row0, in_tile, pid_m, i, i * 128, 128 - s, 0, q_ptr, stride_qm, qs_ptr, stride_qsm,
                     stride_qsk, qt_ptr, stride_qtn, qts_ptr, stride_qtst, colsum_ptr, stride_cst, value_for_inf,
                     False, COLSUM, ROWWISE, COLWISE, MANT, EBIAS, FP8_MAX, POW2)
        _store_block(du0, amax, row0, in_tile, pid_m, i, F, s, 0, q_ptr, stride_qm, qs_ptr, stride_qsm, stride_qsk,
                     qt_ptr, stride_qtn, qts_ptr, stride_qtst, colsum_ptr, stride_cst, value_for_inf, False, COLSUM,
                     ROWWISE, COLWISE, MANT, EBIAS, FP8_MAX, POW2)
        if first_up + num_chunks < NUM_BLOCKS:  # F % 128 > 64: the last chunk's up units reach a block more
            up = tl.where(pos[None, :] < s, 0.0, du)
            _store_block(up, tl.max(nan_free_abs(up), axis=1), row0, in_tile, pid_m, first_up + num_chunks,
                         F + num_chunks * 128, s, F + i * 128, q_ptr, stride_qm, qs_ptr, stride_qsm, stride_qsk,
                         qt_ptr, stride_qtn, qts_ptr, stride_qtst, colsum_ptr, stride_cst, value_for_inf, True,
                         COLSUM, ROWWISE, COLWISE, MANT, EBIAS, FP8_MAX, POW2)
    if WRITE_DPROB:
        tl.store(dprob_ptr + tl.program_id(1) * stride_dprob_part + rows64, dprob, mask=in_tile)


def dglu_quantized(da: torch.Tensor, h: torch.Tensor, ffn: int, schedule: torch.Tensor, num_experts: int,
                   probs: Optional[torch.Tensor], act: dict, want_dprob: bool, spec: FP8Spec, *, rowwise: bool,
                   colwise: bool, col_sums: Optional[torch.Tensor] = None, alloc=torch.empty,
                   chunks_per_program: Optional[int] = None) -> tuple:
    """``(dhq, dprob)``: ``dh = d act(h) * (da * p)`` quantized (the copies asked for) in ``h``'s layout
    and width (``h`` [T, n1'] with the up half at column ``ffn``; ``da`` [T, >= ffn]); ``dprob`` [T]
    FP32 if ``want_dprob``; ``col_sums`` (FP32 [max_m_tiles, n1']) receives each tile's column sums
    of dh. ``act``: an activation's ``launch_args``. ``chunks_per_program``: the walk's
    (``CHUNKS_PER_PROGRAM`` if None)."""
    num_rows, width = h.shape
    if width % BLOCK:
        raise ValueError(f"h: expected a width that is a multiple of {BLOCK} (padded.py's), got {width}")
    n1 = 2 * ffn if act["gated"] else ffn
    blocks = width // BLOCK
    # the walk writes the blocks of the 2F columns, which padded.py's h has exactly
    walk = WALK_UNITS and act["gated"] and blocks == triton.cdiv(n1, BLOCK)
    chunks = chunks_per_program or CHUNKS_PER_PROGRAM
    programs_per_tile = triton.cdiv(triton.cdiv(ffn, BLOCK), chunks) if walk else blocks
    dhq = new_rows(num_rows, width, h, spec, num_experts, rowwise, colwise, alloc)
    parts = alloc((programs_per_tile, num_rows), device=h.device, dtype=torch.float32) if want_dprob else None
    if num_rows and (rowwise or colwise or col_sums is not None or want_dprob):
        q_data = dhq.data if rowwise else dhq.data_t if colwise else h
        qt_data = dhq.data_t if colwise else q_data
        args = (da, da.stride(0), h, h.stride(0), probs if probs is not None else h,
                q_data.view(torch.uint8), q_data.stride(0) if rowwise else 0,
                dhq.scale if rowwise else h, dhq.scale.stride(0) if rowwise else 0,
                dhq.scale.stride(1) if rowwise else 0,
                qt_data.view(torch.uint8), dhq.data_t.stride(0) if colwise else 0,
                dhq.scale_t if colwise else h, dhq.scale_t.stride(0) if colwise else 0,
                parts if want_dprob else h, parts.stride(0) if want_dprob else 0,
                col_sums if col_sums is not None else h, col_sums.stride(0) if col_sums is not None else 0,
                schedule)
        common = dict(ACT=ACT_IDS[act["activation"]], HAS_PROBS=probs is not None, WRITE_DPROB=want_dprob,
                      COLSUM=col_sums is not None, ROWWISE=rowwise, COLWISE=colwise, **spec.constexprs(), BM=BLOCK)
        grid = (max_m_tiles(num_rows, num_experts, BLOCK), programs_per_tile)
        warps = 4 if interpreting() else WALK_WARPS if walk else NUM_WARPS
        if walk:
            dglu_walk_kernel[grid](*args, ffn, BLOCK - ffn % BLOCK, blocks, float(act["alpha"]), float(act["limit"]),
                                   FLOAT32_MAX, num_experts + 1, CHUNKS=chunks, num_warps=warps, **common)
        else:
            dglu_quantize_kernel[grid](*args, ffn, n1, float(act["alpha"]), float(act["limit"]), FLOAT32_MAX,
                                       num_experts + 1, GATED=bool(act["gated"]), num_warps=warps, **common)
    return dhq, (parts.sum(0) if want_dprob else None)
