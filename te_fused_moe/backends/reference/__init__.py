"""The reference backend: the expert MLP as a per-expert loop of PyTorch ops. The ground truth.

Runs on any device (CPU included), every activation, every recipe (by quantize -> dequantize
emulation, see :mod:`.gemm`), every float parameter dtype. It computes in FP32 (FP64 for FP64
inputs) and rounds only the output to ``x.dtype``.

It is **not** the fast path: it reads ``tokens_per_expert`` on the host (``.tolist()``), which
makes the host wait for the GPU, and it launches a handful of kernels per expert. Use it to check
the fused backends, or where none can run.
"""

from __future__ import annotations

from typing import List

import torch

from ...activations import ActivationConfig, apply_activation
from ...recipes import Recipe
from ..base import Availability, Backend, ExpertMLPArgs
from .gemm import expert_gemm

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _split_rows(t: torch.Tensor, counts: List[int]) -> List[torch.Tensor]:
    """Rows of ``t`` per expert, plus a last chunk of padding rows (past ``sum(counts)``)."""
    padding = t.shape[0] - sum(counts)
    # One split (and one concatenating backward) instead of E slices that each scatter a full-size
    # zero gradient: that would cost O(E * T) in backward.
    return list(torch.split(t, counts + [padding], dim=0))


def reference_expert_mlp(args: ExpertMLPArgs) -> torch.Tensor:
    """``y [T, H]`` by a loop over experts; differentiable w.r.t. every tensor input by autograd."""
    x = args.x
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    counts = [int(c) for c in args.tokens_per_expert.tolist()]  # host sync: reference only
    total = sum(counts)
    if total > x.shape[0] or min(counts, default=0) < 0:
        raise ValueError(
            f"tokens_per_expert: counts must be >= 0 and sum to at most the {x.shape[0]} rows of x, got {counts}"
        )
    recipe: Recipe = args.recipe
    activation: ActivationConfig = args.activation

    x_rows = _split_rows(x.to(compute), counts)
    prob_rows = _split_rows(args.probs.to(compute), counts) if args.probs is not None else None
    # unbind: one stacking backward for all experts' weight gradients.
    w1 = args.w1.to(compute).unbind(0)
    w2 = args.w2.to(compute).unbind(0)
    b1 = args.b1.to(compute).unbind(0) if args.b1 is not None else None
    b2 = args.b2.to(compute).unbind(0) if args.b2 is not None else None

    outputs = []
    # Empty experts still go through the loop: their zero-row ops keep every parameter in the
    # autograd graph, so unused ones get a zero gradient rather than None.
    for e in range(len(counts)):
        h = expert_gemm(x_rows[e], w1[e], recipe)
        if b1 is not None:
            h = h + b1[e]
        a = apply_activation(h, activation)
        if prob_rows is not None:
            a = a * prob_rows[e][:, None]
        y = expert_gemm(a, w2[e], recipe)
        if b2 is not None:
            y = y + b2[e]
        outputs.append(y)
    # Padding rows: zero output, and (not being read) zero gradient, whatever they hold.
    outputs.append(x.new_zeros(x.shape[0] - total, x.shape[1], dtype=compute))
    return torch.cat(outputs, dim=0).to(x.dtype)


class ReferenceBackend(Backend):
    name = "reference"

    def availability(self, device: torch.device) -> Availability:
        return Availability(True)

    def supports(self, activation: ActivationConfig, recipe: Recipe, dtype: torch.dtype) -> Availability:
        if dtype not in _FLOAT_DTYPES:
            return Availability(False, f"reference: parameter dtype {dtype} is not a float dtype")
        return Availability(True)

    def forward(self, args: ExpertMLPArgs) -> torch.Tensor:
        return reference_expert_mlp(args)


BACKEND = ReferenceBackend()

__all__ = ["BACKEND", "ReferenceBackend", "reference_expert_mlp"]
