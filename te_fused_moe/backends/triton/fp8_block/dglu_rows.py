"""FP8 block's dGLU at an FFN size off the 128 tile (:mod:`..padded`): ``dh`` formed and quantized in
one pass, from ``da`` and the saved ``h``, without writing it in FP32 first.

Why a kernel of its own: ``dh``'s 1x128 rowwise blocks run along w1's rows, gate gradients in columns
``[0, F)`` then up gradients in ``[F, 2F)``. When F % 128 != 0 a block holds the last gate units and
the first up units, so the tile-aligned path's dGLU epilogue (one tile of units, its gate and up
gradients written 128-aligned at column ``c`` and ``F + c``) cannot fill it. Here a program owns one
128-column block of ``dh`` itself: column ``c`` is unit ``c`` (gate) or ``c - F`` (up); it loads those
units' ``da``, gate and up (contiguous runs, split at most once), takes d act, keeps the gate or up
gradient per column and quantizes the block rowwise and columnwise with :mod:`.gemm`'s epilogue
store. The values are the separate GLU pass's (:mod:`..glu_rows`, same :mod:`..act_math`), so the
bytes are those of that pass followed by the quantize pass.

So each gated unit is loaded and differentiated twice, for its gate block and for its up block. A
program walking one M tile's units in order, each differentiated once and the previous chunk's up
gradients carried into the next up block (commit b86fe1e), was bit-exact but 1.5x slower on an H100
(run 27c: 1.61 ms against 1.07 at GPT-OSS): ~540 bytes of spills a thread at 16 warps, and one
program's chunks in series.

Also per program: the router probabilities' gradient partial (each unit counted at its gate
column) and the tile's column sums of ``dh`` (b1's gradient).
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
from .gemm import _store_quantized
from .quantize import BLOCK, FLOAT32_MAX, FP8Spec, new_rows

# 16 warps: da, gate, up and both gradients of a 128 x 128 block live at once (as the tile-aligned
# dGLU epilogue alone, gemm.EPILOGUE_ALONE_WARPS)
NUM_WARPS = 16
# the grid runs one M tile's blocks together (block index fastest), so that a gated unit's inputs,
# loaded for its gate block and again for its up block 22-23 blocks on, come from L2 the second time
# (M tile fastest, all M tiles of 22 blocks run in between). 1.064 -> 1.030 ms at GPT-OSS on an H100
# (run 27d): DRAM is not what bounds this kernel
BLOCKS_FASTEST = True
MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension


@triton.jit
def dglu_quantize_kernel(
    da_ptr, stride_dam, h_ptr, stride_hm, probs_ptr,
    q_ptr, stride_qm, qs_ptr, stride_qsm, stride_qsk, qt_ptr, stride_qtn, qts_ptr, stride_qtst,
    dprob_ptr, stride_dprob_part, colsum_ptr, stride_cst,
    sched_ptr, F, N1, alpha, limit, value_for_inf, NUM_GROUPS,
    ACT: tl.constexpr, GATED: tl.constexpr, HAS_PROBS: tl.constexpr, WRITE_DPROB: tl.constexpr,
    COLSUM: tl.constexpr, ROWWISE: tl.constexpr, COLWISE: tl.constexpr,
    MANT: tl.constexpr, EBIAS: tl.constexpr, FP8_MAX: tl.constexpr, POW2: tl.constexpr, BM: tl.constexpr,
    BLOCKS_FASTEST: tl.constexpr,
):
    """One program per (schedule M tile, 128 columns of ``dh``); columns from N1 (2F gated, else F) to
    the block's end are zeros, as are the padding group's rows."""
    if BLOCKS_FASTEST:
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
    else:
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
    if pid_m >= total_tiles(sched_ptr, NUM_GROUPS):
        return
    row0, rows64, in_tile, live = program_rows(sched_ptr, pid_m, NUM_GROUPS, BM)
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


def dglu_quantized(da: torch.Tensor, h: torch.Tensor, ffn: int, schedule: torch.Tensor, num_experts: int,
                   probs: Optional[torch.Tensor], act: dict, want_dprob: bool, spec: FP8Spec, *, rowwise: bool,
                   colwise: bool, col_sums: Optional[torch.Tensor] = None, alloc=torch.empty) -> tuple:
    """``(dhq, dprob)``: ``dh = d act(h) * (da * p)`` quantized (the copies asked for) in ``h``'s layout
    and width (``h`` [T, n1'] with the up half at column ``ffn``; ``da`` [T, >= ffn]); ``dprob`` [T]
    FP32 if ``want_dprob``; ``col_sums`` (FP32 [max_m_tiles, n1']) receives each tile's column sums
    of dh. ``act``: an activation's ``launch_args``."""
    num_rows, width = h.shape
    if width % BLOCK:
        raise ValueError(f"h: expected a width that is a multiple of {BLOCK} (padded.py's), got {width}")
    n1 = 2 * ffn if act["gated"] else ffn
    blocks = width // BLOCK
    dhq = new_rows(num_rows, width, h, spec, num_experts, rowwise, colwise, alloc)
    parts = alloc((blocks, num_rows), device=h.device, dtype=torch.float32) if want_dprob else None
    if num_rows and (rowwise or colwise or col_sums is not None or want_dprob):
        q_data = dhq.data if rowwise else dhq.data_t if colwise else h
        qt_data = dhq.data_t if colwise else q_data
        m_tiles = max_m_tiles(num_rows, num_experts, BLOCK)
        blocks_fastest = BLOCKS_FASTEST and m_tiles <= MAX_GRID_Y  # the M tiles in grid y
        dglu_quantize_kernel[(blocks, m_tiles) if blocks_fastest else (m_tiles, blocks)](
            da, da.stride(0), h, h.stride(0), probs if probs is not None else h,
            q_data.view(torch.uint8), q_data.stride(0) if rowwise else 0,
            dhq.scale if rowwise else h, dhq.scale.stride(0) if rowwise else 0, dhq.scale.stride(1) if rowwise else 0,
            qt_data.view(torch.uint8), dhq.data_t.stride(0) if colwise else 0,
            dhq.scale_t if colwise else h, dhq.scale_t.stride(0) if colwise else 0,
            parts if want_dprob else h, parts.stride(0) if want_dprob else 0,
            col_sums if col_sums is not None else h, col_sums.stride(0) if col_sums is not None else 0,
            schedule, ffn, n1, float(act["alpha"]), float(act["limit"]), FLOAT32_MAX, num_experts + 1,
            ACT=ACT_IDS[act["activation"]], GATED=bool(act["gated"]), HAS_PROBS=probs is not None,
            WRITE_DPROB=want_dprob, COLSUM=col_sums is not None, ROWWISE=rowwise, COLWISE=colwise,
            **spec.constexprs(), BM=BLOCK, BLOCKS_FASTEST=blocks_fastest,
            num_warps=4 if interpreting() else NUM_WARPS,
        )
    return dhq, (parts.sum(0) if want_dprob else None)
