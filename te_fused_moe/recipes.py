"""Quantization recipes for the expert MLP.

Each recipe is a small frozen dataclass whose field names follow Transformer Engine's recipe
classes in ``transformer_engine/common/recipe/__init__.py`` (TE 2.x), so that a TE recipe converts
to ours field by field (see :mod:`te_fused_moe.te_compat`). A recipe says *what* is quantized and
how; the quantizers in :mod:`te_fused_moe.quantize` say how each format rounds.

Roles: every GEMM operand has a role — ``"x"`` (activations into a GEMM: FC1's input, FC2's input),
``"w"`` (weights) and ``"grad"`` (output gradients flowing back). A recipe picks a format per role.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Union


class Format(enum.Enum):
    """FP8 format choice, named as TE's ``recipe.Format``.

    ``HYBRID`` is E4M3 in the forward pass and E5M2 for gradients.
    """

    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"

    def for_role(self, role: str) -> str:
        """FP8 element format (``"e4m3"`` or ``"e5m2"``) used for operands of ``role``."""
        if self is Format.E4M3:
            return "e4m3"
        if self is Format.E5M2:
            return "e5m2"
        return "e5m2" if role == "grad" else "e4m3"


ROLES = ("x", "w", "grad")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Base class. ``name`` is the short name used on command lines and in configs."""

    name = "base"

    @property
    def quantized(self) -> bool:
        return True


@dataclasses.dataclass(frozen=True)
class BF16Recipe(Recipe):
    """No quantization: GEMM operands stay in the parameter dtype (BF16 in training)."""

    name = "bf16"

    @property
    def quantized(self) -> bool:
        return False


@dataclasses.dataclass(frozen=True)
class MXFP8BlockScaling(Recipe):
    """MXFP8 (OCP MX v1.0): FP8 values with one E8M0 power-of-two scale per 32 consecutive
    elements along each GEMM's reduction dimension. Same fields as TE's ``MXFP8BlockScaling``.
    TE's default format is E4M3 for every role (including gradients)."""

    name = "mxfp8"
    fp8_format: Format = Format.E4M3
    margin: int = 0

    def __post_init__(self) -> None:
        if self.fp8_format not in (Format.E4M3, Format.HYBRID):
            raise ValueError(
                f"MXFP8BlockScaling: fp8_format must be Format.E4M3 or Format.HYBRID, got {self.fp8_format}"
            )


@dataclasses.dataclass(frozen=True)
class NVFP4BlockScaling(Recipe):
    """NVFP4: E2M1 values, one E4M3 scale per 16 elements and one FP32 per-tensor scale.

    Same option names as TE's ``NVFP4BlockScaling``: weights use 16x16 2D blocks unless
    ``disable_2d_quantization``; the wgrad GEMM's operands get a random Hadamard transform (16-point)
    unless ``disable_rht``; gradients are stochastically rounded unless
    ``disable_stochastic_rounding``."""

    name = "nvfp4"
    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False


@dataclasses.dataclass(frozen=True)
class Float8BlockScaling(Recipe):
    """FP8 with DeepSeek-V3-style block scales (Hopper's native scaled path): 1x128 blocks for
    activations and gradients, 128x128 blocks for weights, one FP32 scale per block.

    Field names follow TE's ``Float8BlockScaling``. ``use_f32_scales=False`` (TE's default)
    rounds each scale to a power of two."""

    name = "fp8_block"
    fp8_format: Format = Format.E4M3
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    use_f32_scales: bool = False

    def __post_init__(self) -> None:
        for field in ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim"):
            if getattr(self, field) not in (1, 2):
                raise ValueError(f"Float8BlockScaling: {field} must be 1 or 2, got {getattr(self, field)}")
        two_d = [role for role in ROLES if self.block_dim(role) == 2]
        if len(two_d) > 1:  # TE refuses these too: no GEMM takes two 128x128-block operands
            raise ValueError(
                f"Float8BlockScaling: at most one of x/w/grad may use 2D (128x128) blocks, got 2D for {two_d} "
                f"(a GEMM of two 2D-block operands is not supported)"
            )
        if self.fp8_format not in (Format.E4M3, Format.HYBRID):
            raise ValueError(
                f"Float8BlockScaling: fp8_format must be Format.E4M3 or Format.HYBRID, got {self.fp8_format}"
            )

    def block_dim(self, role: str) -> int:
        return {"x": self.x_block_scaling_dim, "w": self.w_block_scaling_dim, "grad": self.grad_block_scaling_dim}[role]


RECIPES_BY_NAME = {
    cls.name: cls for cls in (BF16Recipe, MXFP8BlockScaling, NVFP4BlockScaling, Float8BlockScaling)
}

RecipeLike = Union[Recipe, str, None, Any]


def as_recipe(recipe: RecipeLike) -> Recipe:
    """Normalise ``recipe``: one of ours, a short name (``"bf16"``, ``"mxfp8"``, ``"nvfp4"``,
    ``"fp8_block"``), ``None`` (BF16) or a Transformer Engine recipe object."""
    if recipe is None:
        return BF16Recipe()
    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, str):
        key = recipe.strip().lower().replace("-", "_")
        if key not in RECIPES_BY_NAME:
            raise ValueError(
                f"recipe: unknown recipe name {recipe!r}; expected one of {sorted(RECIPES_BY_NAME)}"
            )
        return RECIPES_BY_NAME[key]()
    from . import te_compat  # TE recipes: converted where TE's classes can be imported

    if te_compat.is_te_recipe(recipe):
        return te_compat.recipe_from_te(recipe)
    raise TypeError(
        f"recipe: expected a te_fused_moe recipe, a recipe name or a Transformer Engine recipe, "
        f"got {type(recipe).__name__}"
    )
