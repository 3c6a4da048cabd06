"""The expert MLP's activation and its gradient as passes of their own over FC1's output ``h``, for
hidden / FFN sizes that the block-scaled GEMMs cannot tile (:mod:`.padded`): there FC1 runs as a
plain GEMM over all of w1's rows, so ``h`` holds the gate half in columns ``[0, F)`` and the up half
in ``[F, 2F)`` (w1's own row order, however F falls against the 128-wide tiles), and these passes
pair column ``j`` with column ``F + j`` by plain loads.

- :func:`glu_forward`: ``a = act(h) * p`` in FP32, ``[T, width]`` (width >= F; zeros past F and on
  the padding rows), the value the FC1 epilogues quantize.
- :func:`glu_backward`: ``dh = d act(h) * (da * p)`` in FP32 in h's own layout ``[T, width]`` (gate
  gradients, then up gradients; zeros past them and on the padding rows), and the per-tile row sums
  of ``da * act(h)`` for the router probabilities' gradient.

The math is :mod:`.act_math`'s, the same device functions the fused epilogues call, so ``a`` and
``dh`` are the FP32 values those epilogues quantize. Every element of the outputs is written (no
memset needed). Programs walk the tiles of the device schedule (the padding group included), so
nothing is read on the host.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .act_math import ACT_IDS, act_backward, act_forward, load_gate_up
from .schedule import max_m_tiles, tile_rows, total_tiles

BLOCK_M = 128  # the schedule's M tile
BLOCK_N = 64
# the backward pass holds gate, up, da and both gradients of each unit: 64 units per program spilled
# 328 bytes (offline sm_90a build, 8 warps)
BACKWARD_BLOCK_N = 32
NUM_WARPS = 8


@triton.jit
def program_rows(sched_ptr, tile, NUM_GROUPS, BM: tl.constexpr):
    """M tile ``tile`` of the schedule: its first row and rows (64-bit), which of them it holds
    (``in_tile``) and which of those carry routed tokens (``live``: not the padding group's). Also
    the row pass of :mod:`.fp8_block.dglu_rows`."""
    group, row0, row_end = tile_rows(sched_ptr, tile, BM, NUM_GROUPS)
    rows = row0 + tl.arange(0, BM)
    in_tile = rows < row_end
    return row0.to(tl.int64), rows.to(tl.int64), in_tile, in_tile & (group < NUM_GROUPS - 1)


@triton.jit
def router_probs(probs_ptr, rows, row_ok, HAS_PROBS: tl.constexpr, BM: tl.constexpr):
    """The router probabilities of ``rows`` in FP32 (ones without them)."""
    if HAS_PROBS:
        return tl.load(probs_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    return tl.full((BM,), 1.0, tl.float32)


@triton.jit
def glu_forward_kernel(h_ptr, stride_hm, probs_ptr, a_ptr, stride_am, sched_ptr, F, alpha, limit,
                       NUM_GROUPS, ACT: tl.constexpr, GATED: tl.constexpr, HAS_PROBS: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr):
    """One program per (schedule M tile, ``BN`` columns of ``a``)."""
    if tl.program_id(0) >= total_tiles(sched_ptr, NUM_GROUPS):
        return
    _, rows, in_tile, live = program_rows(sched_ptr, tl.program_id(0), NUM_GROUPS, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    valid = live[:, None] & (cols < F)[None, :]
    h_ptrs = h_ptr + rows[:, None] * stride_hm + cols[None, :]
    g, u = load_gate_up(h_ptrs, F, valid, GATED)
    p = router_probs(probs_ptr, rows, live, HAS_PROBS, BM)
    value = tl.where(valid, act_forward(g, u, alpha, limit, ACT) * p[:, None], 0.0)
    tl.store(a_ptr + rows[:, None] * stride_am + cols[None, :], value, mask=in_tile[:, None])


@triton.jit
def glu_backward_kernel(da_ptr, stride_dam, h_ptr, stride_hm, probs_ptr, dh_ptr, stride_dhm, dprob_ptr,
                        stride_dprob_part, sched_ptr, F, N1, WIDTH, alpha, limit, NUM_GROUPS, ACT: tl.constexpr,
                        GATED: tl.constexpr, HAS_PROBS: tl.constexpr, WRITE_DPROB: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr):
    """One program per (schedule M tile, ``BN`` units), the units' inputs read once: it writes the gate
    gradients at columns ``unit`` of ``dh`` and (gated) the up gradients at ``F + unit``, wherever F
    falls against the tiles. The programs past ``cdiv(F, BN)`` write the zeros of columns
    ``[N1, WIDTH)`` (N1 = 2F gated, else F)."""
    if tl.program_id(0) >= total_tiles(sched_ptr, NUM_GROUPS):
        return
    _, rows, in_tile, live = program_rows(sched_ptr, tl.program_id(0), NUM_GROUPS, BM)
    unit_blocks = tl.cdiv(F, BN)
    if tl.program_id(1) >= unit_blocks:
        cols = N1 + (tl.program_id(1) - unit_blocks) * BN + tl.arange(0, BN)
        tl.store(dh_ptr + rows[:, None] * stride_dhm + cols[None, :], tl.zeros((BM, BN), tl.float32),
                 mask=in_tile[:, None] & (cols < WIDTH)[None, :])
        return
    units = tl.program_id(1) * BN + tl.arange(0, BN)
    unit_ok = units < F
    valid = live[:, None] & unit_ok[None, :]
    da = tl.load(da_ptr + rows[:, None] * stride_dam + units[None, :], mask=valid, other=0.0).to(tl.float32)
    g, u = load_gate_up(h_ptr + rows[:, None] * stride_hm + units[None, :], F, valid, GATED)
    p = router_probs(probs_ptr, rows, live, HAS_PROBS, BM)
    dg, du, value = act_backward(g, u, da * p[:, None], alpha, limit, ACT)
    out = dh_ptr + rows[:, None] * stride_dhm + units[None, :]
    stored = in_tile[:, None] & unit_ok[None, :]
    tl.store(out, tl.where(valid, dg, 0.0), mask=stored)
    if GATED:
        tl.store(out + F, tl.where(valid, du, 0.0), mask=stored)
    if WRITE_DPROB:
        part = tl.sum(tl.where(valid, da * value, 0.0), axis=1)
        tl.store(dprob_ptr + tl.program_id(1) * stride_dprob_part + rows, part, mask=in_tile)


def _grid(num_rows: int, num_experts: int, width: int) -> tuple:
    return (max_m_tiles(num_rows, num_experts, BLOCK_M), triton.cdiv(width, BLOCK_N))


def glu_forward(h: torch.Tensor, ffn: int, width: int, schedule: torch.Tensor, num_experts: int,
                probs: Optional[torch.Tensor], act: dict, alloc=torch.empty) -> torch.Tensor:
    """``a`` FP32 ``[T, width]`` from ``h`` (gate columns ``[0, ffn)``, up columns ``[ffn, 2 ffn)`` if
    ``act['gated']``); ``schedule`` from ``build_schedule(counts, T, 128)``; ``act`` an activation's
    ``launch_args``."""
    num_rows = h.shape[0]
    a = alloc((num_rows, width), device=h.device, dtype=torch.float32)
    if num_rows:
        glu_forward_kernel[_grid(num_rows, num_experts, width)](
            h, h.stride(0), probs if probs is not None else h, a, a.stride(0), schedule, ffn,
            float(act["alpha"]), float(act["limit"]), num_experts + 1, ACT=ACT_IDS[act["activation"]],
            GATED=bool(act["gated"]), HAS_PROBS=probs is not None, BM=BLOCK_M, BN=BLOCK_N, num_warps=NUM_WARPS)
    return a


def glu_backward(da: torch.Tensor, h: torch.Tensor, ffn: int, schedule: torch.Tensor, num_experts: int,
                 probs: Optional[torch.Tensor], act: dict, want_dprob: bool, alloc=torch.empty) -> tuple:
    """``(dh, dprob)``: ``dh`` FP32 in ``h``'s layout and width (``da`` ``[T, >= ffn]``: the gradient of
    ``a``'s columns); ``dprob`` ``[T]`` FP32 (summed over column tiles in a fixed order) if
    ``want_dprob``, else None."""
    num_rows, width = h.shape
    n1 = 2 * ffn if act["gated"] else ffn
    dh = alloc((num_rows, width), device=h.device, dtype=torch.float32)
    unit_blocks = triton.cdiv(ffn, BACKWARD_BLOCK_N)
    grid = (max_m_tiles(num_rows, num_experts, BLOCK_M), unit_blocks + triton.cdiv(width - n1, BACKWARD_BLOCK_N))
    parts = alloc((unit_blocks, num_rows), device=h.device, dtype=torch.float32) if want_dprob else None
    if num_rows:
        glu_backward_kernel[grid](
            da, da.stride(0), h, h.stride(0), probs if probs is not None else h, dh, dh.stride(0),
            parts if want_dprob else dh, parts.stride(0) if want_dprob else 0, schedule, ffn, n1, width,
            float(act["alpha"]), float(act["limit"]), num_experts + 1, ACT=ACT_IDS[act["activation"]],
            GATED=bool(act["gated"]), HAS_PROBS=probs is not None, WRITE_DPROB=want_dprob, BM=BLOCK_M,
            BN=BACKWARD_BLOCK_N, num_warps=NUM_WARPS)
    return dh, (parts.sum(0) if want_dprob else None)
