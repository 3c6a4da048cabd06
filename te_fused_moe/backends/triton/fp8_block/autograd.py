"""The FP8 block recipe's kernels for :class:`~..block_scaled.BlockScaledExpertMLP` (the autograd
Function and its dataflow are shared with MXFP8; see that module), and its recipe/shape checks.

Block sizes: 1x128 along K for x, a, dy, dh (rowwise), 128 tokens per block restarting at each
expert for the wgrad operands (columnwise), 128x128 for weights; FP32 scales (power-of-2 or not).
"""

from __future__ import annotations

from typing import Optional

from ..block_scaled import RecipeKernels
from . import gemm
from .dglu_rows import dglu_quantized
from .quantize import BLOCK, FP8Spec, QuantizedRows, WEIGHT_CACHE, new_rows, quantize_rows, quantize_weight
from .wgrad import fp8_grouped_wgrad, tile_sums_to_experts


def specs_of(recipe):
    """The kernels' FP8 specs (x/a/weights, gradients) of a supported Float8BlockScaling."""
    pow2 = not recipe.use_f32_scales
    return FP8Spec.of(recipe.fp8_format.for_role("x"), pow2), FP8Spec.of(recipe.fp8_format.for_role("grad"), pow2)


def supports_fp8_block(recipe) -> Optional[str]:
    """None if the Triton FP8 path implements ``recipe``, else the reason."""
    from ....recipes import Format

    ok = (recipe.fp8_format in (Format.E4M3, Format.HYBRID) and recipe.x_block_scaling_dim == 1 and recipe.w_block_scaling_dim == 2
          and recipe.grad_block_scaling_dim == 1)
    if ok:
        return None
    return ("backend='triton' implements Float8BlockScaling with fp8_format=E4M3 or HYBRID, x_block_scaling_dim=1, "
            "w_block_scaling_dim=2, grad_block_scaling_dim=1 (power-of-2 or FP32 scales) only, got "
            f"fp8_format={recipe.fp8_format.name}, x_block_scaling_dim={recipe.x_block_scaling_dim}, "
            f"w_block_scaling_dim={recipe.w_block_scaling_dim}, grad_block_scaling_dim={recipe.grad_block_scaling_dim} "
            "(use backend='reference')")


KERNELS = RecipeKernels(
    recipe_name="Float8BlockScaling", tile=BLOCK, weight_cache=WEIGHT_CACHE, quantize_weight=quantize_weight,
    quantize_rows=quantize_rows, new_rows=new_rows, rows=QuantizedRows, gemm=gemm, grouped_wgrad=fp8_grouped_wgrad,
    tile_sums_to_experts=tile_sums_to_experts, specs_of=specs_of, unsupported=supports_fp8_block,
    # "fused" (one-kernel epilogues) cannot take F off the tile: the GLU passes run then
    fc1_off_tile=lambda: gemm.FC1_EPILOGUE != "fused",
    dglu_off_tile=lambda: dglu_quantized if gemm.DACT_EPILOGUE != "fused" else None,
)
check_shapes = KERNELS.check_shapes
fp8_block_expert_mlp = KERNELS.expert_mlp
