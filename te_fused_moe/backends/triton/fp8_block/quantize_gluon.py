"""The FP8 block quantize pass (:func:`.quantize.quantize_rows`) as a Gluon kernel for sm_90: the same
tiles, rules and bytes as the Triton kernel (:func:`.quantize.quantize_tiles_kernel`), with the
layouts chosen by hand.

Why: the pass is bound by its instructions (run 18 ncu), and the Triton kernel spends most of them
on layout work it cannot avoid there: each thread holds 4 rows x 16 columns of a 128 x 128 tile, so
it computes the block scales of all 20 of them (every column's scale on 32 threads, every row's on
8; ~15 integer ops each), and the columnwise codes reach their transposed rows byte by byte
through shared memory (64 ``LDS.U8`` and 32 byte permutes per thread). Here:

- each thread holds 8 consecutive rows x 8 consecutive columns (:func:`_tile_layout`), so both the
  rowwise codes (8 columns of a row) and the columnwise ones (8 tokens of a column) leave a thread as
  one 8-byte store each;
- the row and column amaxes are spread one per thread before their scales are computed
  (:func:`_one_per_thread`), then gathered back (two shared-memory round trips of 512 bytes);
- the columnwise codes are converted in token order by a register permutation only: the tile's
  transpose (``gl.permute``) has the same threads own the same values, and :func:`_tokens_first`
  lists each thread's registers tokens first, so the four values of each ``cvt`` are four tokens of
  one column.

Numerics: the same FP32 products (value x power-of-two or RN scale) through the same codec
(:mod:`.codec`), so the bytes and scales equal the Triton kernel's bit for bit
(tests/gpu/test_fp8_block_quantize_gpu.py). Needs whole 128-column blocks (``K % 128 == 0``: the
Triton kernel takes any K) and 8 warps.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from ..schedule import swizzle, tile_rows, total_tiles
from .codec import block_scale, encode_fp8
from .wgmma_ws import PRODUCER_REGISTERS, PRODUCER_WARPS, _stage

NUM_WARPS = 8  # the tile layout covers 128 rows with 8 warps
TILE = 128  # rows (one expert's token block) and columns (one rowwise block) per program
BLOCK = gl.constexpr(TILE)


@gluon.constexpr_function
def _tile_layout(num_warps):
    """The [128 rows, 128 columns] tile: 8 x 8 values per thread, 16 threads across a row's 128
    columns, 2 x 8 rows per warp, the warps down the rows."""
    return gl.BlockedLayout([8, 8], [2, 16], [num_warps, 1], [1, 0])


@gluon.constexpr_function
def _tokens_first(num_warps):
    """The transposed tile [128 columns, 128 tokens] on the threads of :func:`_tile_layout`, each thread's
    64 registers listed tokens first, so that four consecutive registers are four consecutive tokens
    of one column (from ``gl.permute`` of the tile: a register permutation, no data moves)."""
    regs = [[0, 1], [0, 2], [0, 4], [1, 0], [2, 0], [4, 0]]
    lanes = [[8, 0], [16, 0], [32, 0], [64, 0], [0, 8]]
    warps = [[0, 16 * (1 << i)] for i in range(num_warps.bit_length() - 1)]
    return gl.DistributedLinearLayout(regs, lanes, warps, [], [128, 128])


@gluon.constexpr_function
def _one_per_thread(num_warps):
    """A 128-vector one element per thread (the warps past the fourth hold copies)."""
    return gl.BlockedLayout([1], [32], [num_warps], [0])


@gluon.jit
def _amax(x, axis: gl.constexpr):
    """NaN-free amax along ``axis`` (NaN never wins, as ``codec.nan_free_abs`` + max): the reduction's max
    is the NaN-ignoring ``max.f32`` with |.| folded into its operands, and the one max with 0 after it
    covers an all-NaN block; ``nan_free_abs`` first would cost a max per value."""
    return gl.maximum(gl.max(gl.abs(x), axis=axis), 0.0)


@gluon.jit
def _scales(amax, FP8_MAX: gl.constexpr, POW2: gl.constexpr, value_for_inf, num_warps: gl.constexpr):
    """Block scales of a 128-vector of amaxes computed once per element (one per thread), not on every
    thread holding a copy: (multipliers back in ``amax``'s layout, dequantization scales one per thread)."""
    scale, inv = block_scale(gl.convert_layout(amax, _one_per_thread(num_warps)), FP8_MAX, POW2, value_for_inf)
    return gl.convert_layout(scale, amax.type.layout), inv


@gluon.jit
def _tile(t, m_tiles, num_k, sched_ptr, NUM_GROUPS, GROUP_M: gl.constexpr):
    """Work item ``t``'s (M tile, column block, first row, group end row): bands of ``GROUP_M`` M tiles
    walked column block by column block, so that the items in flight at once read rows of x and
    write rows of both copies in runs of several 128-byte blocks (``data_t``'s rows are the columns)."""
    pid_m, pid_k = swizzle(t, m_tiles, num_k, GROUP_M)
    _, row0, row_end = tile_rows(sched_ptr, pid_m, BLOCK, NUM_GROUPS)
    return pid_m, pid_k, row0, row_end


@gluon.jit
def _producer(x_desc, ring, ready, empty, sched_ptr, m_tiles, num_k, NUM_GROUPS, GROUP_M: gl.constexpr,
              STAGES: gl.constexpr):
    """Loads this program's work items' tiles into the ring by TMA, ``STAGES`` ahead of the consumers:
    waits for a stage to be handed back (``empty``), then copies the tile (rows past the end of x
    read as zeros) completing on the stage's ``ready`` barrier."""
    i = 0
    for t in range(gl.program_id(0), m_tiles * num_k, gl.num_programs(0)):
        _, pid_k, row0, _ = _tile(t, m_tiles, num_k, sched_ptr, NUM_GROUPS, GROUP_M)
        stage = i % STAGES
        # a stage starts free: its empty barrier's phase "before 0" counts as complete
        mbarrier.wait(empty.index(stage), ((i // STAGES) & 1) ^ 1)
        # the consumers read the stage with ordinary loads: order them before the TMA write (async proxy)
        fence_async_shared()
        mbarrier.expect(ready.index(stage), x_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(x_desc, [row0, pid_k * BLOCK], ready.index(stage), ring.index(stage))
        i += 1


@gluon.jit
def _consumer(ring, ready, empty, sched_ptr, m_tiles, num_k, NUM_GROUPS, outputs, value_for_inf, ROWWISE: gl.constexpr,
              COLWISE: gl.constexpr, COLSUM: gl.constexpr, MANT: gl.constexpr, EBIAS: gl.constexpr,
              FP8_MAX: gl.constexpr, POW2: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
              num_warps: gl.constexpr):
    """Quantizes this program's work items as their tiles arrive: reads a stage into registers, hands it
    back, zeroes the rows past the tile's group (the next expert's, which TMA cannot mask) and
    quantizes (:func:`_quantize_tile`). ``outputs``: the kernel's output pointers and strides."""
    tile: gl.constexpr = _tile_layout(num_warps)
    rows = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, tile))
    i = 0
    for t in range(gl.program_id(0), m_tiles * num_k, gl.num_programs(0)):
        here = _tile(t, m_tiles, num_k, sched_ptr, NUM_GROUPS, GROUP_M)
        stage = i % STAGES
        mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
        x = ring.index(stage).load(tile)
        mbarrier.arrive(empty.index(stage), count=1)  # Gluon puts a barrier before it: every warp has read
        x = gl.where((here[2] + rows < here[3])[:, None], x.to(gl.float32), 0.0)
        _quantize_tile(x, here, outputs, value_for_inf, ROWWISE, COLWISE, COLSUM, MANT, EBIAS, FP8_MAX, POW2,
                       num_warps)
        i += 1
    if COLWISE:
        tma.store_wait(0)


@gluon.jit
def quantize_tiles_gluon_kernel(
    x_desc,
    q_ptr, stride_qm, qs_ptr, stride_qsm, stride_qsk,
    qt_desc, qts_ptr, stride_qtst,
    colsum_ptr, stride_cst,
    sched_ptr, K, value_for_inf, NUM_GROUPS,
    ROWWISE: gl.constexpr, COLWISE: gl.constexpr, COLSUM: gl.constexpr,
    MANT: gl.constexpr, EBIAS: gl.constexpr, FP8_MAX: gl.constexpr, POW2: gl.constexpr,
    GROUP_M: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr,
):
    """Persistent over the (schedule M tile, 128 columns) work items ``program_id, + grid, ...``, each as
    :func:`.quantize.quantize_tiles_kernel` does one: rowwise 1x128 blocks of the tile's rows,
    columnwise 128-token blocks (the tile's rows are one expert's block; zeros past its end), per-tile
    column sums. A producer warp loads the tiles by TMA into a ring of ``STAGES`` (``x_desc``: x in
    [128, 128] boxes); the ``num_warps`` consumer warps quantize them as they arrive."""
    num_k = K // BLOCK
    m_tiles = total_tiles(sched_ptr, NUM_GROUPS)
    ring = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BLOCK, BLOCK], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    if COLWISE:  # the columnwise codes of a tile go out through it by a TMA store
        staging = gl.allocate_shared_memory(qt_desc.dtype, qt_desc.block_type.shape, qt_desc.layout)
    else:
        staging = ring  # unused
    outputs = (q_ptr, stride_qm, qs_ptr, stride_qsm, stride_qsk, qt_desc, staging, qts_ptr, stride_qtst, colsum_ptr,
               stride_cst)
    gl.warp_specialize([(_consumer, (ring, ready, empty, sched_ptr, m_tiles, num_k, NUM_GROUPS, outputs, value_for_inf,
                                     ROWWISE, COLWISE, COLSUM, MANT, EBIAS, FP8_MAX, POW2, GROUP_M, STAGES, num_warps)),
                        (_producer, (x_desc, ring, ready, empty, sched_ptr, m_tiles, num_k, NUM_GROUPS, GROUP_M,
                                     STAGES))],
                       [PRODUCER_WARPS], [PRODUCER_REGISTERS])


@gluon.jit
def _quantize_tile(x, here, outputs, value_for_inf, ROWWISE: gl.constexpr, COLWISE: gl.constexpr, COLSUM: gl.constexpr,
                   MANT: gl.constexpr, EBIAS: gl.constexpr, FP8_MAX: gl.constexpr, POW2: gl.constexpr,
                   num_warps: gl.constexpr):
    """Quantizes the FP32 tile ``x`` of work item ``here`` = (M tile, column block, first row, group end
    row) and stores its copies, scales and column sums (``outputs``: see the kernel)."""
    (q_ptr, stride_qm, qs_ptr, stride_qsm, stride_qsk, qt_desc, staging, qts_ptr, stride_qtst, colsum_ptr,
     stride_cst) = outputs
    pid_m, pid_k, row0, row_end = here
    tile: gl.constexpr = _tile_layout(num_warps)
    one: gl.constexpr = _one_per_thread(num_warps)
    rows = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, tile))
    cols = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, tile))
    lanes = gl.arange(0, BLOCK, layout=one)
    col0 = pid_k * BLOCK
    if COLSUM:
        gl.store(colsum_ptr + pid_m * stride_cst + col0 + lanes, gl.convert_layout(gl.sum(x, axis=0), one))
    if ROWWISE:
        scale, inv = _scales(_amax(x, 1), FP8_MAX, POW2, value_for_inf, num_warps)
        codes = encode_fp8(x * scale[:, None], MANT, EBIAS, FP8_MAX)
        q_tile = q_ptr + (row0.to(gl.int64) * stride_qm + col0)
        gl.store(q_tile + (rows[:, None] * stride_qm + cols[None, :]), codes, mask=(row0 + rows < row_end)[:, None])
        gl.store(qs_ptr + row0.to(gl.int64) * stride_qsm + pid_k * stride_qsk + lanes * stride_qsm, inv,
                 mask=row0 + lanes < row_end)
    if COLWISE:
        scale_c, inv_c = _scales(_amax(x, 0), FP8_MAX, POW2, value_for_inf, num_warps)
        # [columns, tokens], each thread's registers tokens first: each cvt packs four tokens of a column
        by_column = gl.convert_layout(gl.permute(x * scale_c[None, :], (1, 0)), _tokens_first(num_warps))
        # the tile's own 128 columns of data_t, whole (rows past the group's end were loaded as 0: codes
        # 0x00), by TMA: stored from registers, each data_t row's 128 bytes came in 16-byte pieces from
        # 8 warps, and this copy cost more than the rowwise one (run 21)
        _stage(encode_fp8(by_column, MANT, EBIAS, FP8_MAX), staging)
        tma.async_copy_shared_to_global(qt_desc, [col0, pid_m * BLOCK], staging)
        gl.store(qts_ptr + pid_m * stride_qtst + col0 + lanes, inv_c)


def usable(x: torch.Tensor) -> bool:
    """Whether this kernel can quantize ``x`` here: an sm_90 GPU, 16-bit values (a TMA stage of FP32 would
    halve the CTAs per SM), whole 128-column blocks, TMA-legal layout (unit inner stride, 16-byte
    aligned base and rows)."""
    return (x.is_cuda and x.dtype in _GL_16BIT and x.dim() == 2 and x.shape[0] > 0 and x.shape[1] % TILE == 0
            and x.stride(1) == 1 and (x.stride(0) * x.element_size()) % 16 == 0 and x.data_ptr() % 16 == 0
            and torch.cuda.get_device_capability(x.device)[0] == 9)


def descriptor(t: torch.Tensor):
    """Gluon TMA descriptor of a 2-D ``t`` (x: 16-bit; ``data_t``: its bytes) in [128, 128] boxes."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    layout = gl.NVMMASharedLayout.get_default_for([TILE, TILE], _GL_DTYPES[t.dtype])
    return TensorDescriptor(t, list(t.shape), [t.stride(0), 1], [TILE, TILE], layout)


_GL_16BIT = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
_GL_DTYPES = {**_GL_16BIT, torch.uint8: gl.uint8}
