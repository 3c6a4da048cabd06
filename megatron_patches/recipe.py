"""Megatron's FP8/FP4 settings → a ``te_fused_moe`` recipe for the fused experts.

The fused experts take their recipe from the same config fields that drive Transformer Engine in
Megatron (``--fp8-format``/``--fp8-recipe``, ``--fp4-format``/``--fp4-recipe``; megatron-core 0.16
and 0.19 have the same fields and values):

    fp8='e4m3'|'hybrid', fp8_recipe='mxfp8'      → MXFP8BlockScaling(fp8_format=E4M3|HYBRID)
    fp8='e4m3'|'hybrid', fp8_recipe='blockwise'  → Float8BlockScaling(fp8_format=E4M3|HYBRID)
    fp4='e2m1', fp4_recipe='nvfp4'               → NVFP4BlockScaling()
    neither                                      → BF16Recipe()

These are the TE recipes Megatron's ``get_fp8_recipe``/``get_fp4_recipe`` build for those values,
with TE's defaults. ``delayed``, ``tensorwise`` and ``custom`` raise ``ValueError``, and so does
``first_last_layers_bf16`` with a quantized recipe (the experts do not know their layer number).
"""

from __future__ import annotations

from typing import Any

from te_fused_moe.recipes import BF16Recipe, Float8BlockScaling, Format, MXFP8BlockScaling, NVFP4BlockScaling, Recipe

FP8_FORMATS = {"e4m3": Format.E4M3, "hybrid": Format.HYBRID}


def _name(value: Any) -> str:
    # Megatron stores recipes as strings or as enums (Fp8Recipe / Fp4Recipe) depending on the version.
    return str(getattr(value, "value", value)).lower()


def _fp8_format(config: Any) -> Format:
    fmt = _name(config.fp8)
    if fmt not in FP8_FORMATS:
        raise ValueError(f"fp8={config.fp8!r}: expected 'e4m3' or 'hybrid' (Megatron's --fp8-format values)")
    return FP8_FORMATS[fmt]


def recipe_from_config(config: Any) -> Recipe:
    """The quantization recipe for ``config`` (``fp8``/``fp8_recipe``, ``fp4``/``fp4_recipe``)."""
    fp8 = getattr(config, "fp8", None)
    fp4 = getattr(config, "fp4", None)
    if fp8 and fp4:
        raise ValueError("fp8 and fp4: the fused experts take one recipe; expected only one of them set")
    if (fp8 or fp4) and getattr(config, "first_last_layers_bf16", False):
        # Megatron keeps those layers out of TE's autocast; the experts do not know their layer.
        raise ValueError(
            "first_last_layers_bf16=True is not supported by the fused experts with fp8/fp4 (they would "
            "quantize the BF16 layers too); expected first_last_layers_bf16=False"
        )
    if fp8:
        recipe = _name(getattr(config, "fp8_recipe", "delayed"))
        if recipe == "mxfp8":
            return MXFP8BlockScaling(fp8_format=_fp8_format(config))
        if recipe == "blockwise":
            return Float8BlockScaling(fp8_format=_fp8_format(config))
        raise ValueError(
            f"fp8_recipe={recipe!r} is not implemented by the fused experts; expected 'mxfp8' or 'blockwise' "
            "(or fp4='e2m1' with fp4_recipe='nvfp4')"
        )
    if fp4:
        if _name(fp4) != "e2m1":
            raise ValueError(f"fp4={fp4!r}: expected 'e2m1' (Megatron's --fp4-format value)")
        recipe = _name(getattr(config, "fp4_recipe", "nvfp4"))
        if recipe == "nvfp4":
            return NVFP4BlockScaling()
        raise ValueError(f"fp4_recipe={recipe!r} is not implemented by the fused experts; expected 'nvfp4'")
    return BF16Recipe()
