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


@pytest.mark.parametrize("case", SWEEP, ids=_case_id)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"])
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
