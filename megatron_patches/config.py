"""The ``moe_grouped_gemm_impl`` option: its values, where it lives, and its validation.

Where the field lives (why a subclass): Megatron builds ``TransformerConfig`` from the command
line by walking ``dataclasses.fields(config_class)`` (Megatron-LM's
``core_transformer_config_from_args(args, config_class)``), and copies configs with
``deepcopy``/``dataclasses.replace``. A dataclass subclass, :class:`FusedMoETransformerConfig`,
makes ``moe_grouped_gemm_impl`` a real field in all of these paths, with validation in
``__post_init__``, without touching Megatron's files or mutating its classes. Configs that were
built as a plain ``TransformerConfig`` (for instance by someone else's launcher) get the value with
:func:`set_moe_grouped_gemm_impl`, which stores it on the instance and validates it; everything in
``megatron_patches`` reads the value through :func:`get_moe_grouped_gemm_impl`, so both kinds work.

Values:
    ``te``            TEGroupedMLP (TE ``GroupedLinear`` → activation → ``GroupedLinear``)
    ``te-op-fuser``   TEGroupedMLP through TE's op fuser (``use_transformer_engine_op_fuser``)
    ``sequential``    SequentialMLP (one MLP per expert)
    ``legacy``        GroupedMLP (``grouped_gemm`` package), only where megatron-core still has it
    ``fused``         ours (:class:`megatron_patches.experts.FusedExpertsMLP`), backend ``auto``
    ``fused-triton``, ``fused-cudnn``, ``fused-reference``: ours with that backend forced
``None`` keeps Megatron's own choice (``moe_grouped_gemm`` / ``moe_use_legacy_grouped_gemm``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Tuple

from megatron.core.transformer.transformer_config import TransformerConfig

from .activation import megatron_activation

IMPLS: Tuple[str, ...] = (
    "te",
    "te-op-fuser",
    "sequential",
    "legacy",
    "fused",
    "fused-triton",
    "fused-cudnn",
    "fused-reference",
)
FUSED_BACKENDS = {
    "fused": "auto",
    "fused-triton": "triton",
    "fused-cudnn": "cudnn",
    "fused-reference": "reference",
}
FIELD = "moe_grouped_gemm_impl"


def is_fused_impl(impl: Optional[str]) -> bool:
    return impl is not None and impl.startswith("fused")


def fused_backend(impl: str) -> str:
    """The ``te_fused_moe`` backend name behind a ``fused*`` value."""
    return FUSED_BACKENDS[impl]


def get_moe_grouped_gemm_impl(config: Any) -> Optional[str]:
    """The value set on ``config`` (subclass field or instance attribute), else ``None``."""
    return getattr(config, FIELD, None)


def resolve_moe_grouped_gemm_impl(config: Any) -> str:
    """The expert implementation this config ends up with, ``None`` resolved as Megatron would."""
    impl = get_moe_grouped_gemm_impl(config)
    if impl is not None:
        return impl
    if not getattr(config, "moe_grouped_gemm", False):
        return "sequential"
    if getattr(config, "moe_use_legacy_grouped_gemm", False):
        return "legacy"
    return "te-op-fuser" if getattr(config, "use_transformer_engine_op_fuser", False) else "te"


def megatron_has_legacy_grouped_mlp() -> bool:
    """Feature test: megatron-core 0.19 removed ``GroupedMLP``."""
    from megatron.core.transformer.moe import experts

    return hasattr(experts, "GroupedMLP")


def _megatron_version() -> str:
    try:
        from importlib.metadata import version

        return version("megatron-core")
    except Exception:  # noqa: BLE001 - only used in messages
        return "unknown"


def validate_moe_grouped_gemm_impl(config: Any) -> None:
    """Raise ``ValueError``/``TypeError`` naming the option when ``config`` cannot run its impl."""
    impl = get_moe_grouped_gemm_impl(config)
    if impl is None:
        return
    if not isinstance(impl, str):
        raise TypeError(f"{FIELD}: expected a string, one of {list(IMPLS)}, got {type(impl).__name__}")
    if impl not in IMPLS:
        raise ValueError(f"{FIELD}: unknown value {impl!r}; expected one of {list(IMPLS)}")
    if not getattr(config, "num_moe_experts", None):
        return  # a dense model: the option selects nothing

    grouped = bool(getattr(config, "moe_grouped_gemm", False))
    if impl != "sequential" and not grouped:
        raise ValueError(
            f"{FIELD}={impl!r} needs moe_grouped_gemm=True (--moe-grouped-gemm); "
            f"use {FIELD}='sequential' for one MLP per expert"
        )
    legacy_flag = bool(getattr(config, "moe_use_legacy_grouped_gemm", False))
    if legacy_flag and impl != "legacy":
        raise ValueError(
            f"{FIELD}={impl!r} conflicts with moe_use_legacy_grouped_gemm=True "
            f"(--moe-use-legacy-grouped-gemm); drop that flag or use {FIELD}='legacy'"
        )
    if impl == "legacy" and not megatron_has_legacy_grouped_mlp():
        raise ValueError(
            f"{FIELD}='legacy' needs megatron.core.transformer.moe.experts.GroupedMLP, which "
            f"megatron-core {_megatron_version()} no longer has; expected 'te', 'fused' or 'sequential'"
        )
    op_fuser_field = hasattr(config, "use_transformer_engine_op_fuser")
    op_fuser = bool(getattr(config, "use_transformer_engine_op_fuser", False))
    if impl == "te-op-fuser":
        if not op_fuser_field:
            raise ValueError(
                f"{FIELD}='te-op-fuser' needs TransformerConfig.use_transformer_engine_op_fuser, which "
                f"megatron-core {_megatron_version()} does not have; expected 'te' or 'fused'"
            )
        if not op_fuser:
            raise ValueError(
                f"{FIELD}='te-op-fuser' needs use_transformer_engine_op_fuser=True "
                "(--use-transformer-engine-op-fuser); megatron_patches.arguments sets it from the flag"
            )
    if impl == "te" and op_fuser:
        raise ValueError(
            f"{FIELD}='te' but use_transformer_engine_op_fuser=True selects the op-fuser path; "
            f"expected {FIELD}='te-op-fuser'"
        )
    if is_fused_impl(impl):
        validate_fused_config(config, impl)


def validate_fused_config(config: Any, impl: str) -> None:
    """What a ``fused*`` impl needs of the rest of ``config`` (``ValueError`` naming the field)."""
    megatron_activation(config)  # raises for unknown activations or a GLU flag that disagrees
    topk = getattr(config, "moe_router_topk", 1)
    if getattr(config, "moe_apply_probs_on_input", False) and topk != 1:
        # Megatron's experts assert this in forward; scaling each of k copies of a token before
        # the experts is a different model from scaling the experts' outputs.
        raise ValueError(
            f"{FIELD}={impl!r}: moe_apply_probs_on_input=True needs moe_router_topk=1, got {topk} "
            "(as TEGroupedMLP and SequentialMLP require)"
        )
    if getattr(config, "moe_latent_size", None):
        raise ValueError(f"{FIELD}={impl!r} does not support moe_latent_size (got {config.moe_latent_size}); expected None")
    interleave = getattr(config, "moe_mlp_glu_interleave_size", None)
    if interleave is not None and getattr(config, "gated_linear_unit", False):
        raise ValueError(
            f"{FIELD}={impl!r} keeps linear_fc1 as [gate; up] (TEGroupedMLP's checkpoint layout); "
            f"moe_mlp_glu_interleave_size={interleave} is not supported, expected None"
        )
    from .recipe import recipe_from_config

    recipe_from_config(config)  # raises for FP8/FP4 recipes the fused op does not implement


def set_moe_grouped_gemm_impl(config: Any, impl: Optional[str]) -> Any:
    """Store ``impl`` on an existing config (any ``TransformerConfig``) and validate it."""
    setattr(config, FIELD, impl)
    validate_moe_grouped_gemm_impl(config)
    return config


@functools.lru_cache(maxsize=None)
def with_moe_grouped_gemm_impl(config_class: type) -> type:
    """A dataclass subclass of ``config_class`` (``TransformerConfig`` or a subclass such as
    ``MLATransformerConfig``) with the ``moe_grouped_gemm_impl`` field and its validation."""
    if not (isinstance(config_class, type) and issubclass(config_class, TransformerConfig)):
        raise TypeError(f"config_class: expected a TransformerConfig subclass, got {config_class!r}")
    if any(f.name == FIELD for f in dataclasses.fields(config_class)):
        return config_class

    def __post_init__(self):
        config_class.__post_init__(self)
        validate_moe_grouped_gemm_impl(self)

    namespace = {
        "__annotations__": {FIELD: Optional[str]},
        FIELD: dataclasses.field(
            default=None,
            metadata={"argparse_meta": {"choices": list(IMPLS), "default": None}},
        ),
        "__post_init__": __post_init__,
        "__module__": __name__,
        "__doc__": f"{config_class.__name__} plus ``{FIELD}`` (see megatron_patches.config).",
    }
    name = "FusedMoE" + config_class.__name__
    return dataclasses.dataclass(type(name, (config_class,), namespace))


FusedMoETransformerConfig = with_moe_grouped_gemm_impl(TransformerConfig)
