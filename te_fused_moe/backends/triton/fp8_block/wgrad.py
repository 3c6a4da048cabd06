"""FP8 weight gradients: ``dW[e] = G_e^T @ X_e`` reduced over expert ``e``'s tokens, from the
columnwise (transposed) copies of ``G`` [T, N] and ``X`` [T, K]: 1x128 blocks along the tokens that
restart at each expert's first row, one per M tile of the schedule (``block_m = 128``), tile ``t``
in columns ``[128 t, 128 t + 128)`` of ``data_t`` with its scales in ``scale_t[t]`` (zeros past the
expert's last row; layout in :mod:`.quantize`). Every step reduces one token block with the scales
of both operands promoted in FP32: ``acc += dot(g, x^T) * gs[:, None] * xs[None, :]``. Blocks are
whole and aligned, so they load by TMA without masks. Experts with no tokens store zeros.

``db1`` comes from per-tile FP32 column sums of ``dh`` written by the DACT epilogue
(:func:`tile_sums_to_experts`), summed per expert in a fixed order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from ..act_math import to_output
from ..block_scaled_launch import wgrad_operands
from ..grouped_gemm import interpreting, register_cap
from ..schedule import swizzle
from . import gemm as fp8_gemm
from .quantize import BLOCK, QuantizedRows


# Which kernel runs the wgrads: "auto" (the default) = the warp-specialised Gluon kernel of
# :mod:`.wgmma_ws` on sm_90 (each token block's promotion under the next block's wgmma, a producer warp
# loading ahead across tiles, dw tiles stored by TMA under the next tile), this module's Triton kernel
# elsewhere and under the interpreter; "gluon" / "triton" force one. At DSv3 w1, same process: 2.43
# ms with two consumer partitions (run 19e), 2.46 with one (19c), 2.79 without the TMA store, 2.82-2.91
# for the Triton kernel; the Gluon load-cursor wgrad before it took 3.05 (run 17d). ~780 TFLOP/s at
# ~8 token blocks per tile rise only to ~840 at 128 (E=2): the outer-product promotion (two FP32 ops
# per accumulator element per block, plus the column scales from shared memory), not the tile's fill
# and store, keeps it under the plain GEMMs' ~1100.
WGRAD_ENGINE = "auto"
# The Gluon wgrad's consumer partitions: 2 = a warpgroup per half of each 128-row tile, each handing its
# stages back on its own (one partition of both warpgroups waits at a shared barrier every block:
# ncu's leading stall, run 19d). Same process (19e): w1 / w2 2.43 / 1.23 ms at 4 stages, 2.51 / 1.28
# at 5, vs 2.55 / 1.28 for one partition at 5 stages (2.66 at 4, 19c); MLP 11.24 vs 11.46 ms (19f)
WGRAD_CONSUMERS = 2


@dataclass(frozen=True)
class FP8WgradConfig:
    block_n: int = 128
    block_k: int = 128
    group_n: int = 8
    num_warps: int = 8
    num_stages: int = 4
    use_tma: bool = True
    engine: Optional[str] = None  # "auto", "gluon" or "triton"; None = WGRAD_ENGINE
    maxnreg: Optional[int] = None  # Triton kernel: register cap (None: the compiler's choice)
    ctas_per_sm: int = 1  # Gluon kernel: persistent programs per SM
    tma_store: bool = False  # Gluon kernel: dw tiles stored by TMA (where dw is 16-bit and contiguous)
    consumers: int = 1  # Gluon kernel: consumer partitions (2: a warpgroup per half of the tile's rows)


def default_config(gluon: bool = False) -> FP8WgradConfig:
    """Triton: 128x64 tiles at 4 warps (~165 registers, 72 KB of shared memory): three CTAs share an SM,
    so one CTA's FP32 promotion (an outer product of scales per token block) runs under another's
    wgmma. On the H200 at DSv3 shapes: 670-690 TFLOP/s vs ~500 with 128x128 tiles at 8 warps.
    Gluon (warp-specialised): 128x128 tiles on two consumer warpgroups, one CTA per SM, dw stored by
    TMA; 4 stages with two consumer partitions, 5 with one (see ``WGRAD_CONSUMERS``). Other tiles,
    same process (run 19a, one partition, no TMA store): 64x128 on one warpgroup at two CTAs per SM
    1.43 / 2.84 ms (w2 / w1) vs 1.37 / 2.75 for 128x128; 64x64 at three CTAs 1.72 / 3.53."""
    if interpreting():
        return FP8WgradConfig(group_n=2, num_warps=4, num_stages=1)
    if gluon:
        return FP8WgradConfig(block_n=128, block_k=128, num_warps=8, num_stages=4 if WGRAD_CONSUMERS == 2 else 5,
                              ctas_per_sm=1, tma_store=True, consumers=WGRAD_CONSUMERS)
    return FP8WgradConfig(block_n=64, block_k=128, num_warps=4, num_stages=3)


def _on_gluon(cfg: Optional[FP8WgradConfig], g: QuantizedRows, x: QuantizedRows) -> bool:
    """Whether the wgrad runs the Gluon kernel: "auto" where it can, "gluon" or an error."""
    def usable() -> bool:
        from .wgmma_gemm import wgrad_usable

        return g.data_t is not None and x.data_t is not None and wgrad_usable(g.data_t, x.data_t, x.scale_t)

    return fp8_gemm.on_gluon((cfg.engine if cfg is not None else None) or WGRAD_ENGINE, "engine", usable,
                             lambda: "the Gluon FP8 block wgrad needs an sm_90 GPU and the FP8 columnwise copies "
                                     "(data_t) contiguous and 16-byte aligned, x's FP32 scale_t with 16-byte aligned rows")


@triton.jit
def fp8_wgrad_kernel(
    g_src, stride_gn, gs_ptr, stride_gst,
    x_src, stride_xk, xs_ptr, stride_xst,
    dw_ptr, stride_dw_e, stride_dw_n,
    sched_ptr, N, K, NUM_GROUPS,
    USE_TMA: tl.constexpr, UPCAST: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
    GROUP_N: tl.constexpr,
):
    pid = tl.program_id(0)
    expert = tl.program_id(1)
    pid_n, pid_k = swizzle(pid, tl.cdiv(N, BN), tl.cdiv(K, BK), GROUP_N)

    tile_start = tl.load(sched_ptr + 0 * NUM_GROUPS + expert)
    tile_end = tl.load(sched_ptr + 1 * NUM_GROUPS + expert)

    cols_n = pid_n * BN + tl.arange(0, BN)
    cols_k = pid_k * BK + tl.arange(0, BK)
    n_in = tl.minimum(cols_n, N - 1)
    k_in = tl.minimum(cols_k, K - 1)
    if not USE_TMA:
        toks = tl.arange(0, BT)
        g_ptrs = g_src + n_in.to(tl.int64)[:, None] * stride_gn + toks[None, :]
        x_ptrs = x_src + k_in.to(tl.int64)[:, None] * stride_xk + toks[None, :]
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    for t in range(tile_start, tile_end):
        if USE_TMA:
            g = g_src.load([pid_n * BN, t * BT])
            x = x_src.load([pid_k * BK, t * BT])
        else:
            g = tl.load(g_ptrs + t * BT)
            x = tl.load(x_ptrs + t * BT)
        gs = tl.load(gs_ptr + t * stride_gst + n_in)
        xs = tl.load(xs_ptr + t * stride_xst + k_in)
        if UPCAST:
            g = g.to(tl.float32)
            x = x.to(tl.float32)
        acc += tl.dot(g, tl.trans(x)) * (gs[:, None] * xs[None, :])

    mask = (cols_n < N)[:, None] & (cols_k < K)[None, :]
    dw_ptrs = dw_ptr + expert.to(tl.int64) * stride_dw_e + cols_n.to(tl.int64)[:, None] * stride_dw_n + cols_k[None, :]
    tl.store(dw_ptrs, to_output(acc, dw_ptr.dtype.element_ty, UPCAST), mask=mask)


def fp8_grouped_wgrad(g: QuantizedRows, x: QuantizedRows, schedule: torch.Tensor, dw: torch.Tensor,
                      config: Optional[FP8WgradConfig] = None) -> None:
    """``dw[e] = G_e^T @ X_e`` ([E, N, K]) from the columnwise copies of ``g`` [T, N] and ``x`` [T, K]."""
    num_experts, n, k = dw.shape
    if _on_gluon(config, g, x):
        from .wgmma_ws import launch_wgrad

        cfg = config or default_config(gluon=True)
        wgrad_operands(g, x, dw, cfg.block_n, cfg.block_k, BLOCK, False)  # the shape checks
        return launch_wgrad(g, x, schedule, dw, block_n=cfg.block_n, block_k=cfg.block_k, group_n=cfg.group_n,
                            num_stages=cfg.num_stages, num_warps=cfg.num_warps, ctas_per_sm=cfg.ctas_per_sm,
                            tma_store=cfg.tma_store, consumers=cfg.consumers)
    cfg = config or default_config()
    grid = (triton.cdiv(n, cfg.block_n) * triton.cdiv(k, cfg.block_k), num_experts)
    use_tma, operands = wgrad_operands(g, x, dw, cfg.block_n, cfg.block_k, BLOCK,
                                       cfg.use_tma and fp8_gemm.USE_TMA_DEFAULT)
    fp8_wgrad_kernel[grid](
        *operands,
        schedule, n, k, num_experts + 1,
        USE_TMA=use_tma, UPCAST=interpreting(), BN=cfg.block_n, BK=cfg.block_k, BT=BLOCK, GROUP_N=cfg.group_n,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **register_cap(cfg.maxnreg),
    )


@triton.jit
def tile_sum_kernel(part_ptr, stride_pt, out_ptr, stride_oe, sched_ptr, N, NUM_GROUPS,
                    UPCAST: tl.constexpr, BN: tl.constexpr):
    """``out[e, cols] = sum over expert e's tiles t (in order) of part[t, cols]``."""
    pid_n = tl.program_id(0)
    expert = tl.program_id(1)
    tile_start = tl.load(sched_ptr + 0 * NUM_GROUPS + expert)
    tile_end = tl.load(sched_ptr + 1 * NUM_GROUPS + expert)
    cols = pid_n * BN + tl.arange(0, BN)
    ok = cols < N
    acc = tl.zeros((BN,), dtype=tl.float32)
    for t in range(tile_start, tile_end):
        acc += tl.load(part_ptr + t * stride_pt + cols, mask=ok, other=0.0)
    tl.store(out_ptr + expert * stride_oe + cols, to_output(acc, out_ptr.dtype.element_ty, UPCAST), mask=ok)


def tile_sums_to_experts(partials: torch.Tensor, schedule: torch.Tensor, out: torch.Tensor) -> None:
    """Per-expert sums (``out`` [E, N]) of the per-tile partials [max_m_tiles, N]."""
    num_experts, n = out.shape
    block_n = 128 if interpreting() else 512
    tile_sum_kernel[(triton.cdiv(n, block_n), num_experts)](
        partials, partials.stride(0), out, out.stride(0), schedule, n, num_experts + 1,
        UPCAST=interpreting(), BN=block_n, num_warps=4,
    )
