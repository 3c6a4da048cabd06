"""Megatron's activation settings → the fused op's activation (:class:`ActivationConfig`).

Megatron describes the expert activation with ``activation_func`` plus ``gated_linear_unit``
(``--swiglu`` sets both), and GPT-OSS's clamped GLU with ``activation_func=quick_gelu``,
``glu_linear_offset=1.0`` and ``activation_func_clamp_value=7.0`` (TEGroupedMLP's ``glu()``:
``quick_gelu(min(g, c)) * (clamp(u, -c, c) + offset)``, quick_gelu being ``x·σ(1.702·x)``).

    F.silu + GLU                         → swiglu
    F.gelu + GLU                         → geglu (exact erf GELU, as F.gelu)
    quick_gelu + GLU, offset 1, clamp c  → gpt_oss_swiglu (alpha 1.702, limit c)
    squared_relu (no GLU)                → srelu
    F.silu / F.gelu (no GLU)             → silu / gelu
Anything else raises ``ValueError`` naming the setting.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F

from te_fused_moe.activations import GPT_OSS_ALPHA, ActivationConfig


def _megatron_functions(module_name: str, name: str) -> tuple:
    import importlib

    try:
        return (getattr(importlib.import_module(module_name), name),)
    except (ImportError, AttributeError):
        return ()


def _is(func, module_functions: tuple, name: str) -> bool:
    # Megatron defines quick_gelu twice (activations.py and fusions/fused_bias_geglu.py); match
    # either object, or a function of that name (a jit_fuser wrapper keeps __name__).
    return any(func is f for f in module_functions) or getattr(func, "__name__", None) == name


def megatron_activation(config: Any) -> ActivationConfig:
    """The fused op's activation for ``config``'s expert MLP, or ``ValueError`` saying why not."""
    func = getattr(config, "activation_func", None)
    gated = bool(getattr(config, "gated_linear_unit", False))
    offset = float(getattr(config, "glu_linear_offset", 0.0) or 0.0)
    clamp = getattr(config, "activation_func_clamp_value", None)
    func_name = getattr(func, "__name__", repr(func))

    quick_gelus = _megatron_functions("megatron.core.activations", "quick_gelu") + _megatron_functions(
        "megatron.core.fusions.fused_bias_geglu", "quick_gelu"
    )
    squared_relus = _megatron_functions("megatron.core.activations", "squared_relu")

    if _is(func, quick_gelus, "quick_gelu"):
        if not gated:
            raise ValueError(
                "activation_func=quick_gelu needs gated_linear_unit=True (GPT-OSS's clamped SwiGLU); "
                "the fused experts have no plain quick_gelu"
            )
        if offset != 1.0 or clamp is None:
            raise ValueError(
                "activation_func=quick_gelu with gated_linear_unit=True maps to gpt_oss_swiglu, which "
                f"expects glu_linear_offset=1.0 and activation_func_clamp_value set (e.g. 7.0); got "
                f"glu_linear_offset={offset}, activation_func_clamp_value={clamp}"
            )
        return ActivationConfig("gpt_oss_swiglu", alpha=GPT_OSS_ALPHA, limit=float(clamp))

    if offset != 0.0:
        raise ValueError(f"glu_linear_offset={offset} is only supported with activation_func=quick_gelu; expected 0.0")
    if clamp is not None:
        raise ValueError(
            f"activation_func_clamp_value={clamp} is only supported with activation_func=quick_gelu; expected None"
        )
    if func is F.silu:
        return ActivationConfig("swiglu" if gated else "silu")
    if func is F.gelu:
        return ActivationConfig("geglu" if gated else "gelu")
    if _is(func, squared_relus, "squared_relu"):
        if gated:
            raise ValueError(
                "activation_func=squared_relu with gated_linear_unit=True is not supported "
                "(srelu is not gated); expected gated_linear_unit=False"
            )
        return ActivationConfig("srelu")
    raise ValueError(
        f"activation_func={func_name} (gated_linear_unit={gated}) has no fused equivalent; expected "
        "F.silu or F.gelu (with or without GLU), quick_gelu with GLU (GPT-OSS) or squared_relu"
    )
