"""The NVFP4 expert MLP on cuDNN Frontend's SM100 block-scaled fused grouped GEMM kernels.

    forward:  x_q   ─► GLU kernel (FP4 operands): FC1 + b1 + GLU + prob; keeps C (FP32) and
                       writes the activation D in FP32 (the epilogue has no FP4 output)
              D     ─► our quantizer, per expert: rowwise (FC2 fprop) and columnwise (FC2 wgrad)
              a_q   ─► block-scaled grouped GEMM (FC2 + b2) ─► y_pad
    backward: dy_q  ─► dGLU kernel (dy @ W2 fused with dGLU(C) * prob, dprob, db1) ─► dh (FP32)
              dh    ─► our quantizer: rowwise (FC1 dgrad) and columnwise (FC1 wgrad)
              dh_q  ─► block-scaled grouped GEMM (FC1 dgrad) ─► dx_pad
              wgrad kernel: dW2 = dy_col^T a_col,  dW1 = dh_col^T x_col       (per group of rows)

Numerics are those of ``backends/reference/gemm.py`` with :class:`NVFP4BlockScaling`: each
expert's slice of every GEMM operand is its own NVFP4 tensor (own FP32 tensor scale), quantized
along that GEMM's reduction dimension by :mod:`te_fused_moe.quantize.nvfp4` (TE's rules):

* activations/gradients: one call over the padded buffer with a per-row tensor amax
  (``row_global_amax``), the amax of the row's group computed on the device by
  :func:`segmented_amax` from ``padded_offsets`` (no host read). Groups start on 256-row
  boundaries, so 16-token blocks of the columnwise (token-innermost) copies restart at each group.
* weights: per expert (each ``w[e]`` is its own tensor), 16x16 tiles unless
  ``disable_2d_quantization`` (the kernels read 1x16 scales, so each tile's scale is repeated on
  its 16 rows); the fprop copy along K and the dgrad copy along N are separate quantizations.
* wgrad operands (x, the activation, dy, dh along tokens): 16-point RHT along tokens first unless
  ``disable_rht``; the tensor amax is that of the transformed slice. The wgrad kernel multiplies
  the transformed operands, which equals the reference's ``qdq(t M) M^T`` products.
* gradients (dy, dh, both copies) are stochastically rounded unless
  ``disable_stochastic_rounding`` (bits from PyTorch's generator, as in the reference; the draws
  differ from the reference's, the distribution does not).

The kernels take the tensor scales as FP32 per-group factors: ``alpha`` of the GLU and quant
wrappers = product of the two operands' dequant scales ``amax / (6 * 448)``; the dGLU kernel
multiplies its accumulator by ``alpha * alpha`` (``square_alpha`` in
``moe_blockscaled_grouped_gemm_dglu_dbias.py``), so it gets the square root of that product; the
wgrad wrapper takes ``global_scale_a``/``global_scale_b`` (one per group each) and multiplies them.

Kernel limits this follows (1.32.0 ``glu/_blockscaled_api.py``, ``dglu/_blockscaled_api.py``):
with FP4 operands D must be FP16/BF16/FP32, and FP32 D (kept so the activation and dh are
quantized from FP32 values, as in the reference) is refused unless a bias is fused — the forward
passes a zero bias when the layer has none and the dGLU always generates dbias. The deterministic
dGLU mode excludes dbias, so ``deterministic=True`` is refused for NVFP4.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...quantize import formats, hadamard, nvfp4
from .layouts import (
    GROUP_ALIGN,
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

NV_BLOCK = 16
FP4 = torch.float4_e2m1fn_x2
E4M3 = torch.float8_e4m3fn
DEQUANT_DIVISOR = nvfp4.E2M1_MAX * nvfp4.E4M3_MAX  # 2688: dequant scale = amax / 2688 (TE)
GLU_FORWARD = {"swiglu": "swiglu", "gpt_oss_swiglu": "geglu"}
GLU_BACKWARD = {"swiglu": "dswiglu", "gpt_oss_swiglu": "dgeglu"}
LINEAR_OFFSET = {"swiglu": 0.0, "gpt_oss_swiglu": 1.0}


class FP4Operand(NamedTuple):
    data: torch.Tensor  # float4_e2m1fn_x2, packed along the reduction dimension
    scales: torch.Tensor  # E4M3 1x16 scales in 128x4 atoms
    amax: torch.Tensor  # float32 [E]: each group's tensor amax


# --------------------------------------------------------------------------- per-group tensor amax

def row_groups(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """int64 ``[rows]``: the group of each padded row (``E`` for rows past the last group)."""
    return torch.searchsorted(offsets.to(torch.int64), torch.arange(rows, device=offsets.device), right=True)


def segmented_amax(values: torch.Tensor, groups: torch.Tensor, experts: int) -> torch.Tensor:
    """float32 ``[E]``: max |values| over each group's rows (NaN skipped, empty group 0), on the
    device: a per-row amax scattered with ``amax`` into one slot per group (+1 dropped slot)."""
    per_row = formats.nan_ignoring_amax(values.to(torch.float32), dim=1)
    out = torch.zeros(experts + 1, dtype=torch.float32, device=values.device)
    out.scatter_reduce_(0, groups, per_row, reduce="amax", include_self=True)
    return out[:experts]


def _per_row(amax: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Each row's group amax; rows past the last group get 0 (never read by a kernel)."""
    return torch.cat([amax, amax.new_zeros(1)])[groups]


def dequant_scale(amax: torch.Tensor) -> torch.Tensor:
    """FP32 per-group dequant factor ``amax * fp32(1/2688)`` (TE's ``dequantize_nvfp4`` factor)."""
    return amax * (1.0 / DEQUANT_DIVISOR)  # a Python scalar: float32 multiply, no host-to-device copy


def gemm_alpha(a: FP4Operand, b: FP4Operand) -> torch.Tensor:
    """Per-group ``alpha`` of a GEMM of two NVFP4 operands: the product of their dequant scales."""
    return dequant_scale(a.amax) * dequant_scale(b.amax)


def dglu_alpha(a: FP4Operand, b: FP4Operand) -> torch.Tensor:
    """The dGLU kernel scales its accumulator by ``alpha * alpha``: pass the square root."""
    return torch.sqrt(gemm_alpha(a, b))


# --------------------------------------------------------------------------- quantizers

_RHT_MATRICES: dict = {}


def rht_along_rows(t: torch.Tensor) -> torch.Tensor:
    """``hadamard.apply_rht(t, axis=0)`` (FP64 transform, one rounding to FP32) for a row count that
    is a multiple of 16, with the 16x16 matrix cached per device: building it copies from the host,
    which synchronizes, so it happens once (in the first, eager call) instead of every step."""
    key = str(t.device)
    if key not in _RHT_MATRICES:
        _RHT_MATRICES[key] = hadamard.rht_matrix(t.device)
    moved = t.t().to(torch.float64)  # [N, M]: runs of 16 tokens along the last dimension
    runs = moved.reshape(moved.shape[0], -1, hadamard.SIZE)
    return (runs @ _RHT_MATRICES[key]).reshape(moved.shape).t().contiguous().to(torch.float32)


def quantize_rows(t: torch.Tensor, groups: torch.Tensor, experts: int, stochastic: bool) -> FP4Operand:
    """Padded ``t [M, K]`` quantized along K (1x16), each row with its group's tensor amax:
    FP4 data ``[M, K/2]`` and scales in atoms over ``(M, K/16)``."""
    amax = segmented_amax(t, groups, experts)
    q = nvfp4.quantize(t, axis=1, stochastic_rounding=stochastic, row_global_amax=_per_row(amax, groups))
    return FP4Operand(q.data.view(FP4), swizzle_scales(q.scale), amax)


def quantize_columns(t: torch.Tensor, groups: torch.Tensor, experts: int, stochastic: bool, rht: bool) -> FP4Operand:
    """Padded ``t [M, N]`` quantized along the rows (tokens) in 16-row blocks, optionally after the
    RHT along the rows: token-innermost FP4 data ``[N, M/2]`` and scales in atoms over
    ``(N, M/16)`` (how the wgrad kernel reads a K=tokens operand)."""
    values = rht_along_rows(t) if rht else t  # M is a multiple of 256: no padding
    amax = segmented_amax(values, groups, experts)
    q = nvfp4.quantize(values, axis=0, stochastic_rounding=stochastic, row_global_amax=_per_row(amax, groups))
    # data [M/2, N] packs tokens (2j, 2j+1) into byte j: its transpose is the token-innermost copy.
    return FP4Operand(q.data.t().contiguous().view(FP4), swizzle_scales(q.scale.t()), amax)


def quantize_weights(w: torch.Tensor, block_2d: bool) -> FP4Operand:
    """``w [E, N, K]`` quantized along K, each expert its own tensor (16x16 tiles with
    ``block_2d``; N must then be a multiple of 16 so tiles stay inside one expert): FP4 data
    ``[E, N, K/2]`` and scales in atoms over ``(E, N, K/16)``."""
    experts, n, k = w.shape
    amax = formats.nan_ignoring_amax(w.reshape(experts, -1).to(torch.float32), dim=1)
    flat = w.reshape(experts * n, k)
    # expand, not repeat_interleave: some torch versions read a repeats tensor back on the host
    q = nvfp4.quantize(flat, axis=1, block_2d=block_2d, row_global_amax=amax[:, None].expand(experts, n).reshape(-1))
    scale = q.scale
    if block_2d:  # one scale per 16x16 tile -> the same scale on each of the tile's 16 rows
        scale = scale[:, None, :].expand(-1, NV_BLOCK, -1).reshape(-1, scale.shape[1])[: experts * n]
    return FP4Operand(q.data.reshape(experts, n, -1).view(FP4), swizzle_scales(scale.reshape(experts, n, -1)), amax)


def _two_d(t: torch.Tensor, rows: int) -> torch.Tensor:
    return t.reshape(rows, -1)


class CudnnNVFP4ExpertMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, counts, w1, w2, b1, b2, probs, act_name, recipe, offsets, fe):
        tokens, hidden = x.shape
        experts, _, ffn = w2.shape
        rows = padded_rows_bound(tokens, experts)
        row_index = padded_row_index(counts, tokens)
        valid = valid_row_mask(counts, tokens)
        groups = row_groups(offsets, rows)
        device = x.device
        norm_const = torch.ones(1, dtype=torch.float32, device=device)
        two_d = not recipe.disable_2d_quantization
        rht = not recipe.disable_rht

        x_pad = scatter_to_padded(torch.where(valid[:, None], x, torch.zeros_like(x)), row_index, rows)
        prob_rows = probs.float() if probs is not None else torch.ones(tokens, device=device)
        prob_pad = scatter_to_padded(torch.where(valid, prob_rows, torch.zeros_like(prob_rows)), row_index, rows)

        w1_k = interleave_glu(w1, dim=1)  # [E, 2F, H]; 32-row blocks keep 16x16 tiles whole
        # FP32 D with FP4 operands needs a fused bias (1.32): a zero one when the layer has none.
        bias1 = interleave_glu(b1, dim=1).t() if b1 is not None else torch.zeros(experts, 2 * ffn, dtype=x.dtype,
                                                                                  device=device).t()
        xq = quantize_rows(x_pad, groups, experts, stochastic=False)
        w1q = quantize_weights(w1_k, two_d)
        fc1 = fe.grouped_gemm_glu_wrapper_sm100(
            a_tensor=xq.data, sfa_tensor=xq.scales, padded_offsets=offsets, alpha_tensor=gemm_alpha(xq, w1q),
            b_tensor=w1q.data, sfb_tensor=w1q.scales, bias_tensor=bias1, prob_tensor=prob_pad,
            norm_const_tensor=norm_const, c_dtype=torch.float32, d_dtype=torch.float32, sf_vec_size=NV_BLOCK,
            m_aligned=GROUP_ALIGN, act_func=GLU_FORWARD[act_name], linear_offset=LINEAR_OFFSET[act_name],
            generate_c=True,
        )
        pre_act = _two_d(fc1["c_tensor"], rows)  # [M, 2F] FP32, bias included
        act = _two_d(fc1["d_tensor"], rows)  # [M, F] FP32 = prob * GLU(C)

        act_row = quantize_rows(act, groups, experts, stochastic=False)  # FC2 fprop, along F
        act_col = quantize_columns(act, groups, experts, stochastic=False, rht=rht)  # FC2 wgrad, along tokens
        w2q = quantize_weights(w2, two_d)  # B (N=H, K=F) per expert
        fc2 = fe.grouped_gemm_quant_wrapper_sm100(
            a_tensor=act_row.data, sfa_tensor=act_row.scales, padded_offsets=offsets,
            alpha_tensor=gemm_alpha(act_row, w2q), b_tensor=w2q.data, sfb_tensor=w2q.scales,
            bias_tensor=b2.t() if b2 is not None else None, norm_const_tensor=norm_const, d_dtype=x.dtype,
            sf_vec_size=NV_BLOCK, m_aligned=GROUP_ALIGN, generate_amax=False,
        )
        y = gather_from_padded(_two_d(fc2["d_tensor"], rows), row_index)
        y = torch.where(valid[:, None], y, torch.zeros_like(y))

        ctx.save_for_backward(x_pad, pre_act, act_col.data, act_col.scales, act_col.amax, prob_pad, offsets,
                              groups, row_index, valid, w1_k, w2, counts)
        ctx.meta = (tokens, hidden, ffn, experts, rows, act_name, recipe, fe, b1 is not None, b2 is not None,
                    probs.dtype if probs is not None else None)
        return y

    @staticmethod
    def backward(ctx, dy):
        (x_pad, pre_act, act_col_data, act_col_scales, act_col_amax, prob_pad, offsets, groups, row_index, valid,
         w1_k, w2, counts) = ctx.saved_tensors
        tokens, hidden, ffn, experts, rows, act_name, recipe, fe, has_b1, has_b2, probs_dtype = ctx.meta
        act_col = FP4Operand(act_col_data, act_col_scales, act_col_amax)
        need = ctx.needs_input_grad  # x, counts, w1, w2, b1, b2, probs, ...
        device = dy.device
        ones = torch.ones(experts, dtype=torch.float32, device=device)
        norm_const = torch.ones(1, dtype=torch.float32, device=device)
        two_d = not recipe.disable_2d_quantization
        rht = not recipe.disable_rht
        sr = not recipe.disable_stochastic_rounding

        dy = dy.to(x_pad.dtype)
        dy_pad = scatter_to_padded(torch.where(valid[:, None], dy, torch.zeros_like(dy)), row_index, rows)

        # FC2 dgrad fused with dGLU: R = dy @ W2, both along H. The kernel scales by alpha^2.
        dyq = quantize_rows(dy_pad, groups, experts, stochastic=sr)
        w2tq = quantize_weights(w2.transpose(1, 2), two_d)  # B = W2^T per expert, (N=F, K=H)
        dprob_pad = torch.zeros(rows, dtype=torch.float32, device=device)  # the kernel accumulates into it
        dglu = fe.grouped_gemm_dglu_wrapper_sm100(
            a_tensor=dyq.data, c_tensor=pre_act, sfa_tensor=dyq.scales, padded_offsets=offsets,
            alpha_tensor=dglu_alpha(dyq, w2tq), beta_tensor=ones, prob_tensor=prob_pad,
            dprob_tensor=dprob_pad, b_tensor=w2tq.data, sfb_tensor=w2tq.scales,
            generate_dbias=True,  # FP32 dh with FP4 operands needs the fused dbias (1.32)
            norm_const_tensor=norm_const, d_dtype=torch.float32, sf_vec_size=NV_BLOCK, m_aligned=GROUP_ALIGN,
            act_func=GLU_BACKWARD[act_name], linear_offset=LINEAR_OFFSET[act_name], deterministic=False,
        )
        dh = _two_d(dglu["d_row_tensor"], rows)  # [M, 2F] FP32, interleaved d(pre_act)

        dx = dw1 = dw2 = db1 = db2 = dprobs = None
        if need[0]:
            # 16-blocks along the interleaved 2F are whole gate or up blocks: the same blocks as [gate | up].
            dhq = quantize_rows(dh, groups, experts, stochastic=sr)
            w1tq = quantize_weights(w1_k.transpose(1, 2), two_d)  # B = W1^T per expert, (N=H, K=2F)
            fc1_dgrad = fe.grouped_gemm_quant_wrapper_sm100(
                a_tensor=dhq.data, sfa_tensor=dhq.scales, padded_offsets=offsets, alpha_tensor=gemm_alpha(dhq, w1tq),
                b_tensor=w1tq.data, sfb_tensor=w1tq.scales, norm_const_tensor=norm_const, d_dtype=x_pad.dtype,
                sf_vec_size=NV_BLOCK, m_aligned=GROUP_ALIGN, generate_amax=False,
            )
            dx = gather_from_padded(_two_d(fc1_dgrad["d_tensor"], rows), row_index)
            dx = torch.where(valid[:, None], dx, torch.zeros_like(dx))
        if need[2]:
            dh_col = quantize_columns(dh, groups, experts, stochastic=sr, rht=rht)
            x_col = quantize_columns(x_pad, groups, experts, stochastic=False, rht=rht)
            dw1_k = fe.grouped_gemm_wgrad_wrapper_sm100(
                a_tensor=dh_col.data, b_tensor=x_col.data.t(), sfa_tensor=dh_col.scales, sfb_tensor=x_col.scales,
                offsets_tensor=offsets, global_scale_a=dequant_scale(dh_col.amax),
                global_scale_b=dequant_scale(x_col.amax), wgrad_dtype=w1_k.dtype, sf_vec_size=NV_BLOCK,
            )["wgrad_tensor"].reshape(w1_k.shape)
            dw1 = zero_empty_groups(deinterleave_glu(dw1_k, dim=1), counts)
        if need[3]:
            dy_col = quantize_columns(dy_pad, groups, experts, stochastic=sr, rht=rht)
            dw2 = fe.grouped_gemm_wgrad_wrapper_sm100(
                a_tensor=dy_col.data, b_tensor=act_col.data.t(), sfa_tensor=dy_col.scales, sfb_tensor=act_col.scales,
                offsets_tensor=offsets, global_scale_a=dequant_scale(dy_col.amax),
                global_scale_b=dequant_scale(act_col.amax), wgrad_dtype=w2.dtype, sf_vec_size=NV_BLOCK,
            )["wgrad_tensor"].reshape(experts, hidden, ffn)
            dw2 = zero_empty_groups(dw2, counts)
        if has_b1 and need[4]:
            db1 = deinterleave_glu(dglu["dbias_tensor"].reshape(experts, -1), dim=1).to(w2.dtype)
        if has_b2 and need[5]:
            from .kernels import group_sums  # the BF16 module owns the helper

            db2 = group_sums(dy_pad, offsets, experts).to(w2.dtype)
        if probs_dtype is not None and need[6]:
            dprob = gather_from_padded(_two_d(dglu["dprob_tensor"], rows), row_index).reshape(tokens)
            dprobs = torch.where(valid, dprob, torch.zeros_like(dprob)).to(probs_dtype)
        return dx, None, dw1, dw2, db1, db2, dprobs, None, None, None, None




def call_limits(args) -> "str | None":
    """Why this NVFP4 path cannot run a call (``None`` when it can): checked before any kernel."""
    if args.activation.name not in GLU_FORWARD:
        return (f"activation {args.activation.name!r} with recipe nvfp4: backend='cudnn' drives cuDNN Frontend's "
                f"FP4 kernels for the GLU activations (swiglu, gpt_oss_swiglu) only; its squared-ReLU wrappers "
                f"are driven for MXFP8 only; use backend='reference'")
    if args.hidden_size % 32 != 0:
        return (f"x: backend='cudnn' with NVFP4 needs H to be a multiple of 32 (16-byte rows of packed FP4 and "
                f"16x16 weight tiles), got H={args.hidden_size}")
    if args.deterministic:
        return ("deterministic: backend='cudnn' with NVFP4 needs cuDNN Frontend's fused dbias in the dGLU kernel "
                "(an FP32 dh from FP4 operands requires it in 1.32) and its deterministic dGLU mode excludes "
                "dbias; use backend='reference', or deterministic=False")
    return None


__all__ = [
    "CudnnNVFP4ExpertMLP",
    "FP4Operand",
    "call_limits",
    "row_groups",
    "segmented_amax",
    "dequant_scale",
    "gemm_alpha",
    "dglu_alpha",
    "quantize_rows",
    "quantize_columns",
    "rht_along_rows",
    "quantize_weights",
]
