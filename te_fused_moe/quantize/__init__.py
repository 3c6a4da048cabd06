"""Quantizers, one module per format, plus ``fake_quantize`` (quantize then dequantize) used by the
reference backend to emulate a recipe exactly.

    formats.py    element formats E4M3 / E5M2 / E2M1 / E8M0: rounding, saturation, codes
    mxfp8.py      E4M3/E5M2 values, E8M0 scale per 32 elements
    nvfp4.py      E2M1 values, E4M3 scale per 16 elements (or 16x16), FP32 tensor scale, SR
    fp8_block.py  E4M3/E5M2 values, FP32 scale per 1x128 or 128x128 block
    hadamard.py   16-point random Hadamard transform of NVFP4's wgrad operands
    blocks.py     cutting tensors into (padded) blocks along an axis

Each module's docstring states its rounding and saturation rules and the TE source files they
follow. All functions are plain torch ops: they run on CPU or GPU without host syncs.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..recipes import BF16Recipe, Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling, ROLES, as_recipe
from . import fp8_block, hadamard, mxfp8, nvfp4
from .blocks import normalize_axis

GEMMS = ("fprop", "dgrad", "wgrad")


def fake_quantize(
    t: torch.Tensor,
    recipe,
    *,
    role: str,
    axis: int,
    gemm: str,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """``t`` as the GEMM ``gemm`` sees it under ``recipe``: quantized then dequantized.

    ``t`` is a 2-D operand; ``axis`` is the GEMM's reduction dimension of it (blocks run along
    it); ``role`` is ``"x"``, ``"w"`` or ``"grad"``; ``gemm`` is ``"fprop"``, ``"dgrad"`` or
    ``"wgrad"``. Returns float32 (float64 when ``t`` is float64) of ``t``'s shape.

    * BF16: ``t`` unchanged.
    * MXFP8: 1x32 blocks along ``axis``, format ``recipe.fp8_format.for_role(role)``.
    * NVFP4: 1x16 blocks along ``axis``; weights use 16x16 tiles unless
      ``disable_2d_quantization``; gradients are stochastically rounded (``generator``) unless
      ``disable_stochastic_rounding``; the wgrad operands x and grad are Hadamard-transformed
      along ``axis`` first unless ``disable_rht``, and the result is transformed back
      (``qdq(t·M)·Mᵀ``), so a product of two such operands equals TE's product of the transformed
      operands up to float32 rounding of the output. With a length that is not a multiple of 16
      that identity needs the padded tail, which is cropped: TE requires multiples of 16 there.
      The NVFP4 tensor scale comes from all of ``t``: to emulate TE's grouped GEMMs, which
      quantize each expert's slice on its own, call this once per expert.
    * FP8 block: ``recipe.block_dim(role)`` 1 -> 1x128 blocks along ``axis``, 2 -> 128x128 tiles;
      power-of-two scales unless ``use_f32_scales``; format ``recipe.fp8_format.for_role(role)``.
    """
    recipe = as_recipe(recipe)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"t: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"t: expected a 2-D GEMM operand, got shape {tuple(t.shape)}")
    if role not in ROLES:
        raise ValueError(f"role: expected one of {ROLES}, got {role!r}")
    if gemm not in GEMMS:
        raise ValueError(f"gemm: expected one of {GEMMS}, got {gemm!r}")
    axis = normalize_axis("axis", axis, 2)
    out_dtype = torch.float64 if t.dtype == torch.float64 else torch.float32

    if isinstance(recipe, BF16Recipe):
        if not t.is_floating_point():
            raise TypeError(f"t: expected a floating tensor, got {t.dtype}")
        return t.to(out_dtype)
    if isinstance(recipe, MXFP8BlockScaling):
        q = mxfp8.quantize(t, axis=axis, fp8_format=recipe.fp8_format.for_role(role))
        return mxfp8.dequantize(q, dtype=out_dtype)
    if isinstance(recipe, Float8BlockScaling):
        block = (1, fp8_block.BLOCK) if recipe.block_dim(role) == 1 else (fp8_block.BLOCK, fp8_block.BLOCK)
        q = fp8_block.quantize(
            t,
            block=block,
            axis=axis,
            power_2_scale=not recipe.use_f32_scales,
            fp8_format=recipe.fp8_format.for_role(role),
        )
        return fp8_block.dequantize(q, dtype=out_dtype)
    if isinstance(recipe, NVFP4BlockScaling):
        return _fake_quantize_nvfp4(t, recipe, role, axis, gemm, generator, out_dtype)
    raise TypeError(f"recipe: no quantizer for {type(recipe).__name__}")


def _fake_quantize_nvfp4(t, recipe, role, axis, gemm, generator, out_dtype) -> torch.Tensor:
    block_2d = role == "w" and not recipe.disable_2d_quantization
    stochastic = role == "grad" and not recipe.disable_stochastic_rounding
    rht = gemm == "wgrad" and role in ("x", "grad") and not recipe.disable_rht
    if not rht:
        q = nvfp4.quantize(t, axis=axis, block_2d=block_2d, stochastic_rounding=stochastic, generator=generator)
        return nvfp4.dequantize(q, dtype=out_dtype)
    transformed = hadamard.apply_rht(t, axis)  # float32, length padded to a multiple of 16
    q = nvfp4.quantize(transformed, axis=axis, block_2d=False, stochastic_rounding=stochastic, generator=generator)
    return hadamard.apply_inverse_rht(nvfp4.dequantize(q, dtype=torch.float64), axis, t.shape[axis], out_dtype)


__all__ = ["GEMMS", "fake_quantize", "fp8_block", "hadamard", "mxfp8", "nvfp4"]
