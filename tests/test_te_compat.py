"""te_compat: TE recipe conversion against TE's REAL recipe classes, TE's autocast, TE status.

TE cannot live in the shared environment (its meta-package makes ``import megatron.core`` raise),
so the tests that need TE's classes run in a pytest *subprocess* whose PYTHONPATH holds a private
install of TE's pure-Python wheel:

    pip install --no-deps --target .deps/te transformer-engine==2.20.2

The directory is ``$TE_FUSED_MOE_TE_PATH`` or ``<repo>/.deps/te``. Without it the TE tests skip
locally and fail when ``TE_FUSED_MOE_REQUIRE_TE=1`` (CI sets it).
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
import torch

from te_fused_moe import recipes, te_compat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INNER = os.environ.get("TE_FUSED_MOE_TE_SUBPROCESS") == "1"
inner_only = pytest.mark.skipif(not INNER, reason="runs inside the TE subprocess started by test_te_suite")
# The test_inner_* functions are collected only inside that subprocess (see the end of this file).


def _te_dir():
    path = os.environ.get("TE_FUSED_MOE_TE_PATH") or os.path.join(ROOT, ".deps", "te")
    return path if os.path.isdir(os.path.join(path, "transformer_engine")) else None


# --------------------------------------------------------------------------- without TE (this process)

@pytest.mark.skipif(INNER, reason="outer-process test")
def test_no_te_in_this_process_means_no_recipes_and_no_autocast():
    # The shared environment has no TE: everything degrades to None without raising.
    if te_compat._te_package_dir() is not None:
        pytest.skip("TE is installed in this interpreter")
    assert te_compat.te_recipe_module() is None
    assert te_compat.autocast_recipe() is None
    status = te_compat.te_status()
    assert status["version"] is None and status["recipes_load"] is False
    assert status["pytorch_imports"] is False and "not installed" in status["pytorch_why_not"]
    with pytest.raises(RuntimeError, match="recipe module is not available"):
        te_compat.recipe_to_te("mxfp8")


def test_our_recipes_are_not_te_recipes_and_bf16_maps_to_no_autocast():
    for value in (recipes.MXFP8BlockScaling(), recipes.BF16Recipe(), "mxfp8", None, 3, recipes.NVFP4BlockScaling):
        assert not te_compat.is_te_recipe(value)
    assert te_compat.recipe_to_te(None) is None and te_compat.recipe_to_te("bf16") is None
    with pytest.raises(TypeError, match="expected a Transformer Engine recipe"):
        te_compat.recipe_from_te(recipes.MXFP8BlockScaling())


def test_te_suite():
    """Runs the ``inner_only`` tests below in a subprocess with TE's wheel on PYTHONPATH."""
    if INNER:
        pytest.skip("already inside the TE subprocess")
    te_dir = _te_dir()
    if te_dir is None:
        message = (
            "TE's wheel not found: run `pip install --no-deps --target .deps/te transformer-engine==2.20.2` "
            "or set TE_FUSED_MOE_TE_PATH"
        )
        if os.environ.get("TE_FUSED_MOE_REQUIRE_TE") == "1":
            pytest.fail(message)
        pytest.skip(message)
    env = {k: v for k, v in os.environ.items() if not k.startswith("NVTE_")}  # TE reads defaults from NVTE_*
    env["PYTHONPATH"] = os.pathsep.join([te_dir, ROOT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["TE_FUSED_MOE_TE_SUBPROCESS"] = "1"
    env["TE_FUSED_MOE_TE_PATH"] = te_dir
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "inner", os.path.abspath(__file__)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail
    summary = proc.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary and "failed" not in summary, tail


# --------------------------------------------------------------------------- with TE (subprocess)

@pytest.fixture
def te():
    module = te_compat.te_recipe_module()
    assert module is not None, te_compat.te_status(check_pytorch=False)
    return module


@inner_only
def test_inner_recipe_module_is_tes_own_file(te):
    te_dir = os.environ["TE_FUSED_MOE_TE_PATH"]
    assert os.path.realpath(te.__file__).startswith(os.path.realpath(te_dir))
    assert te_compat.te_recipe_module() is te  # cached
    status = te_compat.te_status()
    assert status["version"] == "2.20.2" and status["recipes_load"] is True
    if not status["pytorch_imports"]:
        assert status["pytorch_why_not"]  # says why, e.g. TE's missing core library


def _te_fields(obj, names):
    out = {}
    for name in names:
        value = getattr(obj, name)
        out[name] = getattr(value, "name", value)  # Format enums compare by name across copies
    return out


MX_FIELDS = ("margin", "fp8_format", "backward_override", "enable_2d_quantization")
NV_FIELDS = ("disable_rht", "disable_stochastic_rounding", "disable_2d_quantization", "row_scaled_activation",
             "nvfp4_4over6", "backward_override")
BLOCK_FIELDS = ("use_f32_scales", "fp8_format", "x_block_scaling_dim", "w_block_scaling_dim",
                "grad_block_scaling_dim", "backward_override")


def _te_mxfp8_cases(te):
    for fmt, margin in itertools.product(("E4M3", "HYBRID"), (0, 3)):
        yield te.MXFP8BlockScaling(fp8_format=te.Format[fmt], margin=margin)


def _te_nvfp4_cases(te):
    for rht, sr, two_d in itertools.product((False, True), repeat=3):
        yield te.NVFP4BlockScaling(disable_rht=rht, disable_stochastic_rounding=sr, disable_2d_quantization=two_d)


def _te_block_recipe(te, f32, **fields):
    """TE's Float8BlockScaling with ``use_f32_scales`` and the QParams TE's quantizers read in agreement
    (TE derives both from NVTE_FP8_BLOCK_SCALING_FP32_SCALES at import; here we set them per object)."""
    recipe = te.Float8BlockScaling(use_f32_scales=f32, **fields)
    for role in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"):
        setattr(recipe, role, te.QParams(power_2_scale=not f32, amax_epsilon=0.0))
    return recipe


def _te_block_cases(te):
    for fmt, f32, dims in itertools.product(("E4M3", "HYBRID"), (False, True), ((1, 2, 1), (1, 1, 1), (2, 1, 1))):
        yield _te_block_recipe(te, f32, fp8_format=te.Format[fmt], x_block_scaling_dim=dims[0],
                               w_block_scaling_dim=dims[1], grad_block_scaling_dim=dims[2])


@inner_only
def test_inner_block_scaling_f32_flag_that_te_would_ignore_is_refused(te):
    # TE's quantizers read the QParams (power-of-2 by default), not use_f32_scales
    with pytest.raises(ValueError, match="use_f32_scales=True but its QParams say power_2_scale=True"):
        te_compat.recipe_from_te(te.Float8BlockScaling(use_f32_scales=True))
    assert te_compat.recipe_from_te(_te_block_recipe(te, True)).use_f32_scales is True


@inner_only
@pytest.mark.parametrize("kind", ["mxfp8", "nvfp4", "fp8_block"])
def test_inner_te_to_ours_to_te_is_lossless(te, kind):
    cases, fields, ours_cls = {
        "mxfp8": (_te_mxfp8_cases, MX_FIELDS, recipes.MXFP8BlockScaling),
        "nvfp4": (_te_nvfp4_cases, NV_FIELDS, recipes.NVFP4BlockScaling),
        "fp8_block": (_te_block_cases, BLOCK_FIELDS, recipes.Float8BlockScaling),
    }[kind]
    seen = set()
    for te_recipe in cases(te):
        assert te_compat.is_te_recipe(te_recipe)
        converted = te_compat.recipe_from_te(te_recipe)
        assert type(converted) is ours_cls
        assert recipes.as_recipe(te_recipe) == converted  # the op's entry point takes TE recipes too
        back = te_compat.recipe_to_te(converted)
        assert type(back) is type(te_recipe)
        assert _te_fields(back, fields) == _te_fields(te_recipe, fields)
        assert te_compat.recipe_from_te(back) == converted
        seen.add(converted)
    assert len(seen) == len(list(cases(te)))  # distinct TE settings stay distinct


@inner_only
def test_inner_ours_to_te_keeps_every_field(te):
    ours = [
        recipes.MXFP8BlockScaling(fp8_format=recipes.Format.HYBRID, margin=2),
        recipes.NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=False, disable_2d_quantization=True),
        recipes.Float8BlockScaling(fp8_format=recipes.Format.HYBRID, x_block_scaling_dim=2,
                                   w_block_scaling_dim=1, use_f32_scales=True),
    ]
    for recipe in ours:
        te_recipe = te_compat.recipe_to_te(recipe)
        assert type(te_recipe).__name__ == type(recipe).__name__
        assert te_compat.recipe_from_te(te_recipe) == recipe
    assert te_compat.recipe_to_te("nvfp4").disable_rht is False  # names work as well


@inner_only
def test_inner_per_tensor_and_custom_recipes_are_refused_with_a_way_out(te):
    for te_recipe, what in ((te.DelayedScaling(), "per-tensor scaling"),
                            (te.Float8CurrentScaling(), "per-tensor scaling"),
                            (te.CustomRecipe(qfactory=lambda role: None), "user-supplied quantizer factories")):
        assert te_compat.is_te_recipe(te_recipe)
        name = type(te_recipe).__name__
        with pytest.raises(ValueError, match=rf"recipe: TE's {name} \({what}\) is not supported .*use MXFP8BlockScaling"):
            te_compat.recipe_from_te(te_recipe)
        with pytest.raises(ValueError, match=name):
            recipes.as_recipe(te_recipe)


@inner_only
def test_inner_fields_we_cannot_honour_are_refused_not_dropped(te):
    refused = [
        (te.NVFP4BlockScaling(row_scaled_activation=True), "row_scaled_activation=True"),
        (te.NVFP4BlockScaling(nvfp4_4over6="weights"), "nvfp4_4over6='weights'"),
        (te.MXFP8BlockScaling(enable_2d_quantization=True), "enable_2d_quantization=True"),
        (te.MXFP8BlockScaling(backward_override="dequantized"), "backward_override='dequantized'"),
        (te.Float8BlockScaling(backward_override="high_precision"), "backward_override='high_precision'"),
    ]
    for te_recipe, field in refused:
        with pytest.raises(ValueError, match=f"{type(te_recipe).__name__}.{field}"):
            te_compat.recipe_from_te(te_recipe)


@inner_only
def test_inner_op_runs_with_a_te_recipe_exactly_as_with_ours(te):
    from te_fused_moe import fused_moe_mlp

    gen = torch.Generator().manual_seed(7)
    e, h, f, t = 3, 64, 32, 40
    x = torch.randn(t, h, generator=gen)
    w1 = torch.randn(e, 2 * f, h, generator=gen) / h ** 0.5
    w2 = torch.randn(e, h, f, generator=gen) / f ** 0.5
    counts = torch.tensor([15, 0, 21])
    y_te = fused_moe_mlp(x, counts, w1, w2, recipe=te.MXFP8BlockScaling(), backend="reference")
    y_ours = fused_moe_mlp(x, counts, w1, w2, recipe="mxfp8", backend="reference")
    y_bf16 = fused_moe_mlp(x, counts, w1, w2, backend="reference")
    assert torch.equal(y_te, y_ours)
    assert not torch.equal(y_te, y_bf16)  # the TE recipe really quantized


@inner_only
def test_inner_autocast_needs_tes_pytorch_extension_imported(te):
    # TE's PyTorch extension cannot import without TE's compiled core; autocast_recipe must not
    # try to import it and must report "no autocast".
    if "transformer_engine.pytorch" in sys.modules:
        pytest.skip("TE's PyTorch extension is importable here; covered by tests/gpu/test_te_pytorch.py")
    assert te_compat.autocast_recipe() is None
    assert "transformer_engine.pytorch" not in sys.modules


if not INNER:
    # Outside the TE subprocess these run through test_te_suite; don't also list them as skipped.
    for _name in [n for n in globals() if n.startswith("test_inner_")]:
        del globals()[_name]
