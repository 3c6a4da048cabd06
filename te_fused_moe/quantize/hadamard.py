"""The 16-point random Hadamard transform (RHT) NVFP4 applies to the wgrad GEMM's operands.

TE's definition (``transformer_engine/pytorch/tensor/nvfp4_tensor.py``: ``get_wgrad_sign_vector``,
``get_hadamard_matrix``, ``get_rht_matrix``; same in ``pytorch/custom_recipes/reference_nvfp4.py``):
the matrix is ``M = diag(s) · H16 / 4`` with ``H16`` the Sylvester Hadamard matrix
(``H[i][j] = (-1)^popcount(i & j)``) and ``s`` TE's fixed sign vector below. Each run of 16
consecutive elements ``v`` along the transformed axis becomes ``v · M`` (a row vector times
``M``). ``M`` is orthogonal (``M · Mᵀ = I``), so the inverse is ``w · Mᵀ`` and a product
reduced over the axis is unchanged: ``(a M)(b M)ᵀ = a bᵀ``.

Precision: the transform is computed in float64 (entries of ``M`` are ±1/4, so it is exact
unless the 16 inputs span more than ~29 binades) and rounded once to float32. TE computes it on tensor cores from BF16 inputs with float32 accumulation,
which equals this whenever that accumulation is exact (e.g. BF16 inputs of similar magnitude).
A length that is not a multiple of 16 is zero-padded to one; the transformed tensor keeps the
padded length (the padded positions carry information the inverse needs).
"""

from __future__ import annotations

import torch

from .blocks import ceil_div, normalize_axis

SIZE = 16
# TE's fixed "random" signs (get_wgrad_sign_vector).
WGRAD_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def sylvester_hadamard(size: int = SIZE) -> torch.Tensor:
    """Entries ±1 (float64), built by doubling ``[[H, H], [H, -H]]``."""
    h = torch.ones((1, 1), dtype=torch.float64)
    while h.shape[0] < size:
        h = torch.cat((torch.cat((h, h), dim=1), torch.cat((h, -h), dim=1)), dim=0)
    return h


def rht_matrix(device=None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``M = diag(signs) · H16 / 4``."""
    signs = torch.tensor(WGRAD_SIGNS, dtype=torch.float64)
    m = signs[:, None] * sylvester_hadamard(SIZE) / 4.0
    return m.to(device=device, dtype=dtype)


def padded_length(n: int) -> int:
    return ceil_div(n, SIZE) * SIZE


def apply_rht(t: torch.Tensor, axis: int) -> torch.Tensor:
    """``t`` transformed along ``axis`` in runs of 16 (zero-padded to a multiple of 16), float32."""
    axis = normalize_axis("axis", axis, t.dim())
    return _transform(t, axis, rht_matrix(t.device)).to(torch.float32)


def apply_inverse_rht(w: torch.Tensor, axis: int, length: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`apply_rht`, cropped back to ``length`` along ``axis``, in ``dtype``."""
    axis = normalize_axis("axis", axis, w.dim())
    if w.shape[axis] % SIZE:
        raise ValueError(f"w: length along axis {axis} must be a multiple of {SIZE}, got {w.shape[axis]}")
    out = _transform(w, axis, rht_matrix(w.device).T)
    return out.narrow(axis, 0, length).to(dtype)


def _transform(t: torch.Tensor, axis: int, matrix: torch.Tensor) -> torch.Tensor:
    moved = t.movedim(axis, -1).to(torch.float64)
    n = moved.shape[-1]
    pad = padded_length(n) - n
    if pad:
        moved = torch.nn.functional.pad(moved, (0, pad))
    runs = moved.reshape(*moved.shape[:-1], -1, SIZE)
    out = (runs @ matrix).reshape(moved.shape)
    return out.movedim(-1, axis).contiguous()
