"""The autograd Function of the MXFP8 recipe on the Triton backend (same dataflow as ``fp8_block``).

Forward (3 kernels; weights come from the per-step :data:`~.quantize.WEIGHT_CACHE`):
  quantize x (rowwise 1x32 for FC1, 32-token columnwise for w1's wgrad) -> FC1 (+b1, act, x probs;
  h saved; ``a`` written MXFP8 rowwise + columnwise by the epilogue) -> FC2 (+b2) -> y.
Backward (up to 6 kernels):
  quantize dy (rowwise for the dgrad, columnwise for w2's wgrad; per-tile column sums for db2) ->
  FC2 dgrad with the dGLU epilogue (``dh`` quantized rowwise + columnwise, dprob partials, db1
  per-tile sums) -> FC1 dgrad (dx) -> wgrad of w2 and of w1 -> db1, db2 (per-expert sums).

Every GEMM operand is quantized along that GEMM's reduction axis as the reference backend emulates
it (``backends/reference/gemm.py``): fprop x and w along K, dgrad grad and w along N, wgrad grad and
x along the tokens (32-token blocks restarting at each expert's first row). ``a`` and ``dh`` are
quantized from their FP32 values. Differences from the reference: the order of FP32 sums, which can
move a value next to an FP8 rounding boundary (or an amax next to a power of two) by one step; and
``h`` is saved in ``H_DTYPE`` (default x's dtype, as TE saves the GLU input; the reference keeps
FP32), so ``dh`` sees ``h`` rounded to BF16. ``Format.HYBRID`` quantizes dy and dh to E5M2.

Sync-free: no host reads of device data, no data-dependent shapes (buffers sized for the worst case).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..fp8_block.wgrad import tile_sums_to_experts
from ..schedule import build_schedule, max_m_tiles
from . import gemm
from .quantize import TILE, WEIGHT_CACHE, MXRows, MXSpec, new_col_scales, new_row_scales, new_transposed, quantize_rows
from .wgrad import mx_grouped_wgrad

# dtype of the saved FC1 output h (None: x's dtype). Tests set torch.float32 to compare with the reference.
H_DTYPE: Optional[torch.dtype] = None
# Allocator of every kernel buffer (tests replace it to poison buffers with NaN).
ALLOC = torch.empty


def _new(shape, like: torch.Tensor, dtype=None) -> torch.Tensor:
    return ALLOC(shape, device=like.device, dtype=dtype or like.dtype)


def new_rows(num_rows: int, width: int, like: torch.Tensor, spec: MXSpec, num_experts: int, rowwise: bool,
             colwise: bool, alloc=None) -> MXRows:
    """Buffers of a quantized activation that a GEMM epilogue fills."""
    alloc = alloc or ALLOC
    q = MXRows()
    if rowwise:
        q.data = alloc((num_rows, width), device=like.device, dtype=spec.torch_dtype)
        q.scale = new_row_scales(num_rows, width, like, alloc)
    if colwise:
        q.data_t = new_transposed(width, num_rows, num_experts, like, spec.torch_dtype, alloc)
        q.scale_t = new_col_scales(width, num_rows, num_experts, like, alloc)
    return q


class TritonMXFP8ExpertMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tokens_per_expert, w1, w2, b1, b2, probs, activation, specs):
        spec, grad_spec = specs  # x, a and weights; gradients (E5M2 under Format.HYBRID)
        need = ctx.needs_input_grad
        num_rows, hidden = x.shape
        num_experts, n1, _ = w1.shape
        ffn = w2.shape[2]
        act = dict(activation=activation.name, alpha=activation.alpha, limit=activation.limit, gated=activation.gated)
        y = _new((num_rows, hidden), x)
        ctx.act, ctx.grad_spec = act, grad_spec
        if num_rows == 0:
            ctx.empty = True
            ctx.save_for_backward(x, w1, w2, probs)
            return y
        ctx.empty = False
        schedule = build_schedule(tokens_per_expert, num_rows, TILE)
        w1q = WEIGHT_CACHE.get(w1, spec)
        w2q = WEIGHT_CACHE.get(w2, spec)
        xq = quantize_rows(x, schedule, num_experts, spec, rowwise=True, colwise=need[2], alloc=ALLOC)
        h = _new((num_rows, n1), x, H_DTYPE or x.dtype)
        aq = new_rows(num_rows, ffn, x, spec, num_experts, rowwise=True, colwise=need[3])
        gemm.launch("fc1", xq.data, xq.scale, w1q.data, w1q.scale, ffn, schedule, num_experts, spec, q=aq, h=h,
                    h_up_offset=ffn, b_up_rows=ffn, bias=b1, bias_up_offset=ffn, probs=probs, **act)
        gemm.launch("fc2", aq.data, aq.scale, w2q.data, w2q.scale, hidden, schedule, num_experts, spec, c=y, bias=b2)
        # x itself is not kept: backward reads only its columnwise FP8 copy (and x's shape)
        ctx.save_for_backward(w1, w2, probs, h)
        ctx.x_shape = x.shape
        ctx.schedule, ctx.w1q, ctx.w2q = schedule, w1q, w2q
        ctx.x_cols = MXRows(data_t=xq.data_t, scale_t=xq.scale_t)
        ctx.a_cols = MXRows(data_t=aq.data_t, scale_t=aq.scale_t)
        return y

    @staticmethod
    def backward(ctx, dy):
        need = ctx.needs_input_grad  # x, counts, w1, w2, b1, b2, probs, activation, specs
        if ctx.empty:
            x, w1, w2, probs = ctx.saved_tensors
            zeros = lambda t, n: torch.zeros_like(t) if n else None
            return (zeros(x, need[0]), None, zeros(w1, need[2]), zeros(w2, need[3]),
                    torch.zeros((w1.shape[0], w1.shape[1]), device=x.device, dtype=x.dtype) if need[4] else None,
                    torch.zeros((w1.shape[0], x.shape[1]), device=x.device, dtype=x.dtype) if need[5] else None,
                    zeros(probs, need[6]) if probs is not None else None, None, None)
        w1, w2, probs, h = ctx.saved_tensors
        like = w1  # new buffers like x: same dtype and device (validated)
        spec, schedule = ctx.grad_spec, ctx.schedule
        dy = dy.contiguous()
        num_rows, hidden = ctx.x_shape
        num_experts, n1, _ = w1.shape
        ffn = w2.shape[2]
        m_tiles = max_m_tiles(num_rows, num_experts, TILE)
        want_dprob = probs is not None and need[6]
        need_dact = need[0] or need[2] or need[4] or want_dprob
        dx = dw1 = dw2 = db1 = db2 = dprobs = None

        # the dy quantize pass also writes per-tile column sums of dy: db2 without another read of dy
        db2_parts = _new((m_tiles, hidden), like, torch.float32) if need[5] else None
        dyq = quantize_rows(dy, schedule, num_experts, spec, rowwise=need_dact, colwise=need[3], alloc=ALLOC,
                            col_sums=db2_parts)
        dhq = None
        if need_dact:
            dhq = new_rows(num_rows, n1, like, spec, num_experts, rowwise=need[0], colwise=need[2])
            cfg = gemm.default_config("dact")
            dprob_buf = _new((ffn // cfg.block_n, num_rows), like, torch.float32) if want_dprob else None
            dbias_buf = _new((m_tiles, n1), like, torch.float32) if need[4] else None
            gemm.launch("dact", dyq.data, dyq.scale, ctx.w2q.data_t, ctx.w2q.scale_t, ffn, schedule, num_experts,
                        spec, q=dhq, q_up_offset=ffn, h=h, h_up_offset=ffn, probs=probs, dprob=dprob_buf,
                        dbias=dbias_buf, config=cfg, **ctx.act)
            if want_dprob:
                dprobs = dprob_buf.sum(0).to(probs.dtype)
            if need[4]:
                db1 = _new((num_experts, n1), like)
                tile_sums_to_experts(dbias_buf, schedule, db1)
        if need[0]:
            dx = _new((num_rows, hidden), like)
            gemm.launch("dgrad", dhq.data, dhq.scale, ctx.w1q.data_t, ctx.w1q.scale_t, hidden, schedule, num_experts,
                        spec, c=dx)
        if need[3]:
            dw2 = _new(w2.shape, w2)
            mx_grouped_wgrad(MXRows(data_t=dyq.data_t, scale_t=dyq.scale_t), ctx.a_cols, schedule, dw2)
        if need[5]:
            db2 = _new((num_experts, hidden), like)
            tile_sums_to_experts(db2_parts, schedule, db2)
        if need[2]:
            dw1 = _new(w1.shape, w1)
            mx_grouped_wgrad(MXRows(data_t=dhq.data_t, scale_t=dhq.scale_t), ctx.x_cols, schedule, dw1)
        return dx, None, dw1, dw2, db1, db2, dprobs, None, None


def specs_of(recipe):
    """The kernels' element specs (x/a/weights, gradients) of an MXFP8BlockScaling recipe."""
    return MXSpec.of(recipe.fp8_format.for_role("x")), MXSpec.of(recipe.fp8_format.for_role("grad"))


def supports_mxfp8(recipe) -> Optional[str]:
    """None if the Triton MXFP8 path implements ``recipe``, else the reason."""
    from ....recipes import Format

    if recipe.fp8_format in (Format.E4M3, Format.HYBRID) and recipe.fp8_format.for_role("w") == "e4m3":
        return None
    return (f"backend='triton' implements MXFP8BlockScaling with fp8_format=E4M3 or HYBRID only, got "
            f"fp8_format={recipe.fp8_format.name} (use backend='reference')")


def check_shapes(hidden: int, ffn: int) -> Optional[str]:
    """None if the MXFP8 kernels take these sizes (128-column tiles, whole 32-blocks)."""
    if hidden % TILE:
        return (f"w1: backend='triton' with MXFP8BlockScaling needs the hidden size to be a multiple of {TILE}, "
                f"got {hidden}; use backend='reference'")
    if ffn % TILE:
        return (f"w2: backend='triton' with MXFP8BlockScaling needs the FFN size to be a multiple of {TILE}, "
                f"got {ffn}; use backend='reference'")
    return None


def mxfp8_expert_mlp(args) -> torch.Tensor:
    """Entry from the backend (``ExpertMLPArgs``)."""
    return TritonMXFP8ExpertMLP.apply(args.x, args.tokens_per_expert, args.w1, args.w2, args.b1, args.b2,
                                      args.probs, args.activation, specs_of(args.recipe))
