"""Triton quantize kernels of the NVFP4 recipe, and its per-step weight cache.

Every NVFP4 tensor has one FP32 tensor scale from its amax. As TE's grouped GEMMs do (and the
reference backend emulates), each expert's slice is its own tensor: amaxes are per *group* of the
schedule (``[E + 1]``, the last one the padding rows'), computed by :func:`group_amax_kernel` before the
quantize pass reads them — the one thing that keeps NVFP4 out of a single-pass GEMM epilogue.

Layouts (what the NVFP4 GEMMs read; codes are packed two per byte along the GEMM's reduction axis,
element ``2j`` in the low nibble; scales are uint8 E4M3 codes):

- rowwise ``data [T, K/2]`` + ``scale [T, K/16]`` (stored 16-block-major, a ``[K/16, T]`` buffer
  seen transposed, as MXFP8 does) + ``amax [E + 1]``: 1x16 blocks along K (fprop/dgrad operands).
- columnwise ``data_t [K, 64 * max_m_tiles]`` (tokens packed: schedule tile ``t`` owns the 64 bytes
  ``[64 t, 64 t + 64)``, zeros past the expert's rows) + ``scale_t [8 * max_m_tiles, K]`` +
  ``amax_t [E + 1]``: 16-token blocks restarting at each expert (wgrad operands). With RHT the
  values are Hadamard-transformed along the tokens first (``quantize/hadamard.py``) and ``amax_t``
  is the transformed slice's amax.
- weights ``data [E, N, K/2]`` + ``scale [E, N, K/16]`` (fprop, along K) and ``data_t [E, K, N/2]``
  + ``scale_t [E, K, N/16]`` (dgrad, along N) + ``amax [E]``. With 16x16 tiles (the recipe's default)
  the transposed copy holds the same codes and scales transposed; every row of a tile repeats the
  tile's scale, so the GEMMs read one layout for both block shapes.

BF16 values (``expand_values``, ``with_values``): each code times its E4M3 block scale (exact; the
tensor scale stays apart), the layouts above with K (or the tokens) unpacked and each 128-wide block
stored even elements first, as the GEMMs' split dots pair them.

Gradients may be rounded stochastically: 8 bits per element from Philox (``random_bytes``: one
``tl.randint4x`` per 16 columns) keyed by a seed drawn on the device (graph-safe), or from given
``random_bits`` (tests: bit-exact against ``quantize.nvfp4`` with the same bits).

The copies' widths are multiples of 128; other H and F are read as zero-padded to them (``width=``,
:mod:`..padded` and the NVFP4 autograd).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ....quantize import hadamard
from ..act_math import to_output
from ..block_scaled_launch import copies_width
from ..fp8_block.codec import nan_free_abs
from ..fp8_block.quantize import WeightCache
from ..grouped_gemm import interpreting
from ..schedule import build_schedule, max_m_tiles, tile_rows, total_tiles
from .codec import (DEQUANT_FACTOR, block_scale, e2m1_encode, e2m1_encode_stochastic, e2m1_expand_halves, pack_pairs,
                    tensor_scales)

NV = 16  # elements per scale block
TILE = 128  # schedule M tile
QUANT_COLS = 64  # columns per quantize program
# 16x16 weight tiles: the transposed copy's codes as the rowwise copy's codes transposed (True), or encoded again from
# the transposed FP32 tile (False, runs 14-41); the same bytes either way (interpreter), and offline sm_90a half the
# instructions (2416 against 4656) and registers (128 against 255). On since run 42 (H100, DSv3, Triton 3.6: the same
# bytes on the GPU too, w1 7.60 -> 2.28 ms, w2 3.84 -> 1.17 ms); run 14 had seen a transposed tile's codes come out
# wrong on the GPU in some builds (activations, older Triton), so the GPU tests compare both against the emulation
WEIGHT_CODES_TRANSPOSED = True
# The Hadamard transform of BF16 inputs (x, dy) on BF16 tensor cores (mma.sync: exact products, FP32 sums) instead of
# FP32 FMAs; FP32 inputs (a, dh) keep the FMAs (their values would round to BF16). Offline sm_90a at 128 x 64 tiles and
# 8 warps: the RHT amax pass 1160 -> 632 instructions per thread and 163 -> 46 registers; x's quantize pass 3232 -> 2960
# and 169 -> 102 (dy's, with stochastic rounding, 4152 -> 4080 and 177 -> 128). Opt-in until it has run on a GPU: the
# tensor cores' FP32 sums may round differently from the FMA chain's (bit-exact on data whose sums are exact).
RHT_TENSOR_CORES = False
# TE's wgrad RHT sign vector as a bit mask (bit i set: sign i is negative)
RHT_NEG_MASK = sum(1 << i for i, s in enumerate(hadamard.WGRAD_SIGNS) if s < 0)


@dataclasses.dataclass(frozen=True)
class NVSpec:
    """How one role's tensors are quantized: ``stochastic`` rounding (gradients), ``rht`` on the
    wgrad (columnwise) copies, ``block_2d`` 16x16 tiles (weights); ``bf16_values`` (weights): the
    cache also keeps each code times its block scale as BF16 (exact), which the GEMMs then read
    instead of expanding the packed weights in their K loops (twice the BF16 weights' bytes)."""

    stochastic: bool = False
    rht: bool = True
    block_2d: bool = False
    bf16_values: bool = False


@dataclasses.dataclass
class NVRows:
    """An activation or gradient quantized for the expert GEMMs (layouts in the module doc)."""

    data: Optional[torch.Tensor] = None  # [T, K/2] uint8
    scale: Optional[torch.Tensor] = None  # [T, K/16] uint8 E4M3
    amax: Optional[torch.Tensor] = None  # [E + 1] float32
    data_t: Optional[torch.Tensor] = None  # [K, 64 * max_m_tiles] uint8
    scale_t: Optional[torch.Tensor] = None  # [8 * max_m_tiles, K] uint8 E4M3
    amax_t: Optional[torch.Tensor] = None  # [E + 1] float32 (of the transformed values with RHT)
    # bf16 codes x block scales (no tensor scale), each 128-wide block stored even elements first:
    # transient copies that ``with_values`` writes just before a GEMM reads them (never saved)
    values: Optional[torch.Tensor] = None  # [T, K]
    values_t: Optional[torch.Tensor] = None  # [K, 128 * max_m_tiles]


@dataclasses.dataclass
class NVWeight:
    """``w [E, N, K]`` quantized for both GEMM directions."""

    data: torch.Tensor  # [E, N, K/2] uint8
    scale: torch.Tensor  # [E, N, K/16] uint8
    data_t: Optional[torch.Tensor]  # [E, K, N/2] uint8
    scale_t: Optional[torch.Tensor]  # [E, K, N/16] uint8
    amax: torch.Tensor  # [E] float32
    # bf16 codes x block scales (no tensor scale), each 128-wide K (N) block stored even elements first
    values: Optional[torch.Tensor] = None  # [E, N, K]
    values_t: Optional[torch.Tensor] = None  # [E, K, N]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.data_t, self.scale, self.scale_t, self.amax,
                                                          self.values, self.values_t) if t is not None)


# ----------------------------------------------------------------------------- device functions

@triton.jit
def rht_along_rows(v, BM: tl.constexpr, BK: tl.constexpr, NEG_MASK: tl.constexpr, BF16_MMA: tl.constexpr = False,
                   UPCAST: tl.constexpr = False):
    """Each run of 16 rows of FP32 ``v`` [BM, BK] times TE's RHT matrix ``M = diag(s) H16 / 4``
    (``out[16 g + j] = sum_i M[i, j] v[16 g + i]``): exact products (entries +-1/4), FP32 sums (the
    IEEE path; TF32 tensor cores gave codes that differed from the reference on the H200, run 14).
    ``BF16_MMA`` (``v`` holds BF16 values: x, dy): the same exact products on BF16 tensor cores, FP32 sums
    (``UPCAST``, the interpreter, whose dot multiplies BF16 bit patterns: the BF16 operands as FP32)."""
    i = tl.arange(0, 16)[None, :]
    j = tl.arange(0, 16)[:, None]
    x = i & j
    parity = (x ^ (x >> 1) ^ (x >> 2) ^ (x >> 3)) & 1
    m_t = tl.where((parity ^ ((NEG_MASK >> i) & 1)) == 1, -0.25, 0.25)  # [j, i] = M[i, j]
    lhs = tl.broadcast_to(m_t[None, :, :], (BM // 16, 16, 16))
    blocks = tl.reshape(v, (BM // 16, 16, BK))
    if BF16_MMA:
        if UPCAST:
            out = tl.dot(lhs.to(tl.bfloat16).to(tl.float32), blocks.to(tl.bfloat16).to(tl.float32),
                         input_precision="ieee")
        else:
            out = tl.dot(lhs.to(tl.bfloat16), blocks.to(tl.bfloat16))
    else:
        out = tl.dot(lhs, blocks, input_precision="ieee")
    return tl.reshape(out, (BM, BK))


@triton.jit
def random_bytes(seed, rows, col0, K, BM: tl.constexpr, BK: tl.constexpr):
    """8 Philox bits per element of the [BM, BK] tile at ``rows`` x columns ``col0 + [0, BK)`` of a
    K-wide tensor (int32 in [0, 256)). One Philox4x32 call per 16 columns (its 16 bytes: byte b of
    word w to column 4 w + b), counter = the 16-block's index. ``tl.randint`` per element ran ten
    Philox rounds per byte and kept a quarter of the output (run 15: dy's stochastic pass 4.3 ms, x's
    pass without rounding 2.5)."""
    counters = (rows[:, None] * (K // 16) + (col0 // 16 + tl.arange(0, BK // 16))[None, :]).to(tl.uint32)
    w0, w1, w2, w3 = tl.randint4x(seed, counters)
    # join(p, q)[.., i, j] = (p, q)[j][.., i]: this nesting flattens to w0, w1, w2, w3
    words = tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), (BM, BK // 16, 4))
    shifts = (tl.arange(0, 4) * 8).to(tl.uint32)
    bytes4 = (words[:, :, :, None] >> shifts[None, None, None, :]) & 0xFF  # [BM, BK / 16, word, byte]
    return tl.reshape(bytes4, (BM, BK)).to(tl.int32)


@triton.jit
def encode_values(scaled, bits, STOCHASTIC: tl.constexpr):
    if STOCHASTIC:
        return e2m1_encode_stochastic(scaled, bits)
    else:
        return e2m1_encode(scaled)


@triton.jit
def quantize_along_cols(v, s_enc, s_dec, bits, BM: tl.constexpr, BK: tl.constexpr, STOCHASTIC: tl.constexpr):
    """1x16 blocks of FP32 ``v`` [BM, BK] along its columns: (codes [BM, BK] uint8, scale codes
    [BM, BK/16] uint8). The weights' transposed copies transpose the FP32 tile and come through here."""
    blocks = tl.reshape(v, (BM, BK // 16, 16))
    code, r = block_scale(tl.max(nan_free_abs(blocks), axis=2), s_enc, s_dec)
    scaled = tl.reshape(blocks * r[:, :, None], (BM, BK))
    return encode_values(scaled, bits, STOCHASTIC), code


@triton.jit
def quantize_along_rows(v, s_enc, s_dec, bits, BM: tl.constexpr, BK: tl.constexpr, STOCHASTIC: tl.constexpr):
    """16x1 blocks of FP32 ``v`` [BM, BK] along its rows: (codes [BM, BK] uint8, scale codes [BM/16, BK]).
    The columnwise activation copies come through here (on the RHT's output) and are transposed as
    codes: the form that was exact on the H200 in every build of run 14; transposing the FP32 tile
    after the RHT instead gave wrong codes in some builds (colwise-only and BF16-values variants)."""
    blocks = tl.reshape(v, (BM // 16, 16, BK))
    code, r = block_scale(tl.max(nan_free_abs(blocks), axis=1), s_enc, s_dec)
    scaled = tl.reshape(blocks * r[:, None, :], (BM, BK))
    return encode_values(scaled, bits, STOCHASTIC), code


@triton.jit
def quantize_tiles_2d(v, s_enc, s_dec, BM: tl.constexpr, BK: tl.constexpr):
    """16x16 tiles of FP32 ``v`` [BM, BK] (weights): (codes [BM, BK] uint8, one scale code per tile
    [BM/16, BK/16]). Kept in 4-D ([row tile, row, column tile, column]) until the codes."""
    tiles = tl.reshape(v, (BM // 16, 16, BK // 16, 16))
    code, r = block_scale(tl.max(tl.max(nan_free_abs(tiles), axis=3), axis=1), s_enc, s_dec)
    scaled = tl.reshape(tiles * r[:, None, :, None], (BM, BK))
    return e2m1_encode(scaled), code


# ----------------------------------------------------------------------------- kernels

@triton.jit
def group_amax_kernel(
    x_ptr, stride_xm, amax_ptr, amax_t_ptr, sched_ptr, X_COLS, NUM_GROUPS,
    RHT_AMAX: tl.constexpr, NEG_MASK: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
    RHT_MMA: tl.constexpr = False, UPCAST: tl.constexpr = False,
):
    """Per (schedule tile, ``BK`` columns): the tile's NaN-ignoring max |x| into its group's ``amax``
    and, with ``RHT_AMAX``, that of its Hadamard transform along the tokens into ``amax_t`` (x's
    ``X_COLS`` columns; a program past them sees zeros)."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    if pid_m >= total_tiles(sched_ptr, NUM_GROUPS):
        return
    group, row0, row_end = tile_rows(sched_ptr, pid_m, BM, NUM_GROUPS)
    rows = row0 + tl.arange(0, BM)
    cols = pid_k * BK + tl.arange(0, BK)
    mask = (rows < row_end)[:, None] & (cols < X_COLS)[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.atomic_max(amax_ptr + group, tl.max(tl.max(nan_free_abs(x), axis=1), axis=0))
    if RHT_AMAX:
        t = rht_along_rows(x, BM, BK, NEG_MASK, RHT_MMA, UPCAST)
        tl.atomic_max(amax_t_ptr + group, tl.max(tl.max(nan_free_abs(t), axis=1), axis=0))


@triton.jit
def quantize_tiles_kernel(
    x_ptr, stride_xm,
    q_ptr, stride_qm, qs_ptr, stride_qsm, stride_qsk, amax_ptr,
    qt_ptr, stride_qtk, qts_ptr, stride_qtsb, amax_t_ptr,
    colsum_ptr, stride_cst,
    seed_ptr, bits_ptr, stride_bits, bits_t_ptr, stride_bits_t,
    sched_ptr, K, X_COLS, NUM_GROUPS,
    ROWWISE: tl.constexpr, COLWISE: tl.constexpr, COLSUM: tl.constexpr, RHT: tl.constexpr,
    STOCHASTIC: tl.constexpr, GIVEN_BITS: tl.constexpr, NEG_MASK: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
    RHT_MMA: tl.constexpr = False, UPCAST: tl.constexpr = False,
):
    """One program per (schedule M tile, ``BK`` columns): 1x16 rowwise blocks and, with ``COLWISE``,
    16-token blocks inside the tile (Hadamard-transformed with ``RHT``), each with its group's tensor
    scale; with ``COLSUM`` the tile's FP32 column sums (bias gradients). The copies are ``K`` wide;
    x's ``X_COLS`` columns are read, zeros past them (``width=``)."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    if pid_m >= total_tiles(sched_ptr, NUM_GROUPS):
        return
    group, row0, row_end = tile_rows(sched_ptr, pid_m, BM, NUM_GROUPS)
    rows = row0 + tl.arange(0, BM)
    cols = pid_k * BK + tl.arange(0, BK)
    row_ok = rows < row_end
    mask = row_ok[:, None] & (cols < X_COLS)[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if COLSUM:
        tl.store(colsum_ptr + pid_m * stride_cst + cols, tl.sum(x, axis=0))
    slot = pid_m * BM + tl.arange(0, BM)  # the tile's own columns of the columnwise copy
    if ROWWISE:
        bits = tl.zeros((BM, BK), tl.int32)
        if STOCHASTIC:
            if GIVEN_BITS:
                bits = tl.load(bits_ptr + rows64[:, None] * stride_bits + cols[None, :], mask=mask, other=0).to(tl.int32)
            else:
                bits = random_bytes(tl.load(seed_ptr), rows, pid_k * BK, K, BM, BK)
        s_enc, s_dec = tensor_scales(tl.load(amax_ptr + group))
        codes, sc = quantize_along_cols(x, s_enc, s_dec, bits, BM, BK, STOCHASTIC)
        packed_cols = pid_k * (BK // 2) + tl.arange(0, BK // 2)
        tl.store(q_ptr + rows64[:, None] * stride_qm + packed_cols[None, :], pack_pairs(codes, BM, BK),
                 mask=row_ok[:, None])
        kb = pid_k * (BK // 16) + tl.arange(0, BK // 16)
        tl.store(qs_ptr + rows64[:, None] * stride_qsm + kb[None, :] * stride_qsk, sc, mask=row_ok[:, None])
    if COLWISE:
        if RHT:
            # rows past the group's end are zeros: so is their padding
            x = rht_along_rows(x, BM, BK, NEG_MASK, RHT_MMA, UPCAST)
        bits_t = tl.zeros((BM, BK), tl.int32)
        if STOCHASTIC:
            if GIVEN_BITS:
                bits_t = tl.load(bits_t_ptr + slot.to(tl.int64)[:, None] * stride_bits_t + cols[None, :]).to(tl.int32)
            else:
                bits_t = random_bytes(tl.load(seed_ptr + 1), slot, pid_k * BK, K, BM, BK)
        s_enc_t, s_dec_t = tensor_scales(tl.load(amax_t_ptr + group))
        codes_t, sc_t = quantize_along_rows(x, s_enc_t, s_dec_t, bits_t, BM, BK, STOCHASTIC)
        packed_slot = pid_m * (BM // 2) + tl.arange(0, BM // 2)
        tl.store(qt_ptr + cols.to(tl.int64)[:, None] * stride_qtk + packed_slot[None, :],
                 pack_pairs(tl.trans(codes_t), BK, BM))
        tb = pid_m * (BM // 16) + tl.arange(0, BM // 16)
        tl.store(qts_ptr + tb[:, None] * stride_qtsb + cols[None, :], sc_t)


@triton.jit
def quantize_weight_kernel(
    w_ptr, stride_we, stride_wn, amax_ptr,
    q_ptr, s_ptr, stride_se, stride_sk,
    qt_ptr, st_ptr, stride_ste, stride_stn,
    N, K,
    TRANSPOSED: tl.constexpr, BLOCK_2D: tl.constexpr, BLK: tl.constexpr, CODES_T_FROM_CODES: tl.constexpr = False,
):
    """One BLK x BLK tile of ``w[e]`` [N, K] with ``w[e]``'s tensor scale: ``q[e]`` [N, K/2] (1x16
    along K, or 16x16 tiles; scales at ``s[e, k // 16, n]``) and ``qt[e]`` [K, N/2] (along N; with
    16x16 tiles the same codes transposed; scales at ``st[e, n // 16, k]``)."""
    e = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_n * BLK + tl.arange(0, BLK)
    cols = pid_k * BLK + tl.arange(0, BLK)
    w = tl.load(w_ptr + e.to(tl.int64) * stride_we + rows[:, None] * stride_wn + cols[None, :]).to(tl.float32)
    s_enc, s_dec = tensor_scales(tl.load(amax_ptr + e))
    no_bits = tl.zeros((BLK, BLK), tl.int32)
    out = e.to(tl.int64) * N * (K // 2)
    kb = pid_k * (BLK // 16) + tl.arange(0, BLK // 16)
    nb = pid_n * (BLK // 16) + tl.arange(0, BLK // 16)
    if BLOCK_2D:
        # one code per 16x16 tile, the same for both copies; every row of a tile repeats it (3-D
        # stores: [row tile, row, column tile])
        codes, tile_sc = quantize_tiles_2d(w, s_enc, s_dec, BLK, BLK)
        i16 = tl.arange(0, 16)[None, :, None]
        tile_rows16 = pid_n * BLK + tl.arange(0, BLK // 16)[:, None, None] * 16 + i16  # [nt, 16, 1]
        tl.store(s_ptr + e * stride_se + kb[None, None, :] * stride_sk + tile_rows16, tile_sc[:, None, :])
        if TRANSPOSED:
            tile_cols16 = pid_k * BLK + tl.arange(0, BLK // 16)[None, None, :] * 16 + tl.arange(0, 16)[None, :, None]
            tl.store(st_ptr + e * stride_ste + nb[:, None, None] * stride_stn + tile_cols16, tile_sc[:, None, :])
    else:
        codes, sc = quantize_along_cols(w, s_enc, s_dec, no_bits, BLK, BLK, False)
        tl.store(s_ptr + e * stride_se + kb[None, :] * stride_sk + rows[:, None], sc)
    tl.store(q_ptr + out + rows[:, None] * (K // 2) + (pid_k * (BLK // 2) + tl.arange(0, BLK // 2))[None, :],
             pack_pairs(codes, BLK, BLK))
    if TRANSPOSED:
        if BLOCK_2D and CODES_T_FROM_CODES:
            # 16x16 tiles are symmetric under transposition: the transposed tile's codes are the codes transposed
            # (same tile amax, same scale), so the tile is encoded once
            codes_t = tl.trans(codes)
        elif BLOCK_2D:
            # the same codes, encoded again from the transposed FP32 tile (runs 14-41)
            codes_t, _ = quantize_tiles_2d(tl.trans(w), s_enc, s_dec, BLK, BLK)
        else:
            codes_t, sc_t = quantize_along_cols(tl.trans(w), s_enc, s_dec, no_bits, BLK, BLK, False)
            tl.store(st_ptr + e * stride_ste + nb[None, :] * stride_stn + cols[:, None], sc_t)
        tl.store(qt_ptr + out + cols[:, None] * (N // 2) + (pid_n * (BLK // 2) + tl.arange(0, BLK // 2))[None, :],
                 pack_pairs(codes_t, BLK, BLK))


@triton.jit
def expand_kernel(q_ptr, stride_qe, stride_qr, s_ptr, stride_se, stride_sr, stride_sb, v_ptr, stride_ve, stride_vr,
                  ROWS, amax_a_ptr, amax_b_ptr, sched_ptr, NUM_GROUPS,
                  UPCAST: tl.constexpr, BLK: tl.constexpr, TENSOR_SCALES: tl.constexpr = False):
    """One BLK x BLK tile of packed codes ``q[e]`` [ROWS, C/2] (scale codes ``s[e]`` [ROWS, C/16], any
    strides) as exact BF16 values ``v[e]`` [ROWS, C], each BLK-wide block of C stored even elements
    first (the order of the GEMMs' split dots). Rows past ``ROWS`` are left alone.

    ``TENSOR_SCALES`` (columnwise copies: C runs over the schedule's tile slots): each slot's values times
    its group's two tensor scales, ``amax_a[g] / 2688 * amax_b[g] / 2688``, in FP32 and rounded once to BF16."""
    e = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLK + tl.arange(0, BLK)
    pid_c = tl.program_id(2)
    row_ok = (rows < ROWS)[:, None]
    rows64 = rows.to(tl.int64)[:, None]
    half = tl.arange(0, BLK // 2)[None, :]
    packed = tl.load(q_ptr + e * stride_qe + rows64 * stride_qr + pid_c * (BLK // 2) + half, mask=row_ok, other=0)
    cb = pid_c * (BLK // 16) + tl.arange(0, BLK // 16)
    sc = tl.load(s_ptr + e * stride_se + rows64 * stride_sr + cb[None, :] * stride_sb, mask=row_ok, other=0)
    even, odd = e2m1_expand_halves(packed, sc, BLK, BLK, UPCAST)
    if TENSOR_SCALES:
        # the slot's group from the tile -> group map (row 4 of the schedule); slots past the last tile -> padding
        group = tl.minimum(tl.load(sched_ptr + 4 * NUM_GROUPS + pid_c), NUM_GROUPS - 1)
        factor = (tl.load(amax_a_ptr + group) * DEQUANT_FACTOR) * (tl.load(amax_b_ptr + group) * DEQUANT_FACTOR)
        even = to_output(even.to(tl.float32) * factor, tl.bfloat16, UPCAST)
        odd = to_output(odd.to(tl.float32) * factor, tl.bfloat16, UPCAST)
    v = v_ptr + e * stride_ve + rows64 * stride_vr + pid_c * BLK + half
    tl.store(v, even.to(tl.bfloat16), mask=row_ok)
    tl.store(v + BLK // 2, odd.to(tl.bfloat16), mask=row_ok)


# ----------------------------------------------------------------------------- host side

def new_row_scales(num_rows: int, k: int, like: torch.Tensor, alloc=torch.empty) -> torch.Tensor:
    """``[T, K/16]`` uint8 row scales, stored 16-block-major (strides ``(1, T)``)."""
    return alloc((k // NV, num_rows), device=like.device, dtype=torch.uint8).t()


def new_rows(num_rows: int, width: int, like: torch.Tensor, num_experts: int, rowwise: bool, colwise: bool,
             alloc=torch.empty) -> NVRows:
    """Buffers of a quantized activation or gradient (the copies asked for); amaxes start at zero."""
    q = NVRows()
    slots = TILE * max_m_tiles(num_rows, num_experts, TILE)
    if rowwise:
        q.data = alloc((num_rows, width // 2), device=like.device, dtype=torch.uint8)
        q.scale = new_row_scales(num_rows, width, like, alloc)
        q.amax = torch.zeros(num_experts + 1, device=like.device, dtype=torch.float32)
    if colwise:
        q.data_t = alloc((width, slots // 2), device=like.device, dtype=torch.uint8)
        q.scale_t = alloc((slots // NV, width), device=like.device, dtype=torch.uint8)
        q.amax_t = torch.zeros(num_experts + 1, device=like.device, dtype=torch.float32)
    return q


def new_seed(device: torch.device) -> torch.Tensor:
    """Two Philox keys (rowwise, columnwise) drawn on the device from PyTorch's generator: no host
    read, and inside a CUDA graph each replay draws new ones."""
    return torch.randint(0, 2**31 - 1, (2,), device=device, dtype=torch.int64).to(torch.int32)


def rht_on_tensor_cores(x: torch.Tensor) -> bool:
    """Whether ``x``'s RHT runs on BF16 tensor cores (:data:`RHT_TENSOR_CORES`, BF16 inputs only)."""
    return RHT_TENSOR_CORES and x.dtype == torch.bfloat16


def group_amaxes(x: torch.Tensor, schedule: torch.Tensor, num_experts: int, amax: torch.Tensor,
                 amax_t: torch.Tensor, rht: bool, width: int) -> None:
    """The amax pass of ``x [T, K]``: each schedule group's NaN-ignoring max |x| into ``amax`` and, with ``rht``, that
    of x's Hadamard transform along the tokens into ``amax_t`` (``[E + 1]`` FP32, zero before; the same tensor as
    ``amax`` without ``rht``). ``width`` (>= K): the copies' width, x's columns zero-padded to it."""
    grid = (max_m_tiles(x.shape[0], num_experts, TILE), width // QUANT_COLS)
    group_amax_kernel[grid](x, x.stride(0), amax, amax_t, schedule, x.shape[1], num_experts + 1, RHT_AMAX=rht,
                            NEG_MASK=RHT_NEG_MASK, BM=TILE, BK=QUANT_COLS, RHT_MMA=rht_on_tensor_cores(x),
                            UPCAST=interpreting(), num_warps=4 if interpreting() else 8)


def quantize_rows(x: torch.Tensor, schedule: torch.Tensor, num_experts: int, spec: NVSpec, *, rowwise: bool = True,
                  colwise: bool = False, alloc=torch.empty, col_sums: Optional[torch.Tensor] = None,
                  random_bits: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
                  width: Optional[int] = None) -> NVRows:
    """NVFP4-quantize ``x [T, K]`` (rows grouped by expert; ``schedule`` from ``build_schedule(counts, T, 128)``)
    rowwise (1x16 along K) and/or columnwise (16 tokens per block restarting at each expert, RHT per
    ``spec``), each expert with its own tensor scales. ``col_sums`` (FP32 ``[max_m_tiles, K]``)
    receives each tile's column sums of ``x``; ``random_bits`` (tests, stochastic specs): uint8 ``[T, K]`` for the rowwise copy and
    ``[128 * max_m_tiles, K]`` (by slot) for the columnwise one. ``width`` (>= K, default K): the
    copies' width, x zero-padded to it (``padded.py``) without a copy."""
    num_rows, x_cols = x.shape
    k = copies_width(x, width)
    if x.stride(1) != 1:
        raise ValueError(f"x: expected unit stride along the last dimension, got strides {x.stride()}")
    if k % TILE:
        raise ValueError(f"x: the NVFP4 quantize kernels need a width that is a multiple of {TILE}, got {k}")
    if random_bits is not None and not spec.stochastic:
        raise ValueError("random_bits: only used with a stochastic-rounding spec")
    q = new_rows(num_rows, k, x, num_experts, rowwise, colwise, alloc)
    if num_rows == 0 or not (rowwise or colwise or col_sums is not None):
        return q
    m_tiles = max_m_tiles(num_rows, num_experts, TILE)
    grid = (m_tiles, k // QUANT_COLS)
    warps = 4 if interpreting() else 8
    amax = q.amax if rowwise else torch.zeros(num_experts + 1, device=x.device, dtype=torch.float32)
    if colwise and not spec.rht:
        q.amax_t = amax  # the same values quantized along the other axis: the same tensor amax
    rht_amax = colwise and spec.rht
    group_amaxes(x, schedule, num_experts, amax, q.amax_t if rht_amax else amax, rht_amax, k)
    dummy = x.view(torch.uint8) if x.is_contiguous() else amax
    given = random_bits is not None
    seed = new_seed(x.device) if spec.stochastic and not given else amax
    bits, bits_t = random_bits if given else (dummy, dummy)
    quantize_tiles_kernel[grid](
        x, x.stride(0),
        q.data if rowwise else dummy, q.data.stride(0) if rowwise else 0,
        q.scale if rowwise else dummy, q.scale.stride(0) if rowwise else 0, q.scale.stride(1) if rowwise else 0, amax,
        q.data_t if colwise else dummy, q.data_t.stride(0) if colwise else 0,
        q.scale_t if colwise else dummy, q.scale_t.stride(0) if colwise else 0, q.amax_t if colwise else amax,
        col_sums if col_sums is not None else x, col_sums.stride(0) if col_sums is not None else 0,
        seed, bits, bits.stride(0) if given else 0, bits_t, bits_t.stride(0) if given else 0,
        schedule, k, x_cols, num_experts + 1,
        ROWWISE=rowwise, COLWISE=colwise, COLSUM=col_sums is not None, RHT=spec.rht, STOCHASTIC=spec.stochastic,
        GIVEN_BITS=given, NEG_MASK=RHT_NEG_MASK, BM=TILE, BK=QUANT_COLS, RHT_MMA=rht_on_tensor_cores(x),
        UPCAST=interpreting(), num_warps=warps,
    )
    return q


def weight_amax(w: torch.Tensor) -> torch.Tensor:
    """``[E]`` NaN-ignoring max |w[e]| (the amax pass over ``w`` seen as E groups of N rows)."""
    e, n, k = w.shape
    rows = w.reshape(e * n, k)
    schedule = build_schedule(torch.full((e,), n, device=w.device, dtype=torch.int32), e * n, TILE)
    amax = torch.zeros(e + 1, device=w.device, dtype=torch.float32)
    group_amaxes(rows, schedule, e, amax, amax, False, k)
    return amax[:e]


def quantize_weight(w: torch.Tensor, spec: NVSpec, *, transposed: bool = True, alloc=torch.empty) -> NVWeight:
    """NVFP4-quantize each ``w[e]`` ([E, N, K], its own tensor scale) along K and (``transposed``) along N."""
    if w.dim() != 3 or not w.is_contiguous():
        raise ValueError(f"w: expected a contiguous [E, N, K] tensor, got shape {tuple(w.shape)} strides {w.stride()}")
    e, n, k = w.shape
    if n % TILE or k % TILE:
        raise ValueError(f"w: the NVFP4 weight quantizer needs both sizes to be multiples of {TILE}, got {tuple(w.shape)}")
    data = alloc((e, n, k // 2), device=w.device, dtype=torch.uint8)
    scale = alloc((e, k // NV, n), device=w.device, dtype=torch.uint8).transpose(1, 2)
    data_t = alloc((e, k, n // 2), device=w.device, dtype=torch.uint8) if transposed else None
    scale_t = alloc((e, n // NV, k), device=w.device, dtype=torch.uint8).transpose(1, 2) if transposed else None
    amax = weight_amax(w) if w.numel() else torch.zeros(e, device=w.device, dtype=torch.float32)
    values = alloc((e, n, k), device=w.device, dtype=torch.bfloat16) if spec.bf16_values else None
    values_t = alloc((e, k, n), device=w.device, dtype=torch.bfloat16) if spec.bf16_values and transposed else None
    if w.numel():
        quantize_weight_kernel[(e, n // TILE, k // TILE)](
            w, w.stride(0), w.stride(1), amax,
            data, scale, scale.stride(0), scale.stride(2),
            data_t if transposed else data, scale_t if transposed else scale,
            scale_t.stride(0) if transposed else 0, scale_t.stride(2) if transposed else 0,
            n, k, TRANSPOSED=transposed, BLOCK_2D=spec.block_2d, BLK=TILE, CODES_T_FROM_CODES=WEIGHT_CODES_TRANSPOSED,
            num_warps=4 if interpreting() else 8,
        )
        for q, s, v in ((data, scale, values), (data_t, scale_t, values_t)):
            if v is not None:
                expand_values(q, s, out=v)
    return NVWeight(data, scale, data_t, scale_t, amax, values, values_t)


def expand_values(data: torch.Tensor, scale: torch.Tensor, out: Optional[torch.Tensor] = None,
                  alloc=torch.empty, tensor_scales: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
                  ) -> torch.Tensor:
    """BF16 values (codes x E4M3 block scales, split order; see :func:`expand_kernel`) of packed
    ``data`` [(E,) R, C/2] with scale codes ``scale`` [(E,) R, C/16] (any strides). ``tensor_scales =
    (amax_a, amax_b, schedule)``: a columnwise copy's values (C over the schedule's slots) times both
    amaxes' tensor scales of each slot's group, rounded once (``[E + 1]`` amaxes)."""
    squeeze = data.dim() == 2
    if squeeze:
        data, scale = data.unsqueeze(0), scale.unsqueeze(0)
    e, rows, packed = data.shape
    if data.stride(2) != 1 or scale.shape != (e, rows, 2 * packed // NV) or (2 * packed) % TILE:
        raise ValueError(f"data, scale: expected packed codes [(E,) R, C/2] (unit inner stride, C a multiple of "
                         f"{TILE}) and scales [(E,) R, C/16], got {tuple(data.shape)} and {tuple(scale.shape)}")
    # without tensor scales the kernel reads none of these three pointers
    amax_a, amax_b, schedule = tensor_scales if tensor_scales is not None else (data, data, data)
    num_groups = amax_a.numel()
    if tensor_scales is not None and (
            e != 1 or amax_b.numel() != num_groups or amax_a.dtype != torch.float32 or amax_b.dtype != torch.float32
            or schedule.dtype != torch.int32 or schedule.numel() < 4 * num_groups + 2 * packed // TILE):
        raise ValueError(f"tensor_scales: expected two FP32 [E + 1] amaxes and the int32 schedule of one columnwise "
                         f"copy's {2 * packed // TILE} slots, got amaxes {amax_a.dtype} [{amax_a.numel()}] and "
                         f"{amax_b.dtype} [{amax_b.numel()}], a {schedule.dtype} schedule of {schedule.numel()}, "
                         f"for {e} matrices")
    if out is None:
        out = alloc((e, rows, 2 * packed), device=data.device, dtype=torch.bfloat16)
    elif squeeze:
        out = out.unsqueeze(0)
    if data.numel():
        expand_kernel[(e, triton.cdiv(rows, TILE), 2 * packed // TILE)](
            data, data.stride(0), data.stride(1), scale, scale.stride(0), scale.stride(1), scale.stride(2),
            out, out.stride(0), out.stride(1), rows, amax_a, amax_b, schedule, num_groups,
            UPCAST=interpreting(), BLK=TILE, TENSOR_SCALES=tensor_scales is not None,
            num_warps=4 if interpreting() else 8)
    return out[0] if squeeze else out


def with_values(q: NVRows, rowwise: bool = False, colwise: bool = False, alloc=torch.empty,
                colwise_scaled_by: Optional[Tuple[NVRows, torch.Tensor]] = None) -> NVRows:
    """``q`` with the BF16 values of the asked copies filled in (a new object: the caller drops it, and
    the transient values with it, after the GEMM that reads them). ``colwise_scaled_by = (other, schedule)``:
    the columnwise values times each group's tensor scales of ``q`` and of ``other`` (a wgrad's operands, for a
    GEMM that takes no per-group factor: :func:`.autograd.weight_grad` on cuBLAS)."""
    values = expand_values(q.data, q.scale, alloc=alloc) if rowwise else None
    scales = (q.amax_t, colwise_scaled_by[0].amax_t, colwise_scaled_by[1]) if colwise_scaled_by else None
    # scale_t is [slots / 16, K]: seen transposed it is the [K, slots / 16] scales of data_t's rows
    values_t = expand_values(q.data_t, q.scale_t.t(), alloc=alloc, tensor_scales=scales) if colwise else None
    return dataclasses.replace(q, values=values, values_t=values_t)


def with_weight_values(w: NVWeight, transposed: bool, alloc=torch.empty) -> NVWeight:
    """``w`` with the BF16 values of the copy the GEMM reads (``data_t`` if ``transposed``), unless the
    weight cache already holds them."""
    if transposed and w.values_t is None:
        return dataclasses.replace(w, values_t=expand_values(w.data_t, w.scale_t, alloc=alloc))
    if not transposed and w.values is None:
        return dataclasses.replace(w, values=expand_values(w.data, w.scale, alloc=alloc))
    return w


# fp8_block's per-optimizer-step cache (same invalidation rules) holding NVFP4 copies
WEIGHT_CACHE = WeightCache(quantize_fn=quantize_weight)
