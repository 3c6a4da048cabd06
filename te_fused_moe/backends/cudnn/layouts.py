"""Operand layouts cuDNN Frontend's fused grouped GEMM kernels expect, built from ours on device.

All functions here are plain PyTorch, run on any device, never read GPU data on the host and
produce shapes that depend only on static sizes (``T``, ``E``, widths) — so they are safe inside
CUDA graph capture. Each layout fact below was read in nvidia-cudnn-frontend 1.32.0
(``cudnn/gemm/cutedsl/grouped/``):

* **Groups padded to 256 rows.** The kernels read ``padded_offsets``: int32 ``(E,)`` cumulative
  *end* rows of each expert's group, each group's size rounded up to ``m_aligned = 256`` (the only
  value the kernels accept). The A/C/D row dimension is therefore sized for the worst case,
  :func:`padded_rows_bound` rows, and the expert's rows are scattered to their padded positions.
* **Gate/up interleaved in 32-column blocks.** The GLU epilogue takes adjacent 32-column
  accumulator subtiles as (gate, up) pairs — even blocks gate, odd blocks up
  (``moe_grouped_gemm_glu_bias.py``: "adjacent 32-column blocks are interpreted as gate/up pairs";
  ``moe_kernel_helpers.py``: "gate/up are interleaved as even/odd 32-column blocks"). Our FC1
  output is ``[gate | up]`` (Megatron's layout), so FC1's weight rows (and bias, and the dGLU's
  ``[dgate | dup]``) are re-laid out by :func:`interleave_glu` / :func:`deinterleave_glu`.
  This is Megatron's ``moe_mlp_glu_interleave_size=32``.
* **Block scale factors in 128x4 atoms.** A logical scale matrix ``S [MN, K/vec]`` (one scale per
  ``vec`` = 32 (MXFP8, E8M0) or 16 (NVFP4, E4M3) elements along K) is stored as the C-contiguous
  buffer ``(L, ceil(MN/128), ceil(K_sf/4), 32, 4, 4)``: element ``(r, c)`` lives at
  ``[r // 128, c // 4, r % 32, (r // 32) % 4, c % 4]`` (``canonical.py``: the kernels view it as
  ``(32, 4, MN/128, 4, K_sf/4, L)``; the same 128x4 tile layout cuBLAS documents for block-scaled
  GEMMs). Padding rows/columns of the atom are filled with a neutral scale.
"""

from __future__ import annotations

import torch

GROUP_ALIGN = 256  # cuDNN FE's m_aligned: the only group padding its grouped kernels accept
GLU_BLOCK = 32  # gate/up interleave block (columns)
SF_ATOM_ROWS = 128
SF_ATOM_COLS = 4


def _ceil_to(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


# --------------------------------------------------------------------------- padded groups

def padded_rows_bound(tokens: int, experts: int, align: int = GROUP_ALIGN) -> int:
    """Rows of the padded A/D buffers: enough for any split of ``tokens`` rows over ``experts``
    groups each rounded up to ``align`` (sum of ceil(c/align)*align <= tokens + experts*(align-1))."""
    return _ceil_to(tokens + experts * (align - 1), align) if tokens + experts > 0 else 0


def padded_offsets(tokens_per_expert: torch.Tensor, align: int = GROUP_ALIGN) -> torch.Tensor:
    """int32 ``[E]`` cumulative end row of each expert's group, every group padded to ``align``
    rows. Computed on the counts' device; nothing is read on the host."""
    counts = tokens_per_expert.to(torch.int64)
    padded = (counts + (align - 1)) // align * align
    return torch.cumsum(padded, dim=0).to(torch.int32)


def padded_row_index(tokens_per_expert: torch.Tensor, tokens: int, align: int = GROUP_ALIGN) -> torch.Tensor:
    """int64 ``[T]``: where row ``r`` of the packed input goes in the padded layout.

    Rows past ``sum(counts)`` (the caller's padding) go to the last row of the padded buffer,
    :func:`padded_rows_bound` ``- 1``, which no group reaches when any padding row exists (the bound
    leaves at least one spare row then); their values there are never read back.
    """
    experts = tokens_per_expert.shape[0]
    counts = tokens_per_expert.to(torch.int64)
    ends = torch.cumsum(counts, dim=0)
    starts = ends - counts
    padded_ends = padded_offsets(counts, align).to(torch.int64)
    padded_starts = padded_ends - (counts + (align - 1)) // align * align
    rows = torch.arange(tokens, device=counts.device)
    expert = torch.searchsorted(ends, rows, right=True)  # == E for padding rows
    in_range = expert < experts
    expert_clamped = expert.clamp(max=max(experts - 1, 0))
    dest = rows - starts[expert_clamped] + padded_starts[expert_clamped]
    spare = padded_rows_bound(tokens, experts, align) - 1
    return torch.where(in_range, dest, torch.full_like(dest, spare))


def valid_row_mask(tokens_per_expert: torch.Tensor, tokens: int) -> torch.Tensor:
    """bool ``[T]``: rows that belong to an expert (``r < sum(counts)``)."""
    total = tokens_per_expert.to(torch.int64).sum()
    return torch.arange(tokens, device=tokens_per_expert.device) < total


def scatter_to_padded(x: torch.Tensor, row_index: torch.Tensor, padded_rows: int) -> torch.Tensor:
    """``x [T, ...]`` -> ``[padded_rows, ...]`` with row ``r`` at ``row_index[r]``; gaps are zero."""
    out = x.new_zeros((padded_rows,) + tuple(x.shape[1:]))
    out.index_copy_(0, row_index, x)
    return out


def gather_from_padded(padded: torch.Tensor, row_index: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`scatter_to_padded` for the rows it wrote."""
    return padded.index_select(0, row_index)


def zero_empty_groups(per_group: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """``per_group [E, ...]`` with the entries of experts that received no rows set to zero.

    cuDNN FE's wgrad wrapper allocates its output with ``torch.empty``; a group with no rows has
    no tile to write, so its weight gradient would be whatever memory held. Done on the device."""
    has_rows = (tokens_per_expert > 0).reshape((-1,) + (1,) * (per_group.dim() - 1))
    return torch.where(has_rows, per_group, torch.zeros((), dtype=per_group.dtype, device=per_group.device))


# --------------------------------------------------------------------------- gate/up interleave

def _check_glu_width(width: int, block: int) -> None:
    if width % (2 * block) != 0:
        raise ValueError(
            f"GLU width: cuDNN Frontend's GLU kernels interleave gate/up in {block}-column blocks, so 2F must be "
            f"a multiple of {2 * block} (F a multiple of {block}); got 2F={width}"
        )


def interleave_glu(t: torch.Tensor, dim: int, block: int = GLU_BLOCK) -> torch.Tensor:
    """``[gate | up]`` along ``dim`` (width 2F) -> ``[g_0 u_0 g_1 u_1 ...]`` with ``block``-wide
    blocks: gate block ``i`` at positions ``[2i*block, (2i+1)*block)``, up block ``i`` right after."""
    dim = dim % t.dim()
    width = t.shape[dim]
    _check_glu_width(width, block)
    halves = t.unflatten(dim, (2, width // (2 * block), block))  # [..., half, block_idx, col, ...]
    return halves.transpose(dim, dim + 1).flatten(dim, dim + 2).contiguous()


def deinterleave_glu(t: torch.Tensor, dim: int, block: int = GLU_BLOCK) -> torch.Tensor:
    """Inverse of :func:`interleave_glu`."""
    dim = dim % t.dim()
    width = t.shape[dim]
    _check_glu_width(width, block)
    pairs = t.unflatten(dim, (width // (2 * block), 2, block))  # [..., block_idx, half, col, ...]
    return pairs.transpose(dim, dim + 1).flatten(dim, dim + 2).contiguous()


# --------------------------------------------------------------------------- scale-factor atoms

def swizzled_scale_shape(rows: int, sf_cols: int, batch: int = 1):
    """Physical shape of the 128x4-atom buffer for a logical ``[batch, rows, sf_cols]`` scale matrix."""
    return (batch, -(-rows // SF_ATOM_ROWS), -(-sf_cols // SF_ATOM_COLS), 32, 4, 4)


def swizzle_scales(scales: torch.Tensor, fill=None) -> torch.Tensor:
    """Logical scales ``[rows, sf_cols]`` or ``[L, rows, sf_cols]`` -> the C-contiguous atom buffer
    ``(L, ceil(rows/128), ceil(sf_cols/4), 32, 4, 4)`` cuDNN FE's block-scaled kernels read.

    Works on raw scale bytes (``uint8`` E8M0 codes) or ``float8_e4m3fn`` scales alike. Positions
    outside ``[rows, sf_cols]`` get ``fill`` (default: zero bytes; pass E8M0's 127 = 2^0 if a kernel
    could read them — ours never multiply them into a valid output).
    """
    batched = scales.dim() == 3
    if not batched:
        scales = scales.unsqueeze(0)
    if scales.dim() != 3:
        raise ValueError(f"scales: expected [rows, sf_cols] or [L, rows, sf_cols], got {tuple(scales.shape)}")
    batch, rows, cols = scales.shape
    rows_p, cols_p = _ceil_to(rows, SF_ATOM_ROWS), _ceil_to(cols, SF_ATOM_COLS)
    padded = _padded_like(scales, (batch, rows_p, cols_p), fill)
    padded[:, :rows, :cols] = scales
    # [L, R/128, 4 (r//32 %4), 32 (r%32), C/4, 4 (c%4)] -> [L, R/128, C/4, r%32, (r//32)%4, c%4]
    tiled = padded.view(batch, rows_p // 128, 4, 32, cols_p // 4, 4)
    return tiled.permute(0, 1, 4, 3, 2, 5).contiguous()


def unswizzle_scales(atoms: torch.Tensor, rows: int, sf_cols: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_scales`: the atom buffer -> logical ``[L, rows, sf_cols]``."""
    if atoms.dim() != 6 or tuple(atoms.shape[3:]) != (32, 4, 4):
        raise ValueError(f"atoms: expected shape (L, R/128, C/4, 32, 4, 4), got {tuple(atoms.shape)}")
    batch, r_tiles, c_tiles = atoms.shape[:3]
    logical = atoms.permute(0, 1, 4, 3, 2, 5).reshape(batch, r_tiles * 128, c_tiles * 4)
    return logical[:, :rows, :sf_cols]


# --------------------------------------------------------------------------- legacy (pre-canonical) views

# cuDNN FE 1.32's squared-ReLU wrappers (srelu/dsrelu) take only the older operand forms; the GLU,
# dGLU, quant and wgrad wrappers also take the plain 2-D / (E, N, K) / flat-atom forms used elsewhere.
ATOM_VIEW_ORDER = (3, 4, 1, 5, 2, 0)  # (L, MN', K', 32, 4, 4) -> (32, 4, MN', 4, K', L)
ATOM_BUFFER_ORDER = (5, 2, 4, 0, 1, 3)  # its inverse


def legacy_rows(t: torch.Tensor) -> torch.Tensor:
    """Row-major ``[M, K]`` -> the ``(M, K, 1)`` view with stride ``(K, 1, M*K)`` (same memory)."""
    rows, cols = t.shape
    return t.contiguous().as_strided((rows, cols, 1), (cols, 1, rows * cols))


def legacy_vector(v: torch.Tensor) -> torch.Tensor:
    """``[M]`` -> the ``(M, 1, 1)`` view with stride ``(1, M, M)`` (prob / dprob)."""
    rows = v.shape[0]
    return v.contiguous().as_strided((rows, 1, 1), (1, rows, rows))


def legacy_weights(w: torch.Tensor) -> torch.Tensor:
    """``[E, N, K]`` -> the K-major ``(N, K, E)`` view with stride ``(K, 1, N*K)``."""
    return w.contiguous().permute(1, 2, 0)


def atom_view(atoms: torch.Tensor) -> torch.Tensor:
    """Atom buffer ``(L, MN', K', 32, 4, 4)`` -> the ``(32, 4, MN', 4, K', L)`` view the older
    wrappers check (a permutation of the same C-contiguous memory)."""
    return atoms.permute(*ATOM_VIEW_ORDER)


def atoms_from_view(view: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`atom_view` (contiguous again when ``view`` came from one buffer)."""
    return view.permute(*ATOM_BUFFER_ORDER).contiguous()


def _padded_like(t: torch.Tensor, shape, fill) -> torch.Tensor:
    if fill is None:
        if t.dtype.itemsize == 1 and not t.is_floating_point():
            return torch.zeros(shape, dtype=t.dtype, device=t.device)
        # float8 scales: zero-initialise through bytes (torch has no zeros kernel for every fp8 type)
        return torch.zeros(shape, dtype=torch.uint8, device=t.device).view(t.dtype)
    return torch.full(shape, fill, dtype=t.dtype, device=t.device)


__all__ = [
    "GROUP_ALIGN",
    "GLU_BLOCK",
    "padded_rows_bound",
    "padded_offsets",
    "padded_row_index",
    "valid_row_mask",
    "zero_empty_groups",
    "scatter_to_padded",
    "gather_from_padded",
    "interleave_glu",
    "deinterleave_glu",
    "swizzled_scale_shape",
    "swizzle_scales",
    "unswizzle_scales",
    "legacy_rows",
    "legacy_vector",
    "legacy_weights",
    "atom_view",
    "atoms_from_view",
]
