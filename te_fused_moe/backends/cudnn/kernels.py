"""The BF16 expert MLP on cuDNN Frontend's SM100 fused grouped GEMM kernels, forward and backward,
and the entry point that also dispatches MXFP8 runs to :mod:`.blockscaled`.

    forward:  x_pad ─► GLU kernel (FC1 + b1 + GLU + prob; keeps the pre-activation C) ─► a
              a     ─► grouped GEMM (FC2 + b2) ─► y_pad
    backward: dy_pad ─► dGLU kernel (dy @ W2 fused with dGLU(C) * prob, dprob, db1) ─► dh
              dh     ─► grouped GEMM (FC1 dgrad) ─► dx_pad
              wgrad kernel: dW2 = dy_pad^T a,  dW1 = dh^T x_pad      (per group of rows)

Every operand is laid out on the device by :mod:`.layouts` (256-row padded groups, gate/up
interleaved in 32-column blocks); the kernels read ``padded_offsets`` on the device, so the call
never syncs with the host and all shapes depend only on ``T``, ``E``, ``H``, ``F``.

cuDNN FE compiles one kernel per shape/dtype signature inside its wrappers and caches it; the
first call of a signature must therefore happen outside CUDA graph capture (run one eager step
before capturing). :func:`cudnn_expert_mlp` refuses a first-seen signature during capture.

Costs this first version accepts (a later one can keep weights pre-laid-out in the module):
FC1's weight is interleaved, and W1/W2 are transposed for the dgrad GEMMs, once per call.
"""

from __future__ import annotations

from typing import Set, Tuple

import torch

from ...recipes import MXFP8BlockScaling, NVFP4BlockScaling
from ..base import ExpertMLPArgs
from . import api, fp4
from .blockscaled import CudnnMXFP8ExpertMLP
from .layouts import (
    GROUP_ALIGN,
    deinterleave_glu,
    gather_from_padded,
    interleave_glu,
    padded_offsets,
    padded_row_index,
    padded_rows_bound,
    scatter_to_padded,
    valid_row_mask,
    zero_empty_groups,
)

FORWARD_ACT = {"swiglu": "swiglu", "gpt_oss_swiglu": "geglu"}
BACKWARD_ACT = {"swiglu": "dswiglu", "gpt_oss_swiglu": "dgeglu"}
LINEAR_OFFSET = {"swiglu": 0.0, "gpt_oss_swiglu": 1.0}  # GPT-OSS adds 1 to the clamped up projection

_compiled_signatures: Set[Tuple] = set()


def kernel_offsets(tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """``padded_offsets`` for the kernels. cuDNN FE requires the last end offset in ``(0, M]``, so
    when every expert is empty the last group is given one block of 256 all-zero rows (zero input,
    zero prob and zero output gradient there, so it adds nothing to any result)."""
    offsets = padded_offsets(tokens_per_expert)
    last = offsets[-1:].clamp(min=GROUP_ALIGN)
    return torch.cat([offsets[:-1], last])


def check_shapes(args: ExpertMLPArgs) -> None:
    hidden, ffn = args.hidden_size, args.ffn_hidden_size
    if ffn % 32 != 0:
        raise ValueError(
            f"w2: backend='cudnn' needs the FFN width F to be a multiple of 32 (gate/up are interleaved in "
            f"32-column blocks), got F={ffn}"
        )
    if hidden % 8 != 0:
        raise ValueError(f"x: backend='cudnn' needs H to be a multiple of 8 (16-byte rows), got H={hidden}")
    if args.num_experts > 1024:
        raise ValueError(f"w1: cuDNN Frontend's grouped kernels take at most 1024 experts, got {args.num_experts}")


def _signature(args: ExpertMLPArgs) -> Tuple:
    return (
        tuple(args.x.shape), tuple(args.w1.shape), args.x.dtype, args.x.device,
        args.activation.name, args.b1 is not None, args.b2 is not None, args.deterministic, args.recipe,
    )


def cudnn_expert_mlp(args: ExpertMLPArgs) -> torch.Tensor:
    fe, why = api.load()
    if fe is None:
        raise RuntimeError(f"backend='cudnn': {why}")
    return run_expert_mlp(fe, args)


def run_expert_mlp(fe, args: ExpertMLPArgs) -> torch.Tensor:
    """The differentiable expert MLP on the entry points in ``fe`` (see :func:`.api.load`)."""
    check_shapes(args)
    if isinstance(args.recipe, NVFP4BlockScaling):
        reason = fp4.call_limits(args)
        if reason is not None:
            raise ValueError(reason)
    quantized = isinstance(args.recipe, MXFP8BlockScaling)
    if quantized and args.hidden_size % 32 != 0:
        raise ValueError(f"x: backend='cudnn' with MXFP8 needs H to be a multiple of 32 (1x32 scale blocks), "
                         f"got H={args.hidden_size}")
    if not quantized and args.activation.name == "srelu":
        raise ValueError("activation: cuDNN Frontend's squared-ReLU kernels take only block-scaled operands; "
                         "use recipe='mxfp8' with backend='cudnn'")
    if (quantized and args.deterministic and args.activation.name != "srelu" and args.b1 is not None
            and args.b1.requires_grad):
        raise ValueError(
            "deterministic: cuDNN Frontend's deterministic block-scaled dGLU mode excludes the fused dbias; "
            "use backend='triton' or 'reference', or freeze b1"
        )
    if not quantized and args.deterministic and args.probs is not None and args.probs.requires_grad:
        raise ValueError(
            "deterministic: cuDNN Frontend's BF16 dGLU kernel accumulates the router-prob gradient with atomics "
            "(its deterministic mode is block-scaled only); use backend='triton' or 'reference', or detach probs"
        )
    signature = _signature(args)
    if signature not in _compiled_signatures:
        if args.x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "backend='cudnn': first call with this shape during CUDA graph capture; cuDNN Frontend compiles "
                "its kernels on first use, so run one eager forward+backward with the same shapes before capturing"
            )
        _compiled_signatures.add(signature)
    if isinstance(args.recipe, NVFP4BlockScaling):
        return fp4.CudnnNVFP4ExpertMLP.apply(
            args.x, args.tokens_per_expert, args.w1, args.w2, args.b1, args.b2, args.probs,
            args.activation.name, args.recipe, kernel_offsets(args.tokens_per_expert), fe,
        )
    if quantized:
        return CudnnMXFP8ExpertMLP.apply(
            args.x, args.tokens_per_expert, args.w1, args.w2, args.b1, args.b2, args.probs,
            args.activation.name, args.deterministic, kernel_offsets(args.tokens_per_expert), fe,
        )
    return _CudnnExpertMLP.apply(
        args.x, args.tokens_per_expert, args.w1, args.w2, args.b1, args.b2, args.probs,
        args.activation.name, args.deterministic, fe,
    )


def _two_d(t: torch.Tensor, rows: int) -> torch.Tensor:
    return t.reshape(rows, -1)


def group_sums(rows_pad: torch.Tensor, offsets: torch.Tensor, experts: int) -> torch.Tensor:
    """Per-group row sums of a padded ``[M, H]`` tensor (rows past the last group are dropped)."""
    m = rows_pad.shape[0]
    group = torch.searchsorted(offsets.to(torch.int64), torch.arange(m, device=rows_pad.device), right=True)
    acc = torch.float64 if rows_pad.dtype == torch.float64 else torch.float32
    sums = rows_pad.new_zeros((experts + 1, rows_pad.shape[1]), dtype=acc)
    sums.index_add_(0, group, rows_pad.to(acc))
    return sums[:experts]


class _CudnnExpertMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, counts, w1, w2, b1, b2, probs, act_name, deterministic, fe):
        tokens, hidden = x.shape
        experts, _, ffn = w2.shape
        rows = padded_rows_bound(tokens, experts)
        offsets = kernel_offsets(counts)
        row_index = padded_row_index(counts, tokens)
        valid = valid_row_mask(counts, tokens)
        ones = torch.ones(experts, dtype=torch.float32, device=x.device)

        # Rows that belong to no expert become zero rows with zero prob: they add nothing anywhere.
        x_pad = scatter_to_padded(torch.where(valid[:, None], x, torch.zeros_like(x)), row_index, rows)
        prob_rows = probs.float() if probs is not None else torch.ones(tokens, device=x.device)
        prob_pad = scatter_to_padded(torch.where(valid, prob_rows, torch.zeros_like(prob_rows)), row_index, rows)

        w1_glu = interleave_glu(w1, dim=1)  # [E, 2F, H]: B (N=2F, K=H) per expert, K-major
        bias1 = interleave_glu(b1, dim=1).t() if b1 is not None else None  # (N, L), stride (1, N)
        fc1 = fe.grouped_gemm_glu_wrapper_sm100(
            a_tensor=x_pad, sfa_tensor=None, padded_offsets=offsets, alpha_tensor=ones,
            b_tensor=w1_glu, bias_tensor=bias1, prob_tensor=prob_pad,
            c_dtype=x.dtype, d_dtype=x.dtype, act_func=FORWARD_ACT[act_name], linear_offset=LINEAR_OFFSET[act_name],
            m_aligned=GROUP_ALIGN, generate_c=True,
        )
        pre_act = _two_d(fc1["c_tensor"], rows)  # [M, 2F] interleaved, bias included
        act = _two_d(fc1["d_tensor"], rows)  # [M, F] = GLU(pre_act) * prob

        fc2 = fe.grouped_gemm_wrapper_sm100(
            a_tensor=act, padded_offsets=offsets, alpha_tensor=ones, b_tensor=w2,  # B (N=H, K=F) = w2[e]
            bias_tensor=b2.t() if b2 is not None else None, c_dtype=x.dtype, d_dtype=x.dtype, m_aligned=GROUP_ALIGN,
        )
        y_pad = _two_d(fc2["d_tensor"], rows)
        y = gather_from_padded(y_pad, row_index)
        y = torch.where(valid[:, None], y, torch.zeros_like(y))

        ctx.save_for_backward(x_pad, pre_act, act, prob_pad, offsets, row_index, valid, w1_glu, w2, counts)
        ctx.meta = (tokens, hidden, ffn, experts, rows, act_name, deterministic, fe,
                    b1 is not None, b2 is not None, probs.dtype if probs is not None else None)
        return y

    @staticmethod
    def backward(ctx, dy):
        x_pad, pre_act, act, prob_pad, offsets, row_index, valid, w1_glu, w2, counts = ctx.saved_tensors
        tokens, hidden, ffn, experts, rows, act_name, deterministic, fe, has_b1, has_b2, probs_dtype = ctx.meta
        need = ctx.needs_input_grad  # x, counts, w1, w2, b1, b2, probs, ...
        ones = torch.ones(experts, dtype=torch.float32, device=dy.device)

        dy = dy.to(x_pad.dtype)
        dy_pad = scatter_to_padded(torch.where(valid[:, None], dy, torch.zeros_like(dy)), row_index, rows)

        # FC2 dgrad fused with the GLU backward: R = dy @ W2 (B = W2^T per expert, (N=F, K=H) K-major).
        dprob_pad = torch.zeros(rows, dtype=torch.float32, device=dy.device)  # the kernel accumulates into it
        dglu = fe.grouped_gemm_dglu_wrapper_sm100(
            a_tensor=dy_pad, c_tensor=pre_act, sfa_tensor=None, padded_offsets=offsets,
            alpha_tensor=ones, beta_tensor=ones, prob_tensor=prob_pad, dprob_tensor=dprob_pad,
            b_tensor=w2.transpose(1, 2).contiguous(), generate_dbias=has_b1 and need[4],
            # Only dprob is accumulated with atomics; the call refuses deterministic runs that need it.
            d_dtype=x_pad.dtype, act_func=BACKWARD_ACT[act_name], linear_offset=LINEAR_OFFSET[act_name],
            deterministic=False,
        )
        dh = _two_d(dglu["d_row_tensor"], rows)  # [M, 2F] interleaved d(pre_act)

        dx = dw1 = dw2 = db1 = db2 = dprobs = None
        if need[0]:
            # The 2F contraction does not care about column order, so dh and W1 stay interleaved.
            fc1_dgrad = fe.grouped_gemm_wrapper_sm100(
                a_tensor=dh, padded_offsets=offsets, alpha_tensor=ones, b_tensor=w1_glu.transpose(1, 2).contiguous(),
                c_dtype=x_pad.dtype, d_dtype=x_pad.dtype, m_aligned=GROUP_ALIGN,
            )
            dx = gather_from_padded(_two_d(fc1_dgrad["d_tensor"], rows), row_index)
            dx = torch.where(valid[:, None], dx, torch.zeros_like(dx))
        if need[2]:
            dw1_glu = fe.grouped_gemm_wgrad_wrapper_sm100(
                a_tensor=dh.t(), b_tensor=x_pad, sfa_tensor=None, sfb_tensor=None, offsets_tensor=offsets,
                wgrad_dtype=w1_glu.dtype,
            )["wgrad_tensor"]
            dw1 = zero_empty_groups(deinterleave_glu(dw1_glu.reshape(experts, 2 * ffn, hidden), dim=1), counts)
        if need[3]:
            dw2 = fe.grouped_gemm_wgrad_wrapper_sm100(
                a_tensor=dy_pad.t(), b_tensor=act, sfa_tensor=None, sfb_tensor=None, offsets_tensor=offsets,
                wgrad_dtype=w2.dtype,
            )["wgrad_tensor"].reshape(experts, hidden, ffn)
            dw2 = zero_empty_groups(dw2, counts)
        if has_b1 and need[4]:
            db1 = deinterleave_glu(dglu["dbias_tensor"].reshape(experts, 2 * ffn), dim=1).to(w2.dtype)
        if has_b2 and need[5]:
            db2 = group_sums(dy_pad, offsets, experts).to(w2.dtype)
        if probs_dtype is not None and need[6]:
            dprob = gather_from_padded(_two_d(dglu["dprob_tensor"], rows), row_index).reshape(tokens)
            dprobs = torch.where(valid, dprob, torch.zeros_like(dprob)).to(probs_dtype)
        return dx, None, dw1, dw2, db1, db2, dprobs, None, None, None


def compiled_signature_count() -> int:
    """How many shape signatures have been compiled in this process (for tests and `env`)."""
    return len(_compiled_signatures)


__all__ = ["cudnn_expert_mlp", "run_expert_mlp", "kernel_offsets", "check_shapes", "compiled_signature_count"]
