"""Benchmark of the block-scaled recipes (Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling) on
one Hopper GPU, in one process:

- ``bf16_unfused``: ``torch._grouped_mm`` FC1 -> activation -> ``torch._grouped_mm`` FC2, autograd backward
  (:func:`te_fused_moe.bench.unfused_mlp`, the reference point of the FP8 block target);
- ``bf16_fused``: our BF16 Triton path (``fused_moe_mlp(backend="triton")``);
- ``<recipe>_unfused`` (``fp8_block``, ``mxfp8``, ``nvfp4``): the same recipe without fusion: separate quantize
  kernels, our grouped GEMMs of that recipe with plain BF16 outputs (no epilogue), activation and its
  backward as separate PyTorch ops (``a`` and ``dh`` rounded to BF16 before their quantize kernel);
- ``<recipe>_fused``: ``fused_moe_mlp(recipe=..., backend="triton")``;
- ``fp8_rowwise_scaled_grouped_mm`` (opt-in): ``torch._scaled_grouped_mm`` (E4M3, one FP32 scale per
  row / column, the FP8 grouped GEMM of PyTorch) for all six GEMMs (wgrad: K-grouped 2d x 2d with
  per-expert scales), quantization and activation as PyTorch ops.

Forward, backward and forward+backward ms (median), TFLOP/s over routed tokens (fwd+bwd counts 3x the
forward FLOPs), ratios to ``bf16_unfused``, the targets (FP8 block fused fwd+bwd >= 1.5x BF16
unfused; MXFP8 fused >= 1.3x MXFP8 unfused; NVFP4 fused no slower than BF16 unfused), peak memory, each kernel of each fused path alone, and
the weight caches (bytes held, and the per-micro-batch weight quantization they save). Ceilings
measured first: cuBLAS BF16 and FP8 (``torch._scaled_mm``) 8192^3. Implementations that fail are
recorded with their error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import platform
import time
import traceback
from typing import Dict, List, Optional, Sequence

import torch

from . import bench
from .activations import ActivationConfig
from .recipes import Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling

FP8_MAX = 448.0
DEFAULT_SHAPES = ["dsv3-e32", "dsv3-e32-zipf"]
RECIPES = {"fp8_block": Float8BlockScaling, "mxfp8": MXFP8BlockScaling, "nvfp4": NVFP4BlockScaling}
FP8_RECIPES = ("fp8_block", "mxfp8")  # the ones with kernel variants and an fp8_format
# (implementation, baseline, fwd+bwd speedup asked for): the targets
TARGETS = [("fp8_block_fused", "bf16_unfused", 1.5), ("mxfp8_fused", "mxfp8_unfused", 1.3),
           ("nvfp4_fused", "bf16_unfused", 1.0)]


def recipe_kernels(recipe: str):
    """The Triton kernels and the default spec of ``recipe`` (NVFP4: its weights' spec)."""
    if recipe == "fp8_block":
        from .backends.triton.fp8_block.autograd import KERNELS
        from .backends.triton.fp8_block.quantize import FP8Spec

        return KERNELS, FP8Spec()
    if recipe == "mxfp8":
        from .backends.triton.mxfp8.autograd import KERNELS, specs_of

        return KERNELS, specs_of(MXFP8BlockScaling())[0]
    if recipe == "nvfp4":
        from .backends.triton.nvfp4.autograd import KERNELS, specs_of

        return KERNELS, specs_of(NVFP4BlockScaling())[2]
    raise ValueError(f"recipe: expected one of {sorted(RECIPES)}, got {recipe!r}")


# --- same recipe, unfused ----------------------------------------------------------------------------

class BlockScaledUnfused(torch.autograd.Function):
    """A block-scaled recipe without fusion: quantize kernels + plain grouped GEMMs + PyTorch activation.
    The GEMMs read their operands as the fused path does (the recipe's ``operand_reader``). Sizes off
    the 128 grid (GPT-OSS's 2880) run as the fused path's ``padded.py`` runs them: weights quantized
    zero-padded, x / a / dy / dh quantized to the padded width, results stored in their own sizes."""

    @staticmethod
    def forward(ctx, x, counts, w1, w2, activation, recipe):
        from .backends.triton.block_scaled import read_weight
        from .backends.triton.padded import padded_size
        from .backends.triton.schedule import build_schedule

        k, spec = recipe_kernels(recipe)
        act = ActivationConfig(activation)
        T, H = x.shape
        E, n1, _ = w1.shape
        F = w2.shape[2]
        H_p, n1_p, F_p = (padded_size(size, k.tile) for size in (H, n1, F))
        sched = build_schedule(counts, T, k.tile)
        read = k.operand_reader()
        w1q = k.weight_cache.get(w1, spec, padded_to=(E, n1_p, H_p) if (n1_p, H_p) != (n1, H) else None)
        w2q = k.weight_cache.get(w2, spec, padded_to=(E, H_p, F_p) if (H_p, F_p) != (H, F) else None)
        xq = k.quantize_rows(x, sched, E, spec, rowwise=True, colwise=True, width=H_p)
        h = torch.empty(T, n1_p, device=x.device, dtype=x.dtype)
        k.gemm.launch("fc2", read(xq.data, xq.scale), xq.scale, read_weight(read, w1q), w1q.scale, n1_p, sched, E,
                      spec, c=h)
        a = act.forward(h[:, :n1].float()).to(x.dtype)
        aq = k.quantize_rows(a, sched, E, spec, rowwise=True, colwise=True, width=F_p)
        y = torch.empty(T, H, device=x.device, dtype=x.dtype)
        k.gemm.launch("fc2", read(aq.data, aq.scale), aq.scale, read_weight(read, w2q), w2q.scale, H, sched, E,
                      spec, c=y)
        ctx.save_for_backward(h, w1, w2)
        ctx.state = (k, read, sched, w1q, w2q, xq, aq, act, spec)
        return y

    @staticmethod
    def backward(ctx, dy):
        from .backends.triton.block_scaled import read_weight, weight_grad
        from .backends.triton.padded import padded_size

        h, w1, w2 = ctx.saved_tensors
        k, read, sched, w1q, w2q, xq, aq, act, spec = ctx.state
        cols = lambda q: k.rows(data_t=read(q.data_t, q.scale_t, True), scale_t=q.scale_t)
        dy = dy.contiguous()
        T, H = dy.shape
        E, n1, _ = w1.shape
        F = w2.shape[2]
        dyq = k.quantize_rows(dy, sched, E, spec, rowwise=True, colwise=True, width=padded_size(H, k.tile))
        da = torch.empty(T, F, device=dy.device, dtype=dy.dtype)
        k.gemm.launch("dgrad", read(dyq.data, dyq.scale), dyq.scale, read_weight(read, w2q, True), w2q.scale_t, F,
                      sched, E, spec, c=da)
        dh = act.backward(h[:, :n1].float(), da.float()).to(dy.dtype)
        dhq = k.quantize_rows(dh, sched, E, spec, rowwise=True, colwise=True, width=h.shape[1])
        dx = torch.empty(T, H, device=dy.device, dtype=dy.dtype)
        k.gemm.launch("dgrad", read(dhq.data, dhq.scale), dhq.scale, read_weight(read, w1q, True), w1q.scale_t, H,
                      sched, E, spec, c=dx)
        dw2 = weight_grad(k, cols(dyq), cols(aq), sched, w2.shape, w2)
        dw1 = weight_grad(k, cols(dhq), cols(xq), sched, w1.shape, w1)
        return dx, None, dw1, dw2, None, None


# --- PyTorch's FP8 grouped GEMM (rowwise scales) ------------------------------------------------------

def _rowwise(t: torch.Tensor):
    """E4M3 along the last dim, one FP32 scale per row: (data, dequantization scale [...])."""
    amax = t.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-12)
    scale = FP8_MAX / amax
    q = (t.float() * scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, (1.0 / scale).squeeze(-1).contiguous()


def _padded_token_layout(counts: torch.Tensor, num_rows: int, multiple: int = 16):
    """Where each routed row lands when every expert's token block is padded to ``multiple`` rows
    (``_scaled_grouped_mm``'s K-grouped wgrad needs 16-byte group sizes): destination row per row,
    padded offsets, and the fixed padded length ``T + multiple * E`` (no host sync)."""
    padded = (counts + multiple - 1) // multiple * multiple
    shift = torch.cumsum(padded - counts, 0) - (padded - counts)  # padding before each expert
    dest = torch.arange(num_rows, device=counts.device) + torch.repeat_interleave(shift, counts, output_size=num_rows)
    return dest, torch.cumsum(padded, 0, dtype=torch.int32), num_rows + multiple * counts.numel()


def _jagged_colwise_t(t: torch.Tensor, counts: torch.Tensor, dest: torch.Tensor, padded_rows: int):
    """``t [T, N]`` quantized along the tokens per expert (one scale per column and expert), returned
    transposed ``[N, T_padded]`` (row-major, zeros in each expert's padding) with the scales ``[E * N]``
    (expert-major)."""
    amax = torch.segment_reduce(t.abs().float(), "max", lengths=counts, axis=0).clamp_min(1e-12)  # [E, N]
    rows = torch.repeat_interleave(amax, counts, dim=0, output_size=t.shape[0])
    q = (t.float() * (FP8_MAX / rows)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    out = torch.zeros(t.shape[1], padded_rows, device=t.device, dtype=torch.float8_e4m3fn)
    out.view(torch.uint8)[:, dest] = q.view(torch.uint8).t()
    return out, (amax / FP8_MAX).reshape(-1).contiguous()


class FP8RowwiseScaledGroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, counts, w1, w2, activation):
        act = ActivationConfig(activation)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        xq, xs = _rowwise(x)
        w1q, w1s = _rowwise(w1)  # [E, n1, H] along H; mat_b = [E, H, n1] column-major
        h = torch._scaled_grouped_mm(xq, w1q.transpose(1, 2), xs, w1s, offs=offs, out_dtype=torch.bfloat16)
        a = act.forward(h.float()).to(x.dtype)
        aq, as_ = _rowwise(a)
        w2q, w2s = _rowwise(w2)
        y = torch._scaled_grouped_mm(aq, w2q.transpose(1, 2), as_, w2s, offs=offs, out_dtype=torch.bfloat16)
        ctx.save_for_backward(x, counts, offs, w1, w2, h, a)
        ctx.act = act
        return y

    @staticmethod
    def backward(ctx, dy):
        x, counts, offs, w1, w2, h, a = ctx.saved_tensors
        act = ctx.act
        dy = dy.contiguous()
        dyq, dys = _rowwise(dy)
        w2tq, w2ts = _rowwise(w2.transpose(1, 2).contiguous())  # [E, F, H] along H
        da = torch._scaled_grouped_mm(dyq, w2tq.transpose(1, 2), dys, w2ts, offs=offs, out_dtype=torch.bfloat16)
        dh = act.backward(h.float(), da.float()).to(dy.dtype)
        dhq, dhs = _rowwise(dh)
        w1tq, w1ts = _rowwise(w1.transpose(1, 2).contiguous())  # [E, H, n1] along n1
        dx = torch._scaled_grouped_mm(dhq, w1tq.transpose(1, 2), dhs, w1ts, offs=offs, out_dtype=torch.bfloat16)
        # wgrad: K-grouped (tokens), per-expert scales along the tokens, groups padded to 16 tokens
        dest, offs16, padded_rows = _padded_token_layout(counts, dy.shape[0])
        dyt, dyts = _jagged_colwise_t(dy, counts, dest, padded_rows)
        at, ats = _jagged_colwise_t(a, counts, dest, padded_rows)
        dw2 = torch._scaled_grouped_mm(dyt, at.t(), dyts, ats, offs=offs16, out_dtype=torch.bfloat16)
        dht, dhts = _jagged_colwise_t(dh, counts, dest, padded_rows)
        xt, xts = _jagged_colwise_t(x, counts, dest, padded_rows)
        dw1 = torch._scaled_grouped_mm(dht, xt.t(), dhts, xts, offs=offs16, out_dtype=torch.bfloat16)
        return dx, None, dw1, dw2, None


def _fused(recipe: str):
    def run(x, counts, w1, w2, activation):
        from .ops import fused_moe_mlp

        return fused_moe_mlp(x, counts, w1, w2, activation=activation, recipe=RECIPES[recipe](), backend="triton")

    return run


def _unfused(recipe: str):
    if recipe == "nvfp4":
        from .bench_nvfp4 import unfused

        return unfused
    return lambda x, counts, w1, w2, activation: BlockScaledUnfused.apply(x, counts, w1, w2, activation, recipe)


IMPLEMENTATIONS = {"bf16_unfused": bench.unfused_mlp, "bf16_fused": bench.fused_mlp}
for _recipe in RECIPES:
    IMPLEMENTATIONS[f"{_recipe}_unfused"] = _unfused(_recipe)
    IMPLEMENTATIONS[f"{_recipe}_fused"] = _fused(_recipe)


@contextlib.contextmanager
def _module_flags(module_name: str, flags: Dict):
    """Module attributes ``flags`` set inside, restored after."""
    import importlib

    module = importlib.import_module(module_name, __package__)
    defaults = {name: getattr(module, name) for name in flags}
    try:
        for name, value in flags.items():
            setattr(module, name, value)
        yield
    finally:
        for name, value in defaults.items():
            setattr(module, name, value)


@contextlib.contextmanager
def _recipe_module_flags(recipe: str, module_flags: Dict[str, Dict]):
    """Flags of modules ``backends.triton.<recipe>.<module>`` (``{module: dict(...)}``) set inside."""
    with contextlib.ExitStack() as stack:
        for module, flags in module_flags.items():
            stack.enter_context(_module_flags(f".backends.triton.{recipe}.{module}", flags))
        yield


def _call_under(module_name: str, flags: Dict, fn):
    """``fn()`` with ``flags`` set on the module (see :func:`_module_flags`)."""
    with _module_flags(module_name, flags):
        return fn()


def _fused_under(recipe: str, _path=_fused, **module_flags: Dict):
    """The fused path (``_path``: or another of ``recipe``'s) with flags of modules
    ``backends.triton.<recipe>.<module>`` (``module=dict(...)``) set while it is timed, forward and
    backward (``bench_impl`` enters ``run.context``)."""
    base = _path(recipe)
    run = lambda *args: base(*args)  # its own object: the context must not stick to a shared one
    run.context = lambda: _recipe_module_flags(recipe, module_flags)
    return run


# Variants: the expanding recipes' GEMMs expanding quantized operands in their K loops (no transient
# BF16 values; the default before run 15), NVFP4's and MXFP8's weight caches holding BF16 values, MXFP8's
# quantize passes and epilogues writing codes (no QUANTIZE_TO_VALUES) or its separate dGLU epilogue on
# the GEMM kernel (the default before run 34), and the FP8 block
# recipe on its Triton kernels only (no Gluon kernel: the path before run 16), or with its FC1 and dGLU
# as one kernel each instead of the Gluon GEMM + the epilogue alone (the default on sm_90 since run 16;
# at an FFN size off the tile, e.g. gpt-oss, FC1 and the dGLU then run as GLU passes + quantize passes
# instead, padded.py before session 21), or
# with the Triton wgrad (the default before run 19), or with the Gluon wgrad's consumers in one
# partition (run 19's first default), or with the plain Gluon GEMM storing from registers (the default
# before run 20) or in one consumer partition, or with the separate FC1 / dGLU epilogues reading the
# FP32 accumulator instead of h and da in BF16 (both the defaults before run 22), or (F off the tile)
# with the one-pass dGLU's programs launched M tile first (the default before session 23), or with the
# Gluon kernels reading each tile's schedule entries when it starts (the default before session 24), or
# with the plain Gluon GEMM's scales by TMA with each stage or loaded from global memory (RING_SCALES)
FP32_EPILOGUE_INPUT = dict(EPILOGUE_INPUT_DTYPE=torch.float32)
VARIANTS = {"fp8_block": {"fp8_block_fused_fp32_epilogue_input": _fused_under("fp8_block", gemm=FP32_EPILOGUE_INPUT),
                          "fp8_block_fused_triton_kernels": _fused_under("fp8_block", gemm=dict(PLAIN_ENGINE="triton")),
                          "fp8_block_fused_one_kernel_epilogues": _fused_under(
                              "fp8_block", gemm=dict(FC1_EPILOGUE="fused", DACT_EPILOGUE="fused")),
                          "fp8_block_fused_triton_wgrad": _fused_under("fp8_block", wgrad=dict(WGRAD_ENGINE="triton")),
                          "fp8_block_fused_plain_no_tma_store": _fused_under("fp8_block",
                                                                             gemm=dict(PLAIN_TMA_STORE=False)),
                          "fp8_block_fused_plain_one_consumer": _fused_under("fp8_block",
                                                                             gemm=dict(PLAIN_CONSUMERS=1)),
                          "fp8_block_fused_wgrad_one_partition": _fused_under("fp8_block",
                                                                              wgrad=dict(WGRAD_CONSUMERS=1)),
                          # at an FFN size off the tile: the one-pass dGLU's grid with the M tile fastest
                          "fp8_block_fused_dglu_m_tiles_fastest": _fused_under(
                              "fp8_block", dglu_rows=dict(BLOCKS_FASTEST=False)),
                          # the Gluon kernels reading each tile's schedule entries at its start
                          "fp8_block_fused_no_tile_prefetch": _fused_under(
                              "fp8_block", wgmma_ws=dict(TILE_PREFETCH=False)),
                          # the plain Gluon GEMM's scales by TMA with each stage, or loaded by its
                          # consumers from global memory (whichever wgmma_ws.RING_SCALES does not choose)
                          "fp8_block_fused_ring_scales": _fused_under("fp8_block", wgmma_ws=dict(RING_SCALES=True)),
                          "fp8_block_fused_scales_by_load": _fused_under(
                              "fp8_block", wgmma_ws=dict(RING_SCALES=False))},
            "mxfp8": {"mxfp8_fused_k_loop": _fused_under("mxfp8", autograd=dict(EXPAND_BEFORE_GEMM=False)),
                      "mxfp8_fused_fp32_dglu_input": _fused_under("mxfp8", gemm=FP32_EPILOGUE_INPUT),
                      # at an FFN size off the tile (gpt-oss): FC1 as GEMM + GLU pass + quantize pass
                      "mxfp8_fused_fc1_passes": _fused_under("mxfp8", autograd=dict(FC1_OFF_TILE=False)),
                      # the weight cache keeping BF16 values (no weight expansion per micro-batch), fused
                      # and unfused alike: the cache is not what fusion changes
                      "mxfp8_fused_bf16_weights": _fused_under("mxfp8", autograd=dict(BF16_WEIGHT_VALUES=True)),
                      "mxfp8_unfused_bf16_weights": _fused_under("mxfp8", _unfused,
                                                                 autograd=dict(BF16_WEIGHT_VALUES=True)),
                      # the quantize passes and epilogues writing FP8 codes that an expansion pass turns
                      # into values before each GEMM (QUANTIZE_TO_VALUES off: the fused path before run 33;
                      # the unfused path's quantize kernels always write MXFP8 tensors, as TE's do)
                      "mxfp8_fused_codes": _fused_under("mxfp8", autograd=dict(QUANTIZE_TO_VALUES=False)),
                      "mxfp8_fused_bf16_weights_codes": _fused_under(
                          "mxfp8", autograd=dict(BF16_WEIGHT_VALUES=True, QUANTIZE_TO_VALUES=False)),
                      # the separate dGLU epilogue on the GEMM kernel (gemm.SEPARATE_DGLU_KERNEL; the
                      # default before run 34) instead of its chunked kernel
                      "mxfp8_fused_gemm_dglu_epilogue": _fused_under(
                          "mxfp8", gemm=dict(SEPARATE_DGLU_KERNEL="gemm")),
                      # the plain GEMMs on BF16 values on this recipe's kernel instead of the BF16 backend's
                      # persistent one (gemm.PLAIN_VALUES_KERNEL; the default before run 35), fused and
                      # unfused alike: both paths run those GEMMs
                      "mxfp8_fused_mx_plain_kernel": _fused_under("mxfp8", gemm=dict(PLAIN_VALUES_KERNEL="mx")),
                      "mxfp8_unfused_mx_plain_kernel": _fused_under("mxfp8", _unfused,
                                                                    gemm=dict(PLAIN_VALUES_KERNEL="mx")),
                      # the fused FC1 on this recipe's kernel instead of the BF16 backend's persistent one with
                      # this recipe's quantizing store of a (gemm.FC1_VALUES_KERNEL; the default before run 36;
                      # the unfused FC1 is a plain GEMM, routed as above)
                      "mxfp8_fused_fc1_mx_kernel": _fused_under("mxfp8", gemm=dict(FC1_VALUES_KERNEL="mx")),
                      # the dGLU on BF16 values fused on the BF16 backend's persistent kernel with this recipe's
                      # quantizing store of dh (gemm.DGLU_VALUES_KERNEL = "bf16") instead of its GEMM + the chunked
                      # epilogue alone (run 37b: 20.14 against 18.14 ms)
                      "mxfp8_fused_dglu_bf16_kernel": _fused_under("mxfp8", gemm=dict(DGLU_VALUES_KERNEL="bf16")),
                      # the wgrads reading x's and a's columnwise copies as the FP8 codes they were saved as,
                      # expanded in their K loops (autograd.X_CODES_IN_WGRAD) through shared memory or as the
                      # wgmma's A operand (wgrad.X_CODES_AS_A), instead of an expansion pass before each
                      "mxfp8_fused_x_codes_in_wgrad": _fused_under("mxfp8", autograd=dict(X_CODES_IN_WGRAD=True)),
                      "mxfp8_fused_x_codes_in_wgrad_as_a": _fused_under(
                          "mxfp8", autograd=dict(X_CODES_IN_WGRAD=True), wgrad=dict(X_CODES_AS_A=True)),
                      # the BF16-valued wgrads on this recipe's Triton kernel instead of cuBLAS's grouped GEMM
                      # (autograd.VALUES_WGRAD_KERNEL; the default before run 39), fused and unfused alike: both
                      # paths run those wgrads
                      "mxfp8_fused_triton_wgrad": _fused_under("mxfp8", autograd=dict(VALUES_WGRAD_KERNEL="triton")),
                      "mxfp8_unfused_triton_wgrad": _fused_under("mxfp8", _unfused,
                                                                 autograd=dict(VALUES_WGRAD_KERNEL="triton")),
                      # the forward keeping x's and a's columnwise copies as the BF16 values the wgrads read
                      # (autograd.KEEP_COLUMNWISE_VALUES) instead of FP8 codes expanded before each wgrad; the
                      # unfused path keeps MXFP8 tensors, as TE does
                      "mxfp8_fused_keep_values": _fused_under("mxfp8", autograd=dict(KEEP_COLUMNWISE_VALUES=True)),
                      # ... and with the weight cache's BF16 values too (both opt-ins: against
                      # mxfp8_unfused_bf16_weights)
                      "mxfp8_fused_keep_values_bf16_weights": _fused_under(
                          "mxfp8", autograd=dict(KEEP_COLUMNWISE_VALUES=True, BF16_WEIGHT_VALUES=True))},
            "nvfp4": {"nvfp4_fused_k_loop": _fused_under("nvfp4", autograd=dict(EXPAND_BEFORE_GEMM=False)),
                      "nvfp4_fused_bf16_weights": _fused_under("nvfp4", autograd=dict(BF16_WEIGHT_VALUES=True)),
                      # every GEMM on NVFP4's own kernel (before run 41: since then the four token GEMMs on BF16
                      # values run on the BF16 backend's persistent kernel, gemm.VALUES_ON_BF16_KERNEL)
                      "nvfp4_fused_nv_kernel": _fused_under("nvfp4", gemm=dict(VALUES_ON_BF16_KERNEL=False)),
                      # the BF16-valued wgrads at a whole tile slot per step (before run 42: since then half a
                      # slot, wgrad.VALUES_HALF_SLOT)
                      "nvfp4_fused_slot_wgrad": _fused_under("nvfp4", wgrad=dict(VALUES_HALF_SLOT=False)),
                      # the wgrads on NVFP4's Triton kernel (before run 42: since then on cuBLAS, x's and a's values
                      # carrying the tensor scales, autograd.VALUES_WGRAD_KERNEL)
                      "nvfp4_fused_triton_wgrad": _fused_under("nvfp4", autograd=dict(VALUES_WGRAD_KERNEL="triton")),
                      # x's and dy's RHT on BF16 tensor cores (opt-in: quantize.RHT_TENSOR_CORES)
                      "nvfp4_fused_rht_mma": _fused_under("nvfp4", quantize=dict(RHT_TENSOR_CORES=True))}}
for _variants in VARIANTS.values():
    IMPLEMENTATIONS.update(_variants)
# Opt-in (--with-scaled-grouped-mm): unpadded, this baseline's wgrad tripped a device-side assert in
# _scaled_grouped_mm on the H200 (torch 2.11, GroupMMCommon.cuh:64, "dynamic dimension byte size ...
# multiple of 16"), which kills the CUDA context and the whole run; the wgrad operands are now padded
# to 16 tokens per expert, but the device script still runs it in its own process.
SCALED_GROUPED_MM = {
    "fp8_rowwise_scaled_grouped_mm": lambda x, c, w1, w2, act: FP8RowwiseScaledGroupedMM.apply(x, c, w1, w2, act),
}


def selected_implementations(recipes=tuple(RECIPES), with_scaled_grouped_mm: bool = False,
                             only: Sequence[str] = ()) -> Dict:
    """The implementations one run times: the BF16 pair, each chosen recipe's pair and variants, and
    optionally ``torch._scaled_grouped_mm``; ``only``: just these of them, and the BF16 unfused path
    every ratio is taken against (an A/B of two defaults in more rounds than the full set affords)."""
    keep = {"bf16_unfused", "bf16_fused"} | {f"{r}_{kind}" for r in recipes for kind in ("unfused", "fused")}
    for recipe in recipes:
        keep.update(VARIANTS.get(recipe, {}))
    chosen = {name: fn for name, fn in IMPLEMENTATIONS.items() if name in keep}
    if with_scaled_grouped_mm:
        chosen.update(SCALED_GROUPED_MM)
    if only:
        unknown = sorted(set(only) - set(chosen))
        if unknown:
            raise ValueError(f"only: {unknown} are not among the implementations of recipes {list(recipes)}; "
                             f"expected names from {sorted(chosen)}")
        chosen = {name: fn for name, fn in chosen.items() if name in only or name == "bf16_unfused"}
    return chosen


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# --- measuring ----------------------------------------------------------------------------------------

def fp8_ceiling_tflops() -> float:
    n = 8192
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    ms = bench.do_bench_ms(lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    return 2 * n ** 3 / ms / 1e9


def _ptxas_in_use() -> str:
    """The ptxas Triton builds the kernels with (TE_FUSED_MOE_PTXAS chooses it)."""
    from .backends.triton.ptxas import in_use

    used = in_use()
    return f"{used.path} ({used.version})"


def median_of_rounds(rounds: List[Dict]) -> Dict:
    """One implementation's timings over interleaved rounds: the median of each timing field (``*_ms``;
    the TFLOP/s and fraction of peak recomputed from it), the other fields from the first round, and
    every round's ``fwd_bwd_ms``; an error in any round is the result."""
    import statistics

    for r in rounds:
        if "error" in r:
            return r
    if len(rounds) == 1:
        return rounds[0]
    out = dict(rounds[0])
    for key in rounds[0]:
        if key.endswith("_ms"):
            out[key] = statistics.median(r[key] for r in rounds)
            rate = key[:-3] + "_tflops"
            if rate in out and rounds[0][key]:
                out[rate] = rounds[0][rate] * rounds[0][key] / out[key]  # the same flops over the median time
    if "fwd_bwd_of_peak" in out and rounds[0]["fwd_bwd_ms"]:
        out["fwd_bwd_of_peak"] = rounds[0]["fwd_bwd_of_peak"] * rounds[0]["fwd_bwd_ms"] / out["fwd_bwd_ms"]
    out["fwd_bwd_ms_rounds"] = [r.get("fwd_bwd_ms") for r in rounds]
    return out


def bench_impl(name: str, shape: bench.Shape, inputs, peak: float, fn) -> Dict:
    try:
        with getattr(fn, "context", contextlib.nullcontext)():
            return bench.bench_implementation(name, shape, inputs, peak, fn=fn)
    except Exception as exc:  # recorded, not fatal: the other implementations still run
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}


def bench_kernels(recipe: str, shape: bench.Shape, inputs, fp8_peak: float, gemm_config=None, epilogue_config=None,
                  wgrad_config=None, quantize_warps: Optional[int] = None, quantize_maxnreg: Optional[int] = None,
                  quantized_operands: bool = False) -> Dict[str, Dict[str, float]]:
    """Each kernel of ``recipe``'s fused path alone: ms, TFLOP/s (GEMMs) or GB/s (quantize: BF16 read,
    FP8 rowwise + columnwise written; scales not counted); optionally with given block configs
    (``gemm_config``: FC2 / FC1 dgrad, ``epilogue_config``: FC1 / dGLU, ``wgrad_config``) and, for the
    FP8 block quantize kernel, warps and a register cap. ``quantized_operands``: the GEMMs read the
    quantized operands even where the recipe's default expands them to BF16 before the GEMM."""
    if recipe == "nvfp4":
        from . import bench_nvfp4

        return bench_nvfp4.bench_kernels(shape, inputs, fp8_peak)
    import triton

    from .backends.triton import block_scaled
    from .backends.triton.schedule import build_schedule

    k, spec = recipe_kernels(recipe)
    act = ActivationConfig(shape.activation)
    x, w1, w2, counts, dy = (inputs[name] for name in ("x", "w1", "w2", "counts", "dy"))
    T, H, F, E, n1 = x.shape[0], shape.hidden, shape.ffn, shape.experts, w1.shape[1]
    routed = int(counts.sum())
    kw = act.launch_args
    sched = build_schedule(counts, T, k.tile)
    quantize_kw = {} if recipe != "fp8_block" else dict(num_warps=quantize_warps, maxnreg=quantize_maxnreg)
    quantize = lambda t, rowwise=True, colwise=True: k.quantize_rows(t, sched, E, spec, rowwise=rowwise,
                                                                     colwise=colwise, **quantize_kw)
    w1q, w2q = k.quantize_weight(w1, spec), k.quantize_weight(w2, spec)
    xq, dyq = quantize(x), quantize(dy)
    h = torch.empty(T, n1, device=x.device, dtype=x.dtype)
    aq = k.new_rows(T, F, x, spec, E, True, True, torch.empty)
    dhq = k.new_rows(T, n1, x, spec, E, True, True, torch.empty)
    y, dx = torch.empty_like(x), torch.empty_like(x)
    dw1, dw2 = torch.empty_like(w1), torch.empty_like(w2)
    read = block_scaled.as_quantized if quantized_operands else k.operand_reader()
    values = read is not block_scaled.as_quantized
    dprob = torch.empty(triton.cdiv(F, (epilogue_config or k.gemm.default_config("dact", values)).block_n), T,
                        device=x.device, dtype=torch.float32)
    probs = torch.rand(T, device=x.device) + 0.05
    launch = k.gemm.launch
    # the GEMMs read their operands as the fused path does: as they are, or (MXFP8) as BF16 values
    # expanded before the GEMM; those expansions are timed on their own, not inside the GEMMs
    rows = lambda q: (read(q.data, q.scale), q.scale)
    cols = lambda q: k.rows(data_t=read(q.data_t, q.scale_t, True), scale_t=q.scale_t)
    weight = lambda w, transposed: (block_scaled.read_weight(read, w, transposed),
                                    w.scale_t if transposed else w.scale)
    w1_fwd, w2_fwd, w1_bwd, w2_bwd = weight(w1q, False), weight(w2q, False), weight(w1q, True), weight(w2q, True)
    x_rows, x_cols, dy_rows, dy_cols = rows(xq), cols(xq), rows(dyq), cols(dyq)
    launch("fc1", *x_rows, *w1_fwd, F, sched, E, spec, q=aq, h=h, h_up_offset=F, b_up_rows=F, **kw)
    kernels = {
        "quantize_x_row_col": (lambda: quantize(x), None, T * H * 4.0),
        # each copy alone (BF16 read, one FP8 copy written): the columnwise one costs ~1.5x the rowwise
        # one for the same bytes (run 21)
        "quantize_x_row_only": (lambda: quantize(x, colwise=False), None, T * H * 3.0),
        "quantize_x_col_only": (lambda: quantize(x, rowwise=False), None, T * H * 3.0),
        "quantize_weights": (lambda: (k.quantize_weight(w1, spec), k.quantize_weight(w2, spec)), None,
                             (w1.numel() + w2.numel()) * 4.0),
        "fc1_glu_quant": (lambda: launch("fc1", *x_rows, *w1_fwd, F, sched, E, spec, q=aq, h=h, h_up_offset=F,
                                         b_up_rows=F, config=epilogue_config, **kw), 2.0 * routed * H * n1, None),
    }
    a_rows, a_cols = rows(aq), cols(aq)
    kernels.update({
        "fc2": (lambda: launch("fc2", *a_rows, *w2_fwd, H, sched, E, spec, c=y, config=gemm_config),
                2.0 * routed * F * H, None),
        "quantize_dy_row_col": (lambda: quantize(dy), None, T * H * 4.0),
        "fc2_dgrad_dglu_quant": (lambda: launch("dact", *dy_rows, *w2_bwd, F, sched, E, spec, q=dhq, q_up_offset=F,
                                                h=h, h_up_offset=F, probs=probs, dprob=dprob, config=epilogue_config,
                                                **kw), 2.0 * routed * H * F, None),
    })
    launch("dact", *dy_rows, *w2_bwd, F, sched, E, spec, q=dhq, q_up_offset=F, h=h, h_up_offset=F, probs=probs,
           dprob=dprob, config=epilogue_config, **kw)
    dh_rows, dh_cols = rows(dhq), cols(dhq)
    kernels.update({
        "fc1_dgrad": (lambda: launch("dgrad", *dh_rows, *w1_bwd, H, sched, E, spec, c=dx, config=gemm_config),
                      2.0 * routed * n1 * H, None),
        "wgrad_w2": (lambda: k.grouped_wgrad(dy_cols, a_cols, sched, dw2, config=wgrad_config), 2.0 * routed * H * F,
                     None),
        "wgrad_w1": (lambda: k.grouped_wgrad(dh_cols, x_cols, sched, dw1, config=wgrad_config),
                     2.0 * routed * n1 * H, None),
    })
    if hasattr(k.gemm, "EPILOGUE_INPUT_DTYPE"):
        # the separate epilogues on the FP32 accumulator (the default before run 22), same process
        fp32_input = lambda fn: lambda: _call_under(f".backends.triton.{recipe}.gemm", FP32_EPILOGUE_INPUT, fn)
        if recipe == "fp8_block":  # MXFP8's FC1 is one kernel
            kernels["fc1_glu_quant_fp32_input"] = ((fp32_input(kernels["fc1_glu_quant"][0]),)
                                                   + kernels["fc1_glu_quant"][1:])
        kernels["fc2_dgrad_dglu_quant_fp32_input"] = ((fp32_input(kernels["fc2_dgrad_dglu_quant"][0]),)
                                                      + kernels["fc2_dgrad_dglu_quant"][1:])
    # the same GEMMs without their epilogues (plain mode, BF16 out): what the mainloops alone cost
    h_plain, da_plain = torch.empty(T, n1, device=x.device, dtype=x.dtype), torch.empty(T, F, device=x.device,
                                                                                        dtype=x.dtype)
    kernels.update({
        "fc1_gemm_only": (lambda: launch("fc2", *x_rows, *w1_fwd, n1, sched, E, spec, c=h_plain, config=gemm_config),
                          2.0 * routed * H * n1, None),
        "fc2_dgrad_gemm_only": (lambda: launch("fc2", *dy_rows, *w2_bwd, F, sched, E, spec, c=da_plain,
                                               config=gemm_config), 2.0 * routed * H * F, None),
    })
    if values:  # FP8 read, BF16 written, per copy
        kernels["expand_x_row_col"] = (lambda: (rows(xq), cols(xq)), None, 2 * T * H * 3.0)
        kernels["expand_weights"] = (lambda: [weight(w, t) for w in (w1q, w2q) for t in (False, True)], None,
                                     2 * (w1.numel() + w2.numel()) * 3.0)
    return bench.time_kernels(kernels, fp8_peak)


def variants(recipe: str, shape_name: str = "dsv3-e32", only: Optional[List[str]] = None) -> Dict[str, Dict]:
    """The kernels of ``recipe`` under a few block configs (to choose the defaults on the device);
    ``only``: these configs (and ``default``)."""
    if recipe == "fp8_block":
        from .backends.triton.fp8_block.gemm import FP8GemmConfig as G
        from .backends.triton.fp8_block.wgrad import FP8WgradConfig as W, default_config as wgrad_default

        def gluon_wgrad(**changes):
            """The Gluon wgrad's default config (two consumer partitions, TMA store) with ``changes``."""
            return dataclasses.replace(wgrad_default(gluon=True), engine="gluon", **changes)

        configs = {
            "default": {},
            # FC2 / FC1 dgrad on the Triton kernel (the default before the Gluon one)
            "plain_triton": dict(gemm_config=G(num_stages=4, plain_engine="triton")),
            # the Gluon (warp-specialised) plain GEMM's pipeline depth (4 x 32 KB of tiles by default),
            # L2 band and consumer partitions (1: both warpgroups in one; the default, 2, gives each a
            # half of every tile's rows)
            "plain_gluon_s3": dict(gemm_config=G(num_stages=3)),
            "plain_gluon_s5": dict(gemm_config=G(num_stages=5)),
            "plain_gluon_g16": dict(gemm_config=G(num_stages=4, group_m=16)),
            "plain_gluon_1_consumer": dict(gemm_config=G(num_stages=4, consumers=1)),
            "plain_gluon_no_tma_store": dict(gemm_config=G(num_stages=4, tma_store=False)),
            # the wgrads: the Triton kernel (the default before run 19) and the Gluon one at other tiles,
            # stages, L2 bands, consumer partitions and without the TMA store of dw
            "wgrad_triton": dict(wgrad_config=W(block_n=64, block_k=128, num_warps=4, num_stages=3, engine="triton")),
            "wgrad_gluon_1_consumer": dict(wgrad_config=gluon_wgrad(consumers=1, num_stages=5)),
            "wgrad_gluon_s5": dict(wgrad_config=gluon_wgrad(num_stages=5)),
            "wgrad_gluon_no_tma_store": dict(wgrad_config=gluon_wgrad(tma_store=False)),
            "wgrad_gluon_g4": dict(wgrad_config=gluon_wgrad(group_n=4)),
            "wgrad_gluon_64x128_2cta": dict(wgrad_config=gluon_wgrad(block_n=64, num_warps=4, num_stages=3,
                                                                     ctas_per_sm=2, consumers=1)),
            # the Gluon kernels (plain GEMMs and wgrads) reading each tile's schedule entries when it
            # starts instead of under the tile before (wgmma_ws.TILE_PREFETCH)
            "gluon_no_tile_prefetch": dict(module_flags={"wgmma_ws": dict(TILE_PREFETCH=False)}),
            # FC1 and the dGLU as one kernel each (the default before run 16; the epilogues alone are
            # the default on sm_90 since, at gemm.EPILOGUE_ALONE_WARPS)
            "epilogues_fused": dict(epilogue_config=G(num_stages=3, epilogue="fused")),
            # quantize: register caps that let two CTAs share an SM (one's loads under the other's math)
            "quantize_w16_r255": dict(quantize_warps=16, quantize_maxnreg=255),  # the default before run 16
            "quantize_w16_r64": dict(quantize_warps=16, quantize_maxnreg=64),
            "quantize_w4_r128": dict(quantize_warps=4, quantize_maxnreg=128),
            # the epilogues alone (FC1, dGLU): warps and register caps (more CTAs per SM overlap one's
            # loads with another's math), and the unsplit epilogue
            "alone_w8_r128": dict(epilogue_config=G(num_stages=3, alone_warps=8, alone_maxnreg=128)),
            "alone_w8": dict(epilogue_config=G(num_stages=3, alone_warps=8)),
            "alone_w4_r128": dict(epilogue_config=G(num_stages=3, alone_warps=4, alone_maxnreg=128)),
            "alone_w4_r96": dict(epilogue_config=G(num_stages=3, alone_warps=4, alone_maxnreg=96)),
            "alone_w16_r64": dict(epilogue_config=G(num_stages=3, alone_maxnreg=64)),
            "alone_split": dict(epilogue_config=G(num_stages=3, split_epilogue=True)),
            # the Triton wgrad at fewer stages and a register cap: four CTAs per SM instead of three
            "wgrad_s2_r128": dict(wgrad_config=W(block_n=64, block_k=128, num_warps=4, num_stages=2, maxnreg=128)),
            "wgrad_s3_r128": dict(wgrad_config=W(block_n=64, block_k=128, num_warps=4, num_stages=3, maxnreg=128)),
        }
        # measured before (run 11, benchmarks/results/run11_fp8_speed/): 128x64 wgrad tiles at 4 warps
        # (now the default) vs 128x128 at 8 warps; FC2 / FC1 dgrad at 128x64 (mixed, not adopted); the
        # dGLU epilogue in halves (default) vs unsplit vs two passes
    else:
        from .backends.triton.mxfp8.gemm import MXGemmConfig as G
        from .backends.triton.mxfp8.wgrad import MXWgradConfig as W

        promote = dict(expand_bf16=False)
        configs = {
            "default": {},
            # the other inner loop: FP8 wgmma per 32-K block + FP32 promotion (run 12's default)
            "promote": dict(gemm_config=G(block_n=64, num_warps=4, num_stages=4, **promote),
                            epilogue_config=G(block_n=64, num_warps=8, num_stages=4, **promote),
                            wgrad_config=W(block_n=64, block_k=128, num_warps=4, num_stages=3, **promote),
                            quantized_operands=True),
            # expansion in the K loop (the default before run 15)
            "k_loop": dict(quantized_operands=True),
            # the BF16-valued GEMMs (the default) at other tiles
            "plain_128x64_w4": dict(gemm_config=G(block_n=64, num_warps=4, num_stages=4, expand_bf16=True)),
            "epi_bn128_s2": dict(epilogue_config=G(block_n=128, num_warps=8, num_stages=2, expand_bf16=True)),
            "wgrad_64x128_w4": dict(wgrad_config=W(block_n=64, block_k=128, num_warps=4, num_stages=3,
                                                   expand_bf16=True)),
            # the dGLU as its GEMM + the epilogue alone (opt-in, gemm.DACT_EPILOGUE; the FC1 row of this
            # variant runs at 4 stages instead of 3)
            "dglu_separate": dict(epilogue_config=G(block_n=64, num_warps=8, num_stages=4, expand_bf16=True,
                                                    epilogue="separate")),
        }
    shape = bench.SHAPES[shape_name]
    inputs = bench.make_inputs(shape)
    fp8_peak = fp8_ceiling_tflops()
    if only:
        unknown = set(only) - set(configs)
        if unknown:
            raise ValueError(f"only: unknown variants {sorted(unknown)}; expected names from {sorted(configs)}")
        configs = {name: kw for name, kw in configs.items() if name == "default" or name in only}

    def timed(kw):
        # a config may also set module flags of backends.triton.<recipe>.<module> while it is timed
        with _recipe_module_flags(recipe, kw.pop("module_flags", {})):
            return bench_kernels(recipe, shape, inputs, fp8_peak, **kw)

    return {name: timed(dict(kw)) for name, kw in configs.items()}


def weight_cache_report(inputs, recipes=tuple(RECIPES)) -> Dict[str, Dict]:
    """Per recipe, what the per-step weight cache holds and what it saves per micro-batch (one
    quantization of both weights, both layouts), vs re-quantizing every micro-batch; and what each
    fused path keeps for backward besides the weights."""
    from .backends.triton.fp8_block.quantize import WeightCache
    from .backends.triton.schedule import max_m_tiles

    w1, w2 = inputs["w1"], inputs["w2"]
    T, H = inputs["x"].shape
    n1, F = w1.shape[1], w2.shape[2]
    slots = 128 * max_m_tiles(T, w1.shape[0], 128)
    out = {"bf16_weight_bytes": (w1.numel() + w2.numel()) * w1.element_size(),
           "saved_for_backward_bytes": {"bf16_fused": 2 * T * H + 2 * T * n1 + 2 * T * F}}  # x, h, a
    # h, the columnwise FP8 copies of x and a, their scales (FP32 per 128 tokens / E8M0 per 32)
    # (NVFP4: two codes per byte, an E4M3 scale per 16)
    copies_bytes = {"fp8_block": (H + F) * slots + 4 * (H + F) * (slots // 128),
                    "mxfp8": (H + F) * slots + (H + F) * (slots // 32),
                    "nvfp4": (H + F) * slots // 2 + (H + F) * (slots // 16)}
    for recipe in recipes:
        k, spec = recipe_kernels(recipe)
        cache = WeightCache(follow_optimizer_steps=False, quantize_fn=k.quantize_weight)
        cache.get(w1, spec), cache.get(w2, spec)
        out[recipe] = {
            "cache_bytes": cache.nbytes,
            "requantize_ms_per_microbatch": bench.do_bench_ms(
                lambda: (cache.clear(), cache.get(w1, spec), cache.get(w2, spec))),
            "cache_hit_ms": bench.do_bench_ms(lambda: (cache.get(w1, spec), cache.get(w2, spec))),
        }
        out["saved_for_backward_bytes"][f"{recipe}_fused"] = 2 * T * n1 + copies_bytes[recipe]
    return out


def run(shape_names: List[str], out_dir: Optional[str] = None, kernels: bool = True,
        budget_s: float = 150.0, recipes=tuple(RECIPES), with_scaled_grouped_mm: bool = False,
        rounds: int = 1, only: Sequence[str] = ()) -> Dict:
    """``rounds`` > 1: every implementation is timed once per round, the rounds one after the other
    (A B C, A B C, ...), and each timing is the median over the rounds, so that a drift of the GPU's
    clocks over the run weighs on all implementations alike (the BF16 baseline moved 14.1-15.6 ms
    between runs 16-18 while our kernels did not)."""
    import triton

    start = time.time()
    torch.manual_seed(0)
    ceilings = bench.measure_ceilings()
    try:
        ceilings["fp8_gemm_tflops"] = fp8_ceiling_tflops()
    except Exception as exc:
        ceilings["fp8_gemm_tflops"] = float("nan")
        ceilings["fp8_gemm_error"] = f"{type(exc).__name__}: {exc}"
    peak = ceilings["bf16_gemm_tflops"]
    implementations = selected_implementations(recipes, with_scaled_grouped_mm, only)
    fp8_peak = ceilings["fp8_gemm_tflops"] if ceilings["fp8_gemm_tflops"] == ceilings["fp8_gemm_tflops"] else 2 * peak
    report = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "cuda": torch.version.cuda, "python": platform.python_version(), "ptxas": _ptxas_in_use(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "recipes": {name: dataclasses.asdict(RECIPES[name]()) | ({"fp8_format": "E4M3"} if name in FP8_RECIPES else {})
                    for name in recipes},
        "implementations": list(implementations), "ceilings": ceilings, "shapes": {},
        "targets": [f"{impl} fwd+bwd >= {x}x {base}" for impl, base, x in TARGETS if impl in implementations],
    }
    for name in shape_names:
        if time.time() - start > budget_s:
            report["shapes"][name] = {"skipped": f"time budget of {budget_s:.0f} s spent"}
            continue
        shape = bench.SHAPES[name]
        inputs = bench.make_inputs(shape)
        entry = {"shape": dataclasses.asdict(shape), "counts": inputs["counts"].tolist()}
        ys = {}
        timed = {impl: [] for impl in implementations}
        for _ in range(max(1, rounds)):
            for impl, fn in implementations.items():
                result = bench_impl(impl, shape, inputs, peak, fn)
                if "_y" in result:
                    ys[impl] = result.pop("_y")
                timed[impl].append(result)
                torch.cuda.empty_cache()
        for impl in implementations:
            entry[impl] = median_of_rounds(timed[impl])
        routed = int(inputs["counts"].sum())
        base = entry["bf16_unfused"]
        entry["ratio_vs_bf16_unfused"] = {
            impl: {k: base[f"{k}_ms"] / entry[impl][f"{k}_ms"] for k in ("fwd", "bwd", "fwd_bwd")}
            for impl in implementations if "fwd_ms" in entry[impl] and "fwd_ms" in base}
        ref = ys.get("bf16_unfused")
        entry["y_rel_err_vs_bf16_unfused"] = {
            impl: _rel_err(y[:routed], ref[:routed]) for impl, y in ys.items() if ref is not None}
        for recipe in recipes:  # the fused path vs the same recipe unfused (same quantized operands)
            if f"{recipe}_fused" in ys and f"{recipe}_unfused" in ys:
                entry[f"y_rel_err_{recipe}_fused_vs_unfused"] = _rel_err(ys[f"{recipe}_fused"][:routed],
                                                                         ys[f"{recipe}_unfused"][:routed])
        entry["targets"] = {}
        for impl, baseline, wanted in TARGETS:
            if "fwd_bwd_ms" in entry.get(impl, {}) and "fwd_bwd_ms" in entry.get(baseline, {}):
                speedup = entry[baseline]["fwd_bwd_ms"] / entry[impl]["fwd_bwd_ms"]
                entry["targets"][f"{impl} vs {baseline}"] = {"speedup": speedup, "wanted": wanted,
                                                             "met": bool(speedup >= wanted)}
        if kernels and time.time() - start < budget_s:
            entry["kernels"] = {recipe: bench_kernels(recipe, shape, inputs, fp8_peak) for recipe in recipes}
            entry["weight_cache"] = weight_cache_report(inputs, recipes)
            entry.update(_cublas_ceiling(entry, inputs, shape))
        report["shapes"][name] = entry
        del inputs, ys
        torch.cuda.empty_cache()
    report["elapsed_s"] = time.time() - start
    if out_dir:
        save(report, out_dir)
    return report


def _cublas_ceiling(entry: Dict, inputs, shape: bench.Shape) -> Dict:
    """``cublas_fp8``: the MLP's six GEMMs on cuBLAS FP8 with per-tensor scales at their shapes
    (:mod:`.bench_ceiling`); ``with_cublas_gemms``: per fused recipe whose kernels were timed, its MLP
    with cuBLAS's GEMM times in the place of its own (:func:`.bench_ceiling.mlp_model`)."""
    from . import bench_ceiling

    try:
        cublas = bench_ceiling.measure(inputs["counts"].tolist(), shape.hidden, shape.ffn, inputs["w1"].shape[1])
    except Exception as exc:  # recorded: the rest of the report stands
        return {"cublas_fp8": {"error": f"{type(exc).__name__}: {exc}"}}
    models = {}
    for recipe, kernels in entry.get("kernels", {}).items():
        fused, base = entry.get(f"{recipe}_fused", {}), entry.get("bf16_unfused", {})
        if "fwd_bwd_ms" in fused and "fwd_bwd_ms" in base:
            try:
                models[recipe] = bench_ceiling.mlp_model(cublas, kernels, fused["fwd_bwd_ms"], base["fwd_bwd_ms"])
            except ValueError as exc:  # a kernel of the six failed or is not timed for this recipe
                models[recipe] = {"error": str(exc)}
    return {"cublas_fp8": cublas, "with_cublas_gemms": models}


def _ceiling_lines(e: Dict) -> List[str]:
    cublas = e.get("cublas_fp8")
    if not cublas:
        return []
    if "error" in cublas:
        return [f"  cuBLAS FP8 at these GEMMs: failed: {cublas['error'][:150]}"]
    total = sum(v["ms"] for v in cublas.values())
    lines = ["  cuBLAS FP8, per-tensor scales, at these GEMMs: " + "; ".join(
        f"{name} {v['ms']:.3f} ms {v['tflops']:.0f} TF/s" for name, v in cublas.items()) + f"; sum {total:.2f} ms"]
    for recipe, m in e.get("with_cublas_gemms", {}).items():
        if "error" in m:
            lines.append(f"  {recipe}_fused with cuBLAS's GEMMs: {m['error'][:150]}")
            continue
        lines.append(
            f"  {recipe}_fused: its GEMMs {m['ours_gemm_ms']:.2f} ms ({m['ours_gemm_ms'] / m['cublas_gemm_ms']:.2f}x "
            f"cuBLAS's), the rest {m['rest_ms']:.2f} ms; with cuBLAS's GEMMs {m['with_cublas_gemms_ms']:.2f} ms = "
            f"{m['with_cublas_gemms_speedup']:.2f}x bf16_unfused (now {m['fused_speedup']:.2f}x; cuBLAS's GEMMs "
            f"alone {m['gemms_only_speedup']:.2f}x)")
    return lines


def summary_table(report: Dict) -> str:
    c = report["ceilings"]
    lines = [f"{report['gpu']}  torch {report['torch']}  triton {report['triton']}  "
             f"ptxas {report.get('ptxas', '?')}  cuBLAS bf16 "
             f"{c['bf16_gemm_tflops']:.0f} / fp8 {c.get('fp8_gemm_tflops', float('nan')):.0f} TFLOP/s  "
             f"copy {c['d2d_copy_tbps']:.2f} TB/s   targets: {'; '.join(report['targets'])}"]
    for name, e in report["shapes"].items():
        if "skipped" in e:
            lines.append(f"{name}: skipped ({e['skipped']})")
            continue
        met = ", ".join(f"{k}: {v['speedup']:.2f}x (want {v['wanted']}x)" for k, v in e.get("targets", {}).items())
        lines.append(f"\n{name}  ({met})")
        lines.append(f"  {'implementation':32} {'fwd ms':>8} {'bwd ms':>8} {'f+b ms':>8} {'f+b TFLOP/s':>11} "
                     f"{'x fwd':>6} {'x bwd':>6} {'x f+b':>6} {'mem GiB':>8} {'held GiB':>8} {'y err vs bf16':>13}")
        for impl in report["implementations"]:
            r = e[impl]
            if "error" in r:
                lines.append(f"  {impl:32} failed: {r['error'][:150]}")
                continue
            ratio = e["ratio_vs_bf16_unfused"].get(impl, {})
            lines.append(
                f"  {impl:32} {r['fwd_ms']:8.2f} {r['bwd_ms']:8.2f} {r['fwd_bwd_ms']:8.2f} {r['fwd_bwd_tflops']:11.0f} "
                f"{ratio.get('fwd', float('nan')):6.2f} {ratio.get('bwd', float('nan')):6.2f} "
                f"{ratio.get('fwd_bwd', float('nan')):6.2f} {r['peak_mem_gib']:8.2f} "
                f"{r.get('after_forward_gib', float('nan')):8.2f} "
                f"{e['y_rel_err_vs_bf16_unfused'].get(impl, float('nan')):13.2e}")
        for recipe, kernels in e.get("kernels", {}).items():
            lines.append(f"  {recipe} kernels: " + "; ".join(_kernel_summary(k, v) for k, v in kernels.items()))
        w = e.get("weight_cache")
        if w:
            for recipe in report["recipes"]:
                lines.append(f"  {recipe} weight cache: {w[recipe]['cache_bytes'] / 2**30:.2f} GiB held (bf16 weights "
                             f"{w['bf16_weight_bytes'] / 2**30:.2f} GiB); saves "
                             f"{w[recipe]['requantize_ms_per_microbatch']:.3f} ms of weight quantization per "
                             f"micro-batch (hit {w[recipe]['cache_hit_ms'] * 1e3:.1f} us)")
            lines.append("  saved for backward (GiB): " + ", ".join(
                f"{k} {v / 2**30:.2f}" for k, v in w["saved_for_backward_bytes"].items()))
        lines.extend(_ceiling_lines(e))
    return "\n".join(lines)


def _kernel_summary(name: str, v: Dict) -> str:
    if "error" in v:
        return f"{name} failed"
    if "tflops" in v:
        return f"{name} {v['ms']:.3f} ms {v['tflops']:.0f} TF/s"
    return f"{name} {v['ms']:.3f} ms {v['gbps']:.0f} GB/s"


def save(report: Dict, out_dir: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, f"recipes_{report['gpu'].replace(' ', '_')}_{report['date'][:10]}")
    with open(base + ".json", "w") as f:
        json.dump(report, f, indent=1, default=str)
    with open(base + ".txt", "w") as f:
        f.write(summary_table(report) + "\n")
    return base


def main(argv: Optional[List[str]] = None) -> int:
    """``scripts/bench_recipes.py``."""
    import argparse

    parser = argparse.ArgumentParser(prog="bench_recipes", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES),
                        help=f"comma-separated from {sorted(bench.SHAPES)} (default: {','.join(DEFAULT_SHAPES)})")
    parser.add_argument("--out", default="benchmarks/results", help="folder for the JSON and the text table")
    parser.add_argument("--no-kernels", action="store_true", help="skip the per-kernel timings")
    parser.add_argument("--only", default="", help="with --variants: comma-separated config names to time")
    parser.add_argument("--variants", choices=sorted(FP8_RECIPES),
                        help="instead: time that recipe's kernels under a few block configs (first shape only)")
    parser.add_argument("--recipes", default=",".join(RECIPES),
                        help=f"comma-separated from {sorted(RECIPES)}: which recipes' implementations to time")
    parser.add_argument("--implementations", default="",
                        help="comma-separated: time only these of the recipes' implementations (and bf16_unfused)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="time every implementation this many times, interleaved, and keep the medians")
    parser.add_argument("--budget-s", type=float, default=150.0,
                        help="start no new shape (nor the kernel timings) after this many seconds")
    parser.add_argument("--with-scaled-grouped-mm", action="store_true",
                        help="also time torch._scaled_grouped_mm (FP8 rowwise); see SCALED_GROUPED_MM")
    args = parser.parse_args(argv)
    names = args.shapes.split(",")
    unknown = [n for n in names if n not in bench.SHAPES]
    if unknown:
        parser.error(f"--shapes: unknown {unknown}; expected names from {sorted(bench.SHAPES)}")
    if args.only and not args.variants:
        parser.error("--only picks configs of --variants and means nothing without it; "
                     "to time some implementations, use --implementations")
    if not torch.cuda.is_available():
        parser.error("the benchmark times FP8 kernels on a CUDA GPU (Hopper)")
    if args.variants:
        result = variants(args.variants, names[0], [n for n in args.only.split(",") if n])
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"{args.variants}_variants_{names[0]}.json"), "w") as f:
            json.dump(result, f, indent=1)
        for variant, kernels in result.items():
            print(variant, "  ".join(_kernel_summary(k, v) for k, v in kernels.items()))
        return 0
    chosen = args.recipes.split(",")
    if set(chosen) - set(RECIPES):
        parser.error(f"--recipes: unknown {sorted(set(chosen) - set(RECIPES))}; expected names from {sorted(RECIPES)}")
    only = [n for n in args.implementations.split(",") if n]
    try:
        selected_implementations(chosen, args.with_scaled_grouped_mm, only)
    except ValueError as exc:
        parser.error(f"--implementations: {exc}")
    report = run(names, out_dir=args.out, kernels=not args.no_kernels, budget_s=args.budget_s, recipes=chosen,
                 rounds=args.rounds, with_scaled_grouped_mm=args.with_scaled_grouped_mm, only=only)
    print(summary_table(report))
    return 0
