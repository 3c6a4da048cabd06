"""The expert MLP of a block-scaled FP8 recipe (FP8 block, MXFP8) whose hidden or FFN size is not a
multiple of the recipe's 128-wide tile: GPT-OSS's 2880, for one. The GEMM kernels tile K and N by
128 (scale blocks, TMA boxes, one weight scale per 128x128 tile), so this path runs them on
zero-padded operands and returns the unpadded part of each result:

- Weights are padded at the end of each dimension only: ``w1 [E, n1, H]`` to ``[E, n1', H']``,
  ``w2 [E, H, F]`` to ``[E, H', F']`` (' = rounded up to the tile). Every quantization block then sits
  where TE's quantizer puts it on the unpadded weight (a 128x128 block that straddles a gated w1's
  gate / up boundary stays one block), and zeros never change a block's amax: the real elements'
  bytes and scales are TE's, and the padded copy is quantized once per optimizer step (the recipe's
  weight cache, ``padded_to``).
- ``x`` and ``dy`` are quantized as if zero-padded to ``[T, H']`` (the quantize pass reads their ``H``
  columns and writes ``H'``, ``width=``): the zero columns quantize to zero codes and add nothing to
  any GEMM.
- FC1 runs as the plain GEMM over all of w1's rows (``h [T, n1']``, b1 added). The activation pairs
  gate column ``j`` with up column ``F + j`` wherever F falls against the tiles. Where the recipe's
  FC1 takes such an F (``fc1_off_tile``), its epilogue does that and writes ``a [T, F']``
  quantized, zero codes past F: FP8 block's epilogue alone reading h back (unless its
  ``FC1_EPILOGUE`` is "fused"), MXFP8's one kernel on its accumulators (whose weight scales are
  per row, so the up half may start at any row). Otherwise a pass of its own (:mod:`.glu_rows`)
  writes ``a`` in FP32 for the recipe's quantize pass.
- Backward: the dGLU's GEMM writes ``da [T, F']``; ``dh`` in h's own layout is quantized in blocks
  along all of w1's rows, as TE's dgrad and wgrad see it (a 1x128 block holds gate and up gradients
  both where F % 128 != 0). FP8 block forms and quantizes it in one pass over 128-column blocks of
  dh (``dglu_off_tile``: :mod:`.fp8_block.dglu_rows`, unless its ``DACT_EPILOGUE`` is "fused");
  otherwise the dGLU pass writes it in FP32 for the recipe's quantize pass.
- The values quantized are those the tile-aligned path quantizes: ``a`` as its FC1
  forms it (FP8 block: ``act(h)`` of the saved h; MXFP8: of the FP32 accumulator), ``dh`` from ``da``
  in ``EPILOGUE_INPUT_DTYPE`` or h's dtype, as its separate dGLU epilogues read it.
- Results have their own sizes and are contiguous: ``y``, ``dx`` ``[T, H]``, ``dw1`` ``[E, n1, H]``,
  ``dw2`` ``[E, H, F]``. The GEMMs compute the last tile whole and store only its columns (and the
  wgrads' rows) inside the result. (Views of padded buffers would cost more than they save: autograd
  copies a gradient whose strides are not its parameter's, 2.7 ms of 9.8 at GPT-OSS's shape on an
  H100 with the five copies this path used to make.)

What it costs against the tile-aligned path (:mod:`.block_scaled`, whose FC1 / dGLU epilogues form
and quantize ``a`` / ``dh`` in the GEMM kernels): FC1's h and the dGLU's da read back by their
epilogue passes (as there on sm_90, where those epilogues run alone), MXFP8's ``dh`` written and read
once more in FP32; GEMMs over the padded sizes. Still no host reads of device data: sync-free and
graph-capturable like the rest of the backend.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from . import block_scaled
from .block_scaled import (backward_needs, empty_input_grads, expert_sums, keep_columnwise, keep_for_backward,
                           mlp_sizes, new_buffer, read_weight, saved_operand, weight_grad, wgrad_operand)
from .glu_rows import glu_backward, glu_forward
from .schedule import build_schedule, max_m_tiles


def padded_size(size: int, tile: int) -> int:
    """``size`` rounded up to a multiple of ``tile``."""
    return -(-size // tile) * tile


def zero_padded(t: Optional[torch.Tensor], shape: Sequence[int]) -> Optional[torch.Tensor]:
    """``t`` in the leading corner of a zero tensor of ``shape`` (``t`` itself where it has that shape)."""
    if t is None or tuple(t.shape) == tuple(shape):
        return t
    pads = [amount for size, target in zip(reversed(t.shape), reversed(shape)) for amount in (0, target - size)]
    return torch.nn.functional.pad(t, pads)


class PaddedExpertMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tokens_per_expert, w1, w2, b1, b2, probs, activation, specs, kernels):
        spec, grad_spec = specs  # x, a and weights; gradients (E5M2 under Format.HYBRID)
        k = kernels
        need = ctx.needs_input_grad
        num_rows, hidden, num_experts, n1, ffn = mlp_sizes(x.shape, w1, w2)
        hidden_p, n1_p, ffn_p = (padded_size(size, k.tile) for size in (hidden, n1, ffn))
        ctx.act, ctx.grad_spec, ctx.kernels = activation.launch_args, grad_spec, k
        ctx.read = read = k.operand_reader()
        ctx.empty = num_rows == 0
        if ctx.empty:
            ctx.save_for_backward(x, w1, w2, probs)
            return new_buffer((0, hidden), x)
        alloc = block_scaled.ALLOC
        schedule = build_schedule(tokens_per_expert, num_rows, k.tile)
        w1q = k.weight_cache.get(w1, spec, padded_to=(num_experts, n1_p, hidden_p))
        w2q = k.weight_cache.get(w2, spec, padded_to=(num_experts, hidden_p, ffn_p))
        xq = k.quantize_rows(x, schedule, num_experts, spec, rowwise=True, colwise=need[2], alloc=alloc,
                             width=hidden_p)
        h = new_buffer((num_rows, n1_p), x, block_scaled.H_DTYPE or x.dtype)
        x_op, w1_op, b1_p = read(xq.data, xq.scale), read_weight(read, w1q), zero_padded(b1, (num_experts, n1_p))
        if k.fc1_off_tile():
            aq = k.new_rows(num_rows, ffn_p, x, spec, num_experts, True, need[3], alloc)
            k.gemm.launch("fc1", x_op, xq.scale, w1_op, w1q.scale, ffn, schedule, num_experts, spec, q=aq, h=h,
                          h_up_offset=ffn, b_up_rows=ffn, bias=b1_p, bias_up_offset=ffn, probs=probs, **ctx.act)
        else:
            k.gemm.launch("fc2", x_op, xq.scale, w1_op, w1q.scale, n1_p, schedule, num_experts, spec, c=h, bias=b1_p)
            a = glu_forward(h, ffn, ffn_p, schedule, num_experts, probs, ctx.act, alloc)
            aq = k.quantize_rows(a, schedule, num_experts, spec, rowwise=True, colwise=need[3], alloc=alloc)
            del a
        y = new_buffer((num_rows, hidden), x)
        k.gemm.launch("fc2", read(aq.data, aq.scale), aq.scale, read_weight(read, w2q), w2q.scale, hidden,
                      schedule, num_experts, spec, c=y, bias=zero_padded(b2, (num_experts, hidden_p)))
        keep_for_backward(ctx, x, w1, w2, probs, h, schedule, w1q, w2q)
        keep_columnwise(ctx, k, xq, aq)
        return y

    @staticmethod
    def backward(ctx, dy):
        need = ctx.needs_input_grad  # x, counts, w1, w2, b1, b2, probs, activation, specs, kernels
        if ctx.empty:
            return empty_input_grads(need, *ctx.saved_tensors)
        w1, w2, probs, h = ctx.saved_tensors
        k, read, spec, schedule, alloc = ctx.kernels, ctx.read, ctx.grad_spec, ctx.schedule, block_scaled.ALLOC
        cols, saved = wgrad_operand(k, read), saved_operand(k, read)
        num_rows, hidden, num_experts, n1, ffn = mlp_sizes(ctx.x_shape, w1, w2)
        hidden_p, n1_p, ffn_p = (padded_size(size, k.tile) for size in (hidden, n1, ffn))
        m_tiles = max_m_tiles(num_rows, num_experts, k.tile)
        want_dprob, need_dact = backward_needs(need, probs)
        dx = dw1 = dw2 = db1 = db2 = dprobs = dhq = None

        db2_parts = new_buffer((m_tiles, hidden_p), w1, torch.float32) if need[5] else None
        dyq = k.quantize_rows(dy.contiguous(), schedule, num_experts, spec, rowwise=need_dact, colwise=need[3],
                              alloc=alloc, col_sums=db2_parts, width=hidden_p)
        if need_dact:
            # da in the dtype the tile-aligned path's separate dGLU epilogue reads it in
            da = new_buffer((num_rows, ffn_p), w1, k.gemm.EPILOGUE_INPUT_DTYPE or h.dtype)
            k.gemm.launch("fc2", read(dyq.data, dyq.scale), dyq.scale, read_weight(read, ctx.w2q, True),
                          ctx.w2q.scale_t, ffn_p, schedule, num_experts, spec, c=da)
            db1_parts = new_buffer((m_tiles, n1_p), w1, torch.float32) if need[4] else None
            dglu_quantized = k.dglu_off_tile()
            if dglu_quantized is not None:
                dhq, dprobs = dglu_quantized(da, h, ffn, schedule, num_experts, probs, ctx.act, want_dprob, spec,
                                             rowwise=need[0], colwise=need[2], col_sums=db1_parts, alloc=alloc)
            else:
                dh, dprobs = glu_backward(da, h, ffn, schedule, num_experts, probs, ctx.act, want_dprob, alloc)
                dhq = k.quantize_rows(dh, schedule, num_experts, spec, rowwise=need[0], colwise=need[2],
                                      alloc=alloc, col_sums=db1_parts)
                del dh
            del da
            if want_dprob:
                dprobs = dprobs.to(probs.dtype)
            if need[4]:
                db1 = expert_sums(k.tile_sums_to_experts, db1_parts, schedule, num_experts, w1)[:, :n1]
        if need[0]:
            dx = new_buffer((num_rows, hidden), w1)
            k.gemm.launch("dgrad", read(dhq.data, dhq.scale), dhq.scale, read_weight(read, ctx.w1q, True),
                          ctx.w1q.scale_t, hidden, schedule, num_experts, spec, c=dx)
        if need[3]:
            dw2 = weight_grad(k, cols(dyq), saved(ctx.a_cols), schedule, (num_experts, hidden, ffn), w2)
        if need[5]:
            db2 = expert_sums(k.tile_sums_to_experts, db2_parts, schedule, num_experts, w1)[:, :hidden]
        if need[2]:
            dw1 = weight_grad(k, cols(dhq), saved(ctx.x_cols), schedule, (num_experts, n1, hidden), w1)
        return dx, None, dw1, dw2, db1, db2, dprobs, None, None, None

