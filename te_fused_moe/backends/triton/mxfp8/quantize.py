"""Triton quantize kernels of the MXFP8 recipe, and its per-step weight cache.

Layouts (what the MXFP8 GEMMs read; Hopper's FP8 wgmma wants both operands K-major). Scales are
uint8 E8M0 exponents (as :mod:`te_fused_moe.quantize.mxfp8` stores them):

- rowwise activation/gradient ``data [T, K]`` (FP8) + ``scale [T, K/32]``: 1x32 blocks along K,
  the operand of the fprop/dgrad GEMMs. ``scale`` is stored K-block-major (a ``[K/32, T]`` buffer
  seen transposed): a GEMM's K step loads its tile's 128 row scales from one contiguous run.
- columnwise copy ``data_t [K, 128 * max_m_tiles]`` (FP8, transposed) + ``scale_t
  [4 * max_m_tiles, K]``: 32-token blocks along the tokens that restart at each expert's first row.
  As in ``fp8_block``, M tile ``t`` of the schedule (``block_m = 128``) owns columns ``[128 t, 128 t
  + 128)`` of ``data_t`` (zeros past the expert's last row) and scale rows ``[4 t, 4 t + 4)``: each
  32-token block lies inside one expert, and the wgrad reads whole aligned blocks.
- weights ``data [E, N, K]`` + ``scale [E, N, K/32]`` (1x32 along K: fprop), and ``data_t [E, K, N]``
  + ``scale_t [E, K, N/32]`` (the transposed copy, 1x32 along N: dgrad). Both scale tensors are
  stored block-major (``[E, K/32, N]`` and ``[E, N/32, K]`` buffers seen transposed), so a GEMM's
  K step loads one contiguous run of per-column scales.

The copies' widths are multiples of 128 (128x128 weight tiles, 128-wide GEMM tiles; other H and F are
read as zero-padded to them, ``width=``, :mod:`..padded`). The
rules (amax, E8M0, rounding) are :mod:`te_fused_moe.quantize.mxfp8`'s, see :mod:`.codec`.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Optional

import torch
import triton
import triton.language as tl

from ..block_scaled_launch import copies_arguments, copies_width
from ..fp8_block.codec import encode_fp8, nan_free_abs
from ..fp8_block.quantize import WeightCache
from ..grouped_gemm import interpreting
from ..schedule import max_m_tiles, tile_rows, total_tiles
from .codec import decode_fp8, expand_bf16, mx_scale

MX = 32  # elements per scale block
TILE = 128  # schedule M tile
# The quantize pass's launch: 128 columns per program, 4 warps (run 33 on an H100, DSv3's x: 0.567 ms for
# both copies' codes against 0.94 at 8 warps and 0.76 at 64 columns; scripts/probe_mx_quantize.py).
QUANT_COLS, QUANT_WARPS = 128, 4


@dataclasses.dataclass(frozen=True)
class MXSpec:
    """An FP8 element format as the kernels' constexprs (``MAX_NORM_RCP``: FP32 1/max, TE's constant).
    ``bf16_values`` (weights only; not a kernel constexpr): the weight cache also keeps each copy's
    exact BF16 values (code times E8M0 scale), which GEMMs reading values then take instead of
    expanding the FP8 weights per micro-batch (twice the BF16 weights' bytes, see ``autograd``)."""

    torch_dtype: torch.dtype = torch.float8_e4m3fn
    mant: int = 3
    bias: int = 7
    max_value: float = 448.0
    bf16_values: bool = False

    @staticmethod
    def of(fmt: str) -> "MXSpec":
        if fmt == "e4m3":
            return MXSpec(torch.float8_e4m3fn, 3, 7, 448.0)
        if fmt == "e5m2":
            return MXSpec(torch.float8_e5m2, 2, 15, 57344.0)
        raise ValueError(f"fmt: expected 'e4m3' or 'e5m2', got {fmt!r}")

    @property
    def fmt(self) -> str:
        return "e4m3" if self.mant == 3 else "e5m2"

    def constexprs(self) -> dict:
        rcp = struct.unpack("f", struct.pack("f", 1.0 / self.max_value))[0]  # TE's FP32 constant, exactly
        return dict(MANT=self.mant, EBIAS=self.bias, FP8_MAX=self.max_value, MAX_NORM_RCP=rcp)


def new_row_scales(num_rows: int, k: int, like: torch.Tensor, alloc=torch.empty) -> torch.Tensor:
    """``[T, K/32]`` uint8 row scales, stored K-block-major (strides ``(1, T)``)."""
    return alloc((k // MX, num_rows), device=like.device, dtype=torch.uint8).t()


def new_transposed(cols: int, num_rows: int, num_experts: int, like: torch.Tensor, dtype: torch.dtype,
                   alloc=torch.empty) -> torch.Tensor:
    """``[cols, 128 * max_m_tiles]`` buffer of a columnwise copy (one 128-column slot per tile)."""
    return alloc((cols, TILE * max_m_tiles(num_rows, num_experts, TILE)), device=like.device, dtype=dtype)


def new_col_scales(cols: int, num_rows: int, num_experts: int, like: torch.Tensor, alloc=torch.empty) -> torch.Tensor:
    """``[4 * max_m_tiles, cols]`` uint8 scales of a columnwise copy (4 token blocks per tile)."""
    return alloc(((TILE // MX) * max_m_tiles(num_rows, num_experts, TILE), cols), device=like.device,
                 dtype=torch.uint8)


def expert_columns(data_t: torch.Tensor, tile_start: int, num_rows: int) -> torch.Tensor:
    """The ``[K, num_rows]`` columnwise data of a group whose tiles start at ``tile_start`` (tests)."""
    return data_t[:, TILE * tile_start: TILE * tile_start + num_rows]


def expert_col_scales(scale_t: torch.Tensor, tile_start: int, num_rows: int) -> torch.Tensor:
    """The ``[cdiv(num_rows, 32), K]`` columnwise scales of a group (tests)."""
    first = (TILE // MX) * tile_start
    return scale_t[first: first + triton.cdiv(num_rows, MX)]


@dataclasses.dataclass
class MXRows:
    """An activation or gradient quantized for the expert GEMMs (layouts in the module doc)."""

    data: Optional[torch.Tensor] = None  # [T, K] fp8
    scale: Optional[torch.Tensor] = None  # [T, K/32] uint8
    data_t: Optional[torch.Tensor] = None  # [K, 128 * max_m_tiles] fp8
    scale_t: Optional[torch.Tensor] = None  # [4 * max_m_tiles, K] uint8


def new_rows(num_rows: int, width: int, like: torch.Tensor, spec: "MXSpec", num_experts: int, rowwise: bool,
             colwise: bool, alloc=torch.empty, *, row_values: bool = False, col_values: bool = False) -> MXRows:
    """Buffers of a quantized activation that a GEMM epilogue or a quantize pass fills (the copies asked
    for). ``row_values`` / ``col_values``: that copy holds the quantized values in BF16 instead of the
    FP8 codes (:func:`store_mx`; its scales are kept too)."""
    dtype = lambda values: torch.bfloat16 if values else spec.torch_dtype
    q = MXRows()
    if rowwise:
        q.data = alloc((num_rows, width), device=like.device, dtype=dtype(row_values))
        q.scale = new_row_scales(num_rows, width, like, alloc)
    if colwise:
        q.data_t = new_transposed(width, num_rows, num_experts, like, dtype(col_values), alloc)
        q.scale_t = new_col_scales(width, num_rows, num_experts, like, alloc)
    return q


@triton.jit
def quantize_rowwise_block(v, BM: tl.constexpr, BN: tl.constexpr, MANT: tl.constexpr, EBIAS: tl.constexpr,
                           FP8_MAX: tl.constexpr, MAX_NORM_RCP: tl.constexpr):
    """1x32 blocks of FP32 ``v`` [BM, BN] along its columns: (codes [BM, BN] uint8, scales [BM, BN/32] uint8)."""
    blocks = tl.reshape(v, (BM, BN // 32, 32))
    code, mult = mx_scale(tl.max(nan_free_abs(blocks), axis=2), MAX_NORM_RCP)
    codes = encode_fp8(tl.reshape(blocks * mult[:, :, None], (BM, BN)), MANT, EBIAS, FP8_MAX)
    return codes, code


@triton.jit
def quantize_colwise_block(v, BM: tl.constexpr, BN: tl.constexpr, MANT: tl.constexpr, EBIAS: tl.constexpr,
                           FP8_MAX: tl.constexpr, MAX_NORM_RCP: tl.constexpr):
    """32x1 blocks of FP32 ``v`` [BM, BN] along its rows (rows past the group's end must be zero):
    (codes [BM, BN] uint8, scales [BM/32, BN] uint8)."""
    blocks = tl.reshape(v, (BM // 32, 32, BN))
    code, mult = mx_scale(tl.max(nan_free_abs(blocks), axis=1), MAX_NORM_RCP)
    codes = encode_fp8(tl.reshape(blocks * mult[:, None, :], (BM, BN)), MANT, EBIAS, FP8_MAX)
    return codes, code


@triton.jit
def values_of(codes, scales, MANT: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """BF16 values of FP8 ``codes`` [ROWS, COLS] (uint8) with E8M0 ``scales`` [ROWS, COLS / 32]: what
    :func:`expand_values` makes of them, without the FP8 round trip through memory."""
    return expand_bf16(decode_fp8(codes, MANT), scales, ROWS, COLS, False)


@triton.jit
def store_codes_or_values(ptrs, codes, scales, mask, MANT: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Stores FP8 ``codes`` [ROWS, COLS] at ``ptrs``, or, where ``ptrs`` point into a BF16 buffer (a copy
    written as values), their values with E8M0 ``scales`` [ROWS, COLS / 32] (:func:`values_of`)."""
    if ptrs.dtype.element_ty == tl.bfloat16:
        tl.store(ptrs, values_of(codes, scales, MANT, ROWS, COLS), mask=mask)
    else:
        tl.store(ptrs, codes, mask=mask)


@triton.jit
def store_mx(v, rows64, row_ok, cols, tile, q_ptr, stride_qm, qs_ptr, stride_qsm, stride_qsk, qt_ptr, stride_qtn,
             qts_ptr, stride_qtsb, ROWWISE: tl.constexpr, COLWISE: tl.constexpr, MANT: tl.constexpr,
             EBIAS: tl.constexpr, FP8_MAX: tl.constexpr, MAX_NORM_RCP: tl.constexpr, BM: tl.constexpr,
             BN: tl.constexpr):
    """MXFP8-quantize the FP32 tile ``v`` [BM rows, BN columns ``cols``] of schedule M tile ``tile``
    (rows past the group's end ignored): rowwise 1x32 blocks and/or 32-token blocks stored transposed
    into the tile's slot (zeros past the group's end). A copy whose buffer is BF16 receives the
    quantized values (code times scale, exact in BF16) instead of the codes: what the GEMM reading
    values takes, so no expansion pass runs before it. The scales are stored either way."""
    mask = row_ok[:, None]
    v = tl.where(mask, v, 0.0)
    col0 = tl.min(cols, axis=0)
    if ROWWISE:
        codes, sc = quantize_rowwise_block(v, BM, BN, MANT, EBIAS, FP8_MAX, MAX_NORM_RCP)
        store_codes_or_values(q_ptr + rows64[:, None] * stride_qm + cols[None, :], codes, sc, mask, MANT, BM, BN)
        kb = col0 // 32 + tl.arange(0, BN // 32)
        tl.store(qs_ptr + rows64[:, None] * stride_qsm + kb[None, :] * stride_qsk, sc, mask=mask)
    if COLWISE:
        codes_c, sc_c = quantize_colwise_block(v, BM, BN, MANT, EBIAS, FP8_MAX, MAX_NORM_RCP)
        codes_t = tl.trans(tl.where(mask, codes_c, 0).to(tl.uint8))
        slot = tile * BM + tl.arange(0, BM)
        store_codes_or_values(qt_ptr + cols.to(tl.int64)[:, None] * stride_qtn + slot[None, :], codes_t,
                              tl.trans(sc_c), None, MANT, BN, BM)
        tb = tile * (BM // 32) + tl.arange(0, BM // 32)
        tl.store(qts_ptr + tb[:, None] * stride_qtsb + cols[None, :], sc_c)


@triton.jit
def store_mx_chunk(v, first, row_ok, cols, block, q_ptr, stride_qm, qs_ptr, stride_qsm, stride_qsk, qt_ptr,
                   stride_qtn, qts_ptr, stride_qtsb, ROWWISE: tl.constexpr, COLWISE: tl.constexpr,
                   MANT: tl.constexpr, EBIAS: tl.constexpr, FP8_MAX: tl.constexpr, MAX_NORM_RCP: tl.constexpr,
                   BK: tl.constexpr):
    """MXFP8-quantize 32 rows of FP32 ``v`` [32, BK] (rows ``first`` on, a 64-bit scalar; columns ``cols``,
    starting on a 32 boundary): rowwise 1x32 blocks for the rows before the group's end (``row_ok``), and
    the columnwise copy's 32-token block ``block`` (its scale row; its columns ``32 block`` on in each row of
    ``data_t``), for which rows past the group's end must hold zeros. A copy in a BF16 buffer receives
    values, as in :func:`store_mx`."""
    chunk = tl.arange(0, 32)
    if ROWWISE:
        codes, sc = quantize_rowwise_block(v, 32, BK, MANT, EBIAS, FP8_MAX, MAX_NORM_RCP)
        store_codes_or_values(q_ptr + first * stride_qm + (chunk * stride_qm)[:, None] + cols[None, :], codes, sc,
                              row_ok[:, None], MANT, 32, BK)
        kb = tl.min(cols, axis=0) // 32 + tl.arange(0, BK // 32)
        tl.store(qs_ptr + first * stride_qsm + (chunk * stride_qsm)[:, None] + kb[None, :] * stride_qsk, sc,
                 mask=row_ok[:, None])
    if COLWISE:
        code, mult = mx_scale(tl.max(nan_free_abs(v), axis=0), MAX_NORM_RCP)
        codes_t = tl.trans(encode_fp8(v * mult[None, :], MANT, EBIAS, FP8_MAX))
        store_codes_or_values((qt_ptr + cols.to(tl.int64)[:, None] * stride_qtn + block * 32) + chunk[None, :],
                              codes_t, tl.reshape(code, (BK, 1)), None, MANT, BK, 32)
        tl.store(qts_ptr + block * stride_qtsb + cols, code)


@triton.jit
def quantize_chunks_kernel(
    x_ptr, stride_xm,
    q_ptr, stride_qm, qs_ptr, stride_qsm, stride_qsk,
    qt_ptr, stride_qtk, qts_ptr, stride_qtsb,
    colsum_ptr, stride_cst,
    sched_ptr, X_COLS, NUM_GROUPS,
    ROWWISE: tl.constexpr, COLWISE: tl.constexpr, COLSUM: tl.constexpr,
    MANT: tl.constexpr, EBIAS: tl.constexpr, FP8_MAX: tl.constexpr, MAX_NORM_RCP: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr,
):
    """One program per (schedule M tile, ``BK`` columns), the tile's rows (one group's) 32 at a time:
    1x32 rowwise blocks and, with ``COLWISE``, the chunk's 32-token block of the columnwise copy, as
    codes or values (:func:`store_mx_chunk`); with ``COLSUM`` the tile's FP32 column sums (bias
    gradients). The grid's columns are written, x's first ``X_COLS`` read: the rest as zeros.

    Why chunks: building the columnwise blocks from the whole 128-row tile by 3-D reshapes (the kernel
    before run 33, as ``store_mx`` still does in the GEMM epilogues) took 64 SASS instructions per
    element against 34 here, and the pass is instruction-bound: on an H100 at DSv3's x, both copies'
    codes 0.853 -> 0.567 ms, the columnwise copy alone 0.952 -> 0.376, dy's copies as values with
    column sums 1.242 -> 0.734 (run 33a)."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    if pid_m >= total_tiles(sched_ptr, NUM_GROUPS):
        return
    _, row0, row_end = tile_rows(sched_ptr, pid_m, BM, NUM_GROUPS)
    col0 = pid_k * BK
    cols = col0 + tl.arange(0, BK)
    chunk = tl.arange(0, 32)
    col_ok = cols < X_COLS
    colsum = tl.zeros((BK,), tl.float32)
    for j in tl.static_range(BM // 32):
        first = row0.to(tl.int64) + j * 32  # the chunk's first row: one 64-bit base, 32-bit offsets
        row_ok = (row0 + j * 32 + chunk) < row_end
        x = tl.load(x_ptr + first * stride_xm + col0 + (chunk * stride_xm)[:, None] + tl.arange(0, BK)[None, :],
                    mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        if COLSUM:
            colsum += tl.sum(x, axis=0)
        # rows past the group's end were loaded as 0.0 (the columnwise block's zeros)
        store_mx_chunk(x, first, row_ok, cols, pid_m * (BM // 32) + j, q_ptr, stride_qm, qs_ptr, stride_qsm,
                       stride_qsk, qt_ptr, stride_qtk, qts_ptr, stride_qtsb, ROWWISE, COLWISE, MANT, EBIAS, FP8_MAX,
                       MAX_NORM_RCP, BK)
    if COLSUM:
        tl.store(colsum_ptr + pid_m * stride_cst + cols, colsum)


@triton.jit
def quantize_weight_kernel(
    w_ptr, stride_we, stride_wn,
    q_ptr, s_ptr, stride_se, stride_sk,
    qt_ptr, st_ptr, stride_ste, stride_stn,
    N, K,
    MANT: tl.constexpr, EBIAS: tl.constexpr, FP8_MAX: tl.constexpr, MAX_NORM_RCP: tl.constexpr,
    TRANSPOSED: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
):
    """One (expert, ``BM`` rows, ``BK`` columns) tile of ``w[e]`` [N, K]: ``q[e]`` [N, K] with 1x32 blocks along K
    (scales at ``s[e, k // 32, n]``) and ``qt[e]`` [K, N] with 1x32 blocks along N (scales at ``st[e, n // 32, k]``).
    The tile's rows go 32 at a time through :func:`store_mx_chunk`, as the activations' pass takes its tokens, so
    the transposed copy is that pass's columnwise one. The kernel before it (until run 40) quantized the whole tile
    by 3-D reshapes: 50 SASS instructions per element against 34, 6.08 against 3.31 ms for DSv3's w1 and w2 on an
    H100 (``scripts/probe_mx_expand.py``), the same bytes."""
    e = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    cols = tl.program_id(2) * BK + tl.arange(0, BK)
    chunk = tl.arange(0, 32)
    every_row = chunk < 32  # N is a multiple of BM: every row of the tile is w's
    out = e * N * K
    for j in tl.static_range(BM // 32):
        first = (pid_n * BM + j * 32).to(tl.int64)
        w = tl.load(w_ptr + e * stride_we + first * stride_wn + (chunk * stride_wn)[:, None] + cols[None, :])
        store_mx_chunk(w.to(tl.float32), first, every_row, cols, pid_n * (BM // 32) + j, q_ptr + out, K,
                       s_ptr + e * stride_se, 1, stride_sk, qt_ptr + out, N, st_ptr + e * stride_ste, stride_stn,
                       True, TRANSPOSED, MANT, EBIAS, FP8_MAX, MAX_NORM_RCP, BK)


def _codes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def quantize_rows(x: torch.Tensor, schedule: torch.Tensor, num_experts: int, spec: MXSpec, *, rowwise: bool = True,
                  colwise: bool = False, alloc=torch.empty, col_sums: Optional[torch.Tensor] = None,
                  width: Optional[int] = None, row_values: bool = False, col_values: bool = False) -> MXRows:
    """MXFP8-quantize ``x [T, K]`` (rows grouped by expert; ``schedule`` from ``build_schedule(counts, T, 128)``)
    rowwise (1x32 along K) and/or columnwise (32 tokens per block, restarting at each expert).
    ``col_sums`` (FP32 ``[max_m_tiles, K]``), if given, receives each tile's column sums of ``x``.
    ``width`` (>= K, default K): the copies' width, x zero-padded to it (``padded.py``) without a copy.
    ``row_values`` / ``col_values``: that copy is written as its quantized values in BF16 (:func:`new_rows`)."""
    num_rows, x_cols = x.shape
    k = copies_width(x, width)
    if x.stride(1) != 1:
        raise ValueError(f"x: expected unit stride along the last dimension, got strides {x.stride()}")
    if k % TILE:
        raise ValueError(f"x: the MXFP8 quantize kernel needs a width that is a multiple of {TILE}, got {k}")
    out = MXRows()
    if num_rows == 0 or not (rowwise or colwise or col_sums is not None):
        return out
    m_tiles = max_m_tiles(num_rows, num_experts, TILE)
    out = new_rows(num_rows, k, x, spec, num_experts, rowwise, colwise, alloc, row_values=row_values,
                   col_values=col_values)
    dummy = x.view(torch.uint8)
    quantize_chunks_kernel[(m_tiles, k // QUANT_COLS)](
        x, x.stride(0), *copies_arguments(out, dummy, dummy),
        col_sums if col_sums is not None else x, col_sums.stride(0) if col_sums is not None else 0,
        schedule, x_cols, num_experts + 1,
        ROWWISE=rowwise, COLWISE=colwise, COLSUM=col_sums is not None, **spec.constexprs(), BM=TILE, BK=QUANT_COLS,
        num_warps=4 if interpreting() else QUANT_WARPS,
    )
    return out


@dataclasses.dataclass
class MXWeight:
    """``w [E, N, K]`` quantized for both GEMM directions (layouts in the module doc)."""

    data: torch.Tensor  # [E, N, K] fp8, 1x32 along K
    scale: torch.Tensor  # [E, N, K/32] uint8 (block-major storage)
    data_t: Optional[torch.Tensor]  # [E, K, N] fp8, 1x32 along N
    scale_t: Optional[torch.Tensor]  # [E, K, N/32] uint8 (block-major storage)
    # exact BF16 values of data / data_t, kept where the spec asks (``MXSpec.bf16_values``)
    values: Optional[torch.Tensor] = None  # [E, N, K] bf16
    values_t: Optional[torch.Tensor] = None  # [E, K, N] bf16

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.data_t, self.scale, self.scale_t,
                                                           self.values, self.values_t) if t is not None)


def quantize_weight(w: torch.Tensor, spec: MXSpec, *, transposed: bool = True, alloc=torch.empty) -> MXWeight:
    """MXFP8-quantize ``w [E, N, K]`` along K, and (``transposed``) its transpose along N."""
    if w.dim() != 3 or w.stride(2) != 1:
        raise ValueError(f"w: expected [E, N, K] with unit inner stride, got shape {tuple(w.shape)} strides {w.stride()}")
    e, n, k = w.shape
    if n % TILE or k % TILE:
        raise ValueError(f"w: the MXFP8 weight quantizer needs both sizes to be multiples of {TILE}, got {tuple(w.shape)}")
    data = alloc((e, n, k), device=w.device, dtype=spec.torch_dtype)
    scale = alloc((e, k // MX, n), device=w.device, dtype=torch.uint8).transpose(1, 2)
    data_t = alloc((e, k, n), device=w.device, dtype=spec.torch_dtype) if transposed else None
    scale_t = alloc((e, n // MX, k), device=w.device, dtype=torch.uint8).transpose(1, 2) if transposed else None
    if w.numel():
        quantize_weight_kernel[(e, n // TILE, k // QUANT_COLS)](
            w, w.stride(0), w.stride(1),
            _codes(data), scale, scale.stride(0), scale.stride(2),
            _codes(data_t) if transposed else _codes(data), scale_t if transposed else scale,
            scale_t.stride(0) if transposed else 0, scale_t.stride(2) if transposed else 0,
            n, k, **spec.constexprs(), TRANSPOSED=transposed, BM=TILE, BK=QUANT_COLS,
            num_warps=4 if interpreting() else QUANT_WARPS,
        )
    q = MXWeight(data, scale, data_t, scale_t)
    if spec.bf16_values:
        q.values = expand_values(data, scale, alloc=alloc)
        q.values_t = expand_values(data_t, scale_t, alloc=alloc) if transposed else None
    return q


@triton.jit
def expand_kernel(q_ptr, stride_qe, stride_qr, s_ptr, stride_se, stride_sr, stride_sb, v_ptr, stride_ve, stride_vr,
                  ROWS, UPCAST: tl.constexpr, BLK: tl.constexpr):
    """One BLK x BLK tile of FP8 ``q[e]`` [ROWS, C] (E8M0 scales ``s[e]`` [ROWS, C/32], any strides) as
    exact BF16 values ``v[e]`` [ROWS, C] (``codec.expand_bf16``). Rows past ``ROWS`` are left alone."""
    e = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLK + tl.arange(0, BLK)
    cols = tl.program_id(2) * BLK + tl.arange(0, BLK)
    row_ok = (rows < ROWS)[:, None]
    rows64 = rows.to(tl.int64)[:, None]
    codes = tl.load(q_ptr + e * stride_qe + rows64 * stride_qr + cols[None, :], mask=row_ok, other=0.0)
    cb = tl.program_id(2) * (BLK // 32) + tl.arange(0, BLK // 32)  # one E8M0 scale per 32 (expand_bf16)
    sc = tl.load(s_ptr + e * stride_se + rows64 * stride_sr + cb[None, :] * stride_sb, mask=row_ok, other=127)
    values = expand_bf16(codes, sc, BLK, BLK, UPCAST)
    tl.store(v_ptr + e * stride_ve + rows64 * stride_vr + cols[None, :], values.to(tl.bfloat16), mask=row_ok)


def expand_values(data: torch.Tensor, scale: torch.Tensor, alloc=torch.empty) -> torch.Tensor:
    """Exact BF16 values of FP8 ``data`` [(E,) R, C] with E8M0 scales ``scale`` [(E,) R, C/32] (any
    strides): what a GEMM then reads as a plain BF16 operand. For a columnwise copy pass
    ``scale_t.t()`` (the scales of ``data_t``'s rows)."""
    squeeze = data.dim() == 2
    if squeeze:
        data, scale = data.unsqueeze(0), scale.unsqueeze(0)
    e, rows, cols = data.shape
    if data.stride(2) != 1 or scale.shape != (e, rows, cols // MX) or cols % TILE:
        raise ValueError(f"data, scale: expected FP8 [(E,) R, C] (unit inner stride, C a multiple of {TILE}) and "
                         f"scales [(E,) R, C/32], got {tuple(data.shape)} and {tuple(scale.shape)}")
    out = alloc((e, rows, cols), device=data.device, dtype=torch.bfloat16)
    if data.numel():
        expand_kernel[(e, triton.cdiv(rows, TILE), cols // TILE)](
            data, data.stride(0), data.stride(1), scale, scale.stride(0), scale.stride(1), scale.stride(2),
            out, out.stride(0), out.stride(1), rows, UPCAST=interpreting(), BLK=TILE,
            num_warps=4 if interpreting() else 8)
    return out[0] if squeeze else out


# fp8_block's per-optimizer-step cache (same invalidation rules) holding MXFP8 copies
WEIGHT_CACHE = WeightCache(quantize_fn=quantize_weight)
