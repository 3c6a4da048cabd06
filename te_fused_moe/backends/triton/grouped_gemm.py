"""Grouped GEMM over expert row groups, with the MoE epilogues.

One kernel template, three epilogues (``MODE``):

- ``MODE_PLAIN``:   ``C = A @ B_e (+ bias_e)``                         FC2 forward, FC1 dgrad
- ``MODE_ACT_FWD``: ``h = A @ W1_e^T + b1_e``; ``C = act(h) * p``; h saved      FC1 forward
- ``MODE_ACT_BWD``: ``da = A @ W2_e``; ``C = dh = d act(h) * (da * p)``;
  ``dprob = sum_n da * act(h)``                                     FC2 dgrad with dGLU

``B_e`` is read through strides, so the same kernel reads ``w[e]`` or ``w[e]^T``. Gated FC1 keeps two
accumulators per tile, gate columns ``n`` and up columns ``F + n`` of the same ``w1[e]`` (or, with
``GemmConfig.gate_up_box``, one twice as wide, fed by one TMA box per K step): no interleaved weight
layout is needed.

Tiles are mapped to (group, row start) on the device through the schedule's tile -> group map;
programs past the last tile exit at once; the padding group writes zeros. Opt-in persistent variant
(``GemmConfig.persistent``): one program per SM loops over the tiles (the per-tile code, ``_gemm_tile``,
is shared), so that the next tile's loads can overlap this tile's epilogue. Loads are not masked along
M and N: A and B come through TMA descriptors (out-of-tensor boxes are zero-filled) or, where TMA is
not allowed, through pointers whose row/column indices are clamped into the tensor. Rows and columns
that belong to another expert only feed output elements that the masked store drops.

Interpreter note: Triton 3.6's CPU interpreter computes ``tl.dot`` on bf16 operands wrongly (it
returned garbage in our tests) while FP32 dots are right, so ``UPCAST`` (set only when
``TRITON_INTERPRET=1``) converts the dot operands to FP32. On the GPU the operands stay 16-bit so
that the dot lowers to wgmma.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace
from typing import Optional

import torch
import triton
import triton.language as tl

from .act_math import ACT_IDS, act_backward, act_forward, load_gate_up, to_output
from .schedule import build_schedule, max_m_tiles, swizzle

MODE_PLAIN, MODE_ACT_FWD, MODE_ACT_BWD = 0, 1, 2


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def register_cap(maxnreg: Optional[int]) -> dict:
    """Launch keywords capping a kernel's registers per thread at ``maxnreg`` (None: the compiler's
    choice); none under the interpreter, which takes no such option."""
    return {"maxnreg": maxnreg} if maxnreg and not interpreting() else {}


@dataclass(frozen=True)
class GemmConfig:
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    use_tma: bool = True  # TMA loads where the operands allow (see _tma_allowed), else pointer loads
    # One program per SM (times programs_per_sm) looping over the tiles instead of one per tile: the
    # next tile's loads overlap this tile's epilogue, which pays where K loops are short.
    persistent: bool = False
    programs_per_sm: int = 1
    # Persistent only: flatten the tile loop and the K loop into one loop that the pipeliner overlaps
    # across tiles (False: a plain loop over tiles, no cross-tile overlap).
    flatten: bool = True
    # Gated FC1 with TMA: one [2, block_n, block_k] box of w1 (viewed [E * 2, F, H]) brings a tile's gate
    # and up rows, so one 2 * block_n wide dot fills one accumulator (instead of two dots into two).
    # The flattened persistent FC1 needs it: with two accumulators ptxas serializes its wgmmas (C7515).
    gate_up_box: bool = False


INTERPRET_CONFIG = GemmConfig(block_m=16, block_n=32, block_k=32, group_m=2, num_warps=4, num_stages=1)
# Tests flip this to cover the pointer-load path under the interpreter as well.
USE_TMA_DEFAULT = True
# ``persistent`` (and ``gate_up_box``) of the configs that ``default_config`` returns. On since H200
# run 9 (benchmarks/NOTES.md): fwd+bwd Qwen3 1.16 -> 1.22x the unfused path, Qwen3 with empty experts
# 1.05 -> 1.14x, DeepSeek-V3 1.01 -> 1.05x; FC1 84 -> 89% of the dense peak. Tests flip it to cover
# the one-program-per-tile kernel as well.
PERSISTENT_DEFAULT = True
# Persistent programs under the interpreter (no SMs to count): few, so each one loops over many tiles.
INTERPRET_PROGRAMS = 3


def _tma_allowed(a: torch.Tensor, b: torch.Tensor, b_kmajor: bool, k: int, block_k: int) -> bool:
    """TMA needs 16-byte aligned bases and row strides and unit inner strides. When B is read
    row-major ([E * K, N] view), a K tail would spill into the next expert's rows, so K must be a
    whole number of blocks there (when B is K-major the K tail is the tensor edge: zero-filled)."""
    elt = a.element_size()
    return (
        a.stride(1) == 1 and b.is_contiguous() and a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0
        and (a.stride(0) * elt) % 16 == 0 and (b.shape[2] * elt) % 16 == 0
        and (b_kmajor or k % block_k == 0)
    )


def default_config(kind: str, n: int, k: int) -> GemmConfig:
    """Block sizes for sm_90, from the H200 measurements in ``benchmarks/NOTES.md`` (wgmma wants
    BM=128, BK=64, 8 warps). ``kind``: "fc1", "fc2", "dact" (FC2 dgrad + dGLU) or "dgrad" (FC1 dgrad).
    The interpreter gets small tiles. ``persistent`` (with ``gate_up_box``) is ``PERSISTENT_DEFAULT``."""
    return replace(_block_config(kind, n, k), persistent=PERSISTENT_DEFAULT, gate_up_box=PERSISTENT_DEFAULT)


def _block_config(kind: str, n: int, k: int) -> GemmConfig:
    if interpreting():
        return INTERPRET_CONFIG
    if kind == "fc1":
        return GemmConfig(block_n=128, num_stages=4)  # two 128-wide accumulators = a 256-wide tile
    if kind == "dact":
        return GemmConfig(block_n=128, num_stages=4)  # epilogue split in halves (see SPLIT_EPILOGUE)
    if kind == "fc2":
        return GemmConfig(block_n=256, num_stages=4 if k < 1536 else 3)  # short K: deeper pipeline pays
    if kind == "dgrad":
        return GemmConfig(block_n=256, num_stages=4)
    raise ValueError(f"kind: expected 'fc1', 'fc2', 'dact' or 'dgrad', got {kind!r}")


@triton.jit
def grouped_gemm_kernel(
    a_src, stride_am, stride_ak,
    b_src, stride_be, stride_bk, stride_bn, b_up_offset, B_ROWS,
    c_ptr, stride_cm, c_up_offset,
    h_ptr, stride_hm, h_up_offset,
    bias_ptr, stride_bias_e, bias_up_offset,
    probs_ptr, dprob_ptr, stride_dprob_part, scale_ptr,
    sched_ptr, epi_store_args,
    T, N, K, alpha, limit, MAX_M_TILES, NUM_GROUPS, NUM_PROGRAMS,
    MODE: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_PROBS: tl.constexpr, WRITE_DPROB: tl.constexpr, DPROB_PARTIALS: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, N_VEC8: tl.constexpr, USE_TMA: tl.constexpr,
    B_KMAJOR: tl.constexpr, SPLIT_EPILOGUE: tl.constexpr, UPCAST: tl.constexpr, PERSISTENT: tl.constexpr,
    FLATTEN: tl.constexpr, GATE_UP_BOX: tl.constexpr, EPI_STORE: tl.constexpr, EPI_STORE_CONSTS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BN)
    if PERSISTENT:
        # NUM_PROGRAMS programs walk the tile ids in steps of NUM_PROGRAMS, in two passes: the experts'
        # tiles, whose K loops all have cdiv(K, BK) steps (a bound the same for every tile, so that the
        # loop nest can be flattened and the pipeliner can overlap a tile's epilogue with the next
        # tile's loads), then the padding group's tiles (no K loop: zeros written). Both passes end at
        # the schedule's real tile counts, so no tile is skipped inside a loop (an `if` around the K
        # loop would stop the flattening). Padding ids continue the expert ids' round-robin.
        expert_tiles = tl.load(sched_ptr + 0 * NUM_GROUPS + NUM_GROUPS - 1)  # tile_start of padding
        total_tiles = tl.load(sched_ptr + 1 * NUM_GROUPS + NUM_GROUPS - 1)
        expert_ids = expert_tiles * num_pid_n
        for phase in tl.static_range(2):
            if phase == 0:
                first_id, end_id, first_m, band_tiles = pid, expert_ids, 0, expert_tiles
            else:
                first_id = expert_ids + (pid + NUM_PROGRAMS - expert_ids % NUM_PROGRAMS) % NUM_PROGRAMS
                end_id, first_m, band_tiles = total_tiles * num_pid_n, expert_tiles, total_tiles - expert_tiles
            for tile_id in tl.range(first_id, end_id, NUM_PROGRAMS, flatten=FLATTEN and phase == 0):
                pid_m, pid_n = swizzle(tile_id - first_m * num_pid_n, band_tiles, num_pid_n, GROUP_M)
                _gemm_tile(
                    first_m + pid_m, pid_n, a_src, stride_am, stride_ak, b_src, stride_be, stride_bk, stride_bn,
                    b_up_offset, B_ROWS, c_ptr, stride_cm, c_up_offset, h_ptr, stride_hm, h_up_offset, bias_ptr,
                    stride_bias_e, bias_up_offset, probs_ptr, dprob_ptr, stride_dprob_part, scale_ptr, sched_ptr,
                    epi_store_args, T, N, K, alpha, limit, NUM_GROUPS, MODE, ACT, GATED, HAS_BIAS, HAS_PROBS,
                    WRITE_DPROB, DPROB_PARTIALS, EVEN_K, EVEN_N, N_VEC8, USE_TMA, B_KMAJOR, SPLIT_EPILOGUE, UPCAST,
                    phase == 0, GATE_UP_BOX, EPI_STORE, EPI_STORE_CONSTS, HAS_SCALE, BM, BN, BK)
    else:
        # one program per tile of the worst-case grid: GROUP_M swizzle for L2 reuse of B; programs past
        # the last tile exit at once
        pid_m, pid_n = swizzle(pid, MAX_M_TILES, num_pid_n, GROUP_M)
        total_tiles = tl.load(sched_ptr + 1 * NUM_GROUPS + NUM_GROUPS - 1)
        if pid_m >= total_tiles:
            return
        _gemm_tile(
            pid_m, pid_n, a_src, stride_am, stride_ak, b_src, stride_be, stride_bk, stride_bn, b_up_offset, B_ROWS,
            c_ptr, stride_cm, c_up_offset, h_ptr, stride_hm, h_up_offset, bias_ptr, stride_bias_e, bias_up_offset,
            probs_ptr, dprob_ptr, stride_dprob_part, scale_ptr, sched_ptr, epi_store_args, T, N, K, alpha, limit,
            NUM_GROUPS, MODE, ACT, GATED, HAS_BIAS, HAS_PROBS, WRITE_DPROB, DPROB_PARTIALS, EVEN_K, EVEN_N, N_VEC8,
            USE_TMA, B_KMAJOR, SPLIT_EPILOGUE, UPCAST, False, GATE_UP_BOX, EPI_STORE, EPI_STORE_CONSTS, HAS_SCALE, BM,
            BN, BK)


@triton.jit
def _gemm_tile(
    pid_m, pid_n,
    a_src, stride_am, stride_ak,
    b_src, stride_be, stride_bk, stride_bn, b_up_offset, B_ROWS,
    c_ptr, stride_cm, c_up_offset,
    h_ptr, stride_hm, h_up_offset,
    bias_ptr, stride_bias_e, bias_up_offset,
    probs_ptr, dprob_ptr, stride_dprob_part, scale_ptr,
    sched_ptr, epi_store_args,
    T, N, K, alpha, limit, NUM_GROUPS,
    MODE: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_PROBS: tl.constexpr, WRITE_DPROB: tl.constexpr, DPROB_PARTIALS: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, N_VEC8: tl.constexpr, USE_TMA: tl.constexpr,
    B_KMAJOR: tl.constexpr, SPLIT_EPILOGUE: tl.constexpr, UPCAST: tl.constexpr, EXPERT_TILE: tl.constexpr,
    GATE_UP_BOX: tl.constexpr, EPI_STORE: tl.constexpr, EPI_STORE_CONSTS: tl.constexpr, HAS_SCALE: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    """One output tile: (group, row block) from the schedule, the K loop, the epilogue of ``MODE``.
    ``EXPERT_TILE``: the caller guarantees an expert's tile, so the K loop runs its full, tile-invariant
    length (else the padding group's tiles get an empty K loop here)."""
    group = tl.load(sched_ptr + 4 * NUM_GROUPS + pid_m)
    is_padding = group == NUM_GROUPS - 1
    expert = tl.minimum(group, NUM_GROUPS - 2)
    tile_start = tl.load(sched_ptr + 0 * NUM_GROUPS + group)
    row_start = tl.load(sched_ptr + 2 * NUM_GROUPS + group)
    row_end = tl.load(sched_ptr + 3 * NUM_GROUPS + group)

    rows = row_start + (pid_m - tile_start) * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    row_ok = rows < row_end
    col_ok = cols < N
    offs_k = tl.arange(0, BK)
    if USE_TMA:
        # TMA: A is a [T, K] descriptor, B a 2D view of the weight ([E * rows, cols]); out-of-tensor
        # boxes are zero-filled; rows/columns of a neighbouring expert only reach masked outputs.
        a_row = row_start + (pid_m - tile_start) * BM
        if B_KMAJOR:
            b_row = expert * B_ROWS + pid_n * BN
        else:
            b_row = expert * K
    else:
        rows_in = tl.minimum(rows, T - 1).to(tl.int64)
        # keep column indices provably contiguous so that B loads vectorise (and so pipeline)
        if EVEN_N:
            cols_in = cols.to(tl.int64)
        elif N_VEC8:  # wraps at a multiple of 8: every aligned 8-vector stays contiguous
            cols_in = tl.max_contiguous(tl.multiple_of(cols % N, 8), 8).to(tl.int64)
        else:
            cols_in = tl.minimum(cols, N - 1).to(tl.int64)
        a_ptrs = a_src + rows_in[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = b_src + expert.to(tl.int64) * stride_be + offs_k[:, None] * stride_bk + cols_in[None, :] * stride_bn

    # with GATE_UP_BOX, acc holds the gate columns, then the up columns
    acc = tl.zeros((BM, 2 * BN if GATE_UP_BOX else BN), dtype=tl.float32)
    if GATED and MODE == 1 and not GATE_UP_BOX:
        acc_up = tl.zeros((BM, BN), dtype=tl.float32)
    if EXPERT_TILE:
        k_tiles = tl.cdiv(K, BK)
    else:
        k_tiles = tl.where(is_padding, 0, tl.cdiv(K, BK))
    for kt in range(0, k_tiles):
        if USE_TMA:
            k0 = kt * BK
            a = a_src.load([a_row, k0])
            if GATE_UP_BOX:
                b = tl.reshape(b_src.load([expert * 2, pid_n * BN, k0]), (2 * BN, BK)).T
            elif B_KMAJOR:
                b = b_src.load([b_row, k0]).T
            else:
                b = b_src.load([b_row + k0, pid_n * BN])
        elif EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - kt * BK
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)
        if GATED and MODE == 1 and not GATE_UP_BOX:
            if USE_TMA:
                b_up = b_src.load([b_row + b_up_offset, k0]).T
            elif EVEN_K:
                b_up = tl.load(b_ptrs + b_up_offset)
            else:
                b_up = tl.load(b_ptrs + b_up_offset, mask=offs_k[:, None] < k_left, other=0.0)
            if UPCAST:
                b_up = b_up.to(tl.float32)
            acc_up = tl.dot(a, b_up, acc_up)
        if not USE_TMA:
            a_ptrs += BK * stride_ak
            b_ptrs += BK * stride_bk
    if GATE_UP_BOX:
        acc, acc_up = column_halves(acc, BM, BN)
    if HAS_SCALE:  # one FP32 factor per group on the sums (NVFP4's two tensor scales), before any epilogue
        factor = tl.load(scale_ptr + group)
        acc = acc * factor
        if GATED and MODE == 1:
            acc_up = acc_up * factor

    # --- epilogue, FP32
    out_mask = row_ok[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)
    bias_mask = col_ok & (group < NUM_GROUPS - 1)
    c_ptrs = c_ptr + rows64[:, None] * stride_cm + cols[None, :]
    if MODE == 0:
        if HAS_BIAS:
            bias = tl.load(bias_ptr + expert * stride_bias_e + cols, mask=bias_mask, other=0.0)
            acc += bias.to(tl.float32)[None, :]
        tl.store(c_ptrs, to_output(acc, c_ptr.dtype.element_ty, UPCAST), mask=out_mask)
    elif MODE == 1:
        if GATED:
            fc1_epilogue(acc, acc_up, rows64, row_ok, cols, col_ok, bias_mask, bias_ptr + expert * stride_bias_e,
                         bias_up_offset, h_ptr, stride_hm, h_up_offset, c_ptr, stride_cm, probs_ptr, is_padding,
                         pid_m, epi_store_args, alpha, limit, ACT, GATED, HAS_BIAS, HAS_PROBS, UPCAST, EPI_STORE,
                         EPI_STORE_CONSTS)
        else:
            fc1_epilogue(acc, acc, rows64, row_ok, cols, col_ok, bias_mask, bias_ptr + expert * stride_bias_e,
                         bias_up_offset, h_ptr, stride_hm, h_up_offset, c_ptr, stride_cm, probs_ptr, is_padding,
                         pid_m, epi_store_args, alpha, limit, ACT, GATED, HAS_BIAS, HAS_PROBS, UPCAST, EPI_STORE,
                         EPI_STORE_CONSTS)
    else:
        # acc = da, the gradient of act(h) * p. The epilogue runs on two column halves of the tile
        # in turn: with BN=128 the whole tile at once (da, gate, up and their grads live together)
        # spilled ~500-800 registers per thread; halves keep the wgmma tile wide and spill little.
        if HAS_PROBS:
            p = tl.load(probs_ptr + rows64, mask=row_ok, other=0.0).to(tl.float32)
        else:
            p = tl.full((BM,), 1.0, tl.float32)
        if SPLIT_EPILOGUE:
            acc_lo, acc_hi = column_halves(acc, BM, BN // 2)
            cols_lo = pid_n * BN + tl.arange(0, BN // 2)
            part = dact_epilogue(acc_lo, rows64, row_ok, cols_lo, N, p, h_ptr, stride_hm, h_up_offset, c_ptr,
                                 stride_cm, c_up_offset, is_padding, pid_m, epi_store_args, alpha, limit, ACT, GATED,
                                 UPCAST, EPI_STORE, EPI_STORE_CONSTS)
            part += dact_epilogue(acc_hi, rows64, row_ok, cols_lo + BN // 2, N, p, h_ptr, stride_hm, h_up_offset,
                                  c_ptr, stride_cm, c_up_offset, is_padding, pid_m, epi_store_args, alpha, limit, ACT,
                                  GATED, UPCAST, EPI_STORE, EPI_STORE_CONSTS)
        else:
            part = dact_epilogue(acc, rows64, row_ok, cols, N, p, h_ptr, stride_hm, h_up_offset, c_ptr, stride_cm,
                                 c_up_offset, is_padding, pid_m, epi_store_args, alpha, limit, ACT, GATED, UPCAST,
                                 EPI_STORE, EPI_STORE_CONSTS)
        if WRITE_DPROB:  # probs may scale the activation without needing a gradient
            if DPROB_PARTIALS:
                tl.store(dprob_ptr + pid_n * stride_dprob_part + rows64, part, mask=row_ok)
            else:
                tl.atomic_add(dprob_ptr + rows64, part, mask=row_ok)


@triton.jit
def fc1_epilogue(acc, acc_up, rows64, row_ok, cols, col_ok, bias_mask, bias_row_ptr, bias_up_offset, h_ptr, stride_hm,
                 h_up_offset, c_ptr, stride_cm, probs_ptr, is_padding, tile, store_args, alpha, limit,
                 ACT: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_PROBS: tl.constexpr,
                 UPCAST: tl.constexpr, STORE: tl.constexpr, STORE_CONSTS: tl.constexpr):
    """FC1 epilogue of FP32 ``acc`` (gate) / ``acc_up``: h = acc + b1 saved, a = act(h) * p (zeros for
    the padding group) stored by ``STORE`` (:func:`store_activation`, or a recipe's quantizing store).
    ``bias_row_ptr``: the expert's b1 row (``bias_mask`` False for padding); ``tile``: the schedule's M tile."""
    out_mask = row_ok[:, None] & col_ok[None, :]
    h_ptrs = h_ptr + rows64[:, None] * stride_hm + cols[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_row_ptr + cols, mask=bias_mask, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(bias_row_ptr + bias_up_offset + cols, mask=bias_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(h_ptrs, to_output(acc, h_ptr.dtype.element_ty, UPCAST), mask=out_mask)
    if GATED:
        tl.store(h_ptrs + h_up_offset, to_output(acc_up, h_ptr.dtype.element_ty, UPCAST), mask=out_mask)
        value = act_forward(acc, acc_up, alpha, limit, ACT)
    else:
        value = act_forward(acc, acc, alpha, limit, ACT)
    if HAS_PROBS:
        p = tl.load(probs_ptr + rows64, mask=row_ok, other=0.0).to(tl.float32)
        value = value * p[:, None]
    value = tl.where(is_padding, 0.0, value)
    STORE(value, rows64, row_ok, cols, col_ok, tile, c_ptr, stride_cm, store_args, STORE_CONSTS, UPCAST)


@triton.jit
def store_activation(value, rows64, row_ok, cols, col_ok, tile, c_ptr, stride_cm, args, CONSTS: tl.constexpr,
                     UPCAST: tl.constexpr):
    """The FC1 epilogue's store of ``a`` [rows, cols] in ``c``'s dtype (``args``, ``CONSTS``, ``tile``
    unused: the signature of FC1's ``EPI_STORE``)."""
    tl.store(c_ptr + rows64[:, None] * stride_cm + cols[None, :], to_output(value, c_ptr.dtype.element_ty, UPCAST),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def column_halves(x, ROWS: tl.constexpr, HALF: tl.constexpr):
    """x[:, :HALF], x[:, HALF:] of a [ROWS, 2 * HALF] tile, in registers."""
    return tl.split(tl.permute(tl.reshape(x, (ROWS, 2, HALF)), (0, 2, 1)))


@triton.jit
def dact_epilogue(da, rows64, row_ok, cols, N, p, h_ptr, stride_hm, h_up_offset, c_ptr, stride_cm, c_up_offset,
                  is_padding, tile, store_args, alpha, limit, ACT: tl.constexpr, GATED: tl.constexpr,
                  UPCAST: tl.constexpr, STORE: tl.constexpr, STORE_CONSTS: tl.constexpr):
    """dh = d act(h) * (da * p) for one block of columns, stored by ``STORE`` (:func:`store_gate_up_grads`,
    or a recipe's quantizing store); returns the row sums of da * act(h). ``tile``: the schedule's M tile."""
    mask = row_ok[:, None] & (cols < N)[None, :]
    h_ptrs = h_ptr + rows64[:, None] * stride_hm + cols[None, :]
    g, u = load_gate_up(h_ptrs, h_up_offset, mask, GATED)
    dg, du, value = act_backward(g, u, da * p[:, None], alpha, limit, ACT)
    STORE(dg, du, rows64, row_ok, cols, mask, is_padding, tile, c_ptr, stride_cm, c_up_offset, store_args,
          STORE_CONSTS, GATED, UPCAST)
    return tl.sum(tl.where(mask, da * value, 0.0), axis=1)


@triton.jit
def store_gate_up_grads(dg, du, rows64, row_ok, cols, mask, is_padding, tile, c_ptr, stride_cm, c_up_offset, args,
                        CONSTS: tl.constexpr, GATED: tl.constexpr, UPCAST: tl.constexpr):
    """The dGLU epilogue's store of dh's gate and up blocks in ``c``'s dtype, the up half at ``c_up_offset``
    (``row_ok``, ``is_padding``, ``tile``, ``args``, ``CONSTS`` unused: the signature of the dGLU's
    ``EPI_STORE``; padding rows hold zeros here as their da is zero)."""
    c_ptrs = c_ptr + rows64[:, None] * stride_cm + cols[None, :]
    tl.store(c_ptrs, to_output(dg, c_ptr.dtype.element_ty, UPCAST), mask=mask)
    if GATED:
        tl.store(c_ptrs + c_up_offset, to_output(du, c_ptr.dtype.element_ty, UPCAST), mask=mask)


def persistent_programs(device: torch.device, cfg: GemmConfig) -> int:
    """How many programs a persistent launch starts: ``programs_per_sm`` per SM of the device."""
    if cfg.programs_per_sm < 1:
        raise ValueError(f"GemmConfig.programs_per_sm: expected a positive count, got {cfg.programs_per_sm}")
    if device.type != "cuda":
        return INTERPRET_PROGRAMS
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device()) * cfg.programs_per_sm


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def launch(kind: str, a: torch.Tensor, b: torch.Tensor, b_strides: tuple, n: int, k: int, c: torch.Tensor,
           tokens_per_expert: torch.Tensor, *, config: Optional[GemmConfig] = None, schedules: Optional[dict] = None,
           **epilogue):
    """Run one grouped GEMM: rows of ``a`` [T, k] grouped by ``tokens_per_expert``, ``B_e`` [k, n]
    read from ``b`` at ``e * b_strides[0] + k * b_strides[1] + n * b_strides[2]``; ``epilogue``: the
    keywords of :func:`launch_scheduled` (bias, activation, h, probs, dprob, ...).

    ``dprob`` is either ``[T]`` FP32 zeros (atomic row reduction) or ``[cdiv(n, BN), T]`` FP32 (one
    partial per N tile, summed later in a fixed order: the deterministic path). ``schedules`` is an
    optional dict ``block_m -> schedule`` shared by the launches of one call."""
    cfg = config or default_config(kind, n, k)
    if schedules is None:
        schedules = {}
    if cfg.block_m not in schedules:
        schedules[cfg.block_m] = build_schedule(tokens_per_expert, a.shape[0], cfg.block_m)
    return launch_scheduled(kind, a, b, b_strides, n, k, c, schedules[cfg.block_m], tokens_per_expert.shape[0],
                            cfg, **epilogue)


def launch_scheduled(kind: str, a: torch.Tensor, b: torch.Tensor, b_strides: tuple, n: int, k: int, c: torch.Tensor,
                     schedule: torch.Tensor, num_experts: int, cfg: GemmConfig, *, b_up_rows: int = 0,
                     c_up_offset: int = 0, h: Optional[torch.Tensor] = None, h_up_offset: int = 0,
                     bias: Optional[torch.Tensor] = None, bias_up_offset: int = 0,
                     probs: Optional[torch.Tensor] = None, dprob: Optional[torch.Tensor] = None,
                     activation: str = "swiglu", alpha: float = 1.702, limit: float = 7.0, gated: bool = False,
                     epilogue_store: Optional[tuple] = None, scale: Optional[torch.Tensor] = None):
    """:func:`launch` on a ``schedule`` already built for ``cfg.block_m``-row tiles of ``num_experts``
    experts (``schedule.build_schedule``): what a caller holding the schedule, not the counts, runs
    (the block-scaled recipes' GEMMs on BF16 values). ``epilogue_store``: the store of the epilogue's
    output as ``(jit function, its argument tuple, its constexpr tuple)``, FC1's ``a`` with
    :func:`store_activation`'s signature, the dGLU's ``dh`` with :func:`store_gate_up_grads`' (``c`` is
    then passed to it, not written by the kernel); None: those two, in ``c``'s dtype. ``scale``: FP32 ``[E +
    1]``, a factor per group multiplying the FP32 sums before the epilogue (NVFP4's tensor scales)."""
    mode = {"fc1": MODE_ACT_FWD, "fc2": MODE_PLAIN, "dact": MODE_ACT_BWD, "dgrad": MODE_PLAIN}[kind]
    num_rows = a.shape[0]
    num_groups = num_experts + 1
    m_tiles = max_m_tiles(num_rows, num_experts, cfg.block_m)
    num_tiles = m_tiles * triton.cdiv(n, cfg.block_n)  # worst case: the schedule holds the real count
    num_programs = min(num_tiles, persistent_programs(a.device, cfg)) if cfg.persistent else num_tiles
    dummy = c
    b_kmajor = b_strides[1] == 1 and b_strides[2] != 1
    use_tma = cfg.use_tma and USE_TMA_DEFAULT and _tma_allowed(a, b, b_kmajor, k, cfg.block_k)
    gate_up_box = (cfg.gate_up_box and use_tma and gated and mode == MODE_ACT_FWD and b_kmajor
                   and b.shape[1] == 2 * b_up_rows)
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        b_rows = b.shape[1]
        a_src = TensorDescriptor(a, [num_rows, k], [a.stride(0), 1], [cfg.block_m, cfg.block_k])
        b_block = [cfg.block_n, cfg.block_k] if b_kmajor else [cfg.block_k, cfg.block_n]
        if gate_up_box:  # [E * 2, F, K] view: each expert's gate rows, then its up rows; F's tail zero-filled
            b_src = TensorDescriptor(b, [b.shape[0] * 2, b_up_rows, k], [b_up_rows * k, k, 1],
                                     [2, cfg.block_n, cfg.block_k])
        else:
            b_src = TensorDescriptor(b, [b.shape[0] * b_rows, b.shape[2]], [b.shape[2], 1], b_block)
        b_up_offset = b_up_rows
    else:
        a_src, b_src, b_rows = a, b, 0
        b_up_offset = b_up_rows * b_strides[2]
    default_store = store_gate_up_grads if mode == MODE_ACT_BWD else store_activation
    store_fn, store_args, store_consts = epilogue_store or (default_store, (), ())
    return grouped_gemm_kernel[(num_programs,)](
        a_src, a.stride(0), a.stride(1),
        b_src, b_strides[0], b_strides[1], b_strides[2], b_up_offset, b_rows,
        c, c.stride(0), c_up_offset,
        h if h is not None else dummy, h.stride(0) if h is not None else 0, h_up_offset,
        bias if bias is not None else dummy, bias.stride(0) if bias is not None else 0, bias_up_offset,
        probs if probs is not None else dummy,
        dprob if dprob is not None else dummy,
        dprob.stride(0) if (dprob is not None and dprob.dim() == 2) else 0,
        scale if scale is not None else dummy,
        schedule, store_args,
        num_rows, n, k, float(alpha), float(limit), m_tiles, num_groups, num_programs if cfg.persistent else 0,
        MODE=mode, ACT=ACT_IDS[activation], GATED=gated,
        HAS_BIAS=bias is not None, HAS_PROBS=probs is not None, WRITE_DPROB=dprob is not None,
        DPROB_PARTIALS=dprob is not None and dprob.dim() == 2,
        EVEN_K=k % cfg.block_k == 0, EVEN_N=n % cfg.block_n == 0, N_VEC8=n % 8 == 0, USE_TMA=use_tma,
        B_KMAJOR=b_kmajor, SPLIT_EPILOGUE=mode == MODE_ACT_BWD and cfg.block_n >= 32, UPCAST=interpreting(),
        PERSISTENT=cfg.persistent, FLATTEN=cfg.flatten, GATE_UP_BOX=gate_up_box, EPI_STORE=store_fn,
        EPI_STORE_CONSTS=store_consts, HAS_SCALE=scale is not None,
        BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


# --- the four GEMMs of the expert MLP, with their operand layouts spelled out -------------------

def fc1_forward(x, w1, tokens_per_expert, h, a, *, activation, alpha, limit, gated, b1=None, probs=None,
                config=None, schedules=None):
    """h = x @ w1[e]^T + b1[e] (saved for backward), a = act(h) * p. ``B_e[k, n] = w1[e, n, k]``."""
    ffn = a.shape[1]
    return launch("fc1", x, w1, (w1.stride(0), w1.stride(2), w1.stride(1)), ffn, x.shape[1], a,
           tokens_per_expert, b_up_rows=ffn, h=h, h_up_offset=ffn, bias=b1,
           bias_up_offset=ffn, probs=probs, activation=activation, alpha=alpha, limit=limit, gated=gated,
           config=config, schedules=schedules)


def fc2_forward(a, w2, tokens_per_expert, y, *, b2=None, config=None, schedules=None):
    """y = a @ w2[e]^T + b2[e]. ``B_e[k, n] = w2[e, n, k]``."""
    return launch("fc2", a, w2, (w2.stride(0), w2.stride(2), w2.stride(1)), w2.shape[1], a.shape[1], y,
           tokens_per_expert, bias=b2, config=config, schedules=schedules)


def fc2_dgrad_dact(dy, w2, tokens_per_expert, h, dh, *, activation, alpha, limit, gated, probs=None,
                   dprob=None, config=None, schedules=None):
    """da = dy @ w2[e]; dh = d act(h) * (da * p); dprob = sum_n da * act(h). ``B_e[k, n] = w2[e, k, n]``."""
    ffn = w2.shape[2]
    return launch("dact", dy, w2, (w2.stride(0), w2.stride(1), w2.stride(2)), ffn, dy.shape[1], dh,
           tokens_per_expert, c_up_offset=ffn, h=h, h_up_offset=ffn, probs=probs, dprob=dprob,
           activation=activation, alpha=alpha, limit=limit, gated=gated, config=config, schedules=schedules)


def fc1_dgrad(dh, w1, tokens_per_expert, dx, *, config=None, schedules=None):
    """dx = dh @ w1[e]. ``B_e[k, n] = w1[e, k, n]``."""
    return launch("dgrad", dh, w1, (w1.stride(0), w1.stride(1), w1.stride(2)), w1.shape[2], dh.shape[1], dx,
           tokens_per_expert, config=config, schedules=schedules)
