"""Corner cases found in review of the op's Python orchestration (CPU, no interpreter needed)."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("counts", [[5, -3, 4], [-5, 3, 4], [-7, -1, 30], [12, -20, 2]])
def test_schedule_row_ranges_stay_inside_x_for_negative_counts(counts):
    """Bad counts are caught only in debug mode; outside it the schedule must still keep every
    kernel inside ``[0, T)``. A negative count used to give a row range starting below zero
    (``[-5, 3, 4]`` gave expert 1 rows ``[-5, -2)``), i.e. writes before the start of the output."""
    from te_fused_moe.backends.triton.schedule import build_schedule, max_m_tiles, schedule_table

    num_rows, block_m, experts = 10, 4, len(counts)
    flat = build_schedule(torch.tensor(counts), num_rows=num_rows, block_m=block_m)
    tile_start, tile_end, row_start, row_end = schedule_table(flat, experts).tolist()
    assert min(row_start) >= 0 and max(row_end) <= num_rows
    assert all(s <= e for s, e in zip(row_start, row_end)), (row_start, row_end)
    # groups are consecutive and disjoint, and together cover exactly the T rows
    assert row_start[0] == 0 and row_end[-1] == num_rows
    assert all(row_end[g] == row_start[g + 1] for g in range(experts))
    assert tile_end[-1] <= max_m_tiles(num_rows, experts, block_m)


@pytest.mark.parametrize("frozen", ["bias", "weight"])
def test_swap_keeps_frozen_parameters_frozen(frozen):
    """A swapped block's parameters train exactly when the original's did. Frozen biases used to
    come back trainable (only the weights' ``requires_grad`` was carried over)."""
    from test_swap import ExpertBlockStandIn

    from te_fused_moe import swap

    block = ExpertBlockStandIn(3, 8, 16, bias=True)
    for linear in (block.fc1, block.fc2):
        for name, param in linear.named_parameters():
            param.requires_grad_(not name.startswith(frozen))
    fused = swap.fused_from_block(block, backend="reference")
    trainable = {name: p.requires_grad for name, p in fused.named_parameters()}
    expect_weights, expect_biases = (True, False) if frozen == "bias" else (False, True)
    assert trainable == {"weight1": expect_weights, "weight2": expect_weights,
                         "bias1": expect_biases, "bias2": expect_biases}


@pytest.fixture
def te_recipe_module(monkeypatch):
    """TE's real recipe file (TE's pure-Python wheel, see tests/test_te_compat.py), loaded by path in
    this process with TE's environment switches unset; skipped where that wheel is not installed."""
    import os
    import sys

    from te_fused_moe import te_compat

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    te_dir = os.environ.get("TE_FUSED_MOE_TE_PATH") or os.path.join(root, ".deps", "te")
    package = os.path.join(te_dir, "transformer_engine")
    if not os.path.isdir(package):
        if os.environ.get("TE_FUSED_MOE_REQUIRE_TE") == "1":
            pytest.fail(f"TE's wheel is required but missing at {te_dir}")
        pytest.skip(f"TE's pure-Python wheel is not installed at {te_dir}")
    monkeypatch.delenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", raising=False)
    monkeypatch.delenv("NVTE_BACKWARD_OVERRIDE", raising=False)
    module = te_compat._load_recipe_by_path(package)
    monkeypatch.setattr(te_compat, "te_recipe_module", lambda: module)
    yield module
    sys.modules.pop(te_compat._PRIVATE_RECIPE_MODULE, None)


def test_fp8_block_recipe_to_te_quantizes_like_ours(te_recipe_module):
    """TE's Float8Block quantizers read ``fp8_quant_{fwd_inp,fwd_weight,bwd_grad}.power_2_scale``,
    class attributes fixed when TE's recipe module is imported; ``use_f32_scales=True`` passed to
    the constructor does not change them. Our FP32-scale recipe used to become a TE recipe whose
    quantizers round scales to powers of two."""
    from te_fused_moe import recipes, te_compat

    for f32 in (False, True):
        te_recipe = te_compat.recipe_to_te(recipes.Float8BlockScaling(use_f32_scales=f32))
        for role in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"):
            qparams = getattr(te_recipe, role)
            assert qparams.power_2_scale is (not f32), (f32, role, qparams)
            assert qparams.amax_epsilon == 0.0
        assert te_compat.recipe_from_te(te_recipe) == recipes.Float8BlockScaling(use_f32_scales=f32)


def test_fp8_block_quantizer_settings_we_cannot_honour_are_refused(te_recipe_module):
    """TE recipes whose quantizers use an amax epsilon, or power-of-two scales for some roles only,
    used to convert silently to a recipe that computes something else."""
    from te_fused_moe import te_compat

    te = te_recipe_module
    eps = te.Float8BlockScaling()
    eps.fp8_quant_fwd_inp = te.QParams(power_2_scale=True, amax_epsilon=1e-6)
    with pytest.raises(ValueError, match=r"Float8BlockScaling\.fp8_quant_fwd_inp\.amax_epsilon"):
        te_compat.recipe_from_te(eps)
    mixed = te.Float8BlockScaling()
    mixed.fp8_quant_bwd_grad = te.QParams(power_2_scale=False)
    with pytest.raises(ValueError, match=r"Float8BlockScaling\.fp8_quant_bwd_grad\.power_2_scale"):
        te_compat.recipe_from_te(mixed)


@pytest.mark.parametrize("backend", ["auto", "reference", "triton"])
def test_zero_experts_are_refused_naming_w2(backend):
    """E = 0 used to reach the kernels (the Triton schedule then has no group for the padding rows;
    under the interpreter it died in an AssertionError 'shape must be positive')."""
    from te_fused_moe import fused_moe_mlp

    x = torch.randn(8, 16, dtype=torch.bfloat16)
    w1 = torch.randn(0, 32, 16, dtype=torch.bfloat16)
    w2 = torch.randn(0, 16, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"w2: expected at least one expert \(E >= 1\)"):
        fused_moe_mlp(x, torch.zeros(0, dtype=torch.int64), w1, w2, backend=backend)


# --- Triton backend corner cases under the CPU interpreter (one small subprocess) ----------------
# (id, T, E, frozen leaves, probs dtype, counts dtype, non-contiguous dy)
TRITON_CORNERS = [
    ("x-frozen", 40, 3, ("x",), None, torch.int64, False),
    ("biases-frozen", 40, 3, ("b1", "b2"), None, torch.int64, False),
    ("only-w2", 40, 3, ("x", "w1", "b1", "b2", "probs"), None, torch.int64, False),
    ("fp32-probs-int32-counts-strided-dy", 40, 3, (), torch.float32, torch.int32, True),
    ("no-rows", 0, 3, (), None, torch.int64, False),
]
_GRADS = ("x", "w1", "w2", "b1", "b2", "probs")


def _triton_corner_worker() -> None:
    import json
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path[:0] = [root, os.path.join(root, "tests")]
    from moe_reference import expert_mlp_fp64, poison_, random_problem, rel_err

    from te_fused_moe import fused_moe_mlp
    from te_fused_moe.backends.triton import autograd as triton_autograd

    real_new_buffer = triton_autograd.new_buffer
    triton_autograd.new_buffer = lambda *a, **k: poison_(real_new_buffer(*a, **k))
    torch.manual_seed(0)
    results = {}
    for case_id, T, E, frozen, probs_dtype, counts_dtype, strided_dy in TRITON_CORNERS:
        p = random_problem(T, 32, 24, E, activation="swiglu", dtype=torch.bfloat16, bias=True, probs=True,
                           routing="zipf", padding=3 if T else 0)
        p["tokens_per_expert"] = p["tokens_per_expert"].to(counts_dtype)
        if probs_dtype is not None:
            p["probs"] = p["probs"].to(probs_dtype)
        leaves = {k: (v.clone().requires_grad_(k not in frozen) if k in _GRADS else v) for k, v in p.items()}
        y = fused_moe_mlp(leaves["x"], leaves["tokens_per_expert"], leaves["w1"], leaves["w2"], b1=leaves["b1"],
                          b2=leaves["b2"], probs=leaves["probs"], backend="triton")
        dy = torch.randn(y.shape[1], y.shape[0], dtype=y.dtype).t() if strided_dy else torch.randn(y.shape, dtype=y.dtype)
        wanted = [k for k in _GRADS if k not in frozen]
        grads = torch.autograd.grad(y, [leaves[k] for k in wanted], dy)
        ref = expert_mlp_fp64(p["x"], p["tokens_per_expert"], p["w1"], p["w2"], "swiglu", p["b1"], p["b2"], p["probs"],
                              dy=dy)
        out = {"y": rel_err(y, ref["y"])}
        for k, g in zip(wanted, grads):
            out[k] = rel_err(g, ref[k]) if g.dtype == leaves[k].dtype else f"dtype {g.dtype}"
        results[case_id] = out
    print("RESULTS" + json.dumps(results))


@pytest.fixture(scope="module")
def triton_corner_results():
    from moe_reference import run_in_triton_interpreter

    pytest.importorskip("triton", reason="the Triton backend's CPU tests need the triton package")
    return run_in_triton_interpreter("import test_corner_cases as t; t._triton_corner_worker()")


@pytest.mark.parametrize("case", TRITON_CORNERS, ids=[c[0] for c in TRITON_CORNERS])
def test_triton_corner_cases_match_fp64(triton_corner_results, case):
    """Frozen inputs, probs in FP32 with BF16 x, int32 counts, a strided dy and T = 0: every
    gradient asked for comes back in its leaf's dtype and matches the FP64 loop (BF16 bound as in
    tests/test_triton_interpreter.py; with T = 0 the reference is all zeros and the error absolute)."""
    res = triton_corner_results[case[0]]
    assert set(res) == {"y"} | (set(_GRADS) - set(case[3]))
    for name, err in res.items():
        assert isinstance(err, float) and err <= 6e-3, f"{case[0]}: {name}: {err}"


@pytest.mark.parametrize("dims", [(2, 2, 1), (2, 1, 2), (1, 2, 2), (2, 2, 2)])
def test_fp8_block_recipe_refuses_two_2d_block_operands(dims):
    """TE's Float8BlockScaling refuses 2D-by-2D block GEMMs; ours accepted them, so recipe_to_te
    died in TE's assert and the reference emulated a GEMM no kernel runs."""
    from te_fused_moe.recipes import Float8BlockScaling

    x, w, grad = dims
    with pytest.raises(ValueError, match=r"Float8BlockScaling: at most one of x/w/grad may use 2D"):
        Float8BlockScaling(x_block_scaling_dim=x, w_block_scaling_dim=w, grad_block_scaling_dim=grad)
    Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1, grad_block_scaling_dim=1)  # one 2D is fine
