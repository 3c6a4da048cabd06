"""Triton backend on CPU, through Triton's interpreter (TRITON_INTERPRET=1).

``TRITON_INTERPRET`` is read when ``@triton.jit`` decorates a kernel, i.e. when the backend module is
first imported; other tests of the same pytest process may already have imported it compiled. So
the kernels run in one fresh subprocess (:func:`_run_worker`) that checks every case against the
FP64 reference and reports numbers as JSON; the tests below assert on those numbers.

Both load paths are covered: TMA tensor descriptors (the default where operands allow) and plain
pointer loads (``grouped_gemm.USE_TMA_DEFAULT = False`` for the cases marked ``ptr``); cases marked
``clampedtail`` turn off the wgrad's vectorised tail (on by default, see ``WgradConfig.vector_tail``);
cases marked ``persist`` run the persistent grouped GEMMs (``grouped_gemm.PERSISTENT_DEFAULT = True``,
which also loads FC1's gate and up rows as one box: ``GemmConfig.gate_up_box``).

Every kernel buffer is poisoned with NaN (``autograd.new_buffer`` is replaced in the worker), so an
element a kernel fails to write shows up as NaN in an error or an exact-zero check.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import pytest
import torch

from moe_reference import run_in_triton_interpreter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ != "__main__":
    pytest.importorskip("triton", reason="the Triton backend's CPU tests need the triton package (pip install triton)")

# (id, T, H, F, E, activation, bias, probs, routing, padding, dtype, deterministic)
CASES = [
    ("swiglu-e3", 96, 48, 40, 3, "swiglu", True, True, "balanced", 0, "bfloat16", False),
    ("geglu-e3-pad", 80, 64, 32, 3, "geglu", True, True, "balanced", 7, "bfloat16", False),
    ("gptoss-e5-empty", 128, 64, 48, 5, "gpt_oss_swiglu", True, True, "empty", 3, "bfloat16", False),
    ("srelu-e3", 64, 48, 64, 3, "srelu", True, True, "zipf", 0, "bfloat16", False),
    ("silu-e5-empty", 72, 32, 40, 5, "silu", True, True, "empty", 0, "bfloat16", False),
    ("gelu-e1-pad", 50, 40, 24, 1, "gelu", True, True, "balanced", 9, "bfloat16", False),
    ("swiglu-e1-nobias", 64, 64, 64, 1, "swiglu", False, False, "balanced", 0, "bfloat16", False),
    ("swiglu-e5-one", 100, 48, 32, 5, "swiglu", False, True, "one", 4, "bfloat16", False),
    ("gptoss-e3-bias-noprobs", 64, 48, 40, 3, "gpt_oss_swiglu", True, False, "zipf", 5, "bfloat16", False),
    ("swiglu-e3-determ", 96, 48, 72, 3, "swiglu", True, True, "empty", 6, "bfloat16", True),
    ("swiglu-e3-ptr", 96, 48, 40, 3, "swiglu", True, True, "empty", 5, "bfloat16", False),
    ("gptoss-e5-ptr", 128, 64, 64, 5, "gpt_oss_swiglu", True, True, "zipf", 3, "bfloat16", True),
    ("swiglu-e3-clampedtail", 96, 48, 40, 3, "swiglu", True, True, "zipf", 5, "bfloat16", False),
    ("geglu-e5-ptr-clampedtail", 128, 64, 72, 5, "geglu", True, True, "empty", 9, "bfloat16", False),
    ("swiglu-e3-fp16", 96, 48, 40, 3, "swiglu", True, True, "balanced", 5, "float16", False),
    ("srelu-e3-allpad", 32, 32, 32, 3, "srelu", True, True, "balanced", 32, "bfloat16", False),
    # router probs that scale the activation but need no gradient (frozen router)
    ("swiglu-e3-frozenprobs", 96, 48, 40, 3, "swiglu", True, True, "zipf", 5, "bfloat16", False),
    # persistent grouped GEMMs (3 programs under the interpreter, each looping over many tiles)
    ("swiglu-e5-empty-persist", 128, 64, 48, 5, "swiglu", True, True, "empty", 7, "bfloat16", False),
    ("gptoss-e3-determ-persist", 96, 48, 72, 3, "gpt_oss_swiglu", True, True, "zipf", 6, "bfloat16", True),
    ("geglu-e3-ptr-persist", 80, 64, 40, 3, "geglu", True, True, "balanced", 5, "bfloat16", False),
    ("srelu-e5-persist", 100, 48, 40, 5, "srelu", True, True, "one", 0, "bfloat16", False),
    ("swiglu-e3-allpad-persist", 32, 32, 32, 3, "swiglu", True, True, "balanced", 32, "bfloat16", True),
]
GRADS = ("x", "w1", "w2", "b1", "b2", "probs")
# Relative error bounds vs FP64: BF16 keeps 8 significant bits (unit roundoff 2^-9 = 2e-3); the
# outputs are rounded a few times on the way (h, a, y; dh, grads), so a few units of it.
BOUND = {"bfloat16": 6e-3, "float16": 1e-3}


def _worker() -> None:
    """Runs in the subprocess: every case, forward and backward, vs the FP64 loop."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
    from moe_reference import expert_mlp_fp64, poison_, random_problem, rel_err

    from te_fused_moe import fused_moe_mlp
    from te_fused_moe.backends.triton import autograd as triton_autograd
    from te_fused_moe.backends.triton import grouped_gemm, wgrad

    real_wgrad_config = wgrad.INTERPRET_WGRAD_CONFIG

    real_new_buffer = triton_autograd.new_buffer
    triton_autograd.new_buffer = lambda *a, **k: poison_(real_new_buffer(*a, **k))

    results = {}
    for case_id, T, H, F, E, act, bias, probs, routing, padding, dtype, determ in CASES:
        grouped_gemm.USE_TMA_DEFAULT = "-ptr" not in case_id
        grouped_gemm.PERSISTENT_DEFAULT = "-persist" in case_id
        wgrad.INTERPRET_WGRAD_CONFIG = dataclasses.replace(real_wgrad_config, vector_tail="clampedtail" not in case_id)
        p = random_problem(T, H, F, E, activation=act, dtype=getattr(torch, dtype), bias=bias, probs=probs,
                           routing=routing, padding=padding)
        frozen = {"probs"} if "frozenprobs" in case_id else set()
        leaves = {k: (v.clone().requires_grad_(k not in frozen) if (k in GRADS and v is not None) else v)
                  for k, v in p.items()}
        y = fused_moe_mlp(leaves["x"], leaves["tokens_per_expert"], leaves["w1"], leaves["w2"], activation=act,
                          b1=leaves["b1"], b2=leaves["b2"], probs=leaves["probs"], backend="triton",
                          deterministic=determ)
        dy = torch.randn(y.shape, dtype=y.dtype)
        y.backward(dy)
        ref = expert_mlp_fp64(p["x"], p["tokens_per_expert"], p["w1"], p["w2"], act, p["b1"], p["b2"], p["probs"],
                              dy=dy)
        counts = p["tokens_per_expert"]
        routed = int(counts.sum())
        out = {"err": {"y": rel_err(y, ref["y"])}, "counts": counts.tolist()}
        for name in GRADS:
            if leaves[name] is not None and name not in frozen:
                out["err"][name] = rel_err(leaves[name].grad, ref[name])
        # exact zeros: padding rows of y/dx/dprob, weight and bias grads of experts without tokens
        zero_checks = {"y_pad": y[routed:], "dx_pad": leaves["x"].grad[routed:]}
        if probs and not frozen:
            zero_checks["dprob_pad"] = leaves["probs"].grad[routed:]
        empty = [e for e, c in enumerate(counts.tolist()) if c == 0]
        for name in ("w1", "w2", "b1", "b2"):
            if leaves[name] is not None and empty:
                zero_checks[f"d{name}_empty"] = leaves[name].grad[empty]
        out["nonzero"] = {k: int((v != 0).sum()) + int(torch.isnan(v).sum()) for k, v in zero_checks.items()}
        out["empty_experts"] = empty
        results[case_id] = out
    print("RESULTS" + json.dumps(results))


@pytest.fixture(scope="module")
def interpreter_results():
    return run_in_triton_interpreter("import test_triton_interpreter as t; t._worker()")


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_forward_and_grads_match_fp64(interpreter_results, case):
    res = interpreter_results[case[0]]
    bound = BOUND[case[10]]
    wants_dprob = case[7] and "frozenprobs" not in case[0]
    expected = {"y", "x", "w1", "w2"} | ({"b1", "b2"} if case[6] else set()) | ({"probs"} if wants_dprob else set())
    assert set(res["err"]) == expected
    for name, err in res["err"].items():
        # all-padding inputs have an all-zero reference: rel_err then returns the absolute error
        assert err <= bound, f"{case[0]}: {name} rel. error {err:.3g} > {bound} (counts {res['counts']})"


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_padding_rows_and_empty_experts_are_exact_zeros(interpreter_results, case):
    res = interpreter_results[case[0]]
    assert res["nonzero"], "no zero checks ran"
    for name, bad in res["nonzero"].items():
        assert bad == 0, f"{case[0]}: {bad} non-zero/NaN elements in {name} (empty experts {res['empty_experts']})"


def test_cases_cover_empty_experts_and_padding(interpreter_results):
    assert any(res["empty_experts"] for res in interpreter_results.values())
    assert any("dw1_empty" in res["nonzero"] for res in interpreter_results.values())


def test_persistent_cases_cover_empty_experts_padding_and_both_dprob_paths(interpreter_results):
    persist = [c for c in CASES if "-persist" in c[0]]
    assert any(interpreter_results[c[0]]["empty_experts"] for c in persist)
    assert any(c[9] > 0 for c in persist) and any(c[9] == c[1] for c in persist)  # padding, all padding
    assert {c[11] for c in persist if c[7]} == {False, True}  # dprob: atomics and ordered partials


def _persistent_kernel_worker() -> None:
    """Runs in the subprocess: the four grouped GEMMs, persistent (with and without FC1's gate/up box)
    and one program per tile with the box, vs one program per tile, on poisoned outputs. The tiles'
    math is the same, so the outputs must be bitwise equal (dprob through its ordered partials:
    atomics add in program order)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
    from moe_reference import poison_

    from te_fused_moe.backends.triton import grouped_gemm as gg

    torch.manual_seed(7)
    counts = torch.tensor([37, 0, 5, 0, 50, 11])  # empty experts, 17 padding rows
    T, H, F, E = 120, 64, 48, 6
    x = torch.randn(T, H, dtype=torch.bfloat16)
    w1 = torch.randn(E, 2 * F, H, dtype=torch.bfloat16) / 8
    w2 = torch.randn(E, H, F, dtype=torch.bfloat16) / 8
    b1 = torch.randn(E, 2 * F, dtype=torch.bfloat16)
    probs = torch.rand(T)
    dy = torch.randn(T, H, dtype=torch.bfloat16)
    act = dict(activation="swiglu", alpha=1.702, limit=7.0, gated=True)
    base = gg.INTERPRET_CONFIG
    parts = -(-F // base.block_n)

    def run(cfg):
        h, a = poison_(torch.empty(T, 2 * F, dtype=x.dtype)), poison_(torch.empty(T, F, dtype=x.dtype))
        y, dh, dx = poison_(torch.empty_like(x)), poison_(torch.empty_like(h)), poison_(torch.empty_like(x))
        dprob = poison_(torch.empty(parts, T))
        gg.fc1_forward(x, w1, counts, h, a, b1=b1, probs=probs, config=cfg, **act)
        gg.fc2_forward(a, w2, counts, y, config=cfg)
        gg.fc2_dgrad_dact(dy, w2, counts, h, dh, probs=probs, dprob=dprob, config=cfg, **act)
        gg.fc1_dgrad(dh, w1, counts, dx, config=cfg)
        return {"h": h, "a": a, "y": y, "dh": dh, "dprob_parts": dprob, "dx": dx}

    ref = run(base)
    variants = {"persistent": dict(persistent=True), "persistent-box": dict(persistent=True, gate_up_box=True),
                "box": dict(gate_up_box=True)}
    outs = {name: run(dataclasses.replace(base, **kw)) for name, kw in variants.items()}
    tiles = gg.max_m_tiles(T, E, base.block_m) * -(-H // base.block_n)  # FC2's worst-case tile count
    print("RESULTS" + json.dumps({
        "equal": {f"{v}:{k}": bool(torch.equal(out[k], ref[k])) for v, out in outs.items() for k in ref},
        "nan": {f"{v}:{k}": int(torch.isnan(out[k]).sum()) for v, out in outs.items() for k in ref},
        "programs": gg.persistent_programs(torch.device("cpu"), dataclasses.replace(base, persistent=True)),
        "fc2_tiles": tiles,
    }))


@pytest.fixture(scope="module")
def persistent_kernel_results():
    return run_in_triton_interpreter("import test_triton_interpreter as t; t._persistent_kernel_worker()")


def test_persistent_kernels_match_one_program_per_tile_bitwise(persistent_kernel_results):
    res = persistent_kernel_results
    assert res["programs"] == 3 and res["fc2_tiles"] >= 4 * res["programs"], res  # each program loops
    assert not any(res["nan"].values()), f"unwritten (NaN) elements: {res['nan']}"
    assert all(res["equal"].values()), f"persistent differs from one program per tile: {res['equal']}"


def test_persistent_programs_count():
    from te_fused_moe.backends.triton import grouped_gemm as gg

    cfg = gg.GemmConfig(persistent=True, programs_per_sm=2)
    assert gg.persistent_programs(torch.device("cpu"), cfg) == gg.INTERPRET_PROGRAMS
    with pytest.raises(ValueError, match="programs_per_sm"):
        gg.persistent_programs(torch.device("cpu"), dataclasses.replace(cfg, programs_per_sm=0))
    # a bare GemmConfig is one program per tile; the backend's default configs are persistent
    assert gg.GemmConfig().persistent is False and gg.PERSISTENT_DEFAULT is True
    assert gg.default_config("fc1", 256, 256).persistent is True


def test_schedule_maps_tiles_to_groups():
    from te_fused_moe.backends.triton.schedule import build_schedule, max_m_tiles, schedule_table

    counts = torch.tensor([5, 0, 17, 3], dtype=torch.int64)
    flat = build_schedule(counts, num_rows=40, block_m=8)
    assert flat.dtype == torch.int32 and tuple(flat.shape) == (4 * 5 + max_m_tiles(40, 4, 8),)
    sched = schedule_table(flat, 4)
    # groups: 4 experts + padding of 40 - 25 = 15 rows
    assert sched[2].tolist() == [0, 5, 5, 22, 25]  # row_start
    assert sched[3].tolist() == [5, 5, 22, 25, 40]  # row_end
    assert sched[1].tolist() == [1, 1, 4, 5, 7]  # tile_end: cdiv(rows, 8) summed
    assert sched[0].tolist() == [0, 1, 1, 4, 5]
    assert int(sched[1, -1]) <= max_m_tiles(40, 4, 8)
    # tile -> group map: tile 0 is expert 0, tiles 1-3 expert 2, tile 4 expert 3, 5-6 padding, then past the end
    assert flat[20:].tolist() == [0, 2, 2, 2, 3, 4, 4] + [5] * (max_m_tiles(40, 4, 8) - 7)
    # counts summing past T are clamped: no row range leaves [0, T]
    bad = schedule_table(build_schedule(torch.tensor([30, 30]), num_rows=40, block_m=8), 2)
    assert int(bad[3].max()) <= 40 and int(bad[2].min()) >= 0


def test_availability_and_errors_on_cpu(monkeypatch):
    from te_fused_moe import fused_moe_mlp
    from te_fused_moe.activations import ActivationConfig
    from te_fused_moe.backends import get_backend
    from te_fused_moe.recipes import as_recipe

    backend = get_backend("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    verdict = backend.availability(torch.device("cpu"))
    assert not verdict and "needs a CUDA GPU" in verdict.reason
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backend.availability(torch.device("cpu"))
    bad_dtype = backend.supports(ActivationConfig("swiglu"), as_recipe(None), torch.float32)
    assert not bad_dtype and "bfloat16 or float16" in bad_dtype.reason
    assert backend.supports(ActivationConfig("geglu"), as_recipe("bf16"), torch.bfloat16)
    assert backend.supports(ActivationConfig("swiglu"), as_recipe("mxfp8"), torch.bfloat16)
    assert backend.supports(ActivationConfig("swiglu"), as_recipe("nvfp4"), torch.bfloat16)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    w1 = torch.randn(2, 16, 16, dtype=torch.bfloat16)
    w2 = torch.randn(2, 16, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="backend='triton' needs a CUDA GPU"):
        fused_moe_mlp(x, torch.tensor([4, 4]), w1, w2, backend="triton")



def _memory_worker() -> None:
    """Runs in the subprocess: when does backward let go of the forward's ``h`` and ``a``, and does a
    second backward through the same graph fail clearly?"""
    import weakref

    assert os.environ.get("TRITON_INTERPRET") == "1"
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
    from moe_reference import random_problem

    from te_fused_moe import fused_moe_mlp
    from te_fused_moe.backends.triton import autograd as triton_autograd

    T, H, F, E = 64, 32, 48, 3
    refs = {}
    real_new_buffer = triton_autograd.new_buffer

    def tracking_new_buffer(shape, like, dtype=None):
        buf = real_new_buffer(shape, like, dtype)
        if tuple(shape) == (T, 2 * F):
            refs.setdefault("h", weakref.ref(buf))
        elif tuple(shape) == (T, F):
            refs.setdefault("a", weakref.ref(buf))
        return buf

    alive_at = {}

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            alive_at[name] = {k: r() is not None for k, r in refs.items()}
            return fn(*args, **kwargs)
        return wrapped

    triton_autograd.new_buffer = tracking_new_buffer
    gg = triton_autograd.gg
    gg.fc2_dgrad_dact = spy("fc2_dgrad_dact", gg.fc2_dgrad_dact)
    gg.fc1_dgrad = spy("fc1_dgrad", gg.fc1_dgrad)
    p = random_problem(T, H, F, E, activation="swiglu", dtype=torch.bfloat16, bias=True, probs=True,
                       routing="zipf", padding=3)
    leaves = {k: (v.clone().requires_grad_(True) if k in GRADS and v is not None else v) for k, v in p.items()}
    y = fused_moe_mlp(leaves["x"], leaves["tokens_per_expert"], leaves["w1"], leaves["w2"], activation="swiglu",
                      b1=leaves["b1"], b2=leaves["b2"], probs=leaves["probs"], backend="triton")
    dy = torch.randn(y.shape, dtype=y.dtype)
    y.backward(dy, retain_graph=True)
    after = {k: r() is not None for k, r in refs.items()}
    try:
        y.backward(dy)
        second = "no error"
    except RuntimeError as exc:
        second = str(exc)
    print("RESULTS" + json.dumps({"alive_at": alive_at, "after": after, "second_backward": second}))


@pytest.fixture(scope="module")
def memory_results():
    return run_in_triton_interpreter("import test_triton_interpreter as t; t._memory_worker()")


def test_backward_frees_h_and_a_after_their_last_use(memory_results):
    # a's last reader is FC2's wgrad (run first), h's is the dGLU dgrad: neither may live on through
    # FC1's dgrad and wgrad, or the peak exceeds the unfused path's by h + a.
    alive = memory_results["alive_at"]
    assert alive["fc2_dgrad_dact"] == {"h": True, "a": False}
    assert alive["fc1_dgrad"] == {"h": False, "a": False}
    assert memory_results["after"] == {"h": False, "a": False}


def test_second_backward_through_the_same_graph_fails_clearly(memory_results):
    assert "retain_graph=True" in memory_results["second_backward"]
    assert "not supported" in memory_results["second_backward"]
