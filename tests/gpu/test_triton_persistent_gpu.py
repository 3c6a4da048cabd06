"""Persistent grouped GEMMs (``GemmConfig.persistent``) on the GPU: accuracy vs FP64 through the whole
MLP, bitwise equality with the one-program-per-tile kernels, CUDA-graph replay with changing routing.

Run on the device machine: ``pytest -m gpu tests/gpu/test_triton_persistent_gpu.py``.
"""

import dataclasses

import pytest
import torch

from moe_reference import capture_cuda_graph, expert_mlp_fp64, make_counts, poison_, random_problem, rel_err

from te_fused_moe import fused_moe_mlp
from te_fused_moe.backends.triton import grouped_gemm as gg

pytestmark = pytest.mark.gpu

GRADS = ("x", "w1", "w2", "b1", "b2", "probs")
# BF16 keeps 8 significant bits; outputs are rounded a few times on the way (h, a, y / dh, grads).
BF16_BOUND = 1e-2

# (T, H, F, E, activation, bias, probs, routing, padding, deterministic)
MLP_CASES = [
    (4096, 256, 128, 8, "swiglu", True, True, "zipf", 17, False),
    (4096, 256, 128, 8, "geglu", True, True, "zipf", 17, True),
    (8192, 256, 192, 32, "gpt_oss_swiglu", True, False, "empty", 100, False),
    (16384, 512, 256, 128, "swiglu", False, True, "zipf", 0, True),
    (1000, 200, 72, 8, "swiglu", True, True, "empty", 13, False),  # H, F not multiples of the blocks
    (3000, 384, 256, 32, "srelu", False, True, "one", 5, False),
    (512, 256, 128, 4, "swiglu", True, True, "balanced", 512, True),  # all padding
]


@pytest.fixture
def persistent_default(monkeypatch):
    monkeypatch.setattr(gg, "PERSISTENT_DEFAULT", True)


def _leaves(problem):
    return {k: (v.detach().clone().requires_grad_(True) if (k in GRADS and v is not None) else v)
            for k, v in problem.items()}


@pytest.mark.parametrize("case", MLP_CASES, ids=[f"{c[4]}-T{c[0]}-E{c[3]}-{c[7]}-pad{c[8]}" + "-determ" * c[9]
                                                 for c in MLP_CASES])
def test_persistent_mlp_matches_fp64_without_host_syncs(persistent_default, case):
    T, H, F, E, act, bias, probs, routing, padding, determ = case
    problem = random_problem(T, H, F, E, activation=act, dtype=torch.bfloat16, device="cuda", bias=bias,
                             probs=probs, routing=routing, padding=padding)
    leaves = _leaves(problem)
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = fused_moe_mlp(leaves["x"], leaves["tokens_per_expert"], leaves["w1"], leaves["w2"], activation=act,
                          b1=leaves["b1"], b2=leaves["b2"], probs=leaves["probs"], backend="triton",
                          deterministic=determ)
        y.backward(dy)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = expert_mlp_fp64(problem["x"], problem["tokens_per_expert"], problem["w1"], problem["w2"], act,
                          problem["b1"], problem["b2"], problem["probs"], dy=dy)
    errors = {"y": rel_err(y, ref["y"])}
    errors.update({n: rel_err(leaves[n].grad, ref[n]) for n in GRADS if leaves[n] is not None})
    bad = {k: v for k, v in errors.items() if not v <= BF16_BOUND}
    assert not bad, f"rel. errors above {BF16_BOUND}: {bad} (all: {errors})"
    counts = problem["tokens_per_expert"]
    routed = int(counts.sum())
    assert torch.count_nonzero(y[routed:]) == 0 and torch.count_nonzero(leaves["x"].grad[routed:]) == 0
    empty = (counts == 0).nonzero().flatten()
    if len(empty):
        assert torch.count_nonzero(leaves["w1"].grad[empty]) == 0


# (T, H, F, E, routing, padding, use_tma): Qwen3-30B-A3B's H/F with fewer tokens, GPT-OSS's odd 2880
# (columns that are not whole tiles), pointer loads.
KERNEL_CASES = [
    (8192, 2048, 768, 32, "zipf", 100, True),
    (4096, 2880, 2880, 8, "empty", 37, True),
    (3000, 512, 200, 16, "balanced", 0, False),
]


# config overrides vs the one-program-per-tile default: persistent (flattened, FC1 through the gate/up box,
# as PERSISTENT_DEFAULT sets it), persistent with FC1's two accumulators, not flattened, box alone
VARIANTS = {"persistent": dict(persistent=True, gate_up_box=True), "persistent-2acc": dict(persistent=True),
            "persistent-noflat": dict(persistent=True, flatten=False, gate_up_box=True),
            "gate-up-box": dict(gate_up_box=True)}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("case", KERNEL_CASES, ids=[f"T{c[0]}-H{c[1]}-F{c[2]}-E{c[3]}-{c[4]}" + ("" if c[6] else "-ptr")
                                                    for c in KERNEL_CASES])
def test_persistent_kernels_equal_one_program_per_tile_bitwise(case, variant):
    """Same tiles, same K order, same epilogue: FC1+GLU, FC2, FC2 dgrad+dGLU (dprob through its ordered
    per-N-tile partials; atomics add in a run-dependent order) and FC1 dgrad must agree bit for bit,
    on NaN-poisoned outputs (an element no program writes stays NaN and breaks the equality). The
    gate/up box computes gate and up in one 2 * BN wide wgmma instead of two BN wide ones: the same
    products summed in the same K order per element."""
    T, H, F, E, routing, padding, use_tma = case
    g = torch.Generator().manual_seed(3)
    counts = make_counts(T, E, routing, generator=g, padding=padding).cuda()
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    w1 = torch.randn(E, 2 * F, H, device="cuda", dtype=torch.bfloat16) / H ** 0.5
    w2 = torch.randn(E, H, F, device="cuda", dtype=torch.bfloat16) / F ** 0.5
    b1 = torch.randn(E, 2 * F, device="cuda", dtype=torch.bfloat16)
    probs = torch.rand(T, device="cuda")
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    act = dict(activation="swiglu", alpha=1.702, limit=7.0, gated=True)

    def configs(**overrides):
        return {kind: dataclasses.replace(gg.default_config(kind, n, k), use_tma=use_tma, **overrides)
                for kind, n, k in (("fc1", F, H), ("fc2", H, F), ("dact", F, H), ("dgrad", H, 2 * F))}

    def run(cfg):
        new = lambda *shape, dtype=torch.bfloat16: poison_(torch.empty(*shape, device="cuda", dtype=dtype))
        h, a, y, dh, dx = new(T, 2 * F), new(T, F), new(T, H), new(T, 2 * F), new(T, H)
        dprob = new(-(-F // cfg["dact"].block_n), T, dtype=torch.float32)
        gg.fc1_forward(x, w1, counts, h, a, b1=b1, probs=probs, config=cfg["fc1"], **act)
        gg.fc2_forward(a, w2, counts, y, config=cfg["fc2"])
        gg.fc2_dgrad_dact(dy, w2, counts, h, dh, probs=probs, dprob=dprob, config=cfg["dact"], **act)
        gg.fc1_dgrad(dh, w1, counts, dx, config=cfg["dgrad"])
        return {"h": h, "a": a, "y": y, "dh": dh, "dprob_parts": dprob, "dx": dx}

    ref, out = run(configs()), run(configs(**VARIANTS[variant]))
    assert not any(torch.isnan(t).any() for t in out.values()), "persistent kernels left elements unwritten"
    differ = {k: int((out[k] != ref[k]).sum()) for k in ref if not torch.equal(out[k], ref[k])}
    assert not differ, f"{variant} differs from one program per tile (elements): {differ}"


def test_persistent_programs_are_one_per_sm():
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    assert gg.persistent_programs(torch.device("cuda"), gg.GemmConfig(persistent=True)) == sms
    assert gg.persistent_programs(torch.device("cuda"), gg.GemmConfig(persistent=True, programs_per_sm=2)) == 2 * sms


def test_persistent_cuda_graph_replay_with_changing_routing(persistent_default):
    T, H, F, E, act = 4096, 512, 256, 16, "swiglu"
    problem = random_problem(T, H, F, E, activation=act, dtype=torch.bfloat16, device="cuda", bias=True, probs=True)
    leaves = _leaves(problem)
    names = [n for n in GRADS if leaves[n] is not None]
    static_counts = problem["tokens_per_expert"].clone()
    static_dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)

    def step():
        y = fused_moe_mlp(leaves["x"], static_counts, leaves["w1"], leaves["w2"], activation=act, b1=leaves["b1"],
                          b2=leaves["b2"], probs=leaves["probs"], backend="triton", deterministic=True)
        return (y,) + torch.autograd.grad(y, [leaves[n] for n in names], static_dy)

    graph, static_out = capture_cuda_graph(step)
    g = torch.Generator().manual_seed(11)
    for kind, padding in (("balanced", 300), ("empty", 0), ("one", 9)):
        counts = make_counts(T, E, kind, generator=g, padding=padding)
        static_counts.copy_(counts)
        static_dy.normal_()
        graph.replay()
        torch.cuda.synchronize()
        ref = expert_mlp_fp64(problem["x"], counts, problem["w1"], problem["w2"], act, problem["b1"], problem["b2"],
                              problem["probs"], dy=static_dy)
        errors = {"y": rel_err(static_out[0], ref["y"])}
        errors.update({n: rel_err(out, ref[n]) for n, out in zip(names, static_out[1:])})
        bad = {k: v for k, v in errors.items() if not v <= BF16_BOUND}
        assert not bad, f"{kind}: graph replay vs FP64: {bad}"
