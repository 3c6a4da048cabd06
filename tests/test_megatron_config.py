"""The ``moe_grouped_gemm_impl`` option: config field, validation errors, activation mapping,
Megatron command-line flag and the install() hook. No process groups needed."""

import argparse
import dataclasses

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core")

import megatron_patches  # noqa: E402
from megatron_patches import config as cfg_mod  # noqa: E402
from megatron_patches.activation import megatron_activation  # noqa: E402
from megatron_testing import make_config  # noqa: E402


def test_field_is_a_dataclass_field_with_default_none():
    fields = {f.name: f for f in dataclasses.fields(megatron_patches.FusedMoETransformerConfig)}
    assert fields["moe_grouped_gemm_impl"].default is None
    config = make_config("fused")
    assert config.moe_grouped_gemm_impl == "fused"
    assert megatron_patches.resolve_moe_grouped_gemm_impl(make_config("sequential")) == "sequential"


@pytest.mark.parametrize("impl", ["fused", "fused-triton", "fused-cudnn", "fused-reference", "sequential"])
def test_valid_values_construct(impl):
    assert make_config(impl).moe_grouped_gemm_impl == impl


def test_resolve_none_follows_megatron_flags():
    config = make_config("fused")
    config.moe_grouped_gemm_impl = None
    assert megatron_patches.resolve_moe_grouped_gemm_impl(config) == "te"
    config.moe_grouped_gemm = False
    assert megatron_patches.resolve_moe_grouped_gemm_impl(config) == "sequential"


def test_unknown_value_names_option_and_choices():
    with pytest.raises(ValueError, match=r"moe_grouped_gemm_impl: unknown value 'fastest'.*fused-reference"):
        make_config("fastest")
    with pytest.raises(TypeError, match="moe_grouped_gemm_impl: expected a string"):
        make_config(3)


def test_fused_needs_grouped_gemm():
    with pytest.raises(ValueError, match=r"moe_grouped_gemm_impl='fused' needs moe_grouped_gemm=True"):
        make_config("fused", moe_grouped_gemm=False)


def test_legacy_flag_conflicts_with_fused():
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not any(f.name == "moe_use_legacy_grouped_gemm" for f in dataclasses.fields(TransformerConfig)):
        pytest.skip("this megatron-core has no moe_use_legacy_grouped_gemm flag (0.19+)")
    with pytest.raises(ValueError, match="conflicts with moe_use_legacy_grouped_gemm"):
        make_config("fused", moe_use_legacy_grouped_gemm=True)


def test_legacy_on_a_version_without_grouped_mlp(monkeypatch):
    monkeypatch.setattr(cfg_mod, "megatron_has_legacy_grouped_mlp", lambda: False)
    with pytest.raises(ValueError, match=r"'legacy' needs .*GroupedMLP.*no longer has; expected 'te', 'fused'"):
        make_config("legacy")


def test_legacy_matches_installed_version():
    from megatron.core.transformer.moe import experts

    if hasattr(experts, "GroupedMLP"):  # 0.16: accepted
        assert make_config("legacy").moe_grouped_gemm_impl == "legacy"
    else:  # 0.19+: refused with the reason
        with pytest.raises(ValueError, match="no longer has"):
            make_config("legacy")


def test_te_op_fuser_needs_the_op_fuser_flag():
    from megatron.core.transformer.transformer_config import TransformerConfig

    has_field = any(f.name == "use_transformer_engine_op_fuser" for f in dataclasses.fields(TransformerConfig))
    if not has_field:  # 0.16
        with pytest.raises(ValueError, match="'te-op-fuser' needs TransformerConfig.use_transformer_engine_op_fuser"):
            make_config("te-op-fuser")
    else:  # 0.19: the flag must be on (the CLI mapping sets it)
        with pytest.raises(ValueError, match="needs use_transformer_engine_op_fuser=True"):
            make_config("te-op-fuser")


@pytest.mark.parametrize("activation,expected", [("swiglu", "swiglu"), ("geglu", "geglu"),
                                                 ("gpt_oss_swiglu", "gpt_oss_swiglu"), ("srelu", "srelu")])
def test_activation_mapping(activation, expected):
    act = megatron_activation(make_config("fused", activation=activation))
    assert act.name == expected
    if expected == "gpt_oss_swiglu":
        assert act.limit == 7.0 and act.alpha == pytest.approx(1.702)


def test_activation_mapping_plain_and_fusions_quick_gelu():
    from megatron.core.fusions.fused_bias_geglu import quick_gelu as fused_quick_gelu

    assert megatron_activation(make_config("fused", activation_func=F.silu, gated_linear_unit=False)).name == "silu"
    assert megatron_activation(make_config("fused", activation_func=F.gelu, gated_linear_unit=False)).name == "gelu"
    act = megatron_activation(make_config("fused", activation="gpt_oss_swiglu", activation_func=fused_quick_gelu,
                                          activation_func_clamp_value=5.0))
    assert act.name == "gpt_oss_swiglu" and act.limit == 5.0


@pytest.mark.parametrize("overrides,message", [
    (dict(activation_func=torch.tanh), r"activation_func=tanh .* has no fused equivalent"),
    (dict(activation="srelu", gated_linear_unit=True), "squared_relu with gated_linear_unit=True"),
    (dict(activation="gpt_oss_swiglu", gated_linear_unit=False), "quick_gelu needs gated_linear_unit=True"),
    (dict(activation="gpt_oss_swiglu", glu_linear_offset=0.0), "expects glu_linear_offset=1.0"),
    (dict(glu_linear_offset=1.0), "glu_linear_offset=1.0 is only supported with activation_func=quick_gelu"),
    (dict(activation_func_clamp_value=7.0), "activation_func_clamp_value=7.0 is only supported"),
    # TEGroupedMLP/SequentialMLP refuse it (an assert in forward); the fused experts must not
    # silently run a different model
    (dict(moe_apply_probs_on_input=True), r"moe_apply_probs_on_input=True needs moe_router_topk=1, got 2"),
])
def test_fused_validation_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        make_config("fused", **overrides)


def test_recipe_mapping():
    # Megatron's own __post_init__ needs TE for fp8=..., so the mapping is checked on its own.
    from types import SimpleNamespace

    from megatron_patches.recipe import recipe_from_config

    assert recipe_from_config(SimpleNamespace(fp8=None, fp4=None)).name == "bf16"
    assert recipe_from_config(SimpleNamespace(fp8="e4m3", fp8_recipe="mxfp8", fp4=None)).name == "mxfp8"
    assert recipe_from_config(SimpleNamespace(fp8="e4m3", fp8_recipe="blockwise", fp4=None)).name == "fp8_block"
    assert recipe_from_config(SimpleNamespace(fp8=None, fp4="e2m1", fp4_recipe="nvfp4")).name == "nvfp4"
    with pytest.raises(ValueError, match="fp8_recipe='delayed' is not implemented by the fused experts"):
        recipe_from_config(SimpleNamespace(fp8="hybrid", fp8_recipe="delayed", fp4=None))
    with pytest.raises(ValueError, match="only one of them"):
        recipe_from_config(SimpleNamespace(fp8="e4m3", fp8_recipe="mxfp8", fp4="e2m1"))


def test_unsupported_activation_is_fine_for_non_fused_impls():
    # Only the fused experts need the mapping; Megatron's own classes take any activation.
    assert make_config("sequential", activation_func=torch.tanh).moe_grouped_gemm_impl == "sequential"


def test_with_moe_grouped_gemm_impl_on_other_config_classes():
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    cls = megatron_patches.with_moe_grouped_gemm_impl(MLATransformerConfig)
    assert issubclass(cls, MLATransformerConfig) and cls is megatron_patches.with_moe_grouped_gemm_impl(MLATransformerConfig)
    assert megatron_patches.with_moe_grouped_gemm_impl(TransformerConfig) is megatron_patches.FusedMoETransformerConfig
    with pytest.raises(TypeError, match="config_class"):
        megatron_patches.with_moe_grouped_gemm_impl(dict)


def _core_transformer_config_from_args(args, config_class):
    # What Megatron-LM's core_transformer_config_from_args does: copy every dataclass field on args.
    kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(config_class) if hasattr(args, f.name)}
    return config_class(**kwargs)


def test_command_line_flag_reaches_the_config():
    from megatron_patches.arguments import add_megatron_args, apply_args_to_config, config_class_for

    parser = argparse.ArgumentParser()
    for flag, kwargs in (("--num-layers", dict(type=int)), ("--hidden-size", dict(type=int)),
                         ("--num-attention-heads", dict(type=int)), ("--num-moe-experts", dict(type=int)),
                         ("--moe-ffn-hidden-size", dict(type=int)), ("--moe-grouped-gemm", dict(action="store_true")),
                         ("--swiglu", dict(action="store_true", dest="gated_linear_unit"))):
        parser.add_argument(flag, **kwargs)
    assert add_megatron_args(parser) is parser
    add_megatron_args(parser)  # a second call adds nothing (no argparse conflict)
    args = parser.parse_args("--num-layers 1 --hidden-size 16 --num-attention-heads 2 --num-moe-experts 4 "
                             "--moe-ffn-hidden-size 8 --moe-grouped-gemm --swiglu "
                             "--moe-grouped-gemm-impl fused-reference".split())
    args.activation_func = F.silu
    config = _core_transformer_config_from_args(args, config_class_for(args))
    assert config.moe_grouped_gemm_impl == "fused-reference"

    args.moe_grouped_gemm = False
    with pytest.raises(ValueError, match="needs moe_grouped_gemm=True"):
        _core_transformer_config_from_args(args, config_class_for(args))

    from megatron.core.transformer.transformer_config import TransformerConfig

    plain = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, num_moe_experts=4,
                              moe_ffn_hidden_size=8, moe_grouped_gemm=True, gated_linear_unit=True,
                              activation_func=F.silu)
    args.moe_grouped_gemm = True
    assert megatron_patches.get_moe_grouped_gemm_impl(apply_args_to_config(args, plain)) == "fused-reference"
    with pytest.raises(SystemExit):
        parser.parse_args(["--moe-grouped-gemm-impl", "nope"])


def test_install_is_idempotent_and_reversible():
    from megatron.core.transformer.moe.moe_layer import MoELayer

    was = megatron_patches.is_installed()
    megatron_patches.uninstall()
    try:
        original = MoELayer.__init__
        megatron_patches.install()
        wrapped = MoELayer.__init__
        megatron_patches.install()
        assert MoELayer.__init__ is wrapped and wrapped is not original and megatron_patches.is_installed()
        megatron_patches.uninstall()
        assert MoELayer.__init__ is original and not megatron_patches.is_installed()
    finally:
        if was:
            megatron_patches.install()


def test_uninstall_keeps_a_wrapper_added_after_install():
    """Another library wrapping MoELayer.__init__ (functools.wraps copies our marks) after install():
    uninstall must not silently drop that wrapper along with ours."""
    import functools

    from megatron.core.transformer.moe.moe_layer import MoELayer

    was = megatron_patches.is_installed()
    megatron_patches.uninstall()
    original = MoELayer.__init__
    try:
        megatron_patches.install()
        ours = MoELayer.__init__

        @functools.wraps(ours)
        def theirs(self, *args, **kwargs):
            ours(self, *args, **kwargs)

        MoELayer.__init__ = theirs
        assert megatron_patches.is_installed()  # our hook still runs, beneath theirs
        with pytest.raises(RuntimeError, match="MoELayer.__init__ was wrapped after install"):
            megatron_patches.uninstall()
        assert MoELayer.__init__ is theirs
        megatron_patches.install()  # idempotent here too: no second hook
        assert MoELayer.__init__ is theirs
    finally:
        MoELayer.__init__ = original
        if was:
            megatron_patches.install()
