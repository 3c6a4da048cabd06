"""The FP8 block GEMMs on sm_90, warp-specialised Gluon kernels (Triton 3.6): a producer partition (one
warp, 24 registers) walks the tiles and K blocks and fills the ring of shared-memory stages by TMA,
ahead of the consumers and across tile boundaries; the consumer partitions wait for a stage, issue
its wgmma, promote the previous block (:func:`.wgmma_gemm._promoted_mainloop`) and hand its stage
back (an ``empty`` mbarrier per stage). The producer's register budget goes to them (``setmaxnreg``).

- :func:`launch_plain`: FC2 forward, FC1 dgrad and the GEMMs of FC1 / the dGLU when their epilogues
  run alone (same contract as ``gemm.launch("fc2" | "dgrad")``).
- :func:`launch_wgrad`: ``dw[e] = G_e^T X_e`` from the columnwise copies (``wgrad.fp8_grouped_wgrad``).

Why: the load-cursor kernels they replaced (run 19) stepped the cursor in the consumers' own warps
(~75 instructions per K block) and met at a CTA-wide barrier before each refill. At DSv3: FC2 0.97
vs 1.06 ms, FC1 dgrad 1.83 vs 2.07, the wgrad 2.43 vs 3.05 ms (w1; 2.82 for the Triton one). Same
tiles, same K order, same promotion code, so results are bitwise those of the Triton kernels
(tests/gpu/test_fp8_block_wgmma_gpu.py).

Options:
- ``consumers`` = 2: two consumer partitions, a warpgroup per half of each tile's rows, each with its
  own barrier and its own arrive on a stage's ``empty`` barrier (which counts two), so they do not
  wait for each other every block (the wgrad's leading ncu stall with one partition, run 19d).
- ``tma_store``: each output tile goes out through a shared-memory staging tile and a TMA store that
  runs under the next tile's mainloop. The wgrad: at ~8 token blocks per tile the store was most of
  the per-tile overhead (run 19c). The plain GEMM: whole tiles only (TMA cannot mask rows, and an
  expert's last tile ends inside the next expert's rows); that partial tile is read back from the
  staging tile and stored masked.

Register budget (``maxnreg`` at launch, per thread, over the warps rounded up to warpgroups): the
producer's warpgroup gives back all but 24, the consumers get the rest (:func:`launch_maxnreg`,
:func:`consumer_registers`). Gluon notes: the partitions' argument tuples are written out literally
(see the kernels), and a consumer's band of A's rows is a slice of one stage's 2-D tile
(:func:`.wgmma_gemm._a_tile`; a row slice of the 3-D ring asserts in Triton's layout code).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from . import gluon_names as G, wgmma_gemm as W

PRODUCER_WARPS = gl.constexpr(1)
PRODUCER_REGISTERS = gl.constexpr(24)  # the least a warp can be given: it only issues TMA copies
REGISTER_FILE = 64 * 1024  # 32-bit registers per SM (sm_90)
FIRST_BAND, SECOND_BAND = gl.constexpr(0), gl.constexpr(1)  # the consumers' bands of a tile's rows
# Whether the consumers (and the plain GEMM's producer) read the schedule entries of the tiles ahead
# while they work on this one, so that the reads' latency runs under this tile's K loop (the wgrad: the
# next tile's; the plain GEMM: the next tile's rows and the tile after's group, two deep since the rows'
# reads need the group's, see wgmma_gemm._plain_ahead). Without it every tile began with those reads
# (the plain GEMM's two round trips one after the other) ahead of its first wgmma. At DSv3 on an H100
# (run 28, two calls, each kernel alone): the plain GEMMs 0.4-4% faster in both (FC1 dgrad 1.73 vs 1.79
# and 1.80 vs 1.83 ms), the wgrads within +-3% either way (their ~8 token blocks per tile do not lose
# their time at the tile's start), the MLP within its run-to-run spread (10.86 vs 10.94, 10.99 vs 10.83).
TILE_PREFETCH = True
# Whether the plain GEMM's scales (A's row scales and B's 128x128 block scalar of each K block) come with
# the block's stage, loaded by the producer's TMA and read from shared memory once the block's wgmma is
# issued (``wgmma_gemm._ring_scales``), instead of loaded by the consumers from global memory one block
# ahead. Why: with the promotion an FADD and no scale loads, the four DSv3 token GEMMs took 14-16% less
# time (probe_plain, run 32: FC1's 1.709 -> 1.472 ms, cuBLAS FP8 1.494); the loads' latency, not the
# promotion's FP32 work, was what they lost to cuBLAS (run 30: long scoreboard their largest stall).
# Where TMA cannot read the scales (``wgmma_gemm.ring_scale_descriptors``) they are loaded as before.
# Experimental, off: it dies on the GPU with an illegal instruction, with the weight scalar's TMA box 16
# bytes wide (run 32) and 128 (``wgmma_gemm.SCALAR_BOX``, run 33). Run 34 (compute-sanitizer and
# scripts/probe_ring_debug.py): at the scalar's TMA copy below, whatever its tensor or box width, with or
# without the consumers' reads (benchmarks/NOTES.md, runs 33-34). Before turning it on:
# tests/gpu/test_fp8_block_wgmma_gpu.py -k ring_scales (the same bits as the loads), the FP8 block GPU
# tests with it on, then scripts/probe_plain.py and the bench's fp8_block_fused_ring_scales. Off, the
# kernels build to the same instructions as before run 32.
RING_SCALES = False


@gluon.jit
def _producer(ring, src, KIND: gl.constexpr, GROUP: gl.constexpr, NUM_STAGES: gl.constexpr, OUTER: gl.constexpr,
              PREFETCH: gl.constexpr, RING_SCALES: gl.constexpr = False):
    """Loads every K block of this program's tiles, in the consumers' order, into the ring: waits for a
    stage to be handed back (``empty``), then TMA-copies A's and B's tiles (and, ``OUTER``, B's column
    scales; ``RING_SCALES``, A's row scales and B's block scalar) into it, completing on its ``ready``
    barrier."""
    a_desc, b_desc, a_bufs, b_bufs, ready, cs_desc, cs_bufs, empty, ws_desc, ws_bufs = ring
    BLOCK_A: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_B: gl.constexpr = b_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    loaded = 0
    sched_ptr, NUM_GROUPS = src[0], src[5]
    # TILE_PREFETCH, the plain GEMM only: the wgrad's producer computed with it (the same next-tile reads
    # as its consumers) builds to a loop whose token-block range stays the first tile's (Triton 3.6: the
    # frontend IR carries the reads, the TTGIR after the warp-specialisation passes does not), and a
    # producer running NUM_STAGES blocks ahead hides that read's latency anyway
    PLAIN_PREFETCH: gl.constexpr = PREFETCH and KIND == W.KIND_PLAIN
    if PLAIN_PREFETCH:
        num_tiles = W._tile_count(sched_ptr, NUM_GROUPS)
        cur_m, cur_n, cur_g, cur_s, cur_r, cur_e, next_m, next_n, next_g = W._plain_ahead_first(
            gl.program_id(0), src[2], sched_ptr, src[3], src[4], NUM_GROUPS, GROUP)
    for tile in range(gl.program_id(0), src[1], src[2]):
        if PLAIN_PREFETCH:
            a_row = W._first_row(cur_m, cur_s, cur_r, BLOCK_A)
            b_row, end = W._plain_loads(cur_m, cur_n, cur_g, num_tiles, src, BLOCK_B)
            first = 0
            cur_m, cur_n, cur_g, cur_s, cur_r, cur_e, next_m, next_n, next_g = W._plain_ahead(
                tile + 2 * src[2], next_m, next_n, next_g, sched_ptr, src[3], src[4], NUM_GROUPS, GROUP)
        else:
            _, a_row, b_row, first, end = W._tile_loads(tile, src, BLOCK_A, BLOCK_B, KIND, GROUP)
        for blk in range(first, end):
            stage, phase = W.ring_slot(loaded, NUM_STAGES)
            # a stage starts free: its empty barrier's phase "before 0" counts as complete
            mbarrier.wait(empty.index(stage), phase ^ 1)
            bar = ready.index(stage)
            if OUTER:
                # the consumers read the column scales with ordinary loads: order them before the TMA
                # write (async proxy) that reuses the stage
                fence_async_shared()
                mbarrier.expect(bar, nbytes + cs_desc.block_type.nbytes)
                G.tma_load(cs_desc, [blk, b_row], bar, cs_bufs.index(stage))
            elif RING_SCALES:
                _copy_stage_scales(ring, stage, blk, a_row, b_row // BLOCK_B, nbytes)
            else:
                mbarrier.expect(bar, nbytes)
            G.tma_load(a_desc, [a_row, blk * BLOCK_K], bar, a_bufs.index(stage))
            G.tma_load(b_desc, [b_row, blk * BLOCK_K], bar, b_bufs.index(stage))
            loaded += 1


@gluon.jit
def _copy_stage_scales(ring, stage, blk, a_row, b_block_row, nbytes: gl.constexpr):
    """``RING_SCALES``: expects the stage's ``nbytes`` of A and B tiles plus its scales on its ``ready``
    barrier and TMA-copies the scales: A's row scales of K block ``blk`` from ``a_row`` on, and B's block
    scalar (row ``b_block_row`` of the weight's 128x128 blocks). A function of its own so that
    scripts/probe_ring_debug.py can swap it (which copy dies)."""
    cs_desc, cs_bufs, ws_desc, ws_bufs, bar = ring[5], ring[6], ring[8], ring[9], ring[4].index(stage)
    fence_async_shared()  # as for OUTER's column scales, for the row scales and the block scalar
    mbarrier.expect(bar, nbytes + cs_desc.block_type.nbytes + ws_desc.block_type.nbytes)
    G.tma_load(cs_desc, [blk, a_row], bar, cs_bufs.index(stage))
    G.tma_load(ws_desc, [b_block_row, blk], bar, ws_bufs.index(stage))


@gluon.jit
def _ring(a_desc, b_desc, cs_desc, ws_desc, NUM_STAGES: gl.constexpr, OUTER: gl.constexpr, CONSUMERS: gl.constexpr,
          RING_SCALES: gl.constexpr = False):
    """The ring: the descriptors, ``NUM_STAGES`` stages of A and B tiles (and, ``OUTER``, of B's column
    scales, ``cs_desc``; ``RING_SCALES``, of A's row scales, ``cs_desc``, and B's block scalars,
    ``ws_desc``) in shared memory, a ``ready`` barrier per stage (the TMA loads complete on it) and an
    ``empty`` one (each of the ``CONSUMERS`` partitions arrives on it when done with the stage).
    Indices: 0-1 A's and B's descriptors, 2-3 their stages, 4 ready, 5-6 cs, 7 empty, 8-9 ws."""
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES, a_desc.block_type.shape[0], BLOCK_K], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_STAGES, b_desc.block_type.shape[0], BLOCK_K], b_desc.layout)
    if OUTER or RING_SCALES:
        cs_bufs = gl.allocate_shared_memory(cs_desc.dtype, [NUM_STAGES] + cs_desc.block_type.shape, cs_desc.layout)
    else:
        cs_bufs = a_bufs  # unused
    if RING_SCALES:
        ws_bufs = gl.allocate_shared_memory(ws_desc.dtype, [NUM_STAGES] + ws_desc.block_type.shape, ws_desc.layout)
    else:
        ws_bufs = a_bufs  # unused
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    return a_desc, b_desc, a_bufs, b_bufs, ready, cs_desc, cs_bufs, empty, ws_desc, ws_bufs


@gluon.constexpr_function
def _accumulator_layout(num_warps, block_n):
    """A consumer's FP32 accumulator in the wgmma layout: ``num_warps`` warps down the rows, instructions
    ``block_n`` wide."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, block_n, 32])


@gluon.jit
def _stage(acc, staging):
    """Writes ``acc`` into the shared-memory ``staging`` tile (in its dtype) for a TMA store: waits for the
    previous tile's store to have read it (and every warp to have read back a partial tile, see
    :func:`_store_plain_tile`), then fences the writes for the TMA engine (async proxy)."""
    tma.store_wait(0)
    G.thread_barrier()
    staging.store(acc.to(staging.dtype))
    fence_async_shared()
    G.thread_barrier()


@gluon.jit
def _plain_consumer(ring, src, params, c_desc, HAS_BIAS: gl.constexpr, GROUP_M: gl.constexpr,
                    NUM_STAGES: gl.constexpr, TMA_STORE: gl.constexpr, PREFETCH: gl.constexpr, BAND: gl.constexpr,
                    BANDS: gl.constexpr, RING_SCALES: gl.constexpr, num_warps: gl.constexpr):
    """The plain GEMM's tiles ``program_id, + grid, ...`` in the producer's order, rows ``BAND`` of ``BANDS``
    of each on ``num_warps`` warps: the promoted mainloop (scales: one per row of A, each thread
    holding its rows', times one scalar of B per K block), bias, store (:func:`_store_plain_tile`);
    zeros on the padding group's rows. ``params``: the kernel's runtime arguments from ``as_ptr`` to
    ``N`` but the schedule."""
    (as_ptr, stride_asm, stride_ask, bs_ptr, stride_bse, stride_bsn, stride_bsk, c_ptr, stride_cm, bias_ptr,
     stride_bias_e, T, N) = params
    TILE_M: gl.constexpr = ring[0].block_type.shape[0]
    BLOCK_N: gl.constexpr = ring[1].block_type.shape[0]
    BLOCK_M: gl.constexpr = TILE_M // BANDS
    mma: gl.constexpr = _accumulator_layout(num_warps, BLOCK_N)
    if TMA_STORE:
        staging = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    else:
        staging = ring[2]  # unused
    sched_ptr, NUM_GROUPS, k_tiles = src[0], src[5], src[7]
    used = 0
    if PREFETCH:  # see TILE_PREFETCH
        num_tiles = W._tile_count(sched_ptr, NUM_GROUPS)
        cur_m, cur_n, cur_g, cur_s, cur_r, cur_e, next_m, next_n, next_g = W._plain_ahead_first(
            gl.program_id(0), src[2], sched_ptr, src[3], src[4], NUM_GROUPS, GROUP_M)
    for tile in range(gl.program_id(0), src[1], src[2]):
        if PREFETCH:
            pid_m, pid_n, group, row0, row_end = cur_m, cur_n, cur_g, W._first_row(cur_m, cur_s, cur_r, TILE_M), cur_e
            cur_m, cur_n, cur_g, cur_s, cur_r, cur_e, next_m, next_n, next_g = W._plain_ahead(
                tile + 2 * src[2], next_m, next_n, next_g, sched_ptr, src[3], src[4], NUM_GROUPS, GROUP_M)
        else:
            pid_m, pid_n, group, row0, row_end, num_tiles = W._tile_of(tile, sched_ptr, src[3], src[4], NUM_GROUPS,
                                                                       TILE_M, GROUP_M)
        row0 += BAND * BLOCK_M
        if pid_m < num_tiles:
            if group == NUM_GROUPS - 1:
                acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
            else:
                rows = gl.minimum(row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma)), T - 1)
                sb_ptr = bs_ptr + group.to(gl.int64) * stride_bse + ((pid_n * BLOCK_N) // 128) * stride_bsn
                acc = W._promoted_mainloop(ring, used, 0, k_tiles, as_ptr + rows.to(gl.int64) * stride_asm, stride_ask,
                                           sb_ptr, stride_bsk, mma, NUM_STAGES, False, BAND, BANDS, RING_SCALES)
                used += k_tiles
                if HAS_BIAS:
                    cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
                    acc = acc + gl.load(bias_ptr + group * stride_bias_e + cols).to(gl.float32)[None, :]
            _store_plain_tile(acc, staging, c_desc, c_ptr, stride_cm, row0, row_end, pid_n * BLOCK_N, N, TMA_STORE,
                              num_warps)
    if TMA_STORE:
        tma.store_wait(0)


@gluon.jit
def _store_plain_tile(acc, staging, c_desc, c_ptr, stride_cm, row0, row_end, col0, col_end, TMA_STORE: gl.constexpr,
                      num_warps: gl.constexpr):
    """Stores a plain tile's rows before ``row_end`` (the next expert's rows follow) and its columns before
    ``col_end`` (c's width). ``TMA_STORE``: through the shared-memory ``staging`` tile, by a TMA store
    that runs under the next tile's mainloop where the tile's rows are whole (the descriptor has c's
    width: TMA drops columns past it), else (an expert's last tile) read back in row vectors and
    stored masked."""
    BLOCK_M: gl.constexpr = acc.shape[0]
    BLOCK_N: gl.constexpr = acc.shape[1]
    if TMA_STORE:
        _stage(acc, staging)
        if row0 + BLOCK_M <= row_end:
            G.tma_store(c_desc, [row0, col0], staging)
        else:
            W._store_row_vectors(c_ptr, stride_cm, row0, row_end, col0, col_end,
                                 staging.load(W._row_vectors(num_warps)), BLOCK_M, BLOCK_N, num_warps)
    else:
        W._store_rows(c_ptr, stride_cm, row0, row_end, col0, col_end, acc, BLOCK_M, BLOCK_N, num_warps)


@gluon.jit
def fp8_block_gemm_ws_kernel(
    a_desc, as_ptr, as_desc, stride_asm, stride_ask,
    b_desc, bs_ptr, bs_desc, stride_bse, stride_bsn, stride_bsk, B_ROWS,
    c_ptr, c_desc, stride_cm, bias_ptr, stride_bias_e, sched_ptr,
    T, N, K, MAX_M_TILES, NUM_GROUPS,
    HAS_BIAS: gl.constexpr, GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr, TMA_STORE: gl.constexpr,
    PREFETCH: gl.constexpr, RING_SCALES: gl.constexpr, CONSUMERS: gl.constexpr, CONSUMER_REGISTERS: gl.constexpr,
    num_warps: gl.constexpr,
):
    """``c[rows of expert e] = (A_e @ B_e^T) (+ bias_e)``, persistent over the tiles (``CONSUMERS``
    partitions of ``num_warps`` consumer warps each, and the producer). ``c_desc``: ``c`` in boxes of a
    partition's tile, used with ``TMA_STORE``; ``as_desc``, ``bs_desc``: the scales by TMA
    (``wgmma_gemm.ring_scale_descriptors``), used with ``RING_SCALES``."""
    num_pid_n = gl.cdiv(N, b_desc.block_type.shape[0])  # N: c's width; B's rows cover the last tile
    k_tiles = K // a_desc.block_type.shape[1]
    src = (sched_ptr, MAX_M_TILES * num_pid_n, gl.num_programs(0), MAX_M_TILES, num_pid_n, NUM_GROUPS, B_ROWS,
           k_tiles)
    ring = _ring(a_desc, b_desc, as_desc, bs_desc, NUM_STAGES, False, CONSUMERS, RING_SCALES)
    p = (as_ptr, stride_asm, stride_ask, bs_ptr, stride_bse, stride_bsn, stride_bsk, c_ptr, stride_cm, bias_ptr,
         stride_bias_e, T, N)
    # one consumer partition or two (gemm.PLAIN_CONSUMERS), each a warpgroup taking half of every tile's rows,
    # handing its stages back and waiting at its own barriers, not in step with the other. (The
    # partitions' argument tuples are written out: a tuple built by concatenation or bound to a name
    # reaches them with its constexprs turned into Python values, which they cannot take.)
    if CONSUMERS == 1:
        gl.warp_specialize([(_plain_consumer, (ring, src, p, c_desc, HAS_BIAS, GROUP_M, NUM_STAGES, TMA_STORE,
                                               PREFETCH, FIRST_BAND, CONSUMERS, RING_SCALES, num_warps)),
                            (_producer, (ring, src, W.KIND_PLAIN, GROUP_M, NUM_STAGES, False, PREFETCH,
                                         RING_SCALES))],
                           [PRODUCER_WARPS], [PRODUCER_REGISTERS])
    else:
        gl.warp_specialize([(_plain_consumer, (ring, src, p, c_desc, HAS_BIAS, GROUP_M, NUM_STAGES, TMA_STORE,
                                               PREFETCH, FIRST_BAND, CONSUMERS, RING_SCALES, num_warps)),
                            (_plain_consumer, (ring, src, p, c_desc, HAS_BIAS, GROUP_M, NUM_STAGES, TMA_STORE,
                                               PREFETCH, SECOND_BAND, CONSUMERS, RING_SCALES, num_warps)),
                            (_producer, (ring, src, W.KIND_PLAIN, GROUP_M, NUM_STAGES, False, PREFETCH,
                                         RING_SCALES))],
                           [num_warps, PRODUCER_WARPS], [CONSUMER_REGISTERS, PRODUCER_REGISTERS])


@gluon.jit
def _wgrad_consumer(ring, src, params, dw_desc, GROUP_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                    TMA_STORE: gl.constexpr, PREFETCH: gl.constexpr, BAND: gl.constexpr, BANDS: gl.constexpr,
                    num_warps: gl.constexpr):
    """The wgrad's tiles ``program_id, + grid, ...`` in the producer's order, rows ``BAND`` of ``BANDS`` of
    each on ``num_warps`` warps; experts without tokens store zeros. ``TMA_STORE``: each dw
    tile goes out through a shared-memory staging tile and a TMA store that runs under the next tile's
    mainloop (``dw_desc``: dw as [E * N, K] in boxes of this band's rows). ``params``: the kernel's
    runtime arguments gs_ptr, stride_gst, dw_ptr, stride_dw_e, stride_dw_n, N, K."""
    gs_ptr, stride_gst, dw_ptr, stride_dw_e, stride_dw_n, N, K = params
    TILE_N: gl.constexpr = ring[0].block_type.shape[0]
    BLOCK_K: gl.constexpr = ring[1].block_type.shape[0]
    BLOCK_N: gl.constexpr = TILE_N // BANDS
    mma: gl.constexpr = _accumulator_layout(num_warps, BLOCK_K)
    if TMA_STORE:
        staging = gl.allocate_shared_memory(dw_desc.dtype, dw_desc.block_type.shape, dw_desc.layout)
    used = 0
    if PREFETCH:
        next_expert, next_n, next_k, next_start, next_end = W._wgrad_tile(gl.program_id(0), src[0], src[3], src[4],
                                                                          src[5], GROUP_N)
    for tile in range(gl.program_id(0), src[1], src[2]):
        if PREFETCH:  # see TILE_PREFETCH
            expert, pid_n, pid_k, tile_start, tile_end = next_expert, next_n, next_k, next_start, next_end
            next_expert, next_n, next_k, next_start, next_end = W._wgrad_tile(tile + src[2], src[0], src[3], src[4],
                                                                              src[5], GROUP_N)
        else:
            expert, pid_n, pid_k, tile_start, tile_end = W._wgrad_tile(tile, src[0], src[3], src[4], src[5], GROUP_N)
        row0 = pid_n * TILE_N + BAND * BLOCK_N
        if tile_end > tile_start:
            rows_n = row0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
            acc = W._promoted_mainloop(ring, used, tile_start, tile_end - tile_start, gs_ptr + rows_n, stride_gst,
                                       gs_ptr, 0, mma, NUM_STAGES, True, BAND, BANDS)
            used += tile_end - tile_start
        else:
            acc = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, mma)
        if TMA_STORE:
            _stage(acc, staging)
            G.tma_store(dw_desc, [expert * N + row0, pid_k * BLOCK_K], staging)
        else:
            W._store_rows(dw_ptr + expert.to(gl.int64) * stride_dw_e, stride_dw_n, row0, N, pid_k * BLOCK_K, K, acc,
                          BLOCK_N, BLOCK_K, num_warps)
    if TMA_STORE:
        tma.store_wait(0)


@gluon.jit
def fp8_block_wgrad_ws_kernel(
    g_desc, gs_ptr, stride_gst, x_desc, xs_desc, dw_ptr, dw_desc, stride_dw_e, stride_dw_n,
    sched_ptr, N, K, NUM_GROUPS,
    GROUP_N: gl.constexpr, NUM_STAGES: gl.constexpr, TMA_STORE: gl.constexpr, PREFETCH: gl.constexpr,
    CONSUMERS: gl.constexpr,
    CONSUMER_REGISTERS: gl.constexpr, num_warps: gl.constexpr,
):
    """``dw[e][n tile, k tile] = sum over expert e's token blocks t of G_t^T X_t * gs[t, n] * xs[t, k]``
    from the columnwise copies (``data_t`` [N or K, 128 * tiles], one 128-token block per M tile of the
    schedule, scales ``scale_t`` [tiles, N or K]; ``xs`` by TMA with each stage), persistent over the
    tiles (``CONSUMERS`` partitions of ``num_warps`` consumer warps each, and the producer); an expert
    has few token blocks (~8 at DSv3), so the producer's loads run into the next tile under this
    tile's last blocks and its store. ``dw_desc``: used with ``TMA_STORE``."""
    # N, K: dw's sizes; the columnwise copies cover the last tiles (zeros past them, see padded.py)
    tiles_n = gl.cdiv(N, g_desc.block_type.shape[0])
    tiles_k = gl.cdiv(K, x_desc.block_type.shape[0])
    src = (sched_ptr, (NUM_GROUPS - 1) * tiles_n * tiles_k, gl.num_programs(0), tiles_n, tiles_k, NUM_GROUPS, 0, 0)
    ring = _ring(g_desc, x_desc, xs_desc, xs_desc, NUM_STAGES, True, CONSUMERS)
    p = (gs_ptr, stride_gst, dw_ptr, stride_dw_e, stride_dw_n, N, K)
    if CONSUMERS == 1:  # as in fp8_block_gemm_ws_kernel
        gl.warp_specialize([(_wgrad_consumer, (ring, src, p, dw_desc, GROUP_N, NUM_STAGES, TMA_STORE, PREFETCH,
                                               FIRST_BAND, CONSUMERS, num_warps)),
                            (_producer, (ring, src, W.KIND_WGRAD, GROUP_N, NUM_STAGES, True, PREFETCH))],
                           [PRODUCER_WARPS], [PRODUCER_REGISTERS])
    else:
        gl.warp_specialize([(_wgrad_consumer, (ring, src, p, dw_desc, GROUP_N, NUM_STAGES, TMA_STORE, PREFETCH,
                                               FIRST_BAND, CONSUMERS, num_warps)),
                            (_wgrad_consumer, (ring, src, p, dw_desc, GROUP_N, NUM_STAGES, TMA_STORE, PREFETCH,
                                               SECOND_BAND, CONSUMERS, num_warps)),
                            (_producer, (ring, src, W.KIND_WGRAD, GROUP_N, NUM_STAGES, True, PREFETCH))],
                           [num_warps, PRODUCER_WARPS], [CONSUMER_REGISTERS, PRODUCER_REGISTERS])


def launch_maxnreg(consumer_warps: int, ctas_per_sm: int, tile_elements: int = 128 * 128) -> int:
    """The per-thread register cap at launch so that ``ctas_per_sm`` CTAs of ``consumer_warps`` consumer
    warps plus the producer's warpgroup fit the register file (multiples of 8, at most 248); the
    producer gives back its share above 24, which goes to the consumers. ptxas still compiles each
    wgmma within the launch cap (C7602): its accumulator (``tile_elements`` over the consumer threads)
    plus ~26 registers must fit, else a clear error here instead of a ptxas failure."""
    warps = consumer_warps + 4  # the producer's warp occupies a warpgroup
    regs = min(248, (REGISTER_FILE // (ctas_per_sm * warps * 32)) // 8 * 8)
    need = tile_elements // (consumer_warps * 32) + 32
    if regs < need:
        raise ValueError(f"ctas_per_sm: {ctas_per_sm} CTAs per SM of a warp-specialised kernel with {consumer_warps} "
                         f"consumer warps leave {regs} registers per thread at launch; its {tile_elements}-element "
                         f"tiles need at least {need}: use fewer CTAs per SM or smaller tiles")
    return regs


def consumer_registers(consumer_warps: int, maxnreg: int) -> int:
    """Registers per thread each consumer gets: the launch cap's pool over the consumer warps plus the
    producer's warpgroup, less the producer's 24 per thread, shared by the consumers (multiple of 8)."""
    pool = maxnreg * (consumer_warps + 4) - PRODUCER_REGISTERS.value * 4
    return min(248, pool // consumer_warps // 8 * 8)


def _partitions(num_warps: int, consumers: int, ctas_per_sm: int, tile_elements: int) -> dict:
    """Launch keywords of a warp-specialised kernel: ``num_warps`` consumer warps in ``consumers``
    partitions (1, or 2 warpgroups taking half of each tile's rows), the register caps."""
    if consumers not in (1, 2) or num_warps % (4 * consumers):
        raise ValueError(f"consumers: expected 1, or 2 with num_warps a multiple of 8, got {consumers} with "
                         f"num_warps={num_warps}")
    maxnreg = launch_maxnreg(num_warps, ctas_per_sm, tile_elements)
    return dict(num_warps=num_warps // consumers, CONSUMERS=consumers, maxnreg=maxnreg,
                CONSUMER_REGISTERS=consumer_registers(num_warps, maxnreg))


def launch_plain(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, n: int,
                 schedule: torch.Tensor, num_experts: int, c: torch.Tensor, bias, *, group_m: int, num_stages: int,
                 ctas_per_sm: int, consumers: int, tma_store: bool):
    """``c[rows of expert e] = (A_e @ B_e^T) (+ bias_e)``, zeros on the padding rows (see
    :mod:`.wgmma_gemm`), ``ctas_per_sm`` persistent programs per SM (0 counts as 1), ``consumers``
    consumer partitions (:func:`_partitions`); ``tma_store``: whole tiles stored by TMA where ``c``
    allows it (16- or 32-bit floats, 16-byte aligned rows). ``n``: c's width, which B's rows cover in
    whole tiles. The caller has checked K % 128 == 0 and :func:`.wgmma_gemm.usable`."""
    import triton

    from ..schedule import max_m_tiles

    num_rows, k = a.shape
    ctas_per_sm = max(1, ctas_per_sm)
    m_tiles = max_m_tiles(num_rows, num_experts, W.BM)
    a_desc, b_desc = W.descriptors(a, b)
    c_desc = W.store_descriptor(c, W.BM // consumers, W.BN) if tma_store else None
    scale_descs = W.ring_scale_descriptors(a_scale, _contiguous_scales(b_scale), b.shape[1]) if RING_SCALES else None
    as_desc, bs_desc = scale_descs or (a_desc, a_desc)
    dummy = a_scale
    grid = W.persistent_grid(m_tiles * triton.cdiv(n, W.BN), a.device, ctas_per_sm)
    fp8_block_gemm_ws_kernel[(grid,)](
        a_desc, a_scale, as_desc, a_scale.stride(0), a_scale.stride(1),
        b_desc, b_scale, bs_desc, b_scale.stride(0), b_scale.stride(1), b_scale.stride(2), b.shape[1],
        c, c_desc if c_desc is not None else a_desc, c.stride(0), bias if bias is not None else dummy,
        bias.stride(0) if bias is not None else 0, schedule,
        num_rows, n, k, m_tiles, num_experts + 1,
        HAS_BIAS=bias is not None, GROUP_M=group_m, NUM_STAGES=num_stages, TMA_STORE=c_desc is not None,
        PREFETCH=TILE_PREFETCH, RING_SCALES=scale_descs is not None,
        **_partitions(W.NUM_WARPS, consumers, ctas_per_sm, W.BM * W.BN),
    )
    return c


def _contiguous_scales(b_scale: torch.Tensor) -> torch.Tensor:
    """B's block scales as TMA reads them: the dgrad's (the weight's scales seen transposed, ~0.2 MB at
    DSv3) copied contiguous, the forward's as they are."""
    return b_scale if b_scale.is_contiguous() else b_scale.contiguous()


def _wgrad_store_descriptor(dw: torch.Tensor, block_n: int, block_k: int):
    """A TMA descriptor of ``dw`` [E, N, K] as [E * N, K] in [block_n, block_k] boxes, or None where TMA
    cannot store it (not contiguous, not 16-byte aligned, not 16-bit: FP32 dw was not measured)."""
    if not dw.is_contiguous():
        return None
    return W.store_descriptor(dw.view(dw.shape[0] * dw.shape[1], dw.shape[2]), block_n, block_k, W.GL_16BIT)


def launch_wgrad(g, x, schedule: torch.Tensor, dw: torch.Tensor, *, block_n: int, block_k: int, group_n: int,
                 num_stages: int, num_warps: int, ctas_per_sm: int, tma_store: bool, consumers: int):
    """``dw[e] = G_e^T @ X_e`` ([E, N, K]) from the columnwise copies of ``g`` and ``x``
    (:class:`~.quantize.QuantizedRows`) in ``block_n`` x ``block_k`` tiles of ``dw``, ``ctas_per_sm``
    persistent programs per SM (0 counts as 1), ``consumers`` consumer partitions
    (:func:`_partitions`); ``tma_store``: dw tiles stored by TMA where dw allows it (contiguous
    16-bit, N and K multiples of the tile: else an expert's last row tile would run into the next
    expert's rows). The caller (``wgrad.fp8_grouped_wgrad``, from its config) checked the shapes."""
    import triton

    num_experts, n, k = dw.shape
    tma_store = tma_store and n % block_n == 0 and k % block_k == 0
    ctas_per_sm = max(1, ctas_per_sm)
    tiles = num_experts * triton.cdiv(n, block_n) * triton.cdiv(k, block_k)
    launch = _partitions(num_warps, consumers, ctas_per_sm, block_n * block_k)
    g_desc = W.descriptor(g.data_t, block_n)
    dw_desc = _wgrad_store_descriptor(dw, block_n // consumers, block_k) if tma_store else None
    fp8_block_wgrad_ws_kernel[(W.persistent_grid(tiles, dw.device, ctas_per_sm),)](
        g_desc, g.scale_t, g.scale_t.stride(0),
        W.descriptor(x.data_t, block_k), W.scale_descriptor(x.scale_t, block_k),
        dw, dw_desc if dw_desc is not None else g_desc, dw.stride(0), dw.stride(1), schedule, n, k, num_experts + 1,
        GROUP_N=group_n, NUM_STAGES=num_stages, TMA_STORE=dw_desc is not None, PREFETCH=TILE_PREFETCH, **launch,
    )
