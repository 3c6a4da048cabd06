"""The expert MLP of a block-scaled FP8 recipe on the Triton backend: one autograd Function whose
kernels come from the recipe's package (``fp8_block/`` for Float8BlockScaling, ``mxfp8/`` for
MXFP8BlockScaling). Both run the same dataflow; only block sizes, scale formats and layouts differ.

Forward (3 kernels; weights come from the recipe's per-step weight cache):
  quantize x (rowwise for FC1, columnwise for w1's wgrad) -> FC1 (+b1, act, x probs; h saved;
  ``a`` written quantized rowwise + columnwise by the epilogue) -> FC2 (+b2) -> y.
Backward (up to 6 kernels):
  quantize dy (rowwise for the dgrad, columnwise for w2's wgrad; per-tile column sums for db2) ->
  FC2 dgrad with the dGLU epilogue (``dh`` quantized rowwise + columnwise, dprob partials, db1
  per-tile sums) -> FC1 dgrad (dx) -> wgrad of w2 and of w1 (per-token-block scales of both
  operands) -> db1, db2 (per-expert sums of per-tile column sums, in a fixed order).

Every GEMM operand is quantized along that GEMM's reduction axis as the reference backend emulates
it (``te_fused_moe/backends/reference/gemm.py``): fprop x and w along K, dgrad grad and w along N,
wgrad grad and x along the tokens (blocks restarting at each expert's first row). ``a`` and ``dh``
are quantized from FP32 values. Differences from the reference: the order of FP32 sums (and
the FP8 wgmma's own accumulation inside one scale block on the GPU), which can move a value that
sits next to an FP8 rounding boundary (or an amax next to a power of two) by one FP8 step; and
``h`` is saved in ``H_DTYPE`` (default: x's dtype, as TE saves the GLU input; the reference keeps
it in FP32), so ``dh`` sees ``h`` rounded to BF16. Where FC1 and the dGLU run as a GEMM + the
epilogue alone (the default on sm_90), the epilogue reads the GEMM's output in ``h``'s dtype as TE's
activation kernels read its GEMMs' BF16 outputs: ``a = act(h)`` of the saved ``h`` and ``dh`` from
``da`` rounded likewise (the recipes' ``gemm.EPILOGUE_INPUT_DTYPE``; with ``H_DTYPE = float32`` all
of it stays FP32, as the reference has it). ``Format.HYBRID`` quantizes the gradients (dy,
dh) to E5M2: the dgrad and wgrad GEMMs then multiply E5M2 by E4M3 (a mixed FP8 wgmma).

Every GEMM operand goes through the recipe's operand reader first: FP8 block reads its FP8 data
as it is (FP8 wgmma); MXFP8 by default reads BF16 values expanded just before the GEMM
(``mxfp8/autograd.py``).

Sync-free: no host reads of device data, no data-dependent shapes (buffers sized for the worst case).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch
import triton

from .schedule import build_schedule, max_m_tiles

# dtype of the saved FC1 output h (None: x's dtype). Tests set torch.float32 to compare with the reference.
H_DTYPE: Optional[torch.dtype] = None
# Allocator of every kernel buffer (tests replace it to poison buffers with NaN).
ALLOC = torch.empty


@dataclasses.dataclass(frozen=True)
class RecipeKernels:
    """What one recipe's package provides to :class:`BlockScaledExpertMLP` (and to the benchmark).

    ``quantize_weight(w, spec, transposed=)`` makes what ``weight_cache.get(w, spec)`` caches;
    ``quantize_rows(x, schedule, E, spec, rowwise=, colwise=, alloc=, col_sums=)`` and
    ``new_rows(T, width, like, spec, E, rowwise, colwise, alloc)`` return / allocate ``rows``
    objects (``data``, ``scale``, ``data_t``, ``scale_t``); ``gemm`` has ``launch`` and
    ``default_config``; ``grouped_wgrad(g_rows, x_rows, schedule, dw)``; ``specs_of(recipe)`` gives
    the (x/a/weights, gradients) element specs; ``unsupported(recipe)`` None or the reason;
    ``operand_reader()`` the function each GEMM operand goes through, chosen once per forward (the
    backward reads alike): ``read(data, scale, columnwise)`` returns the quantized ``data`` itself
    (the default) or, for MXFP8, its exact BF16 values expanded just before the GEMM."""

    recipe_name: str
    tile: int  # schedule M tile; H and F must be multiples of it
    weight_cache: Any
    quantize_weight: Callable
    quantize_rows: Callable
    new_rows: Callable
    rows: type
    gemm: Any
    grouped_wgrad: Callable
    tile_sums_to_experts: Callable
    specs_of: Callable
    unsupported: Callable
    operand_reader: Callable = lambda: as_quantized
    # whether gemm.launch("fc1") takes an FFN size off the tile now (its epilogue alone, reading h's gate
    # and up halves wherever F falls): the zero-padded path then forms and quantizes ``a`` there
    # (:mod:`.padded`), else in passes of its own
    fc1_off_tile: Callable[[], bool] = lambda: False
    # whether the quantize passes and the quantizing epilogues write the copies that GEMMs of the same
    # pass read as BF16 values instead of FP8 codes, now (MXFP8's ``QUANTIZE_TO_VALUES``): x and a
    # rowwise, dy and dh both ways; the copies kept for backward (x, a columnwise) stay FP8
    values_in_pass: Callable[[], bool] = lambda: False
    # the dGLU + quantize of dh in one pass for that path, now (``fp8_block.dglu_rows.dglu_quantized``'s
    # signature); None: the GLU pass writes FP32 dh for the recipe's quantize pass
    dglu_off_tile: Callable[[], Optional[Callable]] = lambda: None
    # whether ``grouped_wgrad`` takes the copies kept for backward (x, a columnwise) as they were saved, now:
    # FP8 codes that its K loop expands next to the gradient's BF16 values (MXFP8's ``X_CODES_IN_WGRAD``),
    # instead of through the operand reader (an expansion pass before each wgrad)
    wgrad_reads_saved: Callable[[], bool] = lambda: False
    # whether the forward also writes the columnwise copies it keeps for backward (x, a: the wgrads' operands)
    # as BF16 values, now (MXFP8's ``KEEP_COLUMNWISE_VALUES``; only where ``values_in_pass``): no expansion pass
    # before the wgrads, for one more byte per element held from forward to backward
    keeps_values: Callable[[], bool] = lambda: False
    # dW [E, N, K] of the wgrad's operands (as :func:`weight_grad` passes them) from a library GEMM in a tensor
    # of its own, or None where the recipe's ``grouped_wgrad`` runs (MXFP8's BF16 values on cuBLAS)
    library_wgrad: Callable[..., Optional[torch.Tensor]] = lambda g, x, schedule, shape, like: None

    def check_shapes(self, hidden: int, ffn: int) -> Optional[str]:
        """None if the kernels take these sizes as they are (whole tiles along every reduction), else why
        not. Other sizes run zero-padded (:mod:`.padded`)."""
        return tile_multiples(self.recipe_name, self.tile, hidden, ffn)

    def expert_mlp(self, args) -> torch.Tensor:
        """Entry from the backend (``ExpertMLPArgs``)."""
        mlp = BlockScaledExpertMLP
        if self.check_shapes(args.hidden_size, args.ffn_hidden_size) is not None:
            from .padded import PaddedExpertMLP as mlp
        return mlp.apply(args.x, args.tokens_per_expert, args.w1, args.w2, args.b1, args.b2, args.probs,
                         args.activation, self.specs_of(args.recipe), self)


def tile_multiples(recipe_name: str, tile: int, hidden: int, ffn: int) -> Optional[str]:
    """None if the hidden and FFN sizes are multiples of ``tile``, else which is not (naming its weight)."""
    for arg, what, size in (("w1", "hidden", hidden), ("w2", "FFN", ffn)):
        if size % tile:
            return (f"{arg}: backend='triton' with {recipe_name} needs the {what} size to be a multiple "
                    f"of {tile}, got {size}; use backend='reference'")
    return None


def as_quantized(data: torch.Tensor, scale: torch.Tensor, columnwise: bool = False) -> torch.Tensor:
    """The operand reader of GEMMs that read quantized operands as they are."""
    return data


def read_weight(read: Callable, w, transposed: bool = False) -> torch.Tensor:
    """The quantized weight ``w`` (``transposed``: its ``data_t`` copy, the dgrad's) as the next GEMM reads
    it: the BF16 values the weight cache keeps where it keeps them and ``read`` reads values (MXFP8's
    ``BF16_WEIGHT_VALUES``), else through ``read``."""
    values = getattr(w, "values_t" if transposed else "values", None)
    if values is not None and read is not as_quantized:
        return values
    return read(w.data_t, w.scale_t) if transposed else read(w.data, w.scale)


def as_values(on: bool, rowwise: bool = False, colwise: bool = False) -> dict:
    """Keyword arguments asking a recipe's ``quantize_rows`` / ``new_rows`` for copies written as BF16 values
    (``RecipeKernels.values_in_pass``); none where ``on`` is False (the recipes that always write codes)."""
    return dict(row_values=rowwise, col_values=colwise) if on else {}


def new_buffer(shape, like: torch.Tensor, dtype=None) -> torch.Tensor:
    """A kernel buffer from ``ALLOC`` (read at call time: tests poison buffers) on ``like``'s device."""
    return ALLOC(shape, device=like.device, dtype=dtype or like.dtype)


def expert_sums(tile_sums_to_experts: Callable, parts: torch.Tensor, schedule: torch.Tensor, num_experts: int,
                like: torch.Tensor) -> torch.Tensor:
    """Per-expert sums ``[E, width]`` (``like``'s dtype) of the per-tile column sums ``parts``
    ``[max_m_tiles, width]`` (the bias gradients), by the recipe's ``tile_sums_to_experts``."""
    out = new_buffer((num_experts, parts.shape[1]), like)
    tile_sums_to_experts(parts, schedule, out)
    return out


def mlp_sizes(x_shape, w1: torch.Tensor, w2: torch.Tensor) -> tuple:
    """``(T, H, E, n1, F)`` of an expert-MLP call: x ``[T, H]``, w1 ``[E, n1, H]``, w2 ``[E, H, F]``."""
    return x_shape[0], x_shape[1], w1.shape[0], w1.shape[1], w2.shape[2]


def backward_needs(need, probs) -> tuple:
    """``(want_dprob, need_dact)`` of a backward whose inputs' ``needs_input_grad`` is ``need`` (x, counts,
    w1, w2, b1, b2, probs, ...): the probs gradient, and whether the dGLU runs at all (for dx, dw1, db1
    or dprob)."""
    want_dprob = probs is not None and need[6]
    return want_dprob, need[0] or need[2] or need[4] or want_dprob


def keep_for_backward(ctx, x, w1, w2, probs, h, schedule, w1q, w2q) -> None:
    """What every block-scaled Function's backward reads: w1, w2, probs and h saved, x's shape (x itself
    is not kept: backward reads only its columnwise copy), the schedule and the quantized weights."""
    ctx.save_for_backward(w1, w2, probs, h)
    ctx.x_shape = x.shape
    ctx.schedule, ctx.w1q, ctx.w2q = schedule, w1q, w2q


def keep_columnwise(ctx, kernels: "RecipeKernels", xq, aq) -> None:
    """Keeps for backward only the columnwise copies of ``x`` and ``a`` (the wgrads' operands)."""
    ctx.x_cols = kernels.rows(data_t=xq.data_t, scale_t=xq.scale_t)
    ctx.a_cols = kernels.rows(data_t=aq.data_t, scale_t=aq.scale_t)


def wgrad_operand(kernels: "RecipeKernels", read: Callable) -> Callable:
    """A columnwise copy as the wgrad reads it: through the forward's operand reader."""
    return lambda q: kernels.rows(data_t=read(q.data_t, q.scale_t, True), scale_t=q.scale_t)


def saved_operand(kernels: "RecipeKernels", read: Callable) -> Callable:
    """A columnwise copy kept for backward as the wgrad reads it: as saved where the recipe's wgrad expands
    it in its K loop (``RecipeKernels.wgrad_reads_saved``), else as a gradient's (:func:`wgrad_operand`)."""
    return (lambda q: q) if kernels.wgrad_reads_saved() else wgrad_operand(kernels, read)


def weight_grad(kernels: "RecipeKernels", g, x, schedule: torch.Tensor, shape, like: torch.Tensor) -> torch.Tensor:
    """``dW`` ``[E, N, K]`` (``like``'s dtype) of the columnwise copies ``g`` and ``x``: from the recipe's
    ``library_wgrad`` where it gives one, else its ``grouped_wgrad`` into a new buffer."""
    dw = kernels.library_wgrad(g, x, schedule, shape, like)
    if dw is None:
        dw = new_buffer(shape, like)
        kernels.grouped_wgrad(g, x, schedule, dw)
    return dw


def empty_input_grads(need, x, w1, w2, probs) -> tuple:
    """The backward's results when ``x`` has no rows: zeros for every input that needs a gradient."""
    zeros = lambda t, n: torch.zeros_like(t) if n else None
    return (zeros(x, need[0]), None, zeros(w1, need[2]), zeros(w2, need[3]),
            torch.zeros((w1.shape[0], w1.shape[1]), device=x.device, dtype=x.dtype) if need[4] else None,
            torch.zeros((w1.shape[0], x.shape[1]), device=x.device, dtype=x.dtype) if need[5] else None,
            zeros(probs, need[6]) if probs is not None else None, None, None, None)


class BlockScaledExpertMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tokens_per_expert, w1, w2, b1, b2, probs, activation, specs, kernels: RecipeKernels):
        spec, grad_spec = specs  # x, a and weights; gradients (E5M2 under Format.HYBRID)
        k = kernels
        need = ctx.needs_input_grad
        num_rows, hidden, num_experts, n1, ffn = mlp_sizes(x.shape, w1, w2)
        act = activation.launch_args
        y = new_buffer((num_rows, hidden), x)
        ctx.act, ctx.grad_spec, ctx.kernels = act, grad_spec, k
        ctx.read = read = k.operand_reader()
        ctx.values = values = k.values_in_pass()
        keep_values = values and k.keeps_values()
        if num_rows == 0:
            ctx.empty = True
            ctx.save_for_backward(x, w1, w2, probs)
            return y
        ctx.empty = False
        schedule = build_schedule(tokens_per_expert, num_rows, k.tile)
        w1q = k.weight_cache.get(w1, spec)
        w2q = k.weight_cache.get(w2, spec)
        xq = k.quantize_rows(x, schedule, num_experts, spec, rowwise=True, colwise=need[2], alloc=ALLOC,
                             **as_values(values, rowwise=True, colwise=keep_values))
        h = new_buffer((num_rows, n1), x, H_DTYPE or x.dtype)
        aq = k.new_rows(num_rows, ffn, x, spec, num_experts, True, need[3], ALLOC,
                        **as_values(values, rowwise=True, colwise=keep_values))
        k.gemm.launch("fc1", read(xq.data, xq.scale), xq.scale, read_weight(read, w1q), w1q.scale, ffn, schedule,
                      num_experts, spec, q=aq, h=h, h_up_offset=ffn, b_up_rows=ffn, bias=b1, bias_up_offset=ffn,
                      probs=probs, **act)
        k.gemm.launch("fc2", read(aq.data, aq.scale), aq.scale, read_weight(read, w2q), w2q.scale, hidden,
                      schedule, num_experts, spec, c=y, bias=b2)
        keep_for_backward(ctx, x, w1, w2, probs, h, schedule, w1q, w2q)
        keep_columnwise(ctx, k, xq, aq)
        return y

    @staticmethod
    def backward(ctx, dy):
        need = ctx.needs_input_grad  # x, counts, w1, w2, b1, b2, probs, activation, specs, kernels
        if ctx.empty:
            return empty_input_grads(need, *ctx.saved_tensors)
        w1, w2, probs, h = ctx.saved_tensors
        k, read = ctx.kernels, ctx.read
        cols, saved = wgrad_operand(k, read), saved_operand(k, read)
        like = w1  # new buffers like x: same dtype and device (validated)
        spec, schedule = ctx.grad_spec, ctx.schedule
        dy = dy.contiguous()
        num_rows, hidden, num_experts, n1, ffn = mlp_sizes(ctx.x_shape, w1, w2)
        m_tiles = max_m_tiles(num_rows, num_experts, k.tile)
        want_dprob, need_dact = backward_needs(need, probs)
        dx = dw1 = dw2 = db1 = db2 = dprobs = None

        # the dy quantize pass also writes per-tile column sums of dy: db2 without another read of dy
        db2_parts = new_buffer((m_tiles, hidden), like, torch.float32) if need[5] else None
        dyq = k.quantize_rows(dy, schedule, num_experts, spec, rowwise=need_dact, colwise=need[3], alloc=ALLOC,
                              col_sums=db2_parts, **as_values(ctx.values, True, True))
        dhq = None
        if need_dact:
            dhq = k.new_rows(num_rows, n1, like, spec, num_experts, need[0], need[2], ALLOC,
                             **as_values(ctx.values, True, True))
            cfg = k.gemm.default_config("dact", read is not as_quantized)
            dprob_buf = new_buffer((triton.cdiv(ffn, cfg.block_n), num_rows), like, torch.float32) if want_dprob else None
            dbias_buf = new_buffer((m_tiles, n1), like, torch.float32) if need[4] else None
            k.gemm.launch("dact", read(dyq.data, dyq.scale), dyq.scale, read_weight(read, ctx.w2q, True),
                          ctx.w2q.scale_t, ffn, schedule, num_experts, spec, q=dhq, q_up_offset=ffn, h=h, h_up_offset=ffn, probs=probs, dprob=dprob_buf,
                          dbias=dbias_buf, config=cfg, **ctx.act)
            if want_dprob:
                dprobs = dprob_buf.sum(0).to(probs.dtype)
            if need[4]:
                db1 = expert_sums(k.tile_sums_to_experts, dbias_buf, schedule, num_experts, like)
        if need[0]:
            dx = new_buffer((num_rows, hidden), like)
            k.gemm.launch("dgrad", read(dhq.data, dhq.scale), dhq.scale, read_weight(read, ctx.w1q, True),
                          ctx.w1q.scale_t, hidden, schedule, num_experts, spec, c=dx)
        if need[3]:
            dw2 = weight_grad(k, cols(dyq), saved(ctx.a_cols), schedule, w2.shape, w2)
        if need[5]:
            db2 = expert_sums(k.tile_sums_to_experts, db2_parts, schedule, num_experts, like)
        if need[2]:
            dw1 = weight_grad(k, cols(dhq), saved(ctx.x_cols), schedule, w1.shape, w1)
        return dx, None, dw1, dw2, db1, db2, dprobs, None, None, None
