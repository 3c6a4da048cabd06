"""``--moe-grouped-gemm-impl`` for Megatron's command line.

With Megatron-LM (``megatron.training``; not part of the megatron-core wheel)::

    import megatron_patches
    from megatron_patches.arguments import add_megatron_args, config_class_for

    megatron_patches.install()
    pretrain(..., extra_args_provider=add_megatron_args)        # or parse_args(add_megatron_args)
    # in the model provider:
    config = core_transformer_config_from_args(args, config_class_for(args))

``core_transformer_config_from_args`` copies every dataclass field it finds on ``args``, so the
subclass returned by :func:`config_class_for` receives ``moe_grouped_gemm_impl`` and validates it.
For a config built another way, :func:`apply_args_to_config` sets it afterwards.
"""

from __future__ import annotations

import argparse
from typing import Any

from .config import FIELD, IMPLS, set_moe_grouped_gemm_impl, with_moe_grouped_gemm_impl

FLAG = "--moe-grouped-gemm-impl"


def add_megatron_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``extra_args_provider`` for Megatron-LM's ``parse_args``/``pretrain`` (returns the parser)."""
    if any(FLAG in action.option_strings for action in parser._actions):
        return parser  # already added (Megatron may call providers more than once)
    group = parser.add_argument_group(title="te-fused-moe")
    group.add_argument(
        FLAG,
        dest=FIELD,
        type=str,
        default=None,
        choices=list(IMPLS),
        help=(
            "Expert MLP implementation of MoE layers: te (TEGroupedMLP), te-op-fuser (TEGroupedMLP via "
            "TE's op fuser), sequential (SequentialMLP), legacy (GroupedMLP, megatron-core < 0.19), "
            "fused (te-fused-moe, backend auto), fused-triton, fused-cudnn, fused-reference. "
            "Default: Megatron's choice from --moe-grouped-gemm."
        ),
    )
    return parser


def impl_from_args(args: Any):
    return getattr(args, FIELD, None)


def prepare_args(args: Any) -> Any:
    """Settings the chosen impl implies: ``te-op-fuser`` turns on ``use_transformer_engine_op_fuser``."""
    if impl_from_args(args) == "te-op-fuser" and hasattr(args, "use_transformer_engine_op_fuser"):
        args.use_transformer_engine_op_fuser = True
    return args


def config_class_for(args: Any, base: type = None) -> type:
    """The config class to pass to ``core_transformer_config_from_args`` (after :func:`prepare_args`)."""
    prepare_args(args)
    if base is None:
        from megatron.core.transformer.transformer_config import TransformerConfig

        base = TransformerConfig
    return with_moe_grouped_gemm_impl(base)


def apply_args_to_config(args: Any, config: Any) -> Any:
    """Copy ``args.moe_grouped_gemm_impl`` onto an already built config and validate it."""
    impl = impl_from_args(args)
    if impl == "te-op-fuser" and hasattr(config, "use_transformer_engine_op_fuser"):
        config.use_transformer_engine_op_fuser = True
    return set_moe_grouped_gemm_impl(config, impl)
