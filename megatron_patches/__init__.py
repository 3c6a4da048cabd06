"""Megatron Core integration of te-fused-moe.

    import megatron_patches
    megatron_patches.install()          # once, before the model is built
    config = megatron_patches.FusedMoETransformerConfig(..., moe_grouped_gemm=True,
                                                        moe_grouped_gemm_impl="fused")

``install()`` makes every ``MoELayer`` build the experts that ``config.moe_grouped_gemm_impl``
names (ours for ``fused*``), whatever layer spec the model was built from. It wraps
``MoELayer.__init__`` (Megatron's files are not edited), is idempotent, and :func:`uninstall`
undoes it. Configs carry the option as a field (:class:`FusedMoETransformerConfig`, or
:func:`with_moe_grouped_gemm_impl` for other config classes) or as an instance attribute set by
:func:`set_moe_grouped_gemm_impl`. For Megatron-LM's launcher, see
:mod:`megatron_patches.arguments`.
"""

from __future__ import annotations

import functools

from .config import (
    IMPLS,
    FusedMoETransformerConfig,
    get_moe_grouped_gemm_impl,
    resolve_moe_grouped_gemm_impl,
    set_moe_grouped_gemm_impl,
    validate_moe_grouped_gemm_impl,
    with_moe_grouped_gemm_impl,
)

_HOOK_MARK = "_te_fused_moe_hook"


def _moe_layer_class():
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return MoELayer


def is_installed() -> bool:
    return getattr(_moe_layer_class().__init__, _HOOK_MARK, False)


def install() -> None:
    """Make ``MoELayer`` pick its experts from ``moe_grouped_gemm_impl`` (idempotent)."""
    from .cpu_compat import define_missing_te_names

    define_missing_te_names()
    moe_layer_cls = _moe_layer_class()
    if is_installed():
        return
    original_init = moe_layer_cls.__init__

    @functools.wraps(original_init)
    def __init__(self, config, submodules=None, *args, **kwargs):
        from .spec import select_experts

        original_init(self, config, select_experts(config, submodules), *args, **kwargs)

    setattr(__init__, _HOOK_MARK, True)
    __init__._te_fused_moe_original = original_init
    __init__._te_fused_moe_hook_function = __init__  # tells our wrapper from one copying its marks
    moe_layer_cls.__init__ = __init__


def uninstall() -> None:
    """Undo :func:`install` (no-op when not installed).

    Raises ``RuntimeError`` when something wrapped ``MoELayer.__init__`` after :func:`install`
    (``functools.wraps`` copies our marks onto that wrapper): restoring the original would drop it.
    """
    moe_layer_cls = _moe_layer_class()
    if not is_installed():
        return
    current = moe_layer_cls.__init__
    if current._te_fused_moe_hook_function is not current:
        raise RuntimeError(
            "megatron_patches.uninstall(): MoELayer.__init__ was wrapped after install() by "
            f"{getattr(current, '__module__', '?')}.{getattr(current, '__qualname__', '?')}; remove that "
            "wrapper first (restoring Megatron's __init__ would drop it)"
        )
    moe_layer_cls.__init__ = current._te_fused_moe_original


def __getattr__(name):
    # Heavier pieces import on first use.
    lazy = {
        "FusedExpertsMLP": ("megatron_patches.experts", "FusedExpertsMLP"),
        "swap_megatron_experts": ("megatron_patches.swap", "swap_megatron_experts"),
        "unswap_megatron_experts": ("megatron_patches.swap", "unswap_megatron_experts"),
        "add_megatron_args": ("megatron_patches.arguments", "add_megatron_args"),
    }
    if name in lazy:
        import importlib

        module_name, attr = lazy[name]
        return getattr(importlib.import_module(module_name), attr)
    raise AttributeError(f"module 'megatron_patches' has no attribute {name!r}")


__all__ = [
    "IMPLS",
    "FusedExpertsMLP",
    "FusedMoETransformerConfig",
    "add_megatron_args",
    "get_moe_grouped_gemm_impl",
    "install",
    "is_installed",
    "resolve_moe_grouped_gemm_impl",
    "set_moe_grouped_gemm_impl",
    "swap_megatron_experts",
    "uninstall",
    "unswap_megatron_experts",
    "validate_moe_grouped_gemm_impl",
    "with_moe_grouped_gemm_impl",
]
