"""fake_quantize: every recipe x role x axis x gemm is shape-preserving and equals the per-format
quantizers applied by the recipe's rules; NVFP4's RHT keeps wgrad products equal to TE's
transformed product."""

import itertools

import pytest
import torch

from quant_data import fresh_seed, generator
from te_fused_moe.quantize import GEMMS, fake_quantize, fp8_block, hadamard, mxfp8, nvfp4
from te_fused_moe.recipes import (
    ROLES,
    BF16Recipe,
    Float8BlockScaling,
    Format,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)

RECIPES = [
    BF16Recipe(),
    MXFP8BlockScaling(),
    MXFP8BlockScaling(fp8_format=Format.HYBRID),
    NVFP4BlockScaling(),
    NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True, disable_2d_quantization=True),
    Float8BlockScaling(),
    Float8BlockScaling(fp8_format=Format.HYBRID, use_f32_scales=True, x_block_scaling_dim=2, w_block_scaling_dim=1),
]


def _expected(t, recipe, role, axis, gemm, seed):
    """The recipe rules restated with the per-format quantizers."""
    out = torch.float64 if t.dtype == torch.float64 else torch.float32
    if isinstance(recipe, BF16Recipe):
        return t.to(out)
    if isinstance(recipe, MXFP8BlockScaling):
        fmt = "e5m2" if (recipe.fp8_format is Format.HYBRID and role == "grad") else "e4m3"
        return mxfp8.dequantize(mxfp8.quantize(t, axis=axis, fp8_format=fmt), dtype=out)
    if isinstance(recipe, Float8BlockScaling):
        fmt = "e5m2" if (recipe.fp8_format is Format.HYBRID and role == "grad") else "e4m3"
        dim = {"x": recipe.x_block_scaling_dim, "w": recipe.w_block_scaling_dim, "grad": recipe.grad_block_scaling_dim}[role]
        block = (1, 128) if dim == 1 else (128, 128)
        q = fp8_block.quantize(t, block=block, axis=axis, power_2_scale=not recipe.use_f32_scales, fp8_format=fmt)
        return fp8_block.dequantize(q, dtype=out)
    sr = role == "grad" and not recipe.disable_stochastic_rounding
    if gemm == "wgrad" and role != "w" and not recipe.disable_rht:
        w = hadamard.apply_rht(t, axis)
        q = nvfp4.quantize(w, axis=axis, stochastic_rounding=sr, generator=generator(seed))
        return hadamard.apply_inverse_rht(nvfp4.dequantize(q, dtype=torch.float64), axis, t.shape[axis], out)
    two_d = role == "w" and not recipe.disable_2d_quantization
    q = nvfp4.quantize(t, axis=axis, block_2d=two_d, stochastic_rounding=sr, generator=generator(seed))
    return nvfp4.dequantize(q, dtype=out)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: repr(r))
def test_every_combination_matches_per_format_quantizers(recipe):
    seed = fresh_seed()
    g = generator(seed)
    for dtype, role, axis, gemm in itertools.product(
        (torch.float32, torch.bfloat16, torch.float64), ROLES, (0, 1, -1), GEMMS
    ):
        t = (torch.randn(37, 45, generator=g) * 3).to(dtype)
        got = fake_quantize(t, recipe, role=role, axis=axis, gemm=gemm, generator=generator(seed))
        where = f"seed={seed} {recipe} dtype={dtype} role={role} axis={axis} gemm={gemm}"
        assert got.shape == t.shape, where
        assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32), where
        assert bool(torch.isfinite(got).all()), where
        assert torch.equal(got, _expected(t, recipe, role, axis % 2, gemm, seed)), where
        if not isinstance(recipe, BF16Recipe):
            rel = float((got.double() - t.double()).norm() / t.double().norm())
            assert 0 < rel < (0.2 if isinstance(recipe, NVFP4BlockScaling) else 0.07), f"{where}: relative error {rel}"


def test_bf16_recipe_is_identity():
    t = torch.randn(5, 7, dtype=torch.bfloat16)
    assert torch.equal(fake_quantize(t, BF16Recipe(), role="x", axis=1, gemm="fprop"), t.float())
    t64 = torch.randn(5, 7, dtype=torch.float64)
    assert torch.equal(fake_quantize(t64, "bf16", role="w", axis=0, gemm="dgrad"), t64)


def test_rht_wgrad_product_equals_transformed_product():
    # wgrad: dW = gradᵀ · x, reduced over tokens (axis 0 of both operands).
    seed = fresh_seed()
    g = generator(seed)
    tokens = 64
    x = torch.randn(tokens, 24, generator=g)
    dy = torch.randn(tokens, 20, generator=g)
    recipe = NVFP4BlockScaling(disable_stochastic_rounding=True)
    fx = fake_quantize(x, recipe, role="x", axis=0, gemm="wgrad")
    fg = fake_quantize(dy, recipe, role="grad", axis=0, gemm="wgrad")
    # TE's product: both operands transformed along tokens, quantized, multiplied.
    qx = nvfp4.dequantize(nvfp4.quantize(hadamard.apply_rht(x, 0), axis=0), dtype=torch.float64)
    qg = nvfp4.dequantize(nvfp4.quantize(hadamard.apply_rht(dy, 0), axis=0), dtype=torch.float64)
    te = qg.T @ qx
    ours = fg.double().T @ fx.double()
    assert torch.allclose(ours, te, rtol=0, atol=1e-5 * float(te.abs().max())), f"seed={seed}"
    # And the transform matters: without it the product differs.
    plain = NVFP4BlockScaling(disable_stochastic_rounding=True, disable_rht=True)
    p = fake_quantize(dy, plain, role="grad", axis=0, gemm="wgrad").double().T @ fake_quantize(
        x, plain, role="x", axis=0, gemm="wgrad"
    ).double()
    assert not torch.allclose(p, te, rtol=0, atol=1e-5 * float(te.abs().max())), f"seed={seed}"


def test_nvfp4_grad_is_stochastic_and_weights_are_2d():
    seed = fresh_seed()
    t = torch.randn(32, 64, generator=generator(seed))
    r = NVFP4BlockScaling()
    a = fake_quantize(t, r, role="grad", axis=1, gemm="dgrad", generator=generator(seed))
    b = fake_quantize(t, r, role="grad", axis=1, gemm="dgrad", generator=generator(seed + 1))
    assert not torch.equal(a, b), f"seed={seed}: gradients were not stochastically rounded"
    w0 = fake_quantize(t, r, role="w", axis=0, gemm="dgrad")
    w1 = fake_quantize(t, r, role="w", axis=1, gemm="fprop")
    assert torch.equal(w0, w1), f"seed={seed}: 16x16 weight tiles must give the same values on both axes"


def test_bad_arguments_raise():
    t = torch.randn(4, 32)
    with pytest.raises(ValueError, match="role"):
        fake_quantize(t, MXFP8BlockScaling(), role="weight", axis=1, gemm="fprop")
    with pytest.raises(ValueError, match="gemm"):
        fake_quantize(t, MXFP8BlockScaling(), role="x", axis=1, gemm="forward")
    with pytest.raises(ValueError, match="2-D"):
        fake_quantize(torch.randn(2, 4, 32), MXFP8BlockScaling(), role="x", axis=1, gemm="fprop")
    with pytest.raises(ValueError, match="axis"):
        fake_quantize(t, MXFP8BlockScaling(), role="x", axis=2, gemm="fprop")
    with pytest.raises(ValueError, match="recipe"):
        fake_quantize(t, "fp6", role="x", axis=1, gemm="fprop")
