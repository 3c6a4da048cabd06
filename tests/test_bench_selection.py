"""Which implementations the recipe benchmark times (``bench_recipes.selected_implementations``): CPU-only."""

import pytest

from te_fused_moe.bench_recipes import main, selected_implementations


def test_recipe_brings_its_pair_and_variants_and_the_bf16_pair():
    chosen = selected_implementations(["fp8_block"])
    assert {"bf16_unfused", "bf16_fused", "fp8_block_unfused", "fp8_block_fused",
            "fp8_block_fused_plain_one_consumer"} <= set(chosen)
    assert not any(name.startswith("mxfp8") for name in chosen)


def test_only_keeps_the_named_ones_and_the_baseline():
    chosen = selected_implementations(["fp8_block"], only=["fp8_block_fused", "fp8_block_fused_plain_one_consumer"])
    assert list(chosen) == ["bf16_unfused", "fp8_block_fused", "fp8_block_fused_plain_one_consumer"]


def test_only_names_an_unknown_implementation():
    with pytest.raises(ValueError, match=r"only: \['mxfp8_fused'\].*fp8_block_fused"):
        selected_implementations(["fp8_block"], only=["fp8_block_fused", "mxfp8_fused"])


def test_only_without_variants_is_refused_not_ignored(capsys):
    # session 21's device script passed --only where it meant --implementations, and it was ignored
    with pytest.raises(SystemExit):
        main(["--shapes", "gpt-oss", "--only", "fp8_block_fused"])
    assert "--only picks configs of --variants" in capsys.readouterr().err
