"""Triton backend on the GPU: accuracy vs FP64, no host syncs, CUDA-graph capture with changing routing.

Run on the device machine: ``pytest -m gpu tests/gpu/test_triton_gpu.py``.
"""

import pytest
import torch

from moe_reference import capture_cuda_graph, expert_mlp_fp64, make_counts, random_problem, rel_err

from te_fused_moe import fused_moe_mlp

pytestmark = pytest.mark.gpu

GRADS = ("x", "w1", "w2", "b1", "b2", "probs")
# BF16 keeps 8 significant bits; outputs are rounded a few times on the way (h, a, y / dh, grads).
BF16_BOUND = 1e-2

# (T, H, F, E, activation, bias, probs, routing, padding)
CASES = [(4096, 256, 128, 8, act, True, True, "zipf", 17)
         for act in ("swiglu", "geglu", "gpt_oss_swiglu", "srelu", "silu", "gelu")] + [
    (2048, 512, 256, 1, "swiglu", False, False, "balanced", 0),
    (8192, 256, 192, 32, "gpt_oss_swiglu", True, False, "empty", 100),
    (16384, 256, 128, 128, "swiglu", False, True, "zipf", 0),
    (65536, 128, 128, 128, "geglu", True, True, "balanced", 1000),
    (1000, 200, 72, 8, "swiglu", True, True, "empty", 13),  # H, F not multiples of the K block
    (3000, 384, 256, 32, "srelu", False, False, "one", 5),
]


def _leaves(problem):
    return {k: (v.detach().clone().requires_grad_(True) if (k in GRADS and v is not None) else v)
            for k, v in problem.items()}


def _run(leaves, activation, dy, **kw):
    y = fused_moe_mlp(leaves["x"], leaves["tokens_per_expert"], leaves["w1"], leaves["w2"], activation=activation,
                      b1=leaves["b1"], b2=leaves["b2"], probs=leaves["probs"], **kw)
    y.backward(dy)
    return y


@pytest.mark.parametrize("case", CASES, ids=[f"{c[4]}-T{c[0]}-E{c[3]}-{c[7]}" + ("-bias" if c[5] else "") +
                                             ("-probs" if c[6] else "") for c in CASES])
def test_matches_fp64_without_host_syncs(case):
    T, H, F, E, act, bias, probs, routing, padding = case
    problem = random_problem(T, H, F, E, activation=act, dtype=torch.bfloat16, device="cuda", bias=bias,
                             probs=probs, routing=routing, padding=padding)
    leaves = _leaves(problem)
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = _run(leaves, act, dy, backend="triton")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = expert_mlp_fp64(problem["x"], problem["tokens_per_expert"], problem["w1"], problem["w2"], act,
                          problem["b1"], problem["b2"], problem["probs"], dy=dy)
    errors = {"y": rel_err(y, ref["y"])}
    for name in GRADS:
        if leaves[name] is not None:
            errors[name] = rel_err(leaves[name].grad, ref[name])
    bad = {k: v for k, v in errors.items() if not v <= BF16_BOUND}
    assert not bad, f"rel. errors above {BF16_BOUND}: {bad} (all: {errors})"
    routed = int(problem["tokens_per_expert"].sum())
    assert torch.count_nonzero(y[routed:]) == 0 and torch.count_nonzero(leaves["x"].grad[routed:]) == 0


def test_cuda_graph_replay_with_changing_routing():
    T, H, F, E, act = 4096, 512, 256, 8, "swiglu"
    problem = random_problem(T, H, F, E, activation=act, dtype=torch.bfloat16, device="cuda", bias=True, probs=True)
    leaves = _leaves(problem)
    names = [n for n in GRADS if leaves[n] is not None]
    static_counts = problem["tokens_per_expert"].clone()
    static_dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)

    def step():
        y = fused_moe_mlp(leaves["x"], static_counts, leaves["w1"], leaves["w2"], activation=act, b1=leaves["b1"],
                          b2=leaves["b2"], probs=leaves["probs"], backend="triton")
        return (y,) + torch.autograd.grad(y, [leaves[n] for n in names], static_dy)

    graph, static_out = capture_cuda_graph(step)

    generator = torch.Generator().manual_seed(7)
    routings = {
        "balanced-padded": make_counts(T, E, "balanced", generator=generator, padding=300),
        "empty-experts": make_counts(T, E, "empty", generator=generator),
        "one-expert": make_counts(T, E, "one", generator=generator),
    }
    assert (routings["empty-experts"] == 0).any()
    for label, counts in routings.items():
        static_counts.copy_(counts)
        static_dy.normal_()
        graph.replay()
        torch.cuda.synchronize()
        ref_leaves = _leaves({**problem, "tokens_per_expert": counts.cuda()})
        ref_y = fused_moe_mlp(ref_leaves["x"], ref_leaves["tokens_per_expert"], ref_leaves["w1"], ref_leaves["w2"],
                              activation=act, b1=ref_leaves["b1"], b2=ref_leaves["b2"], probs=ref_leaves["probs"],
                              backend="reference")
        ref_grads = torch.autograd.grad(ref_y, [ref_leaves[n] for n in names], static_dy)
        errors = {"y": rel_err(static_out[0], ref_y)}
        errors.update({n: rel_err(g, r) for n, g, r in zip(names, static_out[1:], ref_grads)})
        bad = {k: v for k, v in errors.items() if not v <= BF16_BOUND}
        assert not bad, f"{label}: graph replay differs from the reference backend: {bad}"


def test_backend_reports_hopper():
    from te_fused_moe.backends import get_backend

    verdict = get_backend("triton").availability(torch.device("cuda"))
    major, _ = torch.cuda.get_device_capability()
    assert bool(verdict) == (major >= 9), verdict.reason


# (T, N, K, E, routing, padding): uneven routings so most experts end in a partial row chunk;
# N and K not multiples of the tile (200: vectorised columns that wrap; 72: neither) as well as even.
WGRAD_CASES = [(8192, 512, 256, 32, "zipf", 37), (4096, 200, 7168, 8, "empty", 5),
               (3000, 72, 384, 16, "balanced", 0), (20000, 1536, 2048, 128, "zipf", 11)]


@pytest.mark.parametrize("vector_tail", [False, True], ids=["clamped-tail", "vector-tail"])
@pytest.mark.parametrize("case", WGRAD_CASES, ids=[f"T{c[0]}-N{c[1]}-K{c[2]}-E{c[3]}-{c[4]}" for c in WGRAD_CASES])
def test_wgrad_kernel_matches_fp64_and_repeats_bitwise(case, vector_tail):
    """The wgrad kernel alone, both ways of loading an expert's last partial row chunk: every
    element written (NaN-poisoned output), FP64-accurate, and bitwise equal on a second run."""
    from moe_reference import poison_
    from te_fused_moe.backends.triton.schedule import build_schedule
    from te_fused_moe.backends.triton.wgrad import WgradConfig, grouped_wgrad

    T, N, K, E, routing, padding = case
    counts = make_counts(T, E, routing, padding=padding).cuda()
    g = torch.randn(T, N, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    config = WgradConfig(vector_tail=vector_tail)
    schedule = build_schedule(counts, T, 128)
    runs = []
    for _ in range(2):
        dw = poison_(torch.empty(E, N, K, device="cuda", dtype=torch.bfloat16))
        db = poison_(torch.empty(E, N, device="cuda", dtype=torch.bfloat16))
        grouped_wgrad(g, x, schedule, dw, db, config=config)
        runs.append((dw, db))
    ends = torch.cumsum(counts.cpu(), 0).tolist()
    starts = [0] + ends[:-1]
    ref_dw = torch.stack([g[s:e].double().T @ x[s:e].double() for s, e in zip(starts, ends)])
    ref_db = torch.stack([g[s:e].double().sum(0) for s, e in zip(starts, ends)])
    dw, db = runs[0]
    assert rel_err(dw, ref_dw) <= BF16_BOUND and rel_err(db, ref_db) <= BF16_BOUND
    empty = (counts == 0).nonzero().flatten()
    assert torch.count_nonzero(dw[empty]) == 0 and torch.count_nonzero(db[empty]) == 0
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
