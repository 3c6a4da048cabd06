"""Host side of the block-scaled grouped GEMM launches (FP8 block and MXFP8 ``gemm.launch``): the
operand sources (TMA descriptors or plain tensors) and the kernels' shared run of pointer/stride
arguments, which both kernels take in the same order. Absent buffers become a dummy pointer with
stride 0 (the kernel's constexpr flags keep it from being touched)."""

from __future__ import annotations

from typing import Callable, Optional

import torch

# The block-scaled GEMM kernels' MODE constexpr, and the mode each GEMM of the expert MLP runs in
MODE_PLAIN, MODE_FC1, MODE_DACT = 0, 1, 2
GEMM_MODES = {"fc1": MODE_FC1, "fc2": MODE_PLAIN, "dact": MODE_DACT, "dgrad": MODE_PLAIN}


def separate_epilogue(how: str, auto: Callable[[], bool]) -> bool:
    """Resolves a quantizing GEMM's epilogue switch: "fused" (one kernel), "separate" (the plain GEMM
    into FP32, then the kernel's epilogue alone) or "auto" (``auto()`` decides)."""
    if how not in ("auto", "separate", "fused"):
        raise ValueError(f"epilogue: expected 'auto', 'separate' or 'fused', got {how!r}")
    return auto() if how == "auto" else how == "separate"


def tma_allowed(a: torch.Tensor, b: torch.Tensor) -> bool:
    """TMA needs 16-byte aligned bases and row strides and unit inner strides."""
    return (a.stride(1) == 1 and b.is_contiguous() and a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0
            and a.stride(0) % 16 == 0)


def operand_sources(a: torch.Tensor, b: torch.Tensor, block_m: int, block_n: int, block_k: int, use_tma: bool):
    """``(a_src, b_src)``: TMA descriptors of ``a`` [T, Ka] (boxes ``block_m x block_k``) and of the stacked
    contiguous ``b`` [E, rows, Kb] seen as ``[E * rows, Kb]`` (boxes ``block_n x block_k``), or the tensors
    themselves. ``Ka`` and ``Kb`` are the row widths in elements: equal for FP8 operands; NVFP4's packed
    A and BF16-valued B hold K/2 bytes and K values."""
    if not use_tma:
        return a, b
    from triton.tools.tensor_descriptor import TensorDescriptor

    b_width = b.shape[2]
    return (TensorDescriptor(a, list(a.shape), [a.stride(0), 1], [block_m, block_k]),
            TensorDescriptor(b, [b.shape[0] * b.shape[1], b_width], [b_width, 1], [block_n, block_k]))


def quantized_copies(q) -> tuple:
    """(rowwise, colwise): which copies of the quantized-rows buffers ``q`` (or None) are present."""
    return q is not None and q.data is not None, q is not None and q.data_t is not None


def codes_or_values(t: torch.Tensor) -> torch.Tensor:
    """A quantized copy's buffer as the kernels store into it: FP8 codes as uint8, BF16 values (MXFP8's
    copies written as values, ``mxfp8.quantize.store_mx``) as they are."""
    return t if t.dtype == torch.bfloat16 else t.view(torch.uint8)


def or_dummy(t: Optional[torch.Tensor], dummy: torch.Tensor, *dims: int) -> tuple:
    """``t`` and its strides ``dims``, or the dummy with zero strides."""
    if t is None:
        return (dummy,) + (0,) * len(dims)
    return (t,) + tuple(t.stride(d) for d in dims)


def tiled_width(mode: int, n: int, b_rows: int, tile: int) -> int:
    """The width a GEMM's tiles cover: ``n``, or ``n`` rounded up to ``tile`` for a plain GEMM whose B
    has the rows (zero-padded, see ``padded.py``: the kernels compute the last tile whole and store
    only its columns before ``n``) and for FC1 (its epilogue stores h's columns before ``n`` and zero
    codes past it; the up half's rows, at ``b_up_rows`` = n, run past B's in the last tile and are
    not used there). Launchers check this width against the tile."""
    rounded = -(-n // tile) * tile
    return rounded if mode == MODE_FC1 or (mode == MODE_PLAIN and b_rows >= rounded) else n


def copies_width(x: torch.Tensor, width: Optional[int]) -> int:
    """The width of a quantize pass's copies of ``x`` [T, K]: ``width`` (>= K: x read as zero-padded to
    it, ``padded.py``) or K."""
    if width is None:
        return x.shape[1]
    if width < x.shape[1]:
        raise ValueError(f"width: expected at least x's {x.shape[1]} columns, got {width}")
    return width


def copies_arguments(q, data_dummy: torch.Tensor, scale_dummy: torch.Tensor) -> tuple:
    """The run ``q_ptr, stride_qm, qs_ptr, stride_qsm, stride_qsk, qt_ptr, stride_qtn, qts_ptr, stride_qtsb``
    of a kernel that writes quantized copies: ``q``'s present copies (:func:`codes_or_values`) and their
    scales; for absent ones the other copy's buffer or the dummies, with zero strides."""
    rowwise, colwise = quantized_copies(q)
    q_data = codes_or_values(q.data) if rowwise else (codes_or_values(q.data_t) if colwise else data_dummy)
    qt_data = codes_or_values(q.data_t) if colwise else q_data
    return (q_data, q.data.stride(0) if rowwise else 0, *or_dummy(q.scale if rowwise else None, scale_dummy, 0, 1),
            qt_data, q.data_t.stride(0) if colwise else 0, *or_dummy(q.scale_t if colwise else None, scale_dummy, 0))


def kernel_operands(a_src, a: torch.Tensor, a_scale: torch.Tensor, b_src, b: torch.Tensor, b_scale: torch.Tensor,
                    b_up_rows: int, c=None, q=None, q_up_offset: int = 0, h=None, h_up_offset: int = 0, bias=None,
                    bias_up_offset: int = 0, probs=None, dprob=None, dbias=None) -> tuple:
    """The arguments from ``a_src`` to ``stride_dbias_t`` of ``fp8_grouped_gemm_kernel`` and
    ``mx_grouped_gemm_kernel``. ``q``: quantized-rows buffers (``data``, ``scale``, ``data_t``,
    ``scale_t``); its present copies are written (:func:`copies_arguments`)."""
    dummy = a_scale
    return (
        a_src, a.stride(0), a_scale, a_scale.stride(0), a_scale.stride(1),
        b_src, b.stride(0), b.stride(1), b_scale, b_scale.stride(0), b_scale.stride(1), b_scale.stride(2), b.shape[1],
        b_up_rows,
        *or_dummy(c, dummy, 0),
        *copies_arguments(q, a.view(torch.uint8), dummy),
        q_up_offset,
        *or_dummy(h, dummy, 0), h_up_offset,
        *or_dummy(bias, dummy, 0), bias_up_offset,
        probs if probs is not None else dummy, *or_dummy(dprob, dummy, 0),
        *or_dummy(dbias, dummy, 0),
    )


def wgrad_operands(g, x, dw: torch.Tensor, block_n: int, block_k: int, block_t: int, use_tma: bool) -> tuple:
    """Checks the columnwise copies of ``g`` [T, N] and ``x`` [T, K] against ``dw`` [E, N, K] (a copy may be
    zero-padded up to the next multiple of 128: its columns past dw's are not read), then
    returns (use_tma, the wgrad kernels' arguments from ``g_src`` to ``N, K, NUM_GROUPS`` minus the
    schedule): TMA descriptors of ``data_t`` (FP8 codes, or bytes of two FP4 codes) with ``block_n`` /
    ``block_k`` x ``block_t`` boxes where allowed."""
    num_experts, n, k = dw.shape
    if g.data_t is None or x.data_t is None:
        raise ValueError("g, x: the wgrad needs the columnwise (transposed) copies (data_t, scale_t)")
    def covers(rows: int, size: int) -> bool:
        return size <= rows <= -(-size // 128) * 128

    if not covers(g.data_t.shape[0], n) or not covers(x.data_t.shape[0], k) or g.data_t.shape[1] != x.data_t.shape[1]:
        raise ValueError(f"dw: shape {tuple(dw.shape)} does not match g {tuple(g.data_t.shape)}^T, x {tuple(x.data_t.shape)}^T")
    use_tma = use_tma and all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (g.data_t, x.data_t))
    g_src, x_src = g.data_t, x.data_t
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        slots = g.data_t.shape[1]
        g_src = TensorDescriptor(g.data_t, [n, slots], [slots, 1], [block_n, block_t])
        x_src = TensorDescriptor(x.data_t, [k, slots], [slots, 1], [block_k, block_t])
    return use_tma, (g_src, g.data_t.stride(0), g.scale_t, g.scale_t.stride(0),
                     x_src, x.data_t.stride(0), x.scale_t, x.scale_t.stride(0),
                     dw, dw.stride(0), dw.stride(1))
