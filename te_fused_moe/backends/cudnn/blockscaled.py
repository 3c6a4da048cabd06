"""The MXFP8 expert MLP on cuDNN Frontend's SM100 block-scaled fused grouped GEMM kernels.

    forward:  x_q  ─► act kernel (GLU or sReLU): FC1 + b1 + act + prob; keeps C; emits the
                      activation already MXFP8-quantized rowwise (D, SFD_row) and columnwise
                      (D_col, SFD_col)
              D    ─► block-scaled grouped GEMM (FC2 + b2) ─► y_pad (BF16)
    backward: dy_q ─► dact kernel (dy @ W2 fused with dact(C) * prob, dprob, db1); emits dh
                      quantized rowwise and columnwise the same way
              dh_row ─► block-scaled grouped GEMM (FC1 dgrad) ─► dx_pad
              wgrad kernel: dW2 = dy_col^T D_col,  dW1 = dh_col^T x_col     (per group of rows)

Which copy each GEMM reads follows the recipe rules of ``backends/reference/gemm.py``: every
operand is quantized along that GEMM's reduction dimension (fprop/dgrad: along the feature
dimension, rowwise; wgrad: along tokens, columnwise, 32-row blocks that restart at each group's
first row because groups start on 256-row boundaries). Operands this module quantizes go through
our TE-exact quantizer (:mod:`te_fused_moe.quantize.mxfp8`); the activation and dh are quantized
by the kernels' epilogues, whose rule as read in 1.32.0's code
(``moe_blockscaled_grouped_gemm_glu_bias.py``: ``quant_sfd_row``/``quant_sfd_col``) is
``scale = e8m0(amax * (1/448) * norm_const)``, ``value = fp8(v * norm_const / scale)`` — TE's
MXFP8 rule with ``norm_const = 1`` provided the E8M0 conversion rounds up as TE's does (not
verified on hardware: see docs/te_cudnn.md).

Scale factors travel as ``torch.float8_e8m0fnu`` in the 128x4 atom layout (:mod:`.layouts`).
Only E4M3 operands: the kernels require A and B of one dtype, so ``Format.HYBRID`` (E5M2 gradients
times E4M3 weights) is refused by :func:`te_fused_moe.backends.cudnn.CudnnBackend.supports`.
"""

from __future__ import annotations

import torch

from ...quantize import mxfp8
from .layouts import (
    GROUP_ALIGN,
    atom_view,
    atoms_from_view,
    legacy_rows,
    legacy_vector,
    legacy_weights,
    deinterleave_glu,
    gather_from_padded,
    interleave_glu,
    padded_row_index,
    padded_rows_bound,
    scatter_to_padded,
    swizzle_scales,
    valid_row_mask,
    zero_empty_groups,
)

MX_BLOCK = 32
GLU_FORWARD = {"swiglu": "swiglu", "gpt_oss_swiglu": "geglu"}
GLU_BACKWARD = {"swiglu": "dswiglu", "gpt_oss_swiglu": "dgeglu"}
LINEAR_OFFSET = {"swiglu": 0.0, "gpt_oss_swiglu": 1.0}
E8M0 = torch.float8_e8m0fnu


def mx_rowwise(t: torch.Tensor):
    """``t [..., rows, K]`` quantized along K: (E4M3 data, scales in 128x4 atoms over (rows, K/32)).
    A 3-D ``t`` is one atom batch per expert."""
    q = mxfp8.quantize(t, axis=-1, fp8_format="e4m3")
    return q.data, swizzle_scales(q.scale).view(E8M0)


def mx_columnwise(t: torch.Tensor):
    """``t [M, N]`` quantized along M (32-row blocks): (E4M3 data ``[M, N]``, scales in atoms over the
    transposed logical matrix ``(N, M/32)``, which is how the wgrad kernel reads a K=tokens operand)."""
    q = mxfp8.quantize(t, axis=0, fp8_format="e4m3")
    return q.data, swizzle_scales(q.scale.t()).view(E8M0)


def _two_d(t: torch.Tensor, rows: int) -> torch.Tensor:
    return t.reshape(rows, -1)


class CudnnMXFP8ExpertMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, counts, w1, w2, b1, b2, probs, act_name, deterministic, offsets, fe):
        tokens, hidden = x.shape
        experts, _, ffn = w2.shape
        gated = act_name != "srelu"
        rows = padded_rows_bound(tokens, experts)
        row_index = padded_row_index(counts, tokens)
        valid = valid_row_mask(counts, tokens)
        device = x.device
        ones = torch.ones(experts, dtype=torch.float32, device=device)
        norm_const = torch.ones(1, dtype=torch.float32, device=device)

        x_pad = scatter_to_padded(torch.where(valid[:, None], x, torch.zeros_like(x)), row_index, rows)
        prob_rows = probs.float() if probs is not None else torch.ones(tokens, device=device)
        prob_pad = scatter_to_padded(torch.where(valid, prob_rows, torch.zeros_like(prob_rows)), row_index, rows)

        w1_k = interleave_glu(w1, dim=1) if gated else w1  # [E, N1, H], B (N1, K=H) per expert
        bias1 = None
        if b1 is not None:
            bias1 = (interleave_glu(b1, dim=1) if gated else b1).t()  # (N1, L), stride (1, N1)
        xq, sfx = mx_rowwise(x_pad)
        w1q, sfw1 = mx_rowwise(w1_k)
        fc1_args = dict(
            padded_offsets=offsets, alpha_tensor=ones, bias_tensor=bias1, norm_const_tensor=norm_const,
            c_dtype=x.dtype, d_dtype=torch.float8_e4m3fn, sf_vec_size=MX_BLOCK, m_aligned=GROUP_ALIGN,
        )
        if gated:
            fc1 = fe.grouped_gemm_glu_wrapper_sm100(
                a_tensor=xq, sfa_tensor=sfx, b_tensor=w1q, sfb_tensor=sfw1, prob_tensor=prob_pad, **fc1_args,
                act_func=GLU_FORWARD[act_name], linear_offset=LINEAR_OFFSET[act_name], generate_c=True)
            sf_act_row, sf_act_col = fc1["sfd_row_tensor"], fc1["sfd_col_tensor"]
        else:  # the sReLU wrapper takes only the older operand views (layouts.legacy_*)
            fc1 = fe.grouped_gemm_srelu_wrapper_sm100(
                a_tensor=legacy_rows(xq), sfa_tensor=atom_view(sfx), b_tensor=legacy_weights(w1q),
                sfb_tensor=atom_view(sfw1), prob_tensor=legacy_vector(prob_pad), **fc1_args)
            sf_act_row, sf_act_col = atoms_from_view(fc1["sfd_row_tensor"]), atoms_from_view(fc1["sfd_col_tensor"])
        pre_act = _two_d(fc1["c_tensor"], rows)  # [M, N1], bias included
        act_row = _two_d(fc1["d_tensor"], rows)  # quantized along F: FC2 fprop
        act_col = _two_d(fc1["d_col_tensor"], rows)  # quantized along tokens: FC2 wgrad

        w2q, sfw2 = mx_rowwise(w2)  # B (N=H, K=F) per expert, along F
        fc2 = fe.grouped_gemm_quant_wrapper_sm100(
            a_tensor=act_row, sfa_tensor=sf_act_row, padded_offsets=offsets, alpha_tensor=ones, b_tensor=w2q,
            sfb_tensor=sfw2, bias_tensor=b2.t() if b2 is not None else None, norm_const_tensor=norm_const,
            d_dtype=x.dtype, sf_vec_size=MX_BLOCK, m_aligned=GROUP_ALIGN, generate_amax=False,
        )
        y = gather_from_padded(_two_d(fc2["d_tensor"], rows), row_index)
        y = torch.where(valid[:, None], y, torch.zeros_like(y))

        ctx.save_for_backward(x_pad, pre_act, act_col, sf_act_col, prob_pad, offsets, row_index, valid, w1_k, w2,
                              counts)
        ctx.meta = (tokens, hidden, ffn, experts, rows, act_name, deterministic, fe, b1 is not None, b2 is not None,
                    probs.dtype if probs is not None else None)
        return y

    @staticmethod
    def backward(ctx, dy):
        (x_pad, pre_act, act_col, sf_act_col, prob_pad, offsets, row_index, valid, w1_k, w2,
         counts) = ctx.saved_tensors
        tokens, hidden, ffn, experts, rows, act_name, deterministic, fe, has_b1, has_b2, probs_dtype = ctx.meta
        gated = act_name != "srelu"
        need = ctx.needs_input_grad  # x, counts, w1, w2, b1, b2, probs, ...
        device = dy.device
        ones = torch.ones(experts, dtype=torch.float32, device=device)
        norm_const = torch.ones(1, dtype=torch.float32, device=device)

        dy = dy.to(x_pad.dtype)
        dy_pad = scatter_to_padded(torch.where(valid[:, None], dy, torch.zeros_like(dy)), row_index, rows)

        # FC2 dgrad fused with the activation backward: R = dy @ W2, both quantized along H.
        dyq, sfdy = mx_rowwise(dy_pad)
        w2tq, sfw2t = mx_rowwise(w2.transpose(1, 2))  # B = W2^T per expert, (N=F, K=H)
        dprob_pad = torch.zeros(rows, dtype=torch.float32, device=device)  # the kernel accumulates into it
        dact_args = dict(
            padded_offsets=offsets, alpha_tensor=ones, generate_dbias=has_b1 and need[4],
            norm_const_tensor=norm_const, d_dtype=torch.float8_e4m3fn, sf_vec_size=MX_BLOCK, m_aligned=GROUP_ALIGN,
            deterministic=deterministic,  # block-scaled dprob (and dsReLU's dbias) have a fixed-order mode
        )
        if gated:
            dact = fe.grouped_gemm_dglu_wrapper_sm100(
                a_tensor=dyq, c_tensor=pre_act, sfa_tensor=sfdy, b_tensor=w2tq, sfb_tensor=sfw2t,
                prob_tensor=prob_pad, dprob_tensor=dprob_pad, **dact_args, beta_tensor=ones,
                act_func=GLU_BACKWARD[act_name], linear_offset=LINEAR_OFFSET[act_name])
            sf_dh_row, sf_dh_col = dact["sfd_row_tensor"], dact["sfd_col_tensor"]
        else:
            dact = fe.grouped_gemm_dsrelu_wrapper_sm100(
                a_tensor=legacy_rows(dyq), c_tensor=legacy_rows(pre_act), sfa_tensor=atom_view(sfdy),
                b_tensor=legacy_weights(w2tq), sfb_tensor=atom_view(sfw2t), prob_tensor=legacy_vector(prob_pad),
                dprob_tensor=legacy_vector(dprob_pad), **dact_args)
            sf_dh_row, sf_dh_col = atoms_from_view(dact["sfd_row_tensor"]), atoms_from_view(dact["sfd_col_tensor"])
        dh_row = _two_d(dact["d_row_tensor"], rows)  # quantized along N1: FC1 dgrad
        dh_col = _two_d(dact["d_col_tensor"], rows)  # quantized along tokens: FC1 wgrad

        dx = dw1 = dw2 = db1 = db2 = dprobs = None
        if need[0]:
            # The N1 contraction does not care about column order, so dh and W1 stay interleaved; the
            # 32-blocks along N1 of the interleaved W1 are exactly the gate/up blocks of [gate | up].
            w1tq, sfw1t = mx_rowwise(w1_k.transpose(1, 2))  # B = W1^T per expert, (N=H, K=N1)
            fc1_dgrad = fe.grouped_gemm_quant_wrapper_sm100(
                a_tensor=dh_row, sfa_tensor=sf_dh_row, padded_offsets=offsets, alpha_tensor=ones, b_tensor=w1tq,
                sfb_tensor=sfw1t, norm_const_tensor=norm_const, d_dtype=x_pad.dtype, sf_vec_size=MX_BLOCK,
                m_aligned=GROUP_ALIGN, generate_amax=False,
            )
            dx = gather_from_padded(_two_d(fc1_dgrad["d_tensor"], rows), row_index)
            dx = torch.where(valid[:, None], dx, torch.zeros_like(dx))
        if need[2]:
            xcq, sfxc = mx_columnwise(x_pad)
            dw1_k = fe.grouped_gemm_wgrad_wrapper_sm100(
                a_tensor=dh_col.t(), b_tensor=xcq, sfa_tensor=sf_dh_col, sfb_tensor=sfxc, offsets_tensor=offsets,
                wgrad_dtype=w1_k.dtype, sf_vec_size=MX_BLOCK,
            )["wgrad_tensor"].reshape(w1_k.shape)
            dw1 = zero_empty_groups(deinterleave_glu(dw1_k, dim=1) if gated else dw1_k, counts)
        if need[3]:
            dycq, sfdyc = mx_columnwise(dy_pad)
            dw2 = fe.grouped_gemm_wgrad_wrapper_sm100(
                a_tensor=dycq.t(), b_tensor=act_col, sfa_tensor=sfdyc, sfb_tensor=sf_act_col, offsets_tensor=offsets,
                wgrad_dtype=w2.dtype, sf_vec_size=MX_BLOCK,
            )["wgrad_tensor"].reshape(experts, hidden, ffn)
            dw2 = zero_empty_groups(dw2, counts)
        if has_b1 and need[4]:
            dbias = dact["dbias_tensor"].reshape(experts, -1)
            db1 = (deinterleave_glu(dbias, dim=1) if gated else dbias).to(w2.dtype)
        if has_b2 and need[5]:
            from .kernels import group_sums  # the BF16 module owns the helper

            db2 = group_sums(dy_pad, offsets, experts).to(w2.dtype)
        if probs_dtype is not None and need[6]:
            dprob = gather_from_padded(_two_d(dact["dprob_tensor"], rows), row_index).reshape(tokens)
            dprobs = torch.where(valid, dprob, torch.zeros_like(dprob)).to(probs_dtype)
        return dx, None, dw1, dw2, db1, db2, dprobs, None, None, None, None


__all__ = ["CudnnMXFP8ExpertMLP", "mx_rowwise", "mx_columnwise"]
