"""The Gluon FP8 block wgrad's consumer partition as one stream of token blocks across its tiles
(``wgmma_ws.WGRAD_STREAM``): the wgmma of the next block is issued before this block is promoted even
where the next block starts the program's next tile, so that a tile's last promotion and its dw store
run under the next tile's first wgmma instead of in front of it.

Why: at DSv3 (E = 32) a dw tile has ~8 token blocks, and the tile loop of :mod:`.wgmma_ws` waits for
its last wgmma, promotes it, stages the tile and only then issues the next tile's first wgmma, with the
tensor cores idle through all of it. Run 23 measured the wgrad ~11% slower per FLOP at ~8 blocks per
tile than at ~128 (E = 2); run 28 ruled out the tile's schedule reads as the cause.

The stream: the program's tiles ``program_id, + grid, ...`` in order, each as its token blocks, an
expert without tokens as one block (block 0's data, its result replaced by zeros at the store; the
producer loads the same, ``wgmma_ws._producer(STREAM=True)``). Its length is counted before it starts
(:func:`stream_length`), so that the loop has the shape of ``wgmma_gemm._promoted_mainloop``. An issue
cursor walks it one block ahead of the promotions; each block carries to its promotion whether it ends
its tile and which tile that is.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma

from . import wgmma_gemm as W


@gluon.jit
def stream_tile_raw(tile, sched_ptr, tiles_n, tiles_k, NUM_GROUPS, GROUP_N: gl.constexpr):
    """Tile ``tile``'s (expert, N tile, K tile, first token block, end token block) as read from the
    schedule (raw: :func:`stream_tile_blocks` makes them the stream's blocks where they are used, so that
    a read issued a tile ahead is not waited for at once)."""
    return W._wgrad_tile(tile, sched_ptr, tiles_n, tiles_k, NUM_GROUPS, GROUP_N)


@gluon.jit
def stream_tile_blocks(start, end):
    """A tile's blocks in the stream: (first block, end block, whether it has tokens). An expert without
    tokens is one block, block 0 (always there; its result is dropped)."""
    has_tokens = end > start
    return gl.where(has_tokens, start, 0), gl.where(has_tokens, end, 1), has_tokens


@gluon.jit
def _tile_cursor(tile, raw, gs_ptr, lanes, TILE_N: gl.constexpr):
    """The issue cursor at tile ``tile``'s first block, from its raw schedule entries: (tile, block, end
    block, has tokens, the pointers of this band's row scales in block 0)."""
    blk, end, has_tokens = stream_tile_blocks(raw[3], raw[4])
    return tile, blk, end, has_tokens, gs_ptr + raw[1] * TILE_N + lanes


@gluon.jit
def _block_at(cur, stride_gst):
    """The block at the issue cursor ``cur``: its row scales (a load, issued now) and what it carries to its
    promotion, (tile, is it the tile's last block, has tokens); and the cursor one block on (at the tile's
    end past it: :func:`_after_promotion` moves it onto the next tile)."""
    tile, blk, end, has_tokens, rows = cur
    rs = gl.load(rows + blk * stride_gst)
    return rs, (tile, blk + 1 == end, has_tokens), (tile, blk + 1, end, has_tokens, rows)


@gluon.jit
def _after_promotion(acc, done, issued, cur, nxt, staging, dw_desc, N, step, src, gs_ptr, lanes,
                     GROUP_N: gl.constexpr, TILE_N: gl.constexpr, BAND: gl.constexpr):
    """After the promotion of block ``done`` (its fields), with block ``issued`` the last one the cursor
    passed: stores the tile that ``done`` ended, and moves the cursor onto the next tile where ``issued``
    ended its own (reading the raw entries of the tile after it into ``nxt``; those of the next were read
    a tile ago). Both under one branch: most blocks do neither, and then skip one branch, not two."""
    if done[1] | issued[1]:
        if done[1]:
            acc = _store_tile(acc, done, staging, dw_desc, N, src, GROUP_N, TILE_N, BAND)
        if issued[1]:
            tile = cur[0] + step
            cur = _tile_cursor(tile, nxt, gs_ptr, lanes, TILE_N)
            nxt = stream_tile_raw(tile + step, src[0], src[3], src[4], src[5], GROUP_N)
    return acc, cur, nxt


@gluon.jit
def _store_tile(acc, fields, staging, dw_desc, N, src, GROUP_N: gl.constexpr, TILE_N: gl.constexpr,
                BAND: gl.constexpr):
    """A finished tile: zeros for an expert without tokens, staged and stored by TMA (it runs under the
    next blocks); returns the next tile's zero accumulator."""
    tile, last, has_tokens = fields
    BLOCK_N: gl.constexpr = acc.shape[0]
    BLOCK_K: gl.constexpr = acc.shape[1]
    expert, pid_n, pid_k = W._wgrad_coords(tile, src[3], src[4], src[5], GROUP_N)
    zero = gl.zeros_like(acc)
    W._stage(gl.where(has_tokens, acc, zero), staging)
    tma.async_copy_shared_to_global(dw_desc, [expert * N + pid_n * TILE_N + BAND * BLOCK_N, pid_k * BLOCK_K],
                                    staging)
    return zero


@gluon.jit
def stream_length(sched_ptr, first_tile, step, total_tiles, tiles_per_expert, NUM_GROUPS, num_warps: gl.constexpr):
    """How many blocks the stream of tiles ``first_tile, + step, ...`` (before ``total_tiles``) has: per
    expert, this program's tiles among the expert's ``tiles_per_expert`` times its token blocks (at
    least 1). Read once, before the stream starts, so that its loop can have a trip count (the shape
    that keeps ptxas from serialising the wgmmas, see :func:`wgrad_stream_consumer`)."""
    CHUNK: gl.constexpr = 32 * num_warps
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    blocks = 0
    for chunk in range(0, NUM_GROUPS - 1, CHUNK):
        expert = chunk + gl.arange(0, CHUNK, layout=layout)
        real = expert < NUM_GROUPS - 1
        start = gl.load(sched_ptr + expert, mask=real, other=0)
        end = gl.load(sched_ptr + NUM_GROUPS + expert, mask=real, other=0)
        lo = gl.maximum(expert * tiles_per_expert - first_tile, 0)
        hi = gl.maximum(gl.minimum((expert + 1) * tiles_per_expert, total_tiles) - first_tile, 0)
        mine = (hi + step - 1) // step - (lo + step - 1) // step
        blocks += gl.sum(gl.where(real, mine * gl.maximum(end - start, 1), 0), axis=0)
    return blocks


@gluon.jit
def wgrad_stream_consumer(ring, src, params, dw_desc, GROUP_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                          BAND: gl.constexpr, BANDS: gl.constexpr, num_warps: gl.constexpr):
    """The wgrad's tiles ``program_id, + grid, ...`` as one stream of token blocks (see the module), rows
    ``BAND`` of ``BANDS`` of each on ``num_warps`` warps, dw stored by TMA (``dw_desc``: dw as [E * N, K]
    in boxes of this band's rows). ``params``: the kernel's runtime arguments gs_ptr, stride_gst, dw_ptr,
    stride_dw_e, stride_dw_n, N, K.

    The loop has the shape of :func:`.wgmma_gemm._promoted_mainloop` (two blocks per trip, then a tail of
    one or two blocks in an if / else) over the stream's blocks. Other shapes tried (a while loop ending
    on a dummy block in flight, the loop followed by one tail) made ptxas serialise every wgmma (C7514)
    even with no store inside the loop."""
    gs_ptr, stride_gst, dw_ptr, stride_dw_e, stride_dw_n, N, K = params
    TILE_N: gl.constexpr = ring[0].block_type.shape[0]
    BLOCK_K: gl.constexpr = ring[1].block_type.shape[0]
    BLOCK_N: gl.constexpr = TILE_N // BANDS
    mma: gl.constexpr = W.accumulator_layout(num_warps, BLOCK_K)
    staging = gl.allocate_shared_memory(dw_desc.dtype, dw_desc.block_type.shape, dw_desc.layout)
    sched_ptr, total_tiles, step, tiles_n, tiles_k, NUM_GROUPS = src[0], src[1], src[2], src[3], src[4], src[5]
    lanes = BAND * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
    tile = gl.program_id(0)
    cur = _tile_cursor(tile, stream_tile_raw(tile, sched_ptr, tiles_n, tiles_k, NUM_GROUPS, GROUP_N), gs_ptr, lanes,
                       TILE_N)
    nxt = stream_tile_raw(tile + step, sched_ptr, tiles_n, tiles_k, NUM_GROUPS, GROUP_N)
    blocks = stream_length(sched_ptr, tile, step, total_tiles, tiles_n * tiles_k, NUM_GROUPS, num_warps)

    acc = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, mma)
    spare = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, mma)
    in_flight = W._issue(ring, 0, spare, NUM_STAGES, BAND, BANDS)
    rs, f, cur = _block_at(cur, stride_gst)
    if f[1]:  # a one-block tile
        cur = _tile_cursor(tile + step, nxt, gs_ptr, lanes, TILE_N)
        nxt = stream_tile_raw(tile + 2 * step, sched_ptr, tiles_n, tiles_k, NUM_GROUPS, GROUP_N)
    for k in range(1, blocks - 1, 2):
        rs_k, f_k, cur = _block_at(cur, stride_gst)
        issued = W._issue(ring, k, spare, NUM_STAGES, BAND, BANDS)
        done, cs = W._retire(ring, in_flight, 1, k - 1, NUM_STAGES, True)
        acc = W._promote(acc, done, rs, cs, True)
        acc, cur, nxt = _after_promotion(acc, f, f_k, cur, nxt, staging, dw_desc, N, step, src, gs_ptr, lanes,
                                         GROUP_N, TILE_N, BAND)
        rs, f, cur = _block_at(cur, stride_gst)
        in_flight = W._issue(ring, k + 1, done, NUM_STAGES, BAND, BANDS)
        spare, cs = W._retire(ring, issued, 1, k, NUM_STAGES, True)
        acc = W._promote(acc, spare, rs_k, cs, True)
        acc, cur, nxt = _after_promotion(acc, f_k, f, cur, nxt, staging, dw_desc, N, step, src, gs_ptr, lanes,
                                         GROUP_N, TILE_N, BAND)
    # as in _promoted_mainloop: both branches end with every wgmma waited for; no block after them to move to
    if blocks % 2 == 0:
        last = blocks - 1
        rs_k, f_k, cur = _block_at(cur, stride_gst)
        issued = W._issue(ring, last, spare, NUM_STAGES, BAND, BANDS)
        done, cs = W._retire(ring, in_flight, 1, last - 1, NUM_STAGES, True)
        acc = W._promote(acc, done, rs, cs, True)
        if f[1]:
            acc = _store_tile(acc, f, staging, dw_desc, N, src, GROUP_N, TILE_N, BAND)
        done, cs = W._retire(ring, issued, 0, last, NUM_STAGES, True)
        acc = W._promote(acc, done, rs_k, cs, True)
        _store_tile(acc, f_k, staging, dw_desc, N, src, GROUP_N, TILE_N, BAND)
    else:
        done, cs = W._retire(ring, in_flight, 0, blocks - 1, NUM_STAGES, True)
        acc = W._promote(acc, done, rs, cs, True)
        _store_tile(acc, f, staging, dw_desc, N, src, GROUP_N, TILE_N, BAND)
    tma.store_wait(0)
