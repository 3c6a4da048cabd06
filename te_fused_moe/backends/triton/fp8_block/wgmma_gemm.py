"""FP8 block GEMMs written in Gluon (Triton 3.6), with the scale promotion overlapped with the
tensor cores: the plain grouped GEMM (FC2 forward, FC1 dgrad, and the GEMMs of FC1 / the dGLU when
their epilogues run alone, see ``gemm.FC1_EPILOGUE``) and the wgrad, each a persistent kernel with a
load cursor (below). Their mainloop (:func:`_promoted_mainloop`) also serves the warp-specialised
kernels of :mod:`.wgmma_ws`, the default on sm_90 since run 19, where a producer partition loads.

Why: :mod:`.gemm` (Triton) promotes every 128-wide K block with ``acc += dot(a, b^T) * scale``.
Triton makes a wgmma asynchronous only when nothing but the next wgmma reads its result, so there
every K step waits for its wgmma to drain before the FMAs, and the tensor cores idle while they run
(600-850 TFLOP/s of a ~1290 peak, runs 9-11). Here (as DeepGEMM does on Hopper) block ``k``'s wgmma
is issued into a fresh register tile *before* block ``k-1``'s result is waited for and promoted, so
the promotion FMAs run under the next wgmma: 920-990 TFLOP/s at DSv3 (run 16). Three register tiles
per thread stay live (promoted accumulator, the tile being promoted, the tile in flight): 3 x 64
FP32 at 128x128 over two warpgroups. ptxas serialises every wgmma if a non-wgmma instruction touches
an in-flight tile (C7514/C7515), which small changes provoke (control flow in the K loop does, for
the wgrad); tests/test_fp8_block_wgmma.py checks the sm_90a build for it in CI.

Both kernels are persistent (``ctas_per_sm`` programs per SM walk the tiles ``program_id, + grid,
...``; 0 = one program per tile) and share one pipeline: a ring of ``NUM_STAGES`` shared-memory
stages filled by TMA through a load cursor (:func:`_load_next`) that runs ``NUM_STAGES`` K blocks
ahead of the wgmmas *across* tiles, so the next tile's loads are in flight under this tile's last
blocks and its store. That matters most for the wgrad, whose tiles have ~8 token blocks at DSv3.
The wgrad's per-column scales come with each stage by TMA (read from shared memory at the
promotion: a column vector in registers cost 32-64 of them and spilled).

Plain GEMM, same contract as ``gemm.launch("fc2" | "dgrad")``: ``A`` [T, K] FP8 rowwise (1x128
scales ``sa``), ``B`` [E, rows, K] FP8 K-major in 128x128 blocks (``sb``), the sync-free device
schedule (tiles start at each expert's first row; the padding group's rows get zeros), optional
bias. Wgrad, same contract as ``wgrad.fp8_grouped_wgrad``. Same numerics: each 128-block partial sum
comes from one FP8 wgmma chain and is promoted in FP32 in K order, so results equal the Triton
kernels' (bitwise on the H200, tests/gpu/test_fp8_block_wgmma_gpu.py). Gluon has no interpreter:
these run on sm_90 GPUs only.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from .quantize import BLOCK

BM = BN = BK = BLOCK  # one scale block per K step, one weight scale block per tile
STAGES = 4            # 4 x 32 KB of operand tiles in shared memory
NUM_WARPS = 8         # two warpgroups, 64 rows each


@gluon.jit
def _swizzle(tile_id, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
    """Tile id -> (M tile, N tile) in bands of GROUP_M M tiles walked column by column (L2 reuse of
    B), as :func:`..schedule.swizzle` does for the Triton kernels."""
    pids_per_band = GROUP_M * num_pid_n
    first_m = (tile_id // pids_per_band) * GROUP_M
    band_m = gl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (tile_id % pids_per_band) % band_m, (tile_id % pids_per_band) // band_m


# What a tile of the persistent loop is (see :func:`_resolved`)
KIND_PLAIN = gl.constexpr(0)  # an M tile of the token rows x an N tile of B's rows
KIND_WGRAD = gl.constexpr(1)  # an expert's N tile x K tile of dw (K loop over its token blocks)


@gluon.jit
def _tile_of(tile, sched_ptr, MAX_M_TILES, num_pid_n, NUM_GROUPS, BLOCK_M: gl.constexpr, GROUP_M: gl.constexpr):
    """Plain tile ``tile``'s (M tile, N tile, group, first row, group end row, tile count): the same
    GROUP_M swizzle and schedule reads as :mod:`..schedule` (whose helpers are Triton, not Gluon)."""
    pid_m, pid_n = _swizzle(tile, MAX_M_TILES, num_pid_n, GROUP_M)
    num_tiles = gl.load(sched_ptr + 2 * NUM_GROUPS - 1)  # tile_end of the padding group
    group = gl.load(sched_ptr + 4 * NUM_GROUPS + gl.minimum(pid_m, MAX_M_TILES - 1))
    tile_start = gl.load(sched_ptr + group)
    row0 = gl.load(sched_ptr + 2 * NUM_GROUPS + group) + (pid_m - tile_start) * BLOCK_M
    row_end = gl.load(sched_ptr + 3 * NUM_GROUPS + group)
    return pid_m, pid_n, group, row0, row_end, num_tiles


@gluon.jit
def _wgrad_tile(tile, sched_ptr, tiles_n, tiles_k, NUM_GROUPS, GROUP_N: gl.constexpr):
    """Wgrad tile ``tile``'s (expert, N tile, K tile, first token block, end token block): experts in
    turn (CTAs working at once share an expert's operands in L2), GROUP_N bands within one."""
    per_expert = tiles_n * tiles_k
    expert = gl.minimum(tile // per_expert, NUM_GROUPS - 2)
    pid_n, pid_k = _swizzle(tile % per_expert, tiles_n, tiles_k, GROUP_N)
    return expert, pid_n, pid_k, gl.load(sched_ptr + expert), gl.load(sched_ptr + NUM_GROUPS + expert)


@gluon.jit
def _resolved(tile, src, BLOCK_A: gl.constexpr, BLOCK_B: gl.constexpr, KIND: gl.constexpr, GROUP: gl.constexpr):
    """A cursor position at tile ``tile``'s first K block, read from the schedule: (tile, row of A's
    tiles, row of B's tiles, first K block, end K block); first == end: the tile loads nothing
    (padding rows, empty experts, past the last M tile). ``src`` = (schedule, tile count, tile step,
    A tiles, B tiles, NUM_GROUPS, B_ROWS, K blocks)."""
    sched_ptr, NUM_GROUPS = src[0], src[5]
    if KIND == KIND_PLAIN:
        pid_m, pid_n, group, row0, row_end, num_tiles = _tile_of(tile, sched_ptr, src[3], src[4], NUM_GROUPS,
                                                                 BLOCK_A, GROUP)
        loads = (pid_m < num_tiles) & (group < NUM_GROUPS - 1)
        return tile, row0, group * src[6] + pid_n * BLOCK_B, 0, gl.where(loads, src[7], 0)
    else:
        expert, pid_n, pid_k, first, end = _wgrad_tile(tile, sched_ptr, src[3], src[4], NUM_GROUPS, GROUP)
        return tile, pid_n * BLOCK_A, pid_k * BLOCK_B, first, end


@gluon.jit
def _unresolved(tile):
    """A cursor position at tile ``tile`` whose K blocks are not read from the schedule yet (end -1)."""
    return tile, 0, 0, 0, -1


@gluon.jit
def _load_next(ring, cursor, src, NUM_STAGES: gl.constexpr, OUTER: gl.constexpr):
    """One step of the load cursor ``(here, after, loaded)``, positions being (tile, A row, B row, K block,
    end K block): TMA loads of ``here``'s block (and, ``OUTER``, its B column scales) into the next
    stage if it has one, then on to its next block or, past a tile's last (or an empty tile), to
    ``after``, the next tile of this program, which is then unresolved (:func:`_resolve_after`). An
    unresolved ``here`` waits for :func:`_top_up`. Branch-free and without schedule reads: control
    flow in the K loop makes ptxas serialise the wgrad's wgmmas (C7514), and schedule reads in every
    K step slowed the plain GEMM by a third."""
    a_desc, b_desc, a_bufs, b_bufs, ready, cs_desc, cs_bufs = ring
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    here, after, loaded = cursor
    tile, a_row, b_row, blk, end = here
    pred = (tile < src[1]) & (blk < end)
    stage = loaded % NUM_STAGES
    bar = ready.index(stage)
    if OUTER:
        mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes + cs_desc.block_type.nbytes,
                        pred=pred)
        tma.async_copy_global_to_shared(cs_desc, [blk, b_row], bar, cs_bufs.index(stage), pred=pred)
    else:
        mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(a_desc, [a_row, blk * BLOCK_K], bar, a_bufs.index(stage), pred=pred)
    tma.async_copy_global_to_shared(b_desc, [b_row, blk * BLOCK_K], bar, b_bufs.index(stage), pred=pred)
    blk += pred.to(gl.int32)
    on = (blk >= end) & (end >= 0) & (tile < src[1])
    here = (gl.where(on, after[0], tile), gl.where(on, after[1], a_row), gl.where(on, after[2], b_row),
            gl.where(on, after[3], blk), gl.where(on, after[4], end))
    after = (gl.where(on, after[0] + src[2], after[0]), after[1], after[2], after[3], gl.where(on, -1, after[4]))
    return here, after, loaded + pred.to(gl.int32)


@gluon.jit
def _resolve_after(cursor, src, BLOCK_A: gl.constexpr, BLOCK_B: gl.constexpr, KIND: gl.constexpr,
                   GROUP: gl.constexpr):
    """Reads ``after``'s K blocks from the schedule if unresolved: in each tile's K loop, under its first
    wgmma (branch-free, the reads' latency hidden), so that the cursor can run into the next tile."""
    here, after, loaded = cursor
    _, a_row, b_row, blk, end = _resolved(after[0], src, BLOCK_A, BLOCK_B, KIND, GROUP)
    on = after[4] < 0
    after = (after[0], gl.where(on, a_row, after[1]), gl.where(on, b_row, after[2]), gl.where(on, blk, after[3]),
             gl.where(on, end, after[4]))
    return here, after, loaded


@gluon.jit
def _top_up(ring, cursor, used, src, KIND: gl.constexpr, GROUP: gl.constexpr, NUM_STAGES: gl.constexpr,
            OUTER: gl.constexpr):
    """Before a tile's K loop: steps the cursor (resolving its tiles) until ``NUM_STAGES`` blocks past the
    ``used`` consumed ones are loaded or none are left. Needed where the K loop's own steps could not
    go on: past an empty tile or the end of a short one."""
    BLOCK_A: gl.constexpr = ring[0].block_type.shape[0]
    BLOCK_B: gl.constexpr = ring[1].block_type.shape[0]
    here, after, loaded = cursor
    while (loaded < used + NUM_STAGES) & (here[0] < src[1]):
        if here[4] < 0:
            here = _resolved(here[0], src, BLOCK_A, BLOCK_B, KIND, GROUP)
        here, after, loaded = _load_next(ring, (here, after, loaded), src, NUM_STAGES, OUTER)
    return here, after, loaded


@gluon.jit
def _operand_ring(a_desc, b_desc, cs_desc, src, KIND: gl.constexpr, GROUP: gl.constexpr, NUM_STAGES: gl.constexpr,
                  OUTER: gl.constexpr):
    """The ring: the descriptors and the stages of A and B tiles (and, ``OUTER``, of B's column scales,
    ``cs_desc``) in shared memory with their barriers; and the load cursor at this program's first
    tile (nothing loaded yet, the next tile unresolved)."""
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_A: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_B: gl.constexpr = b_desc.block_type.shape[0]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES, BLOCK_A, BLOCK_K], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_STAGES, BLOCK_B, BLOCK_K], b_desc.layout)
    if OUTER:
        cs_bufs = gl.allocate_shared_memory(cs_desc.dtype, [NUM_STAGES] + cs_desc.block_type.shape, cs_desc.layout)
    else:
        cs_bufs = a_bufs  # unused
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
    here = _resolved(gl.program_id(0), src, BLOCK_A, BLOCK_B, KIND, GROUP)
    ring = (a_desc, b_desc, a_bufs, b_bufs, ready, cs_desc, cs_bufs)
    return ring, (here, _unresolved(gl.program_id(0) + src[2]), 0)


@gluon.jit
def _release(ring, NUM_STAGES: gl.constexpr):
    """Invalidates the ring's barriers at the end of the kernel (every load issued was consumed)."""
    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(ring[4].index(i))


@gluon.jit
def _store_rows(c_ptr, stride_cm, row0, row_end, col0, tile, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                num_warps: gl.constexpr):
    """Stores the [BLOCK_M, BLOCK_N] ``tile`` at (row0, col0) over the rows before ``row_end``, in 16-byte
    row vectors (the wgmma layout would store 4 bytes per thread)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    out = gl.convert_layout(tile.to(c_ptr.dtype.element_ty), layout)
    rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    ptrs = c_ptr + rows.to(gl.int64)[:, None] * stride_cm + cols[None, :]
    gl.store(ptrs, out, mask=(rows < row_end)[:, None])


@gluon.jit
def fp8_block_gemm_wgmma_kernel(
    a_desc, as_ptr, stride_asm, stride_ask,
    b_desc, bs_ptr, stride_bse, stride_bsn, stride_bsk, B_ROWS,
    c_ptr, stride_cm, bias_ptr, stride_bias_e, sched_ptr,
    T, N, K, MAX_M_TILES, NUM_GROUPS,
    HAS_BIAS: gl.constexpr, GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr, num_warps: gl.constexpr,
):
    """Persistent over the tiles ``program_id, + grid, ...`` (one each when the grid covers them all)."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BLOCK_N, 32])
    num_pid_n = N // BLOCK_N
    k_tiles = K // BLOCK_K
    total = MAX_M_TILES * num_pid_n
    src = (sched_ptr, total, gl.num_programs(0), MAX_M_TILES, num_pid_n, NUM_GROUPS, B_ROWS, k_tiles)
    # no per-column scales here (one scalar of B per block): a_desc stands in for their descriptor
    ring, cursor = _operand_ring(a_desc, b_desc, a_desc, src, KIND_PLAIN, GROUP_M, NUM_STAGES, False)
    used = 0  # K blocks consumed so far: the next one sits in stage used % NUM_STAGES
    for tile in range(gl.program_id(0), total, gl.num_programs(0)):
        pid_m, pid_n, group, row0, row_end, num_tiles = _tile_of(tile, sched_ptr, MAX_M_TILES, num_pid_n, NUM_GROUPS,
                                                                 BLOCK_M, GROUP_M)
        if pid_m < num_tiles:
            if group == NUM_GROUPS - 1:
                # the padding group: zero rows, no GEMM
                _store_rows(c_ptr, stride_cm, row0, row_end, pid_n * BLOCK_N,
                            gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma), BLOCK_M, BLOCK_N, num_warps)
            else:
                # scales: one per row of A (each thread holds its rows'), one scalar of B per K block
                rows = gl.minimum(row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma)), T - 1)
                sb_ptr = bs_ptr + group.to(gl.int64) * stride_bse + ((pid_n * BLOCK_N) // 128) * stride_bsn
                cursor = _top_up(ring, cursor, used, src, KIND_PLAIN, GROUP_M, NUM_STAGES, False)
                acc, cursor = _promoted_mainloop(ring, used, 0, k_tiles, cursor, src,
                                                 as_ptr + rows.to(gl.int64) * stride_asm, stride_ask, sb_ptr,
                                                 stride_bsk, mma, NUM_STAGES, False, KIND_PLAIN, GROUP_M)
                used += k_tiles
                if HAS_BIAS:
                    cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
                    acc = acc + gl.load(bias_ptr + group * stride_bias_e + cols).to(gl.float32)[None, :]
                _store_rows(c_ptr, stride_cm, row0, row_end, pid_n * BLOCK_N, acc, BLOCK_M, BLOCK_N, num_warps)
    _release(ring, NUM_STAGES)


@gluon.jit
def fp8_block_wgrad_wgmma_kernel(
    g_desc, gs_ptr, stride_gst, x_desc, xs_desc, dw_ptr, stride_dw_e, stride_dw_n,
    sched_ptr, N, K, NUM_GROUPS,
    GROUP_N: gl.constexpr, NUM_STAGES: gl.constexpr, num_warps: gl.constexpr,
):
    """``dw[e][n tile, k tile] = sum over expert e's token blocks t of G_t^T X_t * gs[t, n] * xs[t, k]``
    from the columnwise copies (``data_t`` [N or K, 128 * tiles], one 128-token block per M tile of
    the schedule, scales ``scale_t`` [tiles, N or K]); zeros for experts without tokens. Persistent
    over the tiles ``program_id, + grid, ...``: an expert has few token blocks (~8 at DSv3), so the
    next tile's loads are issued under this tile's last blocks and its store."""
    BLOCK_N: gl.constexpr = g_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[0]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BLOCK_K, 32])
    tiles_n = N // BLOCK_N
    tiles_k = K // BLOCK_K
    total = (NUM_GROUPS - 1) * tiles_n * tiles_k
    src = (sched_ptr, total, gl.num_programs(0), tiles_n, tiles_k, NUM_GROUPS, 0, 0)
    ring, cursor = _operand_ring(g_desc, x_desc, xs_desc, src, KIND_WGRAD, GROUP_N, NUM_STAGES, True)
    used = 0
    for tile in range(gl.program_id(0), total, gl.num_programs(0)):
        expert, pid_n, pid_k, tile_start, tile_end = _wgrad_tile(tile, sched_ptr, tiles_n, tiles_k, NUM_GROUPS,
                                                                 GROUP_N)
        dw_tile = dw_ptr + expert.to(gl.int64) * stride_dw_e
        if tile_end > tile_start:
            rows_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
            cursor = _top_up(ring, cursor, used, src, KIND_WGRAD, GROUP_N, NUM_STAGES, True)
            acc, cursor = _promoted_mainloop(ring, used, tile_start, tile_end - tile_start, cursor, src,
                                             gs_ptr + rows_n, stride_gst, gs_ptr, 0, mma, NUM_STAGES, True, KIND_WGRAD,
                                             GROUP_N)
            used += tile_end - tile_start
            _store_rows(dw_tile, stride_dw_n, pid_n * BLOCK_N, N, pid_k * BLOCK_K, acc, BLOCK_N, BLOCK_K, num_warps)
        else:
            _store_rows(dw_tile, stride_dw_n, pid_n * BLOCK_N, N, pid_k * BLOCK_K,
                        gl.zeros([BLOCK_N, BLOCK_K], gl.float32, mma), BLOCK_N, BLOCK_K, num_warps)
    _release(ring, NUM_STAGES)


@gluon.jit
def _promoted_mainloop(ring, used, k_first, k_tiles, cursor, src, row_scales, stride_row_scales, col_scales,
                       stride_col_scales, mma: gl.constexpr, NUM_STAGES: gl.constexpr, OUTER: gl.constexpr,
                       KIND: gl.constexpr, GROUP: gl.constexpr, PRODUCER: gl.constexpr = False,
                       BAND: gl.constexpr = 0, BANDS: gl.constexpr = 1):
    """sum over K blocks ``k_first .. k_first + k_tiles - 1`` (``k_tiles >= 1``) of ``dot(A block, B
    block^T) * scale`` in FP32, with block ``k``'s wgmma running while block ``k-1`` is promoted.
    The blocks were loaded by the ``cursor`` (:func:`_load_next`) into the ring's stages from
    ``used`` on; each block retired steps the cursor, which runs ``NUM_STAGES`` blocks ahead across
    tiles. Returns the sum and the cursor. Scales: per row of A (:func:`_row_scale`) times one
    scalar of B per block, or (``OUTER``) times B's per-row scales from the ring (:func:`_retire`).
    ``PRODUCER``: a producer partition fills the ring (:mod:`.wgmma_ws`); each block retired hands its
    stage back to it and ``cursor`` / ``src`` are unused; its consumers may each take a band of A's
    rows (``BAND`` of ``BANDS``, :func:`_a_tile`)."""
    BLOCK_M: gl.constexpr = ring[2].shape[1] // BANDS
    BLOCK_N: gl.constexpr = ring[3].shape[1]
    # Two register tiles take turns (X, Y): the loop runs two K blocks per trip so that neither is ever
    # copied; a copy of a tile whose wgmma is in flight makes ptxas serialise every wgmma (C7514). So
    # does a phi of an in-flight tile that ptxas cannot coalesce, which small changes here provoke:
    # tests/test_fp8_block_wgmma.py checks the build. Row scales load one block ahead.
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
    spare = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
    in_flight = _issue(ring, used, spare, NUM_STAGES, BAND, BANDS)
    if not PRODUCER:
        cursor = _resolve_after(cursor, src, BLOCK_M, BLOCK_N, KIND, GROUP)
    rs = _row_scale(row_scales, stride_row_scales, col_scales, stride_col_scales, k_first, OUTER)
    for k in range(1, k_tiles - 1, 2):
        rs_k = _row_scale(row_scales, stride_row_scales, col_scales, stride_col_scales, k_first + k, OUTER)
        issued = _issue(ring, used + k, spare, NUM_STAGES, BAND, BANDS)
        done, cs, cursor = _retire(ring, in_flight, 1, used + k - 1, cursor, src, NUM_STAGES, OUTER, PRODUCER)
        acc = _promote(acc, done, rs, cs, OUTER)
        rs = _row_scale(row_scales, stride_row_scales, col_scales, stride_col_scales, k_first + k + 1, OUTER)
        in_flight = _issue(ring, used + k + 1, done, NUM_STAGES, BAND, BANDS)
        spare, cs, cursor = _retire(ring, issued, 1, used + k, cursor, src, NUM_STAGES, OUTER, PRODUCER)
        acc = _promote(acc, spare, rs_k, cs, OUTER)
    # both branches end with every wgmma waited for: a token leaving an if would merge X and Y (a copy)
    if k_tiles % 2 == 0:
        # one K block left after the pairs
        last = k_tiles - 1
        issued = _issue(ring, used + last, spare, NUM_STAGES, BAND, BANDS)
        done, cs, cursor = _retire(ring, in_flight, 1, used + last - 1, cursor, src, NUM_STAGES, OUTER, PRODUCER)
        acc = _promote(acc, done, rs, cs, OUTER)
        rs = _row_scale(row_scales, stride_row_scales, col_scales, stride_col_scales, k_first + last, OUTER)
        done, cs, cursor = _retire(ring, issued, 0, used + last, cursor, src, NUM_STAGES, OUTER, PRODUCER)
        acc = _promote(acc, done, rs, cs, OUTER)
    else:
        done, cs, cursor = _retire(ring, in_flight, 0, used + k_tiles - 1, cursor, src, NUM_STAGES, OUTER, PRODUCER)
        acc = _promote(acc, done, rs, cs, OUTER)
    return acc, cursor


@gluon.jit
def _row_scale(row_scales, stride_row_scales, col_scales, stride_col_scales, k, OUTER: gl.constexpr):
    """Block ``k``'s per-row scale factors: A's (``OUTER``: B's come with the stage) or A's times the
    128x128 weight block's scalar (taken at load time: the rows' vector stays 2 registers)."""
    rows = gl.load(row_scales + k * stride_row_scales)
    if OUTER:
        return rows
    else:
        return rows * gl.load(col_scales + k * stride_col_scales)


@gluon.jit
def _promote(acc, part, row_scale, col_scale, OUTER: gl.constexpr):
    """``acc + part * row_scale[:, None] (* col_scale, [1, BLOCK_N], if OUTER)`` in FP32. The FMA is inline
    PTX marked impure so that LLVM keeps it before the next wgmma's issue (also inline asm): sunk past
    it, ``part`` would be live across the wgmma that overwrites its registers, the copy that follows
    makes ptxas serialise every wgmma (C7515; seen with the wgrad's column scales)."""
    if OUTER:
        factor = row_scale[:, None] * col_scale
    else:
        factor = gl.broadcast(row_scale[:, None], part)[0]
    return gl.inline_asm_elementwise("fma.rn.f32 $0, $1, $2, $3;", "=r,r,r,r", [part, factor, acc], dtype=gl.float32,
                                     is_pure=False, pack=1)


@gluon.jit
def _a_tile(ring, stage, BAND: gl.constexpr, BANDS: gl.constexpr):
    """A's tile in ring stage ``stage``: all its rows (``BANDS`` = 1) or, where a warp-specialised
    kernel's consumer takes a band of them (:mod:`.wgmma_ws`), band ``BAND`` of ``BANDS``."""
    a = ring[2].index(stage)
    if BANDS > 1:
        rows: gl.constexpr = a.shape[0] // BANDS
        a = a.slice(BAND * rows, rows)
    return a


@gluon.jit
def _issue(ring, j, out, NUM_STAGES: gl.constexpr, BAND: gl.constexpr = 0, BANDS: gl.constexpr = 1):
    """Waits for the tiles of the ring's ``j``-th K block and issues its wgmma (A's rows: :func:`_a_tile`)
    into ``out``'s registers (not accumulated)."""
    b_bufs, ready = ring[3], ring[4]
    stage = j % NUM_STAGES
    mbarrier.wait(ready.index(stage), (j // NUM_STAGES) & 1)
    return warpgroup_mma(_a_tile(ring, stage, BAND, BANDS), b_bufs.index(stage).permute((1, 0)), out, use_acc=False,
                         is_async=True)


@gluon.jit
def _retire(ring, token, outstanding: gl.constexpr, j, cursor, src, NUM_STAGES: gl.constexpr, OUTER: gl.constexpr,
            PRODUCER: gl.constexpr = False):
    """Waits for the wgmma of the ring's ``j``-th K block (``token``; ``outstanding`` newer ones may still
    run), reads its B column scales (``OUTER``; else 1.0) before the stage can be refilled, then
    steps the load cursor or (``PRODUCER``) hands the stage back to the producer partition (its
    ``empty`` barrier, ``ring[7]``). Returns the partial product, the scales ([1, BLOCK_N] in its
    layout) and the cursor."""
    done = warpgroup_mma_wait(num_outstanding=outstanding, deps=(token,))
    if OUTER:
        cs = ring[6].index(j % NUM_STAGES).load(done.type.layout)
    else:
        cs = 1.0
    gl.thread_barrier()  # every warp is past its wgmma on this stage before TMA overwrites it
    if PRODUCER:
        mbarrier.arrive(ring[7].index(j % NUM_STAGES), count=1)
    else:
        cursor = _load_next(ring, cursor, src, NUM_STAGES, OUTER)
    return done, cs, cursor


def descriptor(t: torch.Tensor, block_rows: int):
    """Gluon TMA descriptor of a 2-D FP8 ``t`` (unit inner stride) in [block_rows, 128] boxes."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    layout = gl.NVMMASharedLayout.get_default_for([block_rows, BLOCK], _GL_DTYPES[t.dtype])
    return TensorDescriptor(t, list(t.shape), [t.stride(0), 1], [block_rows, BLOCK], layout)


def scale_descriptor(scale_t: torch.Tensor, block: int):
    """Gluon TMA descriptor of FP32 per-token-block scales ``scale_t`` [tiles, columns] in [1, block]
    boxes (unswizzled: one row of 4 * block bytes)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    return TensorDescriptor(scale_t, list(scale_t.shape), [scale_t.stride(0), 1], [1, block], layout)


def descriptors(a: torch.Tensor, b: torch.Tensor):
    """Descriptors of ``a`` [T, K] and of ``b`` [E, rows, K] seen as [E * rows, K]."""
    return descriptor(a, BM), descriptor(b.view(b.shape[0] * b.shape[1], b.shape[2]), BN)


_GL_DTYPES = {torch.float8_e4m3fn: gl.float8e4nv, torch.float8_e5m2: gl.float8e5}


def usable(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether this kernel can run these operands here: an sm_90 GPU, FP8 operands, and TMA-legal
    layouts (16-byte aligned bases and rows, unit inner strides, contiguous ``b``, at least one row:
    a descriptor of an empty tensor is refused)."""
    if not (a.is_cuda and a.shape[0] > 0 and torch.cuda.get_device_capability(a.device)[0] == 9):
        return False
    return (a.dtype in _GL_DTYPES and b.dtype in _GL_DTYPES and a.stride(1) == 1 and b.is_contiguous()
            and a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0 and a.stride(0) % 16 == 0)


def persistent_grid(tiles: int, device: torch.device, ctas_per_sm: int) -> int:
    """Programs of a persistent launch: ``ctas_per_sm`` per SM (0: one per tile, not persistent)."""
    if not ctas_per_sm:
        return tiles
    return max(1, min(tiles, ctas_per_sm * torch.cuda.get_device_properties(device).multi_processor_count))


def launch_plain(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, n: int,
                 schedule: torch.Tensor, num_experts: int, c: torch.Tensor, bias=None, group_m: int = 8,
                 num_stages: int = STAGES, ctas_per_sm: int = 0):
    """``c[rows of expert e] = (A_e @ B_e^T) (+ bias_e)``, zeros on the padding rows (see module doc);
    ``ctas_per_sm`` > 0: persistent programs. The caller has checked K % 128 == N % 128 == 0 and
    :func:`usable`."""
    from ..schedule import max_m_tiles

    num_rows, k = a.shape
    m_tiles = max_m_tiles(num_rows, num_experts, BM)
    a_desc, b_desc = descriptors(a, b)
    dummy = a_scale
    fp8_block_gemm_wgmma_kernel[(persistent_grid(m_tiles * triton.cdiv(n, BN), a.device, ctas_per_sm),)](
        a_desc, a_scale, a_scale.stride(0), a_scale.stride(1),
        b_desc, b_scale, b_scale.stride(0), b_scale.stride(1), b_scale.stride(2), b.shape[1],
        c, c.stride(0), bias if bias is not None else dummy, bias.stride(0) if bias is not None else 0, schedule,
        num_rows, n, k, m_tiles, num_experts + 1,
        HAS_BIAS=bias is not None, GROUP_M=group_m, NUM_STAGES=num_stages, num_warps=NUM_WARPS,
    )
    return c


def wgrad_usable(g_t: torch.Tensor, x_t: torch.Tensor, x_scale_t: torch.Tensor) -> bool:
    """:func:`usable` for the wgrad's columnwise copies (``data_t``), and x's FP32 scales (``scale_t``,
    loaded by TMA: unit inner stride, 16-byte aligned base and rows)."""
    return (usable(g_t, x_t.unsqueeze(0)) and g_t.is_contiguous() and g_t.shape[1] > 0
            and x_scale_t.dtype == torch.float32 and x_scale_t.stride(1) == 1 and x_scale_t.stride(0) % 4 == 0
            and x_scale_t.data_ptr() % 16 == 0)


def launch_wgrad(g, x, schedule: torch.Tensor, dw: torch.Tensor, block_n: int = 128, block_k: int = 128,
                 group_n: int = 8, num_stages: int = STAGES, num_warps: int = NUM_WARPS, ctas_per_sm: int = 1):
    """``dw[e] = G_e^T @ X_e`` ([E, N, K], 128-multiples) from the columnwise copies of ``g`` and ``x``
    (:class:`~.quantize.QuantizedRows`) in ``block_n`` x ``block_k`` tiles of ``dw`` (rows: 64 per
    warpgroup), ``ctas_per_sm`` persistent programs per SM (0: one per tile). The caller checked the
    shapes."""
    num_experts, n, k = dw.shape
    tiles = num_experts * (n // block_n) * (k // block_k)
    fp8_block_wgrad_wgmma_kernel[(persistent_grid(tiles, dw.device, ctas_per_sm),)](
        descriptor(g.data_t, block_n), g.scale_t, g.scale_t.stride(0),
        descriptor(x.data_t, block_k), scale_descriptor(x.scale_t, block_k),
        dw, dw.stride(0), dw.stride(1), schedule, n, k, num_experts + 1,
        GROUP_N=group_n, NUM_STAGES=num_stages, num_warps=num_warps,
    )
