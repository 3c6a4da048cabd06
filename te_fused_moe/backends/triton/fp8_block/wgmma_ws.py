"""Warp-specialised FP8 block GEMMs in Gluon: the kernels of :mod:`.wgmma_gemm` with their TMA loads
moved to a producer partition (one warp, 24 registers) that walks the same tiles and K blocks and
fills the ring ahead of the consumers, across tile boundaries.

Why: in the persistent kernels of :mod:`.wgmma_gemm` the warps that run the wgmmas also step the
load cursor (~75 uniform-datapath instructions per K block, run 18a) and wait at a CTA-wide barrier
before each refill; ncu of the wgrads shows barrier and scoreboard stalls ahead of the tensor pipes
(42% active). Here the consumer warps only wait for a stage, issue its wgmma, promote the previous
block and hand its stage back (an ``empty`` mbarrier per stage); the producer's register budget goes
to them (``setmaxnreg``: 232 registers at one consumer warpgroup and two CTAs per SM). Same tiles,
same K order, same promotion code (:func:`.wgmma_gemm._promoted_mainloop`), so results are bitwise
those of the other kernels (tests/gpu/test_fp8_block_wgmma_gpu.py).

Register budget (``maxnreg`` at launch, per thread, over the warps rounded up to warpgroups): the
producer's warpgroup gives back all but 24, the consumers get the rest (see :func:`launch_maxnreg`).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from . import wgmma_gemm as W

PRODUCER_WARPS = gl.constexpr(1)
PRODUCER_REGISTERS = gl.constexpr(24)  # the least a warp can be given: it only issues TMA copies
REGISTER_FILE = 64 * 1024  # 32-bit registers per SM (sm_90)


@gluon.jit
def _producer(ring, src, KIND: gl.constexpr, GROUP: gl.constexpr, NUM_STAGES: gl.constexpr, OUTER: gl.constexpr):
    """Loads every K block of this program's tiles, in the consumers' order, into the ring: waits for a
    stage to be handed back (``empty``), then TMA-copies A's and B's tiles (and, ``OUTER``, B's column
    scales) into it, completing on its ``ready`` barrier."""
    a_desc, b_desc, a_bufs, b_bufs, ready, cs_desc, cs_bufs, empty = ring
    BLOCK_A: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_B: gl.constexpr = b_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    loaded = 0
    for tile in range(gl.program_id(0), src[1], src[2]):
        _, a_row, b_row, first, end = W._resolved(tile, src, BLOCK_A, BLOCK_B, KIND, GROUP)
        for blk in range(first, end):
            stage = loaded % NUM_STAGES
            # a stage starts free: its empty barrier's phase "before 0" counts as complete
            mbarrier.wait(empty.index(stage), ((loaded // NUM_STAGES) & 1) ^ 1)
            bar = ready.index(stage)
            if OUTER:
                # the consumers read the column scales with ordinary loads: order them before the TMA
                # write (async proxy) that reuses the stage
                fence_async_shared()
                mbarrier.expect(bar, nbytes + cs_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(cs_desc, [blk, b_row], bar, cs_bufs.index(stage))
            else:
                mbarrier.expect(bar, nbytes)
            tma.async_copy_global_to_shared(a_desc, [a_row, blk * BLOCK_K], bar, a_bufs.index(stage))
            tma.async_copy_global_to_shared(b_desc, [b_row, blk * BLOCK_K], bar, b_bufs.index(stage))
            loaded += 1


@gluon.jit
def _ring(a_desc, b_desc, cs_desc, NUM_STAGES: gl.constexpr, OUTER: gl.constexpr):
    """:func:`.wgmma_gemm._operand_ring`'s stages and ``ready`` barriers plus an ``empty`` barrier per
    stage (arrived on by the consumers when they are done with it), no cursor."""
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES, a_desc.block_type.shape[0], BLOCK_K], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_STAGES, b_desc.block_type.shape[0], BLOCK_K], b_desc.layout)
    if OUTER:
        cs_bufs = gl.allocate_shared_memory(cs_desc.dtype, [NUM_STAGES] + cs_desc.block_type.shape, cs_desc.layout)
    else:
        cs_bufs = a_bufs  # unused
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    return a_desc, b_desc, a_bufs, b_bufs, ready, cs_desc, cs_bufs, empty


@gluon.jit
def _plain_consumer(ring, src, as_ptr, stride_asm, stride_ask, bs_ptr, stride_bse, stride_bsn, stride_bsk,
                    c_ptr, stride_cm, bias_ptr, stride_bias_e, T, N, HAS_BIAS: gl.constexpr, GROUP_M: gl.constexpr,
                    NUM_STAGES: gl.constexpr, num_warps: gl.constexpr):
    """The plain GEMM's tiles (:func:`.wgmma_gemm.fp8_block_gemm_wgmma_kernel`'s loop, its loads left to
    the producer)."""
    BLOCK_M: gl.constexpr = ring[0].block_type.shape[0]
    BLOCK_N: gl.constexpr = ring[1].block_type.shape[0]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BLOCK_N, 32])
    sched_ptr, NUM_GROUPS, k_tiles = src[0], src[5], src[7]
    used = 0
    for tile in range(gl.program_id(0), src[1], src[2]):
        pid_m, pid_n, group, row0, row_end, num_tiles = W._tile_of(tile, sched_ptr, src[3], src[4], NUM_GROUPS,
                                                                   BLOCK_M, GROUP_M)
        if pid_m < num_tiles:
            if group == NUM_GROUPS - 1:
                W._store_rows(c_ptr, stride_cm, row0, row_end, pid_n * BLOCK_N,
                              gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma), BLOCK_M, BLOCK_N, num_warps)
            else:
                rows = gl.minimum(row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma)), T - 1)
                sb_ptr = bs_ptr + group.to(gl.int64) * stride_bse + ((pid_n * BLOCK_N) // 128) * stride_bsn
                acc, _ = W._promoted_mainloop(ring, used, 0, k_tiles, gl.to_tensor(0), src, as_ptr + rows.to(gl.int64) * stride_asm,
                                              stride_ask, sb_ptr, stride_bsk, mma, NUM_STAGES, False, W.KIND_PLAIN,
                                              GROUP_M, True)
                used += k_tiles
                if HAS_BIAS:
                    cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
                    acc = acc + gl.load(bias_ptr + group * stride_bias_e + cols).to(gl.float32)[None, :]
                W._store_rows(c_ptr, stride_cm, row0, row_end, pid_n * BLOCK_N, acc, BLOCK_M, BLOCK_N, num_warps)


@gluon.jit
def fp8_block_gemm_ws_kernel(
    a_desc, as_ptr, stride_asm, stride_ask,
    b_desc, bs_ptr, stride_bse, stride_bsn, stride_bsk, B_ROWS,
    c_ptr, stride_cm, bias_ptr, stride_bias_e, sched_ptr,
    T, N, K, MAX_M_TILES, NUM_GROUPS,
    HAS_BIAS: gl.constexpr, GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr, num_warps: gl.constexpr,
):
    """:func:`.wgmma_gemm.fp8_block_gemm_wgmma_kernel` (same arguments), warp-specialised."""
    num_pid_n = N // b_desc.block_type.shape[0]
    k_tiles = K // a_desc.block_type.shape[1]
    src = (sched_ptr, MAX_M_TILES * num_pid_n, gl.num_programs(0), MAX_M_TILES, num_pid_n, NUM_GROUPS, B_ROWS,
           k_tiles)
    ring = _ring(a_desc, b_desc, a_desc, NUM_STAGES, False)
    gl.warp_specialize([
        (_plain_consumer, (ring, src, as_ptr, stride_asm, stride_ask, bs_ptr, stride_bse, stride_bsn, stride_bsk,
                           c_ptr, stride_cm, bias_ptr, stride_bias_e, T, N, HAS_BIAS, GROUP_M, NUM_STAGES, num_warps)),
        (_producer, (ring, src, W.KIND_PLAIN, GROUP_M, NUM_STAGES, False)),
    ], [PRODUCER_WARPS], [PRODUCER_REGISTERS])


@gluon.jit
def _wgrad_consumer(ring, src, gs_ptr, stride_gst, dw_ptr, stride_dw_e, stride_dw_n, N,
                    GROUP_N: gl.constexpr, NUM_STAGES: gl.constexpr, num_warps: gl.constexpr):
    """The wgrad's tiles (:func:`.wgmma_gemm.fp8_block_wgrad_wgmma_kernel`'s loop, its loads left to the
    producer)."""
    BLOCK_N: gl.constexpr = ring[0].block_type.shape[0]
    BLOCK_K: gl.constexpr = ring[1].block_type.shape[0]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BLOCK_K, 32])
    used = 0
    for tile in range(gl.program_id(0), src[1], src[2]):
        expert, pid_n, pid_k, tile_start, tile_end = W._wgrad_tile(tile, src[0], src[3], src[4], src[5], GROUP_N)
        dw_tile = dw_ptr + expert.to(gl.int64) * stride_dw_e
        if tile_end > tile_start:
            rows_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
            acc, _ = W._promoted_mainloop(ring, used, tile_start, tile_end - tile_start, gl.to_tensor(0), src, gs_ptr + rows_n,
                                          stride_gst, gs_ptr, 0, mma, NUM_STAGES, True, W.KIND_WGRAD, GROUP_N, True)
            used += tile_end - tile_start
            W._store_rows(dw_tile, stride_dw_n, pid_n * BLOCK_N, N, pid_k * BLOCK_K, acc, BLOCK_N, BLOCK_K, num_warps)
        else:
            W._store_rows(dw_tile, stride_dw_n, pid_n * BLOCK_N, N, pid_k * BLOCK_K,
                          gl.zeros([BLOCK_N, BLOCK_K], gl.float32, mma), BLOCK_N, BLOCK_K, num_warps)


@gluon.jit
def fp8_block_wgrad_ws_kernel(
    g_desc, gs_ptr, stride_gst, x_desc, xs_desc, dw_ptr, stride_dw_e, stride_dw_n,
    sched_ptr, N, K, NUM_GROUPS,
    GROUP_N: gl.constexpr, NUM_STAGES: gl.constexpr, num_warps: gl.constexpr,
):
    """:func:`.wgmma_gemm.fp8_block_wgrad_wgmma_kernel` (same arguments), warp-specialised."""
    tiles_n = N // g_desc.block_type.shape[0]
    tiles_k = K // x_desc.block_type.shape[0]
    src = (sched_ptr, (NUM_GROUPS - 1) * tiles_n * tiles_k, gl.num_programs(0), tiles_n, tiles_k, NUM_GROUPS, 0, 0)
    ring = _ring(g_desc, x_desc, xs_desc, NUM_STAGES, True)
    gl.warp_specialize([
        (_wgrad_consumer, (ring, src, gs_ptr, stride_gst, dw_ptr, stride_dw_e, stride_dw_n, N, GROUP_N, NUM_STAGES,
                           num_warps)),
        (_producer, (ring, src, W.KIND_WGRAD, GROUP_N, NUM_STAGES, True)),
    ], [PRODUCER_WARPS], [PRODUCER_REGISTERS])


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


def launch_plain(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, n: int,
                 schedule: torch.Tensor, num_experts: int, c: torch.Tensor, bias=None, group_m: int = 8,
                 num_stages: int = W.STAGES, ctas_per_sm: int = 1):
    """:func:`.wgmma_gemm.launch_plain`, warp-specialised (always persistent: ``ctas_per_sm`` >= 1)."""
    import triton

    from ..schedule import max_m_tiles

    num_rows, k = a.shape
    m_tiles = max_m_tiles(num_rows, num_experts, W.BM)
    a_desc, b_desc = W.descriptors(a, b)
    dummy = a_scale
    grid = W.persistent_grid(m_tiles * triton.cdiv(n, W.BN), a.device, max(1, ctas_per_sm))
    fp8_block_gemm_ws_kernel[(grid,)](
        a_desc, a_scale, a_scale.stride(0), a_scale.stride(1),
        b_desc, b_scale, b_scale.stride(0), b_scale.stride(1), b_scale.stride(2), b.shape[1],
        c, c.stride(0), bias if bias is not None else dummy, bias.stride(0) if bias is not None else 0, schedule,
        num_rows, n, k, m_tiles, num_experts + 1,
        HAS_BIAS=bias is not None, GROUP_M=group_m, NUM_STAGES=num_stages, num_warps=W.NUM_WARPS,
        maxnreg=launch_maxnreg(W.NUM_WARPS, max(1, ctas_per_sm)),
    )
    return c


def launch_wgrad(g, x, schedule: torch.Tensor, dw: torch.Tensor, block_n: int = 64, block_k: int = 128,
                 group_n: int = 8, num_stages: int = 4, num_warps: int = 4, ctas_per_sm: int = 2):
    """:func:`.wgmma_gemm.launch_wgrad`, warp-specialised (always persistent: ``ctas_per_sm`` >= 1)."""
    num_experts, n, k = dw.shape
    tiles = num_experts * (n // block_n) * (k // block_k)
    fp8_block_wgrad_ws_kernel[(W.persistent_grid(tiles, dw.device, max(1, ctas_per_sm)),)](
        W.descriptor(g.data_t, block_n), g.scale_t, g.scale_t.stride(0),
        W.descriptor(x.data_t, block_k), W.scale_descriptor(x.scale_t, block_k),
        dw, dw.stride(0), dw.stride(1), schedule, n, k, num_experts + 1,
        GROUP_N=group_n, NUM_STAGES=num_stages, num_warps=num_warps,
        maxnreg=launch_maxnreg(num_warps, max(1, ctas_per_sm), block_n * block_k),
    )
