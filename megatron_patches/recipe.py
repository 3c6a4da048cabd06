"""Megatron's FP8/FP4 settings → a ``te_fused_moe`` recipe for the fused experts."""

from __future__ import annotations

from typing import Any

from te_fused_moe.recipes import BF16Recipe, Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling, Recipe


def _name(value: Any) -> str:
    # Megatron stores recipes as strings or as enums (Fp8Recipe / Fp4Recipe) depending on the version.
    return str(getattr(value, "value", value)).lower()


def recipe_from_config(config: Any) -> Recipe:
    """The quantization recipe for ``config`` (``fp8``/``fp8_recipe``, ``fp4``/``fp4_recipe``)."""
    fp8 = getattr(config, "fp8", None)
    fp4 = getattr(config, "fp4", None)
    if fp8 and fp4:
        raise ValueError("fp8 and fp4: the fused experts take one recipe; expected only one of them set")
    if fp8:
        recipe = _name(getattr(config, "fp8_recipe", "delayed"))
        if recipe == "mxfp8":
            return MXFP8BlockScaling()
        if recipe == "blockwise":
            return Float8BlockScaling()
        raise ValueError(
            f"fp8_recipe={recipe!r} is not implemented by the fused experts; expected 'mxfp8' or 'blockwise'"
        )
    if fp4:
        recipe = _name(getattr(config, "fp4_recipe", "nvfp4"))
        if recipe == "nvfp4":
            return NVFP4BlockScaling()
        raise ValueError(f"fp4_recipe={recipe!r} is not implemented by the fused experts; expected 'nvfp4'")
    return BF16Recipe()
