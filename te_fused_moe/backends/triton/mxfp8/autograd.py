"""The MXFP8 recipe's kernels for :class:`~..block_scaled.BlockScaledExpertMLP` (the autograd
Function and its dataflow are shared with the FP8 block recipe; see that module), and its
recipe/shape checks.

Block sizes: 1x32 along each GEMM's reduction axis with E8M0 scales: x, a, dy, dh rowwise along K;
32 tokens per block restarting at each expert for the wgrad operands; weights 1x32 along K (fprop)
and, in their transposed copy, along N (dgrad). Each GEMM reads its operands as BF16 values
(``EXPAND_BEFORE_GEMM``), written by the quantize pass or epilogue that makes them where a GEMM of the
same pass reads them (``QUANTIZE_TO_VALUES``) and by an expansion pass before the GEMM otherwise, or
expands FP8 operands in its K loop.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .. import block_scaled, library_wgrad
from ..block_scaled import RecipeKernels, as_quantized
from ..fp8_block.wgrad import tile_sums_to_experts
from . import gemm
from .quantize import TILE, WEIGHT_CACHE, MXRows, MXSpec, expand_values, new_rows, quantize_rows, quantize_weight
from .wgrad import mx_grouped_wgrad

# How the GEMMs read their MXFP8 operands (an FP8 value times its E8M0 scale is exact in BF16).
# True: an expansion pass writes each operand's BF16 values just before the GEMM that reads them and
# the K loop is a BF16 GEMM's (the values are transient: saved tensors and the weight cache stay
# FP8). False: the GEMMs expand the FP8 tiles in their K loops (``gemm.default_config``), which on
# the H200 bounds them at 150-280 TFLOP/s (run 13).
EXPAND_BEFORE_GEMM = True
# The weight cache also keeps the weights' BF16 values (both layouts, refreshed with the FP8 copies once
# per optimizer step), which the GEMMs then read instead of expanding the weights per micro-batch: at
# DSv3 E = 32 that expansion is 3.2 ms of each forward + backward (run 31). Costs twice the BF16
# weights' bytes on top of the FP8 copies, so it is opt-in (as ``nvfp4.autograd.BF16_WEIGHT_VALUES``).
BF16_WEIGHT_VALUES = False
# With EXPAND_BEFORE_GEMM, the quantize passes and the FC1 / dGLU epilogues write the copies that a GEMM
# of the same pass reads (x and a rowwise; dy and dh both ways) as their BF16 values instead of FP8
# codes (``quantize.store_mx``): six of the eight activation expansion passes go, for a BF16 write in
# place of an FP8 one. The copies kept for backward (x, a columnwise) stay FP8 and are expanded there.
# The zero-padded path for sizes off the tile (padded.py) still writes codes.
# Run 33 (H100, DSv3): with the chunked quantize kernel, writing x's or dy's values costs no more than
# writing their codes (0.549 / 0.734 ms against 0.567 / 0.807).
QUANTIZE_TO_VALUES = True
# The wgrads read the copies kept for backward (x, a columnwise) as the FP8 codes they were saved as and
# expand them in their K loops next to the gradients' BF16 values (``wgrad.mx_wgrad_kernel``'s X_CODES),
# instead of an expansion pass writing their values before each wgrad. Opt-in: run 38a (H100, DSv3,
# scripts/probe_mx_wgrad.py) dW1 4.71 ms (4.63 with X as the wgmma's A operand, ``wgrad.X_CODES_AS_A``)
# against the pass + the values wgrad 0.30 + 3.50; dW2 2.20 against 0.09 + 1.78; the MLP 19.86 ms (19.62)
# against 18.65, for 0.5 GiB less peak memory (no transient BF16 copies: 5.56 against 6.06 GiB).
X_CODES_IN_WGRAD = False
# With QUANTIZE_TO_VALUES, the forward also writes the columnwise copies it keeps for backward (x's and a's, the
# wgrads' operands) as BF16 values: no expansion pass before either wgrad (at DSv3 0.30 + 0.09 ms, run 38a) for a
# BF16 write in place of an FP8 one in the forward, and one byte more per element of x and a held from forward to
# backward (TE keeps FP8 codes there; BF16 training keeps x in BF16). Opt-in: a memory-for-time trade, as
# BF16_WEIGHT_VALUES is. The zero-padded path (padded.py) keeps codes.
KEEP_COLUMNWISE_VALUES = False
# Which kernel runs the wgrads once both their operands are BF16 values (the values path, X_CODES_IN_WGRAD off):
# "cublas" = cuBLAS's grouped GEMM (``library_wgrad``; sm_90 and a BF16 dW, else the Triton kernel), "triton" =
# ``wgrad.mx_grouped_wgrad``. The unfused path runs the same. Run 39a (H100, DSv3, scripts/probe_mx_wgrad.py):
# dW1 / dW2 2.860 / 1.488 ms on cuBLAS against 3.501 / 1.765 on the Triton kernel; the MLP fused 17.26 against
# 18.15 ms, unfused 22.13 against 23.49.
VALUES_WGRAD_KERNEL = "cublas"
# FC1 at an FFN size off the tile (padded.py): True = its one kernel (weight scales per row, so the up
# half may start at any row of w1); False = the plain GEMM + GLU pass + quantize pass (before session 21)
FC1_OFF_TILE = True


def read_expanded(data, scale, columnwise: bool = False):
    """An operand's exact BF16 values (``columnwise``: a ``data_t`` copy, whose scales are ``scale_t``
    seen transposed), for the GEMM launched next; a copy written as values already is read as it is."""
    if data.dtype == torch.bfloat16:
        return data
    return expand_values(data, scale.t() if columnwise else scale, alloc=block_scaled.ALLOC)


def operand_reader():
    """The shared autograd's per-forward choice (``RecipeKernels.operand_reader``)."""
    return read_expanded if EXPAND_BEFORE_GEMM else as_quantized


def cublas_wgrad(g: MXRows, x: MXRows, schedule: torch.Tensor, shape, like: torch.Tensor) -> Optional[torch.Tensor]:
    """``RecipeKernels.library_wgrad``: dW on cuBLAS where ``VALUES_WGRAD_KERNEL`` asks for it and it applies."""
    if VALUES_WGRAD_KERNEL != "cublas" or not library_wgrad.applies(g.data_t, x.data_t, like):
        return None
    return library_wgrad.values_wgrad(g.data_t, x.data_t, schedule, shape)


def specs_of(recipe):
    """The kernels' element specs (x/a/weights, gradients) of an MXFP8BlockScaling recipe; the first
    carries ``BF16_WEIGHT_VALUES`` for the weight cache (the quantize kernels ignore it)."""
    x_spec = dataclasses.replace(MXSpec.of(recipe.fp8_format.for_role("x")),
                                 bf16_values=BF16_WEIGHT_VALUES and EXPAND_BEFORE_GEMM)
    return x_spec, MXSpec.of(recipe.fp8_format.for_role("grad"))


def supports_mxfp8(recipe) -> Optional[str]:
    """None if the Triton MXFP8 path implements ``recipe``, else the reason."""
    from ....recipes import Format

    if recipe.fp8_format in (Format.E4M3, Format.HYBRID) and recipe.fp8_format.for_role("w") == "e4m3":
        return None
    return (f"backend='triton' implements MXFP8BlockScaling with fp8_format=E4M3 or HYBRID only, got "
            f"fp8_format={recipe.fp8_format.name} (use backend='reference')")


KERNELS = RecipeKernels(
    recipe_name="MXFP8BlockScaling", tile=TILE, weight_cache=WEIGHT_CACHE, quantize_weight=quantize_weight,
    quantize_rows=quantize_rows, new_rows=new_rows, rows=MXRows, gemm=gemm, grouped_wgrad=mx_grouped_wgrad,
    tile_sums_to_experts=tile_sums_to_experts, specs_of=specs_of, unsupported=supports_mxfp8,
    operand_reader=operand_reader, fc1_off_tile=lambda: FC1_OFF_TILE,
    values_in_pass=lambda: EXPAND_BEFORE_GEMM and QUANTIZE_TO_VALUES,
    wgrad_reads_saved=lambda: X_CODES_IN_WGRAD, library_wgrad=cublas_wgrad,
    keeps_values=lambda: KEEP_COLUMNWISE_VALUES,
)
check_shapes = KERNELS.check_shapes
mxfp8_expert_mlp = KERNELS.expert_mlp
