"""The Gluon (Triton 3.6) pieces of the FP8 block GEMMs on sm_90: the promoted mainloop, the tile
schedules and the operand descriptors that the warp-specialised kernels of :mod:`.wgmma_ws` are made of
(the plain grouped GEMM: FC2 forward, FC1 dgrad and the GEMMs of FC1 / the dGLU when their epilogues
run alone, see ``gemm.FC1_EPILOGUE``; and the wgrad).

Why: :mod:`.gemm` (Triton) promotes every 128-wide K block with ``acc += dot(a, b^T) * scale``.
Triton makes a wgmma asynchronous only when nothing but the next wgmma reads its result, so there
every K step waits for its wgmma to drain before the FMAs, and the tensor cores idle while they run
(600-850 TFLOP/s of a ~1290 peak, runs 9-11). Here (as DeepGEMM does on Hopper) block ``k``'s wgmma
is issued into a fresh register tile *before* block ``k-1``'s result is waited for and promoted, so
the promotion FMAs run under the next wgmma (:func:`_promoted_mainloop`). Three register tiles per
thread stay live (promoted accumulator, the tile being promoted, the tile in flight): 3 x 64 FP32 at
128x128 over two warpgroups. ptxas serialises every wgmma if a non-wgmma instruction touches an
in-flight tile (C7514/C7515), which small changes provoke (control flow in the K loop does, for the
wgrad); tests/test_fp8_block_wgmma.py checks the sm_90a builds for it in CI.

The operands come through a ring of shared-memory stages filled by TMA (``ready`` barriers) and
handed back when their wgmma has retired (``empty`` barriers, :func:`_retire`). Runs 16-18 filled it
from the consumers' own warps with a load cursor running ahead across tiles; the producer partition
of :mod:`.wgmma_ws` replaced it in run 19 (FC2 1.06 -> 0.97 ms, w1's wgrad 3.05 -> 2.43): the cursor
kernels are in the history (``git show 866abe6:te_fused_moe/backends/triton/fp8_block/wgmma_gemm.py``).
The wgrad's per-column scales come with each stage by TMA (read from shared memory at the promotion:
a column vector in registers cost 32-64 of them and spilled).

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
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from . import gluon_names as G
from .quantize import BLOCK

BM = BN = BK = BLOCK  # one scale block per K step, one weight scale block per tile
STAGES = 4            # 4 x 32 KB of operand tiles in shared memory
NUM_WARPS = 8         # two warpgroups, 64 rows each
# FP32 scales per TMA box of the weight's block scalar (``RING_SCALES``): one is used, but each stage's
# copy must start 128-byte aligned in shared memory (a 16-byte box, TMA's least, put stage 1 at +16 B:
# an illegal instruction on the H100, run 32)
SCALAR_BOX = 32


@gluon.jit
def _swizzle(tile_id, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
    """Tile id -> (M tile, N tile) in bands of GROUP_M M tiles walked column by column (L2 reuse of
    B), as :func:`..schedule.swizzle` does for the Triton kernels."""
    pids_per_band = GROUP_M * num_pid_n
    first_m = (tile_id // pids_per_band) * GROUP_M
    band_m = gl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (tile_id % pids_per_band) % band_m, (tile_id % pids_per_band) // band_m


# What a tile of the persistent loop is (see :func:`_tile_loads`)
KIND_PLAIN = gl.constexpr(0)  # an M tile of the token rows x an N tile of B's rows
KIND_WGRAD = gl.constexpr(1)  # an expert's N tile x K tile of dw (K loop over its token blocks)


@gluon.jit
def _tile_of(tile, sched_ptr, MAX_M_TILES, num_pid_n, NUM_GROUPS, BLOCK_M: gl.constexpr, GROUP_M: gl.constexpr):
    """Plain tile ``tile``'s (M tile, N tile, group, first row, group end row, tile count): the same
    GROUP_M swizzle and schedule reads as :mod:`..schedule` (whose helpers are Triton, not Gluon)."""
    pid_m, pid_n, group = _tile_group(tile, sched_ptr, MAX_M_TILES, num_pid_n, NUM_GROUPS, GROUP_M)
    tile_start, row_start, row_end = _group_rows(group, sched_ptr, NUM_GROUPS)
    return (pid_m, pid_n, group, _first_row(pid_m, tile_start, row_start, BLOCK_M), row_end,
            _tile_count(sched_ptr, NUM_GROUPS))


@gluon.jit
def _first_row(pid_m, tile_start, row_start, BLOCK_M: gl.constexpr):
    """M tile ``pid_m``'s first row, from its group's first M tile and first row."""
    return row_start + (pid_m - tile_start) * BLOCK_M


@gluon.jit
def _tile_count(sched_ptr, NUM_GROUPS):
    """The M tiles in use: the padding group's tile_end."""
    return gl.load(sched_ptr + 2 * NUM_GROUPS - 1)


@gluon.jit
def _tile_group(tile, sched_ptr, MAX_M_TILES, num_pid_n, NUM_GROUPS, GROUP_M: gl.constexpr):
    """Plain tile ``tile``'s (M tile, N tile, group): the swizzle and one read of the tile -> group map."""
    pid_m, pid_n = _swizzle(tile, MAX_M_TILES, num_pid_n, GROUP_M)
    return pid_m, pid_n, gl.load(sched_ptr + 4 * NUM_GROUPS + gl.minimum(pid_m, MAX_M_TILES - 1))


@gluon.jit
def _group_rows(group, sched_ptr, NUM_GROUPS):
    """Group ``group``'s (first M tile, first row, end row), as read from the schedule (raw: the arithmetic
    on them is left to the caller, so that a prefetch does not wait for them, see :func:`_plain_ahead`)."""
    return (gl.load(sched_ptr + group), gl.load(sched_ptr + 2 * NUM_GROUPS + group),
            gl.load(sched_ptr + 3 * NUM_GROUPS + group))


@gluon.jit
def _plain_ahead(tile, m1, n1, g1, sched_ptr, MAX_M_TILES, num_pid_n, NUM_GROUPS, GROUP_M: gl.constexpr):
    """One step of the plain tiles' two-deep schedule prefetch: the next tile's (M tile, N tile, group)
    = ``m1, n1, g1`` (read a tile ago) with its group's rows read now, and ``tile``'s (M tile, N tile,
    group) read now. A tile's rows depend on its group's read, so a one-deep prefetch would wait for that
    read at once; here every read is used one tile after it is issued."""
    s1, r1, e1 = _group_rows(g1, sched_ptr, NUM_GROUPS)
    m2, n2, g2 = _tile_group(tile, sched_ptr, MAX_M_TILES, num_pid_n, NUM_GROUPS, GROUP_M)
    return m1, n1, g1, s1, r1, e1, m2, n2, g2


@gluon.jit
def _plain_ahead_first(tile, step, sched_ptr, MAX_M_TILES, num_pid_n, NUM_GROUPS, GROUP_M: gl.constexpr):
    """The two-deep prefetch's state as a loop over tiles ``tile, tile + step, ...`` enters its first
    trip (:func:`_plain_ahead`): ``tile``'s fields and rows, and ``tile + step``'s fields."""
    m0, n0, g0 = _tile_group(tile, sched_ptr, MAX_M_TILES, num_pid_n, NUM_GROUPS, GROUP_M)
    return _plain_ahead(tile + step, m0, n0, g0, sched_ptr, MAX_M_TILES, num_pid_n, NUM_GROUPS, GROUP_M)


@gluon.jit
def _wgrad_tile(tile, sched_ptr, tiles_n, tiles_k, NUM_GROUPS, GROUP_N: gl.constexpr):
    """Wgrad tile ``tile``'s (expert, N tile, K tile, first token block, end token block): experts in
    turn (CTAs working at once share an expert's operands in L2), GROUP_N bands within one."""
    per_expert = tiles_n * tiles_k
    expert = gl.minimum(tile // per_expert, NUM_GROUPS - 2)
    pid_n, pid_k = _swizzle(tile % per_expert, tiles_n, tiles_k, GROUP_N)
    return expert, pid_n, pid_k, gl.load(sched_ptr + expert), gl.load(sched_ptr + NUM_GROUPS + expert)


@gluon.jit
def _tile_loads(tile, src, BLOCK_A: gl.constexpr, BLOCK_B: gl.constexpr, KIND: gl.constexpr, GROUP: gl.constexpr):
    """Where tile ``tile``'s K blocks come from, read from the schedule: (tile, row of A's tiles, row of B's
    tiles, first K block, end K block); first == end: the tile loads nothing (padding rows, empty
    experts, past the last M tile). ``src`` = (schedule, tile count, tile step, A tiles, B tiles,
    NUM_GROUPS, B_ROWS, K blocks)."""
    sched_ptr, NUM_GROUPS = src[0], src[5]
    if KIND == KIND_PLAIN:
        pid_m, pid_n, group, row0, row_end, num_tiles = _tile_of(tile, sched_ptr, src[3], src[4], NUM_GROUPS,
                                                                 BLOCK_A, GROUP)
        b_row, end = _plain_loads(pid_m, pid_n, group, num_tiles, src, BLOCK_B)
        return tile, row0, b_row, 0, end
    else:
        expert, pid_n, pid_k, first, end = _wgrad_tile(tile, sched_ptr, src[3], src[4], NUM_GROUPS, GROUP)
        return tile, pid_n * BLOCK_A, pid_k * BLOCK_B, first, end


@gluon.jit
def _plain_loads(pid_m, pid_n, group, num_tiles, src, BLOCK_B: gl.constexpr):
    """A plain tile's row of B's tiles and end K block (0: nothing to load, see :func:`_tile_loads`)."""
    loads = (pid_m < num_tiles) & (group < src[5] - 1)
    return group * src[6] + pid_n * BLOCK_B, gl.where(loads, src[7], 0)


@gluon.jit
def _store_rows(c_ptr, stride_cm, row0, row_end, col0, col_end, tile, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                num_warps: gl.constexpr):
    """Stores the [BLOCK_M, BLOCK_N] ``tile`` at (row0, col0) over the rows before ``row_end`` and the
    columns before ``col_end``, in 16-byte row vectors (the wgmma layout would store 4 bytes per thread)."""
    out = gl.convert_layout(tile.to(c_ptr.dtype.element_ty), _row_vectors(num_warps))
    _store_row_vectors(c_ptr, stride_cm, row0, row_end, col0, col_end, out, BLOCK_M, BLOCK_N, num_warps)


@gluon.constexpr_function
def _row_vectors(num_warps):
    """The layout :func:`_store_row_vectors` stores from: 8 consecutive columns per thread."""
    return gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])


@gluon.jit
def _store_row_vectors(c_ptr, stride_cm, row0, row_end, col0, col_end, out, BLOCK_M: gl.constexpr,
                       BLOCK_N: gl.constexpr, num_warps: gl.constexpr):
    """Stores ``out`` (in :func:`_row_vectors`, ``c``'s dtype) at (row0, col0) over the rows before
    ``row_end`` and the columns before ``col_end`` (``c``'s width: narrower than the tiles where its
    size is off the 128 grid, see ``padded.py``)."""
    layout: gl.constexpr = _row_vectors(num_warps)
    rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    ptrs = c_ptr + rows.to(gl.int64)[:, None] * stride_cm + cols[None, :]
    gl.store(ptrs, out, mask=(rows < row_end)[:, None] & (cols < col_end)[None, :])


@gluon.jit
def _promoted_mainloop(ring, used, k_first, k_tiles, row_scales, stride_row_scales, col_scales, stride_col_scales,
                       mma: gl.constexpr, NUM_STAGES: gl.constexpr, OUTER: gl.constexpr, BAND: gl.constexpr,
                       BANDS: gl.constexpr, RING_SCALES: gl.constexpr = False):
    """sum over K blocks ``k_first .. k_first + k_tiles - 1`` (``k_tiles >= 1``) of ``dot(A block, B
    block^T) * scale`` in FP32, with block ``k``'s wgmma running while block ``k-1`` is promoted, A's
    rows ``BAND`` of ``BANDS`` (:func:`_a_tile`). The blocks sit in the ring's stages from ``used`` on;
    each one retired is handed back to the producer (:func:`_retire`). Scales: per row of A
    (:func:`_row_scale`) times one scalar of B per block, or (``OUTER``) times B's per-row scales
    from the ring. ``RING_SCALES`` (plain GEMM): A's row scales and B's scalar come with each block's
    stage too (:func:`_ring_scales`), read once its wgmma is issued, instead of from global memory
    (``row_scales``, ``col_scales`` unused)."""
    BLOCK_M: gl.constexpr = ring[2].shape[1] // BANDS
    BLOCK_N: gl.constexpr = ring[3].shape[1]
    # Two register tiles take turns (X, Y): the loop runs two K blocks per trip so that neither is ever
    # copied; a copy of a tile whose wgmma is in flight makes ptxas serialise every wgmma (C7514). So
    # does a phi of an in-flight tile that ptxas cannot coalesce, which small changes here provoke:
    # tests/test_fp8_block_wgmma.py checks the build. Row scales load one block ahead.
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
    spare = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
    in_flight = _issue(ring, used, spare, NUM_STAGES, BAND, BANDS)
    rs = _scales_ahead(row_scales, stride_row_scales, col_scales, stride_col_scales, k_first, OUTER, RING_SCALES)
    rs = _scales_of(ring, used, rs, mma, NUM_STAGES, BAND, BANDS, RING_SCALES)
    for k in range(1, k_tiles - 1, 2):
        rs_k = _scales_ahead(row_scales, stride_row_scales, col_scales, stride_col_scales, k_first + k, OUTER,
                             RING_SCALES)
        issued = _issue(ring, used + k, spare, NUM_STAGES, BAND, BANDS)
        rs_k = _scales_of(ring, used + k, rs_k, mma, NUM_STAGES, BAND, BANDS, RING_SCALES)
        done, cs = _retire(ring, in_flight, 1, used + k - 1, NUM_STAGES, OUTER)
        acc = _promote(acc, done, _block_factor(rs, OUTER), cs, OUTER)
        rs = _scales_ahead(row_scales, stride_row_scales, col_scales, stride_col_scales, k_first + k + 1, OUTER,
                           RING_SCALES)
        in_flight = _issue(ring, used + k + 1, done, NUM_STAGES, BAND, BANDS)
        rs = _scales_of(ring, used + k + 1, rs, mma, NUM_STAGES, BAND, BANDS, RING_SCALES)
        spare, cs = _retire(ring, issued, 1, used + k, NUM_STAGES, OUTER)
        acc = _promote(acc, spare, _block_factor(rs_k, OUTER), cs, OUTER)
    # both branches end with every wgmma waited for: a token leaving an if would merge X and Y (a copy)
    if k_tiles % 2 == 0:
        # one K block left after the pairs
        last = k_tiles - 1
        issued = _issue(ring, used + last, spare, NUM_STAGES, BAND, BANDS)
        done, cs = _retire(ring, in_flight, 1, used + last - 1, NUM_STAGES, OUTER)
        acc = _promote(acc, done, _block_factor(rs, OUTER), cs, OUTER)
        rs = _scales_ahead(row_scales, stride_row_scales, col_scales, stride_col_scales, k_first + last, OUTER,
                           RING_SCALES)
        rs = _scales_of(ring, used + last, rs, mma, NUM_STAGES, BAND, BANDS, RING_SCALES)
        done, cs = _retire(ring, issued, 0, used + last, NUM_STAGES, OUTER)
        acc = _promote(acc, done, _block_factor(rs, OUTER), cs, OUTER)
    else:
        done, cs = _retire(ring, in_flight, 0, used + k_tiles - 1, NUM_STAGES, OUTER)
        acc = _promote(acc, done, _block_factor(rs, OUTER), cs, OUTER)
    return acc


@gluon.jit
def _row_scale(row_scales, stride_row_scales, col_scales, stride_col_scales, k, OUTER: gl.constexpr):
    """Block ``k``'s scales as loaded: A's per-row ones and B's 128x128 weight block's scalar (``OUTER``: 1,
    B's per-row scales come with the stage); :func:`_block_factor` multiplies them at the promotion.
    Multiplied here, at the load, ptxas put the product before the next block's wgmma issue: each block
    the warp stalled there on the loads' latency (ncu, run 30: the plain GEMMs' hottest consumer
    instruction)."""
    rows = gl.load(row_scales + k * stride_row_scales)[:, None]
    if OUTER:
        return rows, 1.0
    else:
        return rows, gl.load(col_scales + k * stride_col_scales)


@gluon.jit
def _scales_ahead(row_scales, stride_row_scales, col_scales, stride_col_scales, k, OUTER: gl.constexpr,
                  RING_SCALES: gl.constexpr):
    """K block ``k``'s scales loaded from global memory ahead of its wgmma (:func:`_row_scale`), or nothing
    where they come with its stage (``RING_SCALES``: :func:`_scales_of` reads them there)."""
    if RING_SCALES:
        return 0.0, 0.0
    else:
        return _row_scale(row_scales, stride_row_scales, col_scales, stride_col_scales, k, OUTER)


@gluon.jit
def _scales_of(ring, j, ahead, mma: gl.constexpr, NUM_STAGES: gl.constexpr, BAND: gl.constexpr, BANDS: gl.constexpr,
               RING_SCALES: gl.constexpr):
    """The ring's ``j``-th block's scales: ``ahead`` (:func:`_scales_ahead`), or with ``RING_SCALES`` read from
    its stage (:func:`_ring_scales`; call it once the block's wgmma is issued, its stage then holds them,
    and before :func:`_retire` hands the stage back)."""
    if RING_SCALES:
        return _ring_scales(ring, j, mma, NUM_STAGES, BAND, BANDS)
    else:
        return ahead


@gluon.jit
def _ring_scales(ring, j, mma: gl.constexpr, NUM_STAGES: gl.constexpr, BAND: gl.constexpr, BANDS: gl.constexpr):
    """The plain GEMM's scales of the ring's ``j``-th block from its stage, where the producer put them by
    TMA (``wgmma_ws``, ``RING_SCALES``): A's row scales of this band (``ring[6]``, one run of the tile's
    rows) and B's 128x128 block scalar (``ring[9]``, the first of a :data:`SCALAR_BOX` box), as :func:`_row_scale`
    returns them. Read with ordinary loads: the producer fences before the TMA that reuses the stage."""
    BLOCK_M: gl.constexpr = ring[2].shape[1] // BANDS
    stage = ring_slot(j, NUM_STAGES)[0]
    # the stage holds the rows as a [1, BM] run: seen transposed, this band's [BLOCK_M, 1] column
    rows = ring[6].index(stage).permute((1, 0)).slice(BAND * BLOCK_M, BLOCK_M).load(mma)
    # the box's first scale as a [1, 1] tile in the same layout (no reduction: it broadcasts as it is)
    return rows, ring[9].index(stage).slice(0, 1, dim=1).load(mma)


@gluon.jit
def _block_factor(scales, OUTER: gl.constexpr):
    """The per-row factor ([BLOCK_M, 1]) of a block's promotion from :func:`_row_scale`'s pair."""
    if OUTER:
        return scales[0]
    else:
        return scales[0] * scales[1]


@gluon.jit
def _promote(acc, part, row_scale, col_scale, OUTER: gl.constexpr):
    """``acc + part * row_scale ([BLOCK_M, 1]) (* col_scale, [1, BLOCK_N], if OUTER)`` in FP32. The FMA is inline
    PTX marked impure so that LLVM keeps it before the next wgmma's issue (also inline asm): sunk past
    it, ``part`` would be live across the wgmma that overwrites its registers, the copy that follows
    makes ptxas serialise every wgmma (C7515; seen with the wgrad's column scales)."""
    if OUTER:
        factor = row_scale * col_scale
    else:
        factor = gl.broadcast(row_scale, part)[0]
    return gl.inline_asm_elementwise("fma.rn.f32 $0, $1, $2, $3;", "=r,r,r,r", [part, factor, acc], dtype=gl.float32,
                                     is_pure=False, pack=1)


@gluon.jit
def _a_tile(ring, stage, BAND: gl.constexpr, BANDS: gl.constexpr):
    """A's tile in ring stage ``stage``: all its rows (``BANDS`` = 1) or, where each consumer partition
    takes a band of them (:mod:`.wgmma_ws`), band ``BAND`` of ``BANDS``."""
    a = ring[2].index(stage)
    if BANDS > 1:
        rows: gl.constexpr = a.shape[0] // BANDS
        a = a.slice(BAND * rows, rows)
    return a


@gluon.jit
def ring_slot(j, NUM_STAGES: gl.constexpr):
    """The ring's ``j``-th block (``j >= 0``): its stage and the phase of that stage's barriers. Unsigned:
    a signed remainder costs ptxas ~5 more uniform instructions per use (sign fix-ups)."""
    u = j.to(gl.uint32)
    return (u % NUM_STAGES).to(gl.int32), ((u // NUM_STAGES) & 1).to(gl.int32)


@gluon.jit
def _issue(ring, j, out, NUM_STAGES: gl.constexpr, BAND: gl.constexpr, BANDS: gl.constexpr):
    """Waits for the tiles of the ring's ``j``-th K block and issues its wgmma (A's rows: :func:`_a_tile`)
    into ``out``'s registers (not accumulated)."""
    b_bufs, ready = ring[3], ring[4]
    stage, phase = ring_slot(j, NUM_STAGES)
    mbarrier.wait(ready.index(stage), phase)
    return warpgroup_mma(_a_tile(ring, stage, BAND, BANDS), b_bufs.index(stage).permute((1, 0)), out, use_acc=False,
                         is_async=True)


@gluon.jit
def _retire(ring, token, outstanding: gl.constexpr, j, NUM_STAGES: gl.constexpr, OUTER: gl.constexpr):
    """Waits for the wgmma of the ring's ``j``-th K block (``token``; ``outstanding`` newer ones may still
    run), reads its B column scales (``OUTER``; else 1.0), then hands the stage back to the producer
    (its ``empty`` barrier, ``ring[7]``). Returns the partial product and the scales ([1, BLOCK_N] in
    its layout)."""
    done = warpgroup_mma_wait(num_outstanding=outstanding, deps=(token,))
    stage = ring_slot(j, NUM_STAGES)[0]
    if OUTER:
        cs = ring[6].index(stage).load(done.type.layout)
    else:
        cs = 1.0
    G.thread_barrier()  # every warp of this consumer is past its wgmma on this stage before TMA overwrites it
    mbarrier.arrive(ring[7].index(stage), count=1)
    return done, cs


def descriptor(t: torch.Tensor, block_rows: int):
    """Gluon TMA descriptor of a 2-D FP8 ``t`` (unit inner stride) in [block_rows, 128] boxes."""
    return _tma_descriptor(t, [block_rows, BLOCK])


def scale_descriptor(scale_t: torch.Tensor, block: int):
    """Gluon TMA descriptor of FP32 per-token-block scales ``scale_t`` [tiles, columns] in [1, block]
    boxes (unswizzled: one row of 4 * block bytes)."""
    return _tma_descriptor(scale_t, [1, block], gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))


def ring_scale_descriptors(a_scale: torch.Tensor, b_scale: torch.Tensor, b_rows: int):
    """TMA descriptors of the plain GEMM's scales (``wgmma_ws.RING_SCALES``): A's row scales ``a_scale``
    [T, K/128] stored K-block-major, in [1, BM] boxes of ``a_scale.t()`` (one K block's run of a
    tile's rows); B's ``b_scale`` [E, rows/128, K/128] seen as [E * rows/128, K/128], in boxes of
    :data:`SCALAR_BOX` (the first is the block's scalar). None where TMA cannot read them: ``a_scale`` not
    K-block-major with 16-byte aligned runs (see ``quantize.new_row_scales``), ``b_scale`` not
    contiguous or its rows not 16-byte aligned (K off a multiple of 512), B's rows off the tile."""
    a_t = a_scale.t()
    if (a_t.stride(1) != 1 or (a_t.stride(0) * 4) % 16 or a_t.data_ptr() % 16 or a_scale.dtype != torch.float32
            or b_scale.dtype != torch.float32 or not b_scale.is_contiguous() or (b_scale.shape[2] * 4) % 16
            or b_scale.data_ptr() % 16 or b_rows % BN or a_scale.shape[0] == 0):
        return None
    unswizzled = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    flat_b = b_scale.view(b_scale.shape[0] * b_scale.shape[1], b_scale.shape[2])
    return _tma_descriptor(a_t, [1, BM], unswizzled), _tma_descriptor(flat_b, [1, SCALAR_BOX], unswizzled)


def store_descriptor(t: torch.Tensor, block_rows: int, block_cols: int, dtypes=None):
    """A TMA descriptor of a 2-D ``t`` in [block_rows, block_cols] boxes that a kernel stores through,
    or None where TMA cannot store it: not of ``dtypes`` (default: 16- and 32-bit floats), not unit
    inner stride, or base or rows not 16-byte aligned."""
    dtypes = _GL_STORED if dtypes is None else dtypes
    if (t.dtype not in dtypes or t.dim() != 2 or t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 16
            or t.data_ptr() % 16):
        return None
    return _tma_descriptor(t, [block_rows, block_cols])


def _tma_descriptor(t: torch.Tensor, box, layout=None):
    """Gluon TMA descriptor of a 2-D ``t`` (unit inner stride) in ``box``-shaped boxes, in shared memory
    as ``layout`` (default: the swizzled layout the wgmma / TMA store read for ``t``'s dtype)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    layout = layout or gl.NVMMASharedLayout.get_default_for(box, _GL_ALL[t.dtype])
    return TensorDescriptor(t, list(t.shape), [t.stride(0), 1], box, layout)


def descriptors(a: torch.Tensor, b: torch.Tensor):
    """Descriptors of ``a`` [T, K] and of ``b`` [E, rows, K] seen as [E * rows, K]."""
    return descriptor(a, BM), descriptor(b.view(b.shape[0] * b.shape[1], b.shape[2]), BN)


_GL_DTYPES = {torch.float8_e4m3fn: gl.float8e4nv, torch.float8_e5m2: gl.float8e5}
GL_16BIT = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
_GL_STORED = {**GL_16BIT, torch.float32: gl.float32}
_GL_ALL = {**_GL_DTYPES, **_GL_STORED}


def usable(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether this kernel can run these operands here: an sm_90 GPU, FP8 operands, and TMA-legal
    layouts (16-byte aligned bases and rows, unit inner strides, contiguous ``b``, at least one row:
    a descriptor of an empty tensor is refused)."""
    if not (a.is_cuda and a.shape[0] > 0 and torch.cuda.get_device_capability(a.device)[0] == 9):
        return False
    return (a.dtype in _GL_DTYPES and b.dtype in _GL_DTYPES and a.stride(1) == 1 and b.is_contiguous()
            and a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0 and a.stride(0) % 16 == 0)


def persistent_grid(tiles: int, device: torch.device, ctas_per_sm: int) -> int:
    """Programs of a persistent launch: ``ctas_per_sm`` (>= 1) per SM, at most one per tile."""
    return max(1, min(tiles, ctas_per_sm * torch.cuda.get_device_properties(device).multi_processor_count))


def wgrad_usable(g_t: torch.Tensor, x_t: torch.Tensor, x_scale_t: torch.Tensor) -> bool:
    """:func:`usable` for the wgrad's columnwise copies (``data_t``), and x's FP32 scales (``scale_t``,
    loaded by TMA: unit inner stride, 16-byte aligned base and rows)."""
    return (usable(g_t, x_t.unsqueeze(0)) and g_t.is_contiguous() and g_t.shape[1] > 0
            and x_scale_t.dtype == torch.float32 and x_scale_t.stride(1) == 1 and x_scale_t.stride(0) % 4 == 0
            and x_scale_t.data_ptr() % 16 == 0)
