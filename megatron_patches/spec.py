"""Which expert module a ``MoELayer`` builds, from ``moe_grouped_gemm_impl``.

megatron-core 0.16 describes submodules with ``ModuleSpec`` and builds them with
``build_module``; 0.19 passes builders (classes or ``functools.partial``) and calls them. The
helpers here detect which one the installed version uses (``ExpertsBuilder`` exists in 0.19's
``moe_layer``) instead of comparing version numbers.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

from .config import (
    FIELD,
    get_moe_grouped_gemm_impl,
    is_fused_impl,
    resolve_moe_grouped_gemm_impl,
    validate_moe_grouped_gemm_impl,
)


def uses_builders() -> bool:
    """True where ``MoELayer`` calls ``submodules.experts(...)`` (0.19+), False for ``ModuleSpec``s."""
    from megatron.core.transformer.moe import moe_layer

    return hasattr(moe_layer, "ExpertsBuilder")


def have_transformer_engine() -> bool:
    from megatron.core.extensions import transformer_engine

    return bool(getattr(transformer_engine, "HAVE_TE", False))


def _experts_entry(module_cls: type, submodules: Any = None) -> Any:
    """An ``experts`` entry of ``MoESubmodules`` in the installed version's style."""
    if submodules is None:
        return module_cls  # a class is valid in both styles
    if uses_builders():
        return functools.partial(module_cls, submodules=submodules)
    from megatron.core.transformer.spec_utils import ModuleSpec

    return ModuleSpec(module=module_cls, submodules=submodules)


def experts_class(entry: Any) -> Optional[type]:
    """The class an ``experts`` entry builds (``ModuleSpec``, ``partial`` or class)."""
    if isinstance(entry, functools.partial):
        return entry.func
    if isinstance(entry, type):
        return entry
    module = getattr(entry, "module", None)
    return module if isinstance(module, type) else None


def _require_te(impl: str) -> None:
    if not have_transformer_engine():
        raise ValueError(
            f"{FIELD}={impl!r} needs Transformer Engine (TEGroupedMLP), which cannot be imported here; "
            "expected 'fused', 'fused-reference' or 'sequential'"
        )


def experts_spec(config: Any, use_te: Optional[bool] = None) -> Any:
    """The ``experts`` entry for ``config``'s implementation (validated first).

    ``use_te`` picks TE or local linear layers for ``sequential`` (default: TE where importable).
    """
    validate_moe_grouped_gemm_impl(config)
    impl = resolve_moe_grouped_gemm_impl(config)
    from megatron.core.transformer.moe import experts as mcore_experts

    if is_fused_impl(impl):
        from .experts import FusedExpertsMLP

        return _experts_entry(FusedExpertsMLP)
    if impl == "legacy":
        return _experts_entry(mcore_experts.GroupedMLP)
    if impl in ("te", "te-op-fuser"):
        _require_te(impl)
        from megatron.core.extensions.transformer_engine import (
            TEColumnParallelGroupedLinear,
            TERowParallelGroupedLinear,
        )

        submodules_cls = getattr(mcore_experts, "GroupedMLPSubmodules", None)
        if submodules_cls is None:  # 0.16 reuses MLPSubmodules for TEGroupedMLP
            from megatron.core.transformer.mlp import MLPSubmodules as submodules_cls
        return _experts_entry(
            mcore_experts.TEGroupedMLP,
            submodules_cls(linear_fc1=TEColumnParallelGroupedLinear, linear_fc2=TERowParallelGroupedLinear),
        )
    # sequential
    from megatron.core.transformer.mlp import MLPSubmodules

    if use_te is None:
        use_te = have_transformer_engine()
    if use_te:
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TERowParallelLinear

        linears = dict(linear_fc1=TEColumnParallelLinear, linear_fc2=TERowParallelLinear)
    else:
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

        linears = dict(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    return _experts_entry(mcore_experts.SequentialMLP, MLPSubmodules(**linears))


def select_experts(config: Any, submodules: Any) -> Any:
    """``MoESubmodules`` with ``experts`` replaced to follow ``config.moe_grouped_gemm_impl``.

    Unchanged when the option is unset, or when the spec already builds the requested class.
    """
    impl = get_moe_grouped_gemm_impl(config)
    if impl is None or submodules is None or not getattr(config, "num_moe_experts", None):
        return submodules
    current = experts_class(getattr(submodules, "experts", None))
    wanted_entry = experts_spec(config, use_te=_uses_te_linears(submodules))
    if current is not None and current is experts_class(wanted_entry) and not is_fused_impl(impl):
        return submodules  # Megatron's own spec already builds it, keep its exact submodules
    return dataclasses.replace(submodules, experts=wanted_entry)


def _uses_te_linears(submodules: Any) -> Optional[bool]:
    entry = getattr(submodules, "experts", None)
    inner = getattr(entry, "submodules", None)
    if inner is None and isinstance(entry, functools.partial):
        inner = entry.keywords.get("submodules")
    fc1 = getattr(inner, "linear_fc1", None)
    if fc1 is None:
        return None
    return getattr(fc1, "__name__", "").startswith("TE")


def apply_to_moe_spec(moe_spec: Any, config: Any) -> Any:
    """Return a MoE layer spec (0.16 ``ModuleSpec`` or 0.19 ``partial(MoELayer, ...)``) whose experts
    follow ``config.moe_grouped_gemm_impl``. Other specs are returned unchanged."""
    if isinstance(moe_spec, functools.partial):
        submodules = moe_spec.keywords.get("submodules")
        if submodules is None or not hasattr(submodules, "experts"):
            return moe_spec
        keywords = dict(moe_spec.keywords, submodules=select_experts(config, submodules))
        return functools.partial(moe_spec.func, *moe_spec.args, **keywords)
    submodules = getattr(moe_spec, "submodules", None)
    if submodules is not None and hasattr(submodules, "experts"):
        return dataclasses.replace(moe_spec, submodules=select_experts(config, submodules))
    return moe_spec


def get_moe_layer_spec(config: Any, use_te: Optional[bool] = None) -> Any:
    """A complete MoE layer spec (router, experts from the option, shared experts) for ``config``."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend

    if use_te is None:
        use_te = have_transformer_engine()
    if use_te:
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        backend = TESpecProvider()
    else:
        backend = LocalSpecProvider()
    # Ask Megatron for its plain (non-grouped) spec: 0.16's local provider maps moe_grouped_gemm
    # to the legacy GroupedMLP, which we replace anyway.
    spec = get_moe_module_spec_for_backend(backend=backend, num_experts=config.num_moe_experts,
                                           moe_grouped_gemm=False)
    return apply_to_moe_spec(spec, config)


def build_experts(entry: Any, num_local_experts: int, config: Any, pg_collection: Any = None) -> Any:
    """Instantiate an ``experts`` entry the way the installed ``MoELayer`` would."""
    if isinstance(entry, (functools.partial, type)) and uses_builders():
        return entry(num_local_experts, config, pg_collection=pg_collection)
    from megatron.core.transformer.spec_utils import build_module

    return build_module(entry, num_local_experts, config, pg_collection=pg_collection)
