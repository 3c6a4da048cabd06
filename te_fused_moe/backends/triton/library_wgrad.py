"""Weight gradients on cuBLAS's grouped GEMM (``torch._grouped_mm``) where both operands are BF16 values.

Once a recipe's wgrad operands are exact BF16 values (MXFP8's values path: the quantized columnwise copies
expanded, or written as values by their quantize pass), ``dW[e] = G_e^T @ X_e`` is a plain BF16 GEMM over each
expert's tokens, and nothing recipe-specific is left in it to fuse. The columnwise copies ``data_t`` are
``[width, 128 * tiles]``: expert ``e``'s tokens fill its tile slots from their first column on, zeros after
its last token (:mod:`.mxfp8.quantize`), so its K range can be whole slots, ``[128 * tile_start[e], 128 *
tile_end[e])``, and the group offsets come from the schedule on the device (no host read, graph-capturable).
G^T is read row-major and X^T column-major, as laid out; slots past the last expert's are not read.

Where it runs: CUDA devices of compute capability 9.0 only (the Triton backend's GEMMs target sm_90; on
sm_100 ``torch._grouped_mm`` has been reported to leave experts with no tokens non-zero, pytorch#172439).
The result is a new BF16 tensor (``torch._grouped_mm`` has no ``out=``), so dW must be BF16.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from .schedule import TILE_END

TILE = 128  # tokens per tile slot of the columnwise copies


def slot_offsets(schedule: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int32 ``[E]``: where each expert's K range ends in the columnwise copies' token columns (its last
    slot's end), on the schedule's device."""
    first = TILE_END * (num_experts + 1)
    return schedule[first: first + num_experts] * TILE


def values_wgrad(g_t: torch.Tensor, x_t: torch.Tensor, schedule: torch.Tensor, shape) -> torch.Tensor:
    """``dW [E, N, K]`` (BF16) of the columnwise BF16 copies ``g_t`` ``[>= N, slots]`` and ``x_t`` ``[>= K,
    slots]`` (rows past N / K: zero padding, not read) through ``torch._grouped_mm``."""
    num_experts, n, k = shape
    if g_t.dtype != torch.bfloat16 or x_t.dtype != torch.bfloat16 or g_t.shape[1] != x_t.shape[1]:
        raise ValueError(f"g_t, x_t: expected BF16 columnwise copies with the same token columns, got "
                         f"{g_t.dtype} {tuple(g_t.shape)} and {x_t.dtype} {tuple(x_t.shape)}")
    if g_t.shape[0] < n or x_t.shape[0] < k:
        raise ValueError(f"shape: dW {tuple(shape)} has more rows or columns than g_t {tuple(g_t.shape)}, "
                         f"x_t {tuple(x_t.shape)} have rows")
    return torch._grouped_mm(g_t[:n], x_t[:k].t(), offs=slot_offsets(schedule, num_experts))


@functools.lru_cache(maxsize=None)
def _is_sm90(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def runs_on(like: torch.Tensor) -> bool:
    """Whether the wgrads of tensors on ``like``'s device go to cuBLAS (an sm_90 GPU; CPU tests replace this
    to run PyTorch's fallback of ``torch._grouped_mm`` through the autograd path)."""
    return (like.is_cuda and hasattr(torch, "_grouped_mm")
            and _is_sm90(torch.cuda.current_device() if like.device.index is None else like.device.index))


def applies(g_t: Optional[torch.Tensor], x_t: Optional[torch.Tensor], like: torch.Tensor) -> bool:
    """Whether :func:`values_wgrad` gives this wgrad: both copies BF16 values and dW BF16, where it runs."""
    return (g_t is not None and x_t is not None and g_t.dtype == x_t.dtype == like.dtype == torch.bfloat16
            and runs_on(like))
