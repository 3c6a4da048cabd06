"""The reference backend against the FP64 per-expert loop of tests/moe_reference.py.

Unquantized: forward and every gradient (x, w1, w2, b1, b2, probs) on seeded sweeps over expert
counts, routings, padding, activations, bias/probs and dtypes. Quantized recipes: against an
independent FP64 composition with the same fake-quantized operands (tests/fake_quant_reference.py),
plus a loose bound against the unquantized FP64 result that fits each format.
"""

import itertools

import pytest
import torch

import te_fused_moe
from moe_reference import expert_mlp_fp64, random_problem, rel_err
from te_fused_moe.activations import ACTIVATIONS
from te_fused_moe.backends import get_backend

ACTS = sorted(ACTIVATIONS)
GRAD_NAMES = ("x", "w1", "w2", "b1", "b2", "probs")


def run_op(problem, activation, recipe=None, backend="reference", dy_seed=0):
    """Forward + backward through ``fused_moe_mlp``; returns (y, dy, grads by name)."""
    leaves = {k: problem[k] for k in GRAD_NAMES if problem.get(k) is not None}
    for t in leaves.values():
        t.requires_grad_(True)
        t.grad = None
    y = te_fused_moe.fused_moe_mlp(
        problem["x"], problem["tokens_per_expert"], problem["w1"], problem["w2"], activation=activation,
        recipe=recipe, b1=problem.get("b1"), b2=problem.get("b2"), probs=problem.get("probs"), backend=backend,
    )
    g = torch.Generator().manual_seed(dy_seed)
    dy = torch.randn(y.shape, generator=g).to(y.dtype)
    y.backward(dy)
    grads = {k: t.grad for k, t in leaves.items()}
    return y, dy, grads


def assert_matches_fp64(problem, activation, y, dy, grads, tol, grad_tol=None):
    ref = expert_mlp_fp64(**problem, activation=activation, dy=dy)
    assert y.shape == problem["x"].shape and y.dtype == problem["x"].dtype
    err = rel_err(y, ref["y"])
    assert err < tol, f"y: rel err {err:.3g}"
    for name, grad in grads.items():
        assert grad is not None, f"{name}: no gradient"
        assert grad.shape == problem[name].shape and grad.dtype == problem[name].dtype, name
        err = rel_err(grad, ref[name])
        assert err < (grad_tol or tol), f"d{name}: rel err {err:.3g}"


# Seeded sweep: every activation x E x routing; bias, probs and padding rotate through the cases.
SWEEP = [
    dict(activation=act, E=E, routing=routing, bias=i % 2 == 1, probs=(i // 2) % 2 == 1, padding=(i % 3) * 3, seed=i)
    for i, (act, E, routing) in enumerate(itertools.product(ACTS, (1, 3, 8, 64), ("balanced", "zipf", "empty", "one")))
]


def _case_id(c):
    return f"{c['activation']}-E{c['E']}-{c['routing']}{'-bias' if c['bias'] else ''}{'-probs' if c['probs'] else ''}-pad{c['padding']}"


# bf16 on every other case (bias/probs/padding still rotate through all values) to keep CI short.
SWEEP_DTYPES = [(case, torch.float32, 1e-5) for case in SWEEP] + [(c, torch.bfloat16, 1e-2) for i, c in enumerate(SWEEP) if (i + i // 4) % 2 == 0]


@pytest.mark.parametrize("case,dtype,tol", SWEEP_DTYPES,
                         ids=[f"{'fp32' if d == torch.float32 else 'bf16'}-{_case_id(c)}" for c, d, _ in SWEEP_DTYPES])
def test_sweep_vs_fp64(case, dtype, tol):
    T = 96 if case["E"] == 64 else 40
    problem = random_problem(T, 32, 16, case["E"], case["activation"], dtype=dtype, bias=case["bias"],
                             probs=case["probs"], routing=case["routing"], padding=case["padding"], seed=case["seed"])
    y, dy, grads = run_op(problem, case["activation"], dy_seed=case["seed"])
    assert_matches_fp64(problem, case["activation"], y, dy, grads, tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float16, 4e-3)], ids=["fp64", "fp16"])
@pytest.mark.parametrize("activation", ["swiglu", "srelu", "gpt_oss_swiglu"])
def test_other_dtypes(dtype, tol, activation):
    problem = random_problem(50, 48, 32, 4, activation, dtype=dtype, bias=True, probs=True, routing="zipf",
                             padding=5, seed=3)
    problem["probs"] = problem["probs"].to(dtype)  # FP32 by default; FP64 here so dprobs is FP64 too
    y, dy, grads = run_op(problem, activation)
    assert_matches_fp64(problem, activation, y, dy, grads, tol)


@pytest.mark.parametrize("count_dtype", [torch.int32, torch.int64])
def test_padding_rows_hold_garbage(count_dtype):
    """Padding rows (past sum(counts)) may hold anything, NaN included: zero output, zero gradient,
    and nothing leaks into the routed rows."""
    problem = random_problem(30, 32, 16, 3, "swiglu", bias=True, probs=True, padding=7, seed=8)
    problem["tokens_per_expert"] = problem["tokens_per_expert"].to(count_dtype)
    with torch.no_grad():
        problem["x"][-7:] = float("nan")
        problem["probs"][-7:] = float("nan")
    y, dy, grads = run_op(problem, "swiglu")
    assert torch.all(y[-7:] == 0)
    assert torch.all(grads["x"][-7:] == 0) and torch.all(grads["probs"][-7:] == 0)
    for name, grad in grads.items():
        assert torch.isfinite(grad).all(), name
    clean = {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in problem.items()}
    clean["x"][-7:] = 0
    clean["probs"][-7:] = 0
    ref = expert_mlp_fp64(**clean, activation="swiglu", dy=dy)
    assert rel_err(y, ref["y"]) < 1e-5
    for name in GRAD_NAMES:
        assert rel_err(grads[name], ref[name]) < 1e-5, name


def test_empty_experts_get_exact_zero_gradients():
    problem = random_problem(24, 16, 16, 5, "geglu", bias=True, seed=4)
    problem["tokens_per_expert"] = torch.tensor([0, 10, 0, 14, 0])
    y, dy, grads = run_op(problem, "geglu")
    for e in (0, 2, 4):
        for name in ("w1", "w2", "b1", "b2"):
            assert torch.all(grads[name][e] == 0), (name, e)
    for e in (1, 3):
        assert grads["w1"][e].abs().sum() > 0 and grads["b2"][e].abs().sum() > 0
    assert_matches_fp64(problem, "geglu", y, dy, grads, 1e-5)


@pytest.mark.parametrize("padding", [0, 6])
def test_no_routed_tokens(padding):
    """T = 0, or every row padding: zero output and zero (not missing) gradients for every input."""
    problem = random_problem(padding, 16, 16, 4, "swiglu", bias=True, probs=True, padding=padding, seed=2)
    y, dy, grads = run_op(problem, "swiglu")
    assert y.shape == (padding, 16) and torch.all(y == 0)
    for name, grad in grads.items():
        assert grad is not None and torch.all(grad == 0), name


def test_backend_interface():
    backend = get_backend("reference")
    assert backend.name == "reference"
    assert backend.availability(torch.device("cpu"))
    assert backend.availability(torch.device("cuda", 0))  # pure PyTorch: any device
    for act in ACTS:
        for recipe in ("bf16", "mxfp8", "nvfp4", "fp8_block"):
            for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
                verdict = backend.supports(te_fused_moe.ActivationConfig(act), te_fused_moe.as_recipe(recipe), dtype)
                assert verdict.ok, (act, recipe, dtype, verdict.reason)
    assert not backend.supports(te_fused_moe.ActivationConfig("swiglu"), te_fused_moe.as_recipe(None), torch.int32)


def test_reference_rejects_bad_counts_even_outside_debug_mode():
    """It reads the counts on the host anyway, so it checks them at no extra cost."""
    problem = random_problem(10, 16, 16, 2, "swiglu", seed=1)
    for counts in ([6, 6], [12, -2]):
        with pytest.raises(ValueError, match="tokens_per_expert"):
            te_fused_moe.fused_moe_mlp(problem["x"], torch.tensor(counts), problem["w1"], problem["w2"],
                                       backend="reference")


def test_deterministic_run_to_run():
    problem = random_problem(64, 32, 32, 8, "swiglu", bias=True, probs=True, routing="zipf", seed=6)
    y1, _, g1 = run_op(problem, "swiglu")
    y2, _, g2 = run_op(problem, "swiglu")
    assert torch.equal(y1, y2)
    for name in g1:
        assert torch.equal(g1[name], g2[name]), name


# ----------------------------------------------------------------------------- quantized recipes

from fake_quant_reference import quantized_expert_mlp_fp64  # noqa: E402
from te_fused_moe.recipes import (  # noqa: E402
    BF16Recipe, Float8BlockScaling, Format, MXFP8BlockScaling, NVFP4BlockScaling,
)

# name -> (recipe, loose bound vs the unquantized FP64 result). Measured on these problems:
# E4M3 ~0.07, HYBRID (E5M2 gradients) ~0.10, NVFP4 ~0.26-0.33.
QUANTIZED = {
    "mxfp8": (MXFP8BlockScaling(), 0.15),
    "mxfp8-hybrid": (MXFP8BlockScaling(fp8_format=Format.HYBRID), 0.2),
    "fp8_block": (Float8BlockScaling(), 0.15),
    "fp8_block-f32-scales-1d-weights": (Float8BlockScaling(use_f32_scales=True, w_block_scaling_dim=1), 0.15),
    "nvfp4": (NVFP4BlockScaling(disable_stochastic_rounding=True), 0.5),
    "nvfp4-1d-no-rht": (NVFP4BlockScaling(disable_stochastic_rounding=True, disable_rht=True,
                                          disable_2d_quantization=True), 0.5),
}
# vs the FP64 composition on the same fake-quantized operands: FP32 compute may put an operand
# element on a neighbouring code now and then (seen up to 5e-5); bf16 adds the output rounding.
QUANT_TOL = {torch.float32: 2e-3, torch.bfloat16: 1e-2}

QUANT_CASES = [
    dict(activation=act, E=E, routing=routing, bias=bias, probs=probs, seed=10 + i)
    for i, (act, E, routing, bias, probs) in enumerate([
        ("swiglu", 3, "zipf", True, True),
        ("gpt_oss_swiglu", 8, "empty", False, True),
        ("srelu", 1, "balanced", True, False),
        ("geglu", 3, "one", False, False),
    ])
]


def _quant_problem(case, dtype):
    # T and H past one 128-block and not multiples of it: partial blocks along tokens and K.
    return random_problem(150, 160, 48, case["E"], case["activation"], dtype=dtype, bias=case["bias"],
                          probs=case["probs"], routing=case["routing"], padding=5, seed=case["seed"])


@pytest.mark.parametrize("recipe_name", sorted(QUANTIZED))
@pytest.mark.parametrize("case", QUANT_CASES, ids=lambda c: f"{c['activation']}-E{c['E']}-{c['routing']}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_quantized_vs_fake_quantized_fp64(recipe_name, case, dtype):
    recipe, bound = QUANTIZED[recipe_name]
    problem = _quant_problem(case, dtype)
    y, dy, grads = run_op(problem, case["activation"], recipe=recipe, dy_seed=case["seed"])
    ref = quantized_expert_mlp_fp64(**problem, recipe=recipe, activation=case["activation"], dy=dy)
    assert rel_err(y, ref["y"]) < QUANT_TOL[dtype]
    for name, grad in grads.items():
        assert rel_err(grad, ref[name]) < QUANT_TOL[dtype], name
    exact = expert_mlp_fp64(**problem, activation=case["activation"], dy=dy)
    assert rel_err(y, exact["y"]) < bound
    for name, grad in grads.items():
        assert rel_err(grad, exact[name]) < bound, name
    # and quantization did happen: the result is off the unquantized one by more than rounding
    assert rel_err(y, exact["y"]) > 5e-3


def test_fake_quant_ground_truth_is_the_fp64_loop_without_quantization():
    """The hand-written backward of the quantized ground truth, checked against FP64 autograd."""
    problem = random_problem(60, 32, 16, 4, "gpt_oss_swiglu", dtype=torch.float64, bias=True, probs=True,
                             routing="empty", padding=4, seed=21)
    dy = torch.randn(60, 32, dtype=torch.float64)
    ours = quantized_expert_mlp_fp64(**problem, recipe=BF16Recipe(), activation="gpt_oss_swiglu", dy=dy)
    ref = expert_mlp_fp64(**problem, activation="gpt_oss_swiglu", dy=dy)
    for name in ("y",) + GRAD_NAMES:
        assert rel_err(ours[name], ref[name]) < 1e-13, name


def test_wgrad_blocks_restart_at_each_expert():
    """Token-dimension (wgrad) blocks are per expert: quantizing all tokens as one operand would
    give a different weight gradient."""
    from te_fused_moe.quantize import fake_quantize

    recipe = MXFP8BlockScaling()
    problem = random_problem(64, 32, 32, 2, "swiglu", routing="balanced", seed=2)
    problem["tokens_per_expert"] = torch.tensor([20, 44])  # expert 1 starts inside a 32-row block
    with torch.no_grad():
        # Expert 0's rows would set the scale of the shared block [0, 32) so high that expert 1's
        # rows 20..31 fall into E4M3's subnormals (a mere 50x would not: FP8 keeps its relative
        # precision over a wide range).
        problem["x"][:20] *= 2.0**16
    x = problem["x"].detach()
    shared = fake_quantize(x, recipe, role="x", axis=0, gemm="wgrad")[20:32]
    own = fake_quantize(x[20:], recipe, role="x", axis=0, gemm="wgrad")[:12]
    assert rel_err(shared, own) > 1e-2  # the problem does tell the two apart

    _, dy, grads = run_op(problem, "swiglu", recipe=recipe)
    ref = quantized_expert_mlp_fp64(**problem, recipe=recipe, activation="swiglu", dy=dy)
    for e in range(2):
        assert rel_err(grads["w1"][e], ref["w1"][e]) < 2e-3, e
        assert rel_err(grads["w2"][e], ref["w2"][e]) < 2e-3, e


def test_nvfp4_stochastic_rounding():
    """With stochastic rounding of gradients: forward as without it, gradients within NVFP4's bound,
    seeded runs reproducible, and the rounding really is stochastic."""
    sr = NVFP4BlockScaling()
    rtn = NVFP4BlockScaling(disable_stochastic_rounding=True)
    case = QUANT_CASES[0]
    problem = _quant_problem(case, torch.float32)
    torch.manual_seed(0)
    y1, dy, g1 = run_op(problem, case["activation"], recipe=sr, dy_seed=1)
    torch.manual_seed(0)
    y2, _, g2 = run_op(problem, case["activation"], recipe=sr, dy_seed=1)
    y3, _, g3 = run_op(problem, case["activation"], recipe=sr, dy_seed=1)  # other random stream
    y_rtn, _, g_rtn = run_op(problem, case["activation"], recipe=rtn, dy_seed=1)
    assert torch.equal(y1, y_rtn)
    exact = expert_mlp_fp64(**problem, activation=case["activation"], dy=dy)
    for name in ("x", "w1", "w2", "probs"):
        assert torch.equal(g1[name], g2[name]), name
        assert not torch.equal(g1[name], g3[name]), name
        assert not torch.equal(g1[name], g_rtn[name]), name
        assert rel_err(g1[name], exact[name]) < 0.5, name


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4", "fp8_block"])
def test_quantized_recipe_by_name_through_the_op(recipe):
    """Recipe names resolve to the same recipe objects (NVFP4's default includes stochastic
    rounding, so only its forward is compared)."""
    problem = random_problem(40, 64, 32, 3, "swiglu", routing="zipf", seed=7)
    y_name = te_fused_moe.fused_moe_mlp(problem["x"], problem["tokens_per_expert"], problem["w1"], problem["w2"],
                                        recipe=recipe, backend="reference")
    y_obj = te_fused_moe.fused_moe_mlp(problem["x"], problem["tokens_per_expert"], problem["w1"], problem["w2"],
                                       recipe=te_fused_moe.as_recipe(recipe), backend="reference")
    assert torch.equal(y_name, y_obj)
    ref = quantized_expert_mlp_fp64(**problem, recipe=te_fused_moe.as_recipe(recipe), activation="swiglu")
    assert rel_err(y_name, ref["y"]) < 2e-3


def test_auto_on_cpu_is_the_reference(recwarn):
    problem = random_problem(30, 32, 16, 3, "swiglu", bias=True, probs=True, routing="zipf", padding=2, seed=9)
    args = (problem["x"], problem["tokens_per_expert"], problem["w1"], problem["w2"])
    kwargs = dict(b1=problem["b1"], b2=problem["b2"], probs=problem["probs"], recipe="mxfp8")
    y_auto = te_fused_moe.fused_moe_mlp(*args, backend="auto", **kwargs)
    y_ref = te_fused_moe.fused_moe_mlp(*args, backend="reference", **kwargs)
    assert torch.equal(y_auto, y_ref)
    assert not [w for w in recwarn if "fell back" in str(w.message)]  # the warning is for GPUs only


@pytest.mark.parametrize("recipe_name", ["mxfp8", "fp8_block"])
def test_block_axes_with_wide_dynamic_range(recipe_name):
    """With power-of-two scales an FP8 block's values do not depend on its neighbours unless they
    fall into subnormals, so gaussian data cannot tell a block laid along the wrong axis. Rows and
    columns scaled over 2^±8 can: each GEMM operand must be blocked along its own reduction axis."""
    recipe = QUANTIZED[recipe_name][0]
    problem = random_problem(96, 128, 64, 2, "swiglu", bias=True, probs=True, routing="balanced", seed=31)
    g = torch.Generator().manual_seed(32)
    spread = lambda n: 2.0 ** torch.randint(-8, 9, (n,), generator=g).float()
    with torch.no_grad():
        problem["x"].mul_(spread(96)[:, None] * spread(128)[None, :])
        problem["w1"].mul_(spread(128)[None, None, :])
        problem["w2"].mul_(spread(128)[None, :, None] * spread(64)[None, None, :])
    y, dy, grads = run_op(problem, "swiglu", recipe=recipe)
    ref = quantized_expert_mlp_fp64(**problem, recipe=recipe, activation="swiglu", dy=dy)
    # Worst row or column, not the whole-tensor norm, which the large rows would dominate.
    assert worst_slice_err(y, ref["y"]) < 1e-3
    for name, grad in grads.items():
        assert worst_slice_err(grad, ref[name]) < 1e-3, name


def worst_slice_err(out, ref):
    """Largest relative error of any row or column (any slice along the last dim for 3-D)."""
    out, ref = out.detach().double().reshape(-1, out.shape[-1]), ref.detach().double().reshape(-1, ref.shape[-1])
    worst = 0.0
    for dim in (0, 1):
        num, den = (out - ref).norm(dim=dim), ref.norm(dim=dim)
        keep = den > 0
        if keep.any():
            worst = max(worst, (num[keep] / den[keep]).max().item())
        worst = max(worst, num[~keep].max().item() if (~keep).any() else 0.0)
    return worst
