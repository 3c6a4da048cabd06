"""FP8 block GEMMs written in Gluon (Triton 3.6), with the scale promotion overlapped with the
tensor cores: the plain grouped GEMM (FC2 forward, FC1 dgrad, and the GEMMs of FC1 / the dGLU when
their epilogues run alone, see ``gemm.FC1_EPILOGUE``) and, opt-in, the wgrad.

Why: :mod:`.gemm` (Triton) promotes every 128-wide K block with ``acc += dot(a, b^T) * scale``.
Triton makes a wgmma asynchronous only when nothing but the next wgmma reads its result, so there
every K step waits for its wgmma to drain before the FMAs, and the tensor cores idle while they run
(600-850 TFLOP/s of a ~1290 peak, runs 9-11). Here (as DeepGEMM does on Hopper) block ``k``'s wgmma
is issued into a fresh register tile *before* block ``k-1``'s result is waited for and promoted, so
the promotion FMAs run under the next wgmma: 920-990 TFLOP/s at DSv3 (run 16). Three register tiles
per thread stay live (promoted accumulator, the tile being promoted, the tile in flight): 3 x 64
FP32 at 128x128 over two warpgroups. ptxas serialises every wgmma if a non-wgmma instruction touches
an in-flight tile (C7514/C7515), which small changes provoke; tests/test_fp8_block_wgmma.py checks
the sm_90a build for it in CI.

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


@gluon.jit
def _tile_of(sched_ptr, MAX_M_TILES, num_pid_n, NUM_GROUPS, BLOCK_M: gl.constexpr, GROUP_M: gl.constexpr):
    """This program's (M tile, N tile, group, first row, group end row, tile count): the same GROUP_M
    swizzle and schedule reads as :mod:`..schedule` (whose helpers are Triton, not Gluon)."""
    pid_m, pid_n = _swizzle(gl.program_id(0), MAX_M_TILES, num_pid_n, GROUP_M)
    num_tiles = gl.load(sched_ptr + 2 * NUM_GROUPS - 1)  # tile_end of the padding group
    group = gl.load(sched_ptr + 4 * NUM_GROUPS + gl.minimum(pid_m, MAX_M_TILES - 1))
    tile_start = gl.load(sched_ptr + group)
    row0 = gl.load(sched_ptr + 2 * NUM_GROUPS + group) + (pid_m - tile_start) * BLOCK_M
    row_end = gl.load(sched_ptr + 3 * NUM_GROUPS + group)
    return pid_m, pid_n, group, row0, row_end, num_tiles


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
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BLOCK_N, 32])
    pid_m, pid_n, group, row0, row_end, num_tiles = _tile_of(sched_ptr, MAX_M_TILES, N // BLOCK_N, NUM_GROUPS,
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
            acc = _promoted_mainloop(a_desc, b_desc, row0, group * B_ROWS + pid_n * BLOCK_N, 0, K // BLOCK_K,
                                     as_ptr + rows.to(gl.int64) * stride_asm, stride_ask, sb_ptr, stride_bsk,
                                     mma, NUM_STAGES, False)
            if HAS_BIAS:
                cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
                acc = acc + gl.load(bias_ptr + group * stride_bias_e + cols).to(gl.float32)[None, :]
            _store_rows(c_ptr, stride_cm, row0, row_end, pid_n * BLOCK_N, acc, BLOCK_M, BLOCK_N, num_warps)


@gluon.jit
def fp8_block_wgrad_wgmma_kernel(
    g_desc, gs_ptr, stride_gst, x_desc, xs_ptr, stride_xst, dw_ptr, stride_dw_e, stride_dw_n,
    sched_ptr, N, K, NUM_GROUPS,
    GROUP_N: gl.constexpr, NUM_STAGES: gl.constexpr, num_warps: gl.constexpr,
):
    """``dw[e][n tile, k tile] = sum over expert e's token blocks t of G_t^T X_t * gs[t, n] * xs[t, k]``
    from the columnwise copies (``data_t`` [N or K, 128 * tiles], one 128-token block per M tile of
    the schedule, scales ``scale_t`` [tiles, N or K]); zeros for experts without tokens."""
    BLOCK_N: gl.constexpr = g_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[0]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BLOCK_K, 32])
    expert = gl.program_id(1)
    pid_n, pid_k = _swizzle(gl.program_id(0), N // BLOCK_N, K // BLOCK_K, GROUP_N)
    tile_start = gl.load(sched_ptr + expert)
    tile_end = gl.load(sched_ptr + NUM_GROUPS + expert)
    dw_tile = dw_ptr + expert.to(gl.int64) * stride_dw_e
    if tile_end > tile_start:
        rows_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
        cols_k = pid_k * BLOCK_K + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, mma))
        acc = _promoted_mainloop(g_desc, x_desc, pid_n * BLOCK_N, pid_k * BLOCK_K, tile_start, tile_end - tile_start,
                                 gs_ptr + rows_n, stride_gst, xs_ptr + cols_k, stride_xst, mma, NUM_STAGES, True)
        _store_rows(dw_tile, stride_dw_n, pid_n * BLOCK_N, N, pid_k * BLOCK_K, acc, BLOCK_N, BLOCK_K, num_warps)
    else:
        _store_rows(dw_tile, stride_dw_n, pid_n * BLOCK_N, N, pid_k * BLOCK_K,
                    gl.zeros([BLOCK_N, BLOCK_K], gl.float32, mma), BLOCK_N, BLOCK_K, num_warps)


@gluon.jit
def _promoted_mainloop(a_desc, b_desc, a_row, b_row, k_first, k_tiles, row_scales, stride_row_scales, col_scales,
                       stride_col_scales, mma: gl.constexpr, NUM_STAGES: gl.constexpr, OUTER: gl.constexpr):
    """sum over K blocks ``k_first .. k_first + k_tiles - 1`` (``k_tiles >= 1``) of ``dot(A block, B
    block^T) * scale`` in FP32, with block ``k``'s wgmma running while block ``k-1`` is promoted. TMA
    loads run ``NUM_STAGES`` blocks ahead. Scales (see :func:`_block_scale`): per row of A times one
    scalar per block, or (``OUTER``) per row of A times per row of B."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
    for i in gl.static_range(NUM_STAGES):
        _load_stage(a_desc, b_desc, a_bufs, b_bufs, ready, i, k_first + i, a_row, b_row, i < k_tiles)

    # Two register tiles take turns (X, Y): the loop runs two K blocks per trip so that neither is ever
    # copied; a copy of a tile whose wgmma is in flight makes ptxas serialise every wgmma (C7514). So
    # does a phi of an in-flight tile that ptxas cannot coalesce, which small changes here provoke:
    # tests/test_fp8_block_wgmma.py checks the build. Row scales load one block ahead; the wgrad's
    # column scales at the promotion (see _block_scale).
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
    spare = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
    mbarrier.wait(ready.index(0), 0)
    in_flight = warpgroup_mma(a_bufs.index(0), b_bufs.index(0).permute((1, 0)), spare, use_acc=False, is_async=True)
    rs, cs = _block_scale(row_scales, stride_row_scales, col_scales, stride_col_scales, k_first, OUTER)
    for k in range(1, k_tiles - 1, 2):
        rs_k, cs_k = _block_scale(row_scales, stride_row_scales, col_scales, stride_col_scales, k_first + k, OUTER)
        issued = _issue(a_bufs, b_bufs, ready, k, spare, NUM_STAGES)
        done = _retire(a_desc, b_desc, a_bufs, b_bufs, ready, in_flight, 1, k - 1, k_first, a_row, b_row, k_tiles,
                       NUM_STAGES)
        acc = _promote(acc, done, rs, cs, OUTER)
        rs, cs = _block_scale(row_scales, stride_row_scales, col_scales, stride_col_scales, k_first + k + 1, OUTER)
        in_flight = _issue(a_bufs, b_bufs, ready, k + 1, done, NUM_STAGES)
        spare = _retire(a_desc, b_desc, a_bufs, b_bufs, ready, issued, 1, k, k_first, a_row, b_row, k_tiles,
                        NUM_STAGES)
        acc = _promote(acc, spare, rs_k, cs_k, OUTER)
    # both branches end with every wgmma waited for: a token leaving an if would merge X and Y (a copy)
    if k_tiles % 2 == 0:
        # one K block left after the pairs
        last = k_tiles - 1
        issued = _issue(a_bufs, b_bufs, ready, last, spare, NUM_STAGES)
        done = warpgroup_mma_wait(num_outstanding=1, deps=(in_flight,))
        acc = _promote(acc, done, rs, cs, OUTER)
        rs, cs = _block_scale(row_scales, stride_row_scales, col_scales, stride_col_scales, k_first + last, OUTER)
        done = warpgroup_mma_wait(num_outstanding=0, deps=(issued,))
        acc = _promote(acc, done, rs, cs, OUTER)
    else:
        done = warpgroup_mma_wait(num_outstanding=0, deps=(in_flight,))
        acc = _promote(acc, done, rs, cs, OUTER)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(ready.index(i))
    return acc


@gluon.jit
def _block_scale(row_scales, stride_row_scales, col_scales, stride_col_scales, k, OUTER: gl.constexpr):
    """Block ``k``'s scale factors: (per row of A times the 128x128 weight block's scalar, 1.0) or,
    ``OUTER``, (per row of A, the pointers of B's per-row scales, loaded at the promotion: a
    column vector is 32 registers per thread at 128 columns, two of them held across the loop spilled).
    The plain product is taken at load time: the rows' vector stays 2 registers."""
    rows = gl.load(row_scales + k * stride_row_scales)
    if OUTER:
        return rows, col_scales + k * stride_col_scales
    else:
        return rows * gl.load(col_scales + k * stride_col_scales), 1.0


@gluon.jit
def _promote(acc, part, row_scale, col_scale, OUTER: gl.constexpr):
    """``acc + part * row_scale[:, None] (* col_scale[None, :] if OUTER)`` in FP32. The FMA is inline PTX
    marked impure so that LLVM keeps it before the next wgmma's issue (also inline asm): sunk past
    it, ``part`` would be live across the wgmma that overwrites its registers, the copy that follows
    makes ptxas serialise every wgmma (C7515; seen with the wgrad's column scales)."""
    if OUTER:
        factor = row_scale[:, None] * gl.load(col_scale)[None, :]
    else:
        factor = gl.broadcast(row_scale[:, None], part)[0]
    return gl.inline_asm_elementwise("fma.rn.f32 $0, $1, $2, $3;", "=r,r,r,r", [part, factor, acc], dtype=gl.float32,
                                     is_pure=False, pack=1)


@gluon.jit
def _issue(a_bufs, b_bufs, ready, k, out, NUM_STAGES: gl.constexpr):
    """Waits for K block ``k``'s tiles and issues its wgmma into ``out``'s registers (not accumulated)."""
    stage = k % NUM_STAGES
    mbarrier.wait(ready.index(stage), (k // NUM_STAGES) & 1)
    return warpgroup_mma(a_bufs.index(stage), b_bufs.index(stage).permute((1, 0)), out, use_acc=False, is_async=True)


@gluon.jit
def _retire(a_desc, b_desc, a_bufs, b_bufs, ready, token, outstanding: gl.constexpr, k, k_first, a_row, b_row,
            k_tiles, NUM_STAGES: gl.constexpr):
    """Waits for the wgmma of the loop's block ``k`` (``outstanding`` newer ones may still run), then
    refills its stage with block ``k + NUM_STAGES``. Returns block ``k``'s partial product."""
    done = warpgroup_mma_wait(num_outstanding=outstanding, deps=(token,))
    gl.thread_barrier()  # both warpgroups are past their wgmma on this stage before TMA overwrites it
    _load_stage(a_desc, b_desc, a_bufs, b_bufs, ready, k % NUM_STAGES, k_first + k + NUM_STAGES, a_row, b_row,
                k + NUM_STAGES < k_tiles)
    return done


@gluon.jit
def _load_stage(a_desc, b_desc, a_bufs, b_bufs, ready, stage, k_block, a_row, b_row, pred):
    """TMA loads of K block ``k_block`` (absolute) of A's tile rows and B's tile rows into ``stage``."""
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    bar = ready.index(stage)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(a_desc, [a_row, k_block * BLOCK_K], bar, a_bufs.index(stage), pred=pred)
    tma.async_copy_global_to_shared(b_desc, [b_row, k_block * BLOCK_K], bar, b_bufs.index(stage), pred=pred)


def descriptor(t: torch.Tensor, block_rows: int):
    """Gluon TMA descriptor of a 2-D FP8 ``t`` (unit inner stride) in [block_rows, 128] boxes."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    layout = gl.NVMMASharedLayout.get_default_for([block_rows, BLOCK], _GL_DTYPES[t.dtype])
    return TensorDescriptor(t, list(t.shape), [t.stride(0), 1], [block_rows, BLOCK], layout)


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


def launch_plain(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, n: int,
                 schedule: torch.Tensor, num_experts: int, c: torch.Tensor, bias=None, group_m: int = 8,
                 num_stages: int = STAGES):
    """``c[rows of expert e] = (A_e @ B_e^T) (+ bias_e)``, zeros on the padding rows (see module doc).
    The caller has checked K % 128 == N % 128 == 0 and :func:`usable`."""
    from ..schedule import max_m_tiles

    num_rows, k = a.shape
    m_tiles = max_m_tiles(num_rows, num_experts, BM)
    a_desc, b_desc = descriptors(a, b)
    dummy = a_scale
    fp8_block_gemm_wgmma_kernel[(m_tiles * triton.cdiv(n, BN),)](
        a_desc, a_scale, a_scale.stride(0), a_scale.stride(1),
        b_desc, b_scale, b_scale.stride(0), b_scale.stride(1), b_scale.stride(2), b.shape[1],
        c, c.stride(0), bias if bias is not None else dummy, bias.stride(0) if bias is not None else 0, schedule,
        num_rows, n, k, m_tiles, num_experts + 1,
        HAS_BIAS=bias is not None, GROUP_M=group_m, NUM_STAGES=num_stages, num_warps=NUM_WARPS,
    )
    return c


def wgrad_usable(g_t: torch.Tensor, x_t: torch.Tensor) -> bool:
    """:func:`usable` for the wgrad's columnwise copies (``data_t``)."""
    return usable(g_t, x_t.unsqueeze(0)) and g_t.is_contiguous() and g_t.shape[1] > 0


def launch_wgrad(g, x, schedule: torch.Tensor, dw: torch.Tensor, block_n: int = 128, block_k: int = 64,
                 group_n: int = 8, num_stages: int = STAGES, num_warps: int = NUM_WARPS):
    """``dw[e] = G_e^T @ X_e`` ([E, N, K], 128-multiples) from the columnwise copies of ``g`` and ``x``
    (:class:`~.quantize.QuantizedRows`) in ``block_n`` x ``block_k`` tiles of ``dw`` (rows: 64 per
    warpgroup). The caller checked the shapes."""
    num_experts, n, k = dw.shape
    fp8_block_wgrad_wgmma_kernel[((n // block_n) * (k // block_k), num_experts)](
        descriptor(g.data_t, block_n), g.scale_t, g.scale_t.stride(0),
        descriptor(x.data_t, block_k), x.scale_t, x.scale_t.stride(0),
        dw, dw.stride(0), dw.stride(1), schedule, n, k, num_experts + 1,
        GROUP_N=group_n, NUM_STAGES=num_stages, num_warps=num_warps,
    )
