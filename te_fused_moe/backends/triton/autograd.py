"""The autograd Function of the Triton backend: 2 kernels forward, 4 backward.

Forward:  FC1 (+b1, activation, x probs; saves pre-activation h) -> FC2 (+b2).
Backward: FC2 dgrad with the dGLU epilogue (dh, dprob) -> FC1 dgrad (dx) -> wgrad of w2 (+db2) and
of w1 (+db1).

``h`` [T, N1] is saved rather than recomputed: storing it costs one extra write of T x N1 16-bit
values in the FC1 epilogue (well under 1% of the FC1 GEMM's time at the benchmarked shapes), while
recomputing it would cost a whole second FC1 GEMM in backward.

Memory: ``h`` and ``a`` are this Function's own buffers, held on ``ctx`` rather than saved tensors,
so backward can drop each right after its last use (``a`` after FC2's wgrad, which therefore runs
first; ``h`` after the dGLU dgrad). Saved tensors would stay alive until backward returns, through
FC1's dgrad and wgrad, and the peak would exceed the unfused path's by ``h`` + ``a`` (measured
+10-35%, benchmarks/NOTES.md). As in Transformer Engine's modules, the price is that one graph
cannot be backpropagated twice (``retain_graph=True``): the second backward raises.
"""

from __future__ import annotations

import torch
import triton

from . import grouped_gemm as gg
from .schedule import build_schedule
from .wgrad import grouped_wgrad


def new_buffer(shape, like: torch.Tensor, dtype=None) -> torch.Tensor:
    """Uninitialised buffer for a kernel to fill (tests replace this to poison buffers with NaN)."""
    return torch.empty(shape, device=like.device, dtype=dtype or like.dtype)


class TritonExpertMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tokens_per_expert, w1, w2, b1, b2, probs, activation, deterministic):
        num_rows, hidden = x.shape
        ffn = w2.shape[2]
        act = activation.launch_args
        h = new_buffer((num_rows, w1.shape[1]), x)
        a = new_buffer((num_rows, ffn), x)
        y = new_buffer((num_rows, hidden), x)
        if num_rows > 0:
            schedules = {}  # one device-side schedule per M block size, shared by the launches
            gg.fc1_forward(x, w1, tokens_per_expert, h, a, b1=b1, probs=probs, schedules=schedules, **act)
            gg.fc2_forward(a, w2, tokens_per_expert, y, b2=b2, schedules=schedules)
        ctx.save_for_backward(x, tokens_per_expert, w1, w2, probs)
        ctx.saved_activations = [h, a]  # dropped during backward, see the module docstring
        ctx.act = act
        ctx.has_b1, ctx.has_b2 = b1 is not None, b2 is not None
        ctx.deterministic = deterministic
        return y

    @staticmethod
    def backward(ctx, dy):
        x, counts, w1, w2, probs = ctx.saved_tensors
        if ctx.saved_activations is None:
            raise RuntimeError(
                "te_fused_moe backend='triton' frees its saved activations during backward (as Transformer "
                "Engine's modules do) to keep peak memory at the unfused path's; backpropagating through the "
                "same forward twice (retain_graph=True) is not supported: run the forward again")
        h, a = ctx.saved_activations
        ctx.saved_activations = None
        need = ctx.needs_input_grad  # x, counts, w1, w2, b1, b2, probs, activation, deterministic
        dy = dy.contiguous()
        num_rows = x.shape[0]
        num_experts, n1, hidden = w1.shape
        dx = dw1 = dw2 = db1 = db2 = dprobs = None
        if num_rows == 0:
            zeros = lambda t, n: torch.zeros_like(t) if n else None
            return (zeros(x, need[0]), None, zeros(w1, need[2]), zeros(w2, need[3]),
                    torch.zeros((num_experts, n1), device=x.device, dtype=x.dtype) if need[4] else None,
                    torch.zeros((num_experts, hidden), device=x.device, dtype=x.dtype) if need[5] else None,
                    zeros(probs, need[6]) if probs is not None else None, None, None)

        need_dh = need[0] or need[2] or need[4]  # dh feeds dx, dW1 and db1
        want_dprob = probs is not None and need[6]
        dact_cfg = gg.default_config("dact", w2.shape[2], hidden)
        # One device-side schedule for every launch; the wgrads read only its row ranges.
        schedule = build_schedule(counts, num_rows, dact_cfg.block_m)
        schedules = {dact_cfg.block_m: schedule}

        # FC2's wgrad first: it is the last reader of ``a``, which is freed right after.
        if need[3] or need[5]:
            dw2 = new_buffer(w2.shape, w2)
            db2 = new_buffer((num_experts, hidden), x) if ctx.has_b2 else None
            grouped_wgrad(dy, a, schedule, dw2, db2)
        del a

        # dh and dprob: FC2's dgrad with the dGLU epilogue, the last reader of ``h``.
        dh = None
        if need_dh or want_dprob:
            dh = new_buffer(h.shape, h)
            dprob_buf = None
            if want_dprob:
                if ctx.deterministic:
                    parts = triton.cdiv(w2.shape[2], dact_cfg.block_n)
                    dprob_buf = new_buffer((parts, num_rows), x, torch.float32)
                else:
                    dprob_buf = torch.zeros((num_rows,), device=x.device, dtype=torch.float32)
            gg.fc2_dgrad_dact(dy, w2, counts, h, dh, probs=probs, dprob=dprob_buf, config=dact_cfg,
                              schedules=schedules, **ctx.act)
            if want_dprob:
                total = dprob_buf.sum(0) if ctx.deterministic else dprob_buf
                dprobs = total.to(probs.dtype)
        del h

        if need[0]:
            dx = new_buffer(x.shape, x)
            gg.fc1_dgrad(dh, w1, counts, dx, schedules=schedules)
        if need[2] or need[4]:
            dw1 = new_buffer(w1.shape, w1)
            db1 = new_buffer((num_experts, n1), x) if ctx.has_b1 else None
            grouped_wgrad(dh, x, schedule, dw1, db1)
        return (dx, None, dw1 if need[2] else None, dw2 if need[3] else None,
                db1 if need[4] else None, db2 if need[5] else None, dprobs, None, None)
