"""te-fused-moe: the fused, sync-free expert MLP for Mixture-of-Experts training.

Public API:
    fused_moe_mlp         the op (te_fused_moe.ops)
    FusedGroupedMLP       a TE-style torch module around it (te_fused_moe.module)
    swap_experts          replace unfused expert blocks in a model (te_fused_moe.swap)
    recipes               BF16 / MXFP8 / NVFP4 / FP8-blockwise recipes (te_fused_moe.recipes)
"""

from .activations import ACTIVATIONS, ActivationConfig
from .ops import fused_moe_mlp, set_debug_mode
from .recipes import (
    BF16Recipe,
    Float8BlockScaling,
    Format,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    as_recipe,
)

__version__ = "0.1.0"

_LAZY = {
    "FusedGroupedMLP": ("te_fused_moe.module", "FusedGroupedMLP"),
    "swap_experts": ("te_fused_moe.swap", "swap_experts"),
    "unswap_experts": ("te_fused_moe.swap", "unswap_experts"),
}


def __getattr__(name):
    # The module layer and the swap helper import lazily so that `import te_fused_moe` stays light.
    if name in _LAZY:
        import importlib

        module_name, attr = _LAZY[name]
        return getattr(importlib.import_module(module_name), attr)
    raise AttributeError(f"module 'te_fused_moe' has no attribute {name!r}")


__all__ = [
    "ACTIVATIONS",
    "ActivationConfig",
    "BF16Recipe",
    "Float8BlockScaling",
    "Format",
    "FusedGroupedMLP",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
    "as_recipe",
    "fused_moe_mlp",
    "set_debug_mode",
    "swap_experts",
    "unswap_experts",
]
