"""The MXFP8 recipe's kernels for :class:`~..block_scaled.BlockScaledExpertMLP` (the autograd
Function and its dataflow are shared with the FP8 block recipe; see that module), and its
recipe/shape checks.

Block sizes: 1x32 along each GEMM's reduction axis with E8M0 scales: x, a, dy, dh rowwise along K;
32 tokens per block restarting at each expert for the wgrad operands; weights 1x32 along K (fprop)
and, in their transposed copy, along N (dgrad).
"""

from __future__ import annotations

from typing import Optional

from ..block_scaled import RecipeKernels
from ..fp8_block.wgrad import tile_sums_to_experts
from . import gemm
from .quantize import TILE, WEIGHT_CACHE, MXRows, MXSpec, new_rows, quantize_rows, quantize_weight
from .wgrad import mx_grouped_wgrad


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


KERNELS = RecipeKernels(
    recipe_name="MXFP8BlockScaling", tile=TILE, weight_cache=WEIGHT_CACHE, quantize_weight=quantize_weight,
    quantize_rows=quantize_rows, new_rows=new_rows, rows=MXRows, gemm=gemm, grouped_wgrad=mx_grouped_wgrad,
    tile_sums_to_experts=tile_sums_to_experts, specs_of=specs_of, unsupported=supports_mxfp8,
)
check_shapes = KERNELS.check_shapes
mxfp8_expert_mlp = KERNELS.expert_mlp
