"""Ground truth for tests: an FP64 per-expert loop, random routings and output poisoning.

Independent of the library's reference backend on purpose: it uses plain autograd on FP64 copies,
with the activation written out here again from its definition.
"""

from __future__ import annotations

import math
from typing import Dict, Optional

import torch

GPT_OSS_ALPHA, GPT_OSS_LIMIT = 1.702, 7.0
GATED = {"swiglu", "geglu", "gpt_oss_swiglu"}


def activation_fp64(name: str, h: torch.Tensor, alpha=GPT_OSS_ALPHA, limit=GPT_OSS_LIMIT) -> torch.Tensor:
    if name in GATED:
        g, u = h.chunk(2, dim=-1)
        if name == "swiglu":
            return torch.nn.functional.silu(g) * u
        if name == "geglu":
            return torch.nn.functional.gelu(g) * u
        g = torch.clamp(g, max=limit)
        u = torch.clamp(u, -limit, limit)
        return g * torch.sigmoid(alpha * g) * (u + 1)
    if name == "srelu":
        return torch.relu(h) ** 2
    if name == "silu":
        return torch.nn.functional.silu(h)
    if name == "gelu":
        return torch.nn.functional.gelu(h)
    raise ValueError(name)


def expert_mlp_fp64(x, tokens_per_expert, w1, w2, activation="swiglu", b1=None, b2=None, probs=None, alpha=GPT_OSS_ALPHA,
                    limit=GPT_OSS_LIMIT, dy=None) -> Dict[str, Optional[torch.Tensor]]:
    """FP64 forward (and backward when ``dy`` is given) by a Python loop over experts.

    Returns a dict with ``y`` and, with ``dy``, the gradients ``x, w1, w2, b1, b2, probs``; with ``dy``
    and ``probs`` also ``probs_scale``, each row's sum of ``|da * act(h)|`` (what the probs gradient's
    rounding error scales with: that gradient is a sum over F terms that may cancel).
    """
    leaves = {}
    probs_scale = []
    for name, t in (("x", x), ("w1", w1), ("w2", w2), ("b1", b1), ("b2", b2), ("probs", probs)):
        leaves[name] = None if t is None else t.detach().double().cpu().requires_grad_(dy is not None)
    counts_list = [int(c) for c in tokens_per_expert.cpu().tolist()]
    rows = []
    start = 0
    for e, n in enumerate(counts_list):
        xe = leaves["x"][start:start + n]
        h = xe @ leaves["w1"][e].T
        if leaves["b1"] is not None:
            h = h + leaves["b1"][e]
        a = activation_fp64(activation, h, alpha, limit)
        if leaves["probs"] is not None:
            if dy is not None:
                da = dy[start:start + n].detach().double().cpu() @ leaves["w2"][e].detach()
                probs_scale.append((da.abs() * a.detach().abs()).sum(1))
            a = a * leaves["probs"][start:start + n, None]
        ye = a @ leaves["w2"][e].T
        if leaves["b2"] is not None:
            ye = ye + leaves["b2"][e]
        rows.append(ye)
        start += n
    pad = leaves["x"].shape[0] - start
    rows.append(leaves["x"].new_zeros(pad, leaves["x"].shape[1]) + 0 * leaves["x"][start:].sum())
    y = torch.cat(rows, dim=0)
    out = {"y": y.detach()}
    if dy is not None:
        y.backward(dy.detach().double().cpu())
        for name, t in leaves.items():
            out[name] = None if t is None else (t.grad if t.grad is not None else torch.zeros_like(t))
        if probs is not None:
            out["probs_scale"] = torch.cat(probs_scale + [leaves["x"].new_zeros(pad)])
    return out


def rel_err_to(out: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor) -> float:
    """||out - ref|| / ||scale|| in FP64 (||out - ref|| where ||scale|| is 0): the error relative to the
    magnitudes a result was summed from (a sum that cancels has a small ||ref|| but the rounding error
    of its terms)."""
    num = (out.detach().double().cpu() - ref.detach().double().cpu()).norm().item()
    denom = scale.detach().double().cpu().norm().item()
    return num if denom == 0.0 else num / denom


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in FP64 (NaN anywhere gives NaN, which fails every bound)."""
    return rel_err_to(out, ref, ref)


def make_counts(num_tokens: int, num_experts: int, kind: str = "balanced", generator=None,
                padding: int = 0) -> torch.Tensor:
    """Tokens per expert summing to ``num_tokens - padding``.

    kind: ``balanced`` (random multinomial), ``zipf`` (skewed, s=1.2), ``empty`` (about half the
    experts get none), ``one`` (all tokens on one random expert).
    """
    g = generator
    routed = num_tokens - padding
    if routed < 0:
        raise ValueError("padding larger than num_tokens")
    if kind == "one":
        counts = torch.zeros(num_experts, dtype=torch.int64)
        counts[int(torch.randint(num_experts, (1,), generator=g))] = routed
        return counts
    if kind == "balanced":
        weights = torch.ones(num_experts)
    elif kind == "zipf":
        ranks = torch.randperm(num_experts, generator=g).double() + 1
        weights = (1.0 / ranks ** 1.2).float()
    elif kind == "empty":
        weights = (torch.rand(num_experts, generator=g) < 0.5).float()
        if weights.sum() == 0:
            weights[0] = 1
    else:
        raise ValueError(kind)
    if routed == 0:
        return torch.zeros(num_experts, dtype=torch.int64)
    picks = torch.multinomial(weights, routed, replacement=True, generator=g)
    return torch.bincount(picks, minlength=num_experts).to(torch.int64)


def random_problem(T, H, F, E, activation="swiglu", dtype=torch.float32, device="cpu", bias=False, probs=False,
                   routing="balanced", padding=0, seed=None, scale=1.0):
    """Random (never zero) inputs with weights scaled like a real init (std ~ 1/sqrt(fan_in))."""
    g = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(1 << 30, (1,))))
    n1 = 2 * F if activation in GATED else F
    x = torch.randn(T, H, generator=g) * scale
    w1 = torch.randn(E, n1, H, generator=g) / math.sqrt(H)
    w2 = torch.randn(E, H, F, generator=g) / math.sqrt(F)
    b1 = torch.randn(E, n1, generator=g) * 0.1 if bias else None
    b2 = torch.randn(E, H, generator=g) * 0.1 if bias else None
    p = torch.rand(T, generator=g) + 0.05 if probs else None
    counts = make_counts(T, E, routing, generator=g, padding=padding)
    to = lambda t: None if t is None else t.to(device=device, dtype=dtype).contiguous()
    return dict(x=to(x), tokens_per_expert=counts.to(device), w1=to(w1), w2=to(w2), b1=to(b1), b2=to(b2),
                probs=None if p is None else p.to(device=device, dtype=torch.float32))


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill a buffer with NaN so that any element a kernel fails to write shows up."""
    if t.is_floating_point():
        return t.fill_(float("nan"))
    return t.fill_(-1)


def capture_cuda_graph(step, warmup: int = 2):
    """Run ``step`` ``warmup`` times on a side stream (so every kernel is compiled and every cache
    filled before capture), then capture one call. Returns ``(graph, outputs of the captured call)``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs


def run_in_triton_interpreter(call: str, tag: str = "RESULTS", extra_env=None, timeout: int = 600):
    """Run the Python statement ``call`` (e.g. ``"import test_x as t; t._worker()"``) in a fresh
    process with ``TRITON_INTERPRET=1`` and return the JSON it printed after ``tag``.

    A fresh process because Triton reads the flag when it first decorates the kernels: once any test
    has imported the Triton backend, the flag can no longer be turned on in this process. The
    repository and ``tests/`` are importable there."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", **(extra_env or {}))
    env["PYTHONPATH"] = os.pathsep.join([root, os.path.join(root, "tests"), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", call], cwd=root, env=env, capture_output=True, text=True,
                          timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(tag)]
    assert proc.returncode == 0 and lines, (
        f"interpreter worker `{call}` failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    return json.loads(lines[-1][len(tag):])


def graph_replay_errors(recipe, grads=("x", "w1", "w2", "b1", "b2", "probs"), T=4096, H=512, F=256, E=8,
                        activation="swiglu") -> dict:
    """``fused_moe_mlp(recipe=..., backend='triton')`` forward+backward captured once in a CUDA graph,
    then replayed with new routings written into the same counts tensor (padding rows, empty experts,
    one expert, and a weight update between replays, which the graph must see). Returns, per routing,
    the relative error of y and of every gradient vs the reference backend's emulation of the recipe."""
    from te_fused_moe import fused_moe_mlp

    problem = random_problem(T, H, F, E, activation=activation, dtype=torch.bfloat16, device="cuda", bias=True,
                             probs=True)
    leaves = {k: (v.detach().clone().requires_grad_(True) if (k in grads and v is not None) else v)
              for k, v in problem.items()}
    names = [n for n in grads if leaves[n] is not None]
    static_counts = problem["tokens_per_expert"].clone()
    static_dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)

    def run(p, counts, backend):
        return fused_moe_mlp(p["x"], counts, p["w1"], p["w2"], activation=activation, recipe=recipe, b1=p["b1"],
                             b2=p["b2"], probs=p["probs"], backend=backend)

    def step():
        y = run(leaves, static_counts, "triton")
        return (y,) + torch.autograd.grad(y, [leaves[n] for n in names], static_dy)

    graph, static_out = capture_cuda_graph(step)
    generator = torch.Generator().manual_seed(7)
    routings = [
        ("balanced-padded", make_counts(T, E, "balanced", generator=generator, padding=300), False),
        ("empty-experts", make_counts(T, E, "empty", generator=generator), False),
        ("one-expert", make_counts(T, E, "one", generator=generator), False),
        ("after-weight-update", make_counts(T, E, "zipf", generator=generator), True),
    ]
    out = {}
    for label, counts, update in routings:
        if update:  # an optimizer step between replays
            with torch.no_grad():
                leaves["w1"].mul_(1.5)
                leaves["w2"].add_(0.01)
        static_counts.copy_(counts)
        static_dy.normal_()
        graph.replay()
        torch.cuda.synchronize()
        ref = {k: (v.detach().clone().requires_grad_(True) if (k in grads and v is not None) else v)
               for k, v in leaves.items()}
        ref_y = run(ref, counts.cuda(), "reference")
        ref_grads = torch.autograd.grad(ref_y, [ref[n] for n in names], static_dy)
        errors = {"y": rel_err(static_out[0], ref_y)}
        errors.update({n: rel_err(g, r) for n, g, r in zip(names, static_out[1:], ref_grads)})
        out[label] = errors
    return out
