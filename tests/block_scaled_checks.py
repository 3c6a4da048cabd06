"""Checks shared by the block-scaled recipes' Triton tests (FP8 block, MXFP8, NVFP4; interpreter and
GPU): the whole MLP against the reference backend's emulation of the same recipe, forward + backward
on the same random problem, with every kernel buffer poisoned if asked; no host syncs after warm-up."""

from __future__ import annotations

import contextlib

import torch

GRADS = ("x", "w1", "w2", "b1", "b2", "probs")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def poisoned(t: torch.Tensor) -> torch.Tensor:
    """``t`` filled so that an element no kernel writes shows up: NaN (FP8: the NaN code 0x7F, written
    through a byte view; uint8 codes and scales: 0xFF, E8M0's NaN)."""
    if t.dtype in FP8_DTYPES:
        t.view(torch.uint8).fill_(0x7F)
        return t
    return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(0xFF)


def poison_alloc(*args, **kwargs) -> torch.Tensor:
    """``torch.empty`` poisoned: the kernels' and quantizers' ``alloc``."""
    return poisoned(torch.empty(*args, **kwargs))


def far_from_fp64(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, shift=None) -> int:
    """Elements of a GEMM's ``out`` (16-bit) farther from the FP64 ``a @ b`` (``+ shift``, a bias row) than
    ``2^-8 |exact|`` (the output's rounding) ``+ 2^-12 (|a| @ |b|)`` (FP32 sums; on the GPU the FP8 wgmma's
    reduced-precision accumulation inside one 128-block)."""
    a, b = a.double(), b.double()
    exact = a @ b if shift is None else a @ b + shift.double()
    return int(((out.cpu().double() - exact).abs() > 2.0**-8 * exact.abs() + 2.0**-12 * (a.abs() @ b.abs())).sum())


def unwritten(t: torch.Tensor) -> int:
    """Elements of ``t`` still holding :func:`poisoned`'s value."""
    if t.element_size() == 1:
        return int((t.view(torch.uint8) == (0xFF if t.dtype == torch.uint8 else 0x7F)).sum())
    return int(torch.isnan(t).sum())


def compare_with_reference(p, recipe, activation, dy, frozen=(), alloc=torch.empty, h_fp32=True, gemm=None,
                           use_tma=True, triton_context=None) -> dict:
    """Runs problem ``p`` (``moe_reference.random_problem``) through ``backend='triton'`` and
    ``backend='reference'`` with ``recipe``; ``frozen`` inputs get no gradient. Kernel buffers come
    from ``alloc`` (poisoning); ``h`` is saved in FP32 if ``h_fp32`` (as the reference keeps it);
    ``gemm.USE_TMA_DEFAULT`` is set to ``use_tma``; ``triton_context`` (a context-manager factory)
    wraps the Triton call only. Returns per output: relative error vs the reference (``err``), the
    share of elements off by more than 1e-3 of the reference's max (``far``), NaN count (``nan``), the
    error vs the FP64 fake-quantized truth (``fp64``), and nonzero counts where the outputs must be
    zero (padding rows, empty experts: ``nonzero``)."""
    from fake_quant_reference import quantized_expert_mlp_fp64
    from moe_reference import rel_err

    from te_fused_moe import fused_moe_mlp
    from te_fused_moe.backends.triton import block_scaled

    block_scaled.H_DTYPE = torch.float32 if h_fp32 else None
    block_scaled.ALLOC = alloc
    gemm.USE_TMA_DEFAULT = use_tma
    outs = {}
    try:
        for backend in ("triton", "reference"):
            leaves = {k: (p[k].clone().requires_grad_(k not in frozen) if (k in GRADS and p[k] is not None) else p[k])
                      for k in p}
            ctx = triton_context() if (triton_context is not None and backend == "triton") else contextlib.nullcontext()
            with ctx:
                y = fused_moe_mlp(leaves["x"], leaves["tokens_per_expert"], leaves["w1"], leaves["w2"],
                                  activation=activation, recipe=recipe, b1=leaves["b1"], b2=leaves["b2"],
                                  probs=leaves["probs"], backend=backend)
                y.backward(dy)
            outs[backend] = {"y": y.detach()}
            for k in GRADS:
                if leaves[k] is not None and k not in frozen:
                    outs[backend][k] = leaves[k].grad
    finally:
        block_scaled.H_DTYPE, block_scaled.ALLOC, gemm.USE_TMA_DEFAULT = None, torch.empty, True
    res = {"err": {}, "far": {}, "nan": {}, "fp64": {}}
    for k, ref in outs["reference"].items():
        got = outs["triton"].get(k)
        if got is None:
            res["err"][k] = float("nan")
            continue
        res["err"][k] = rel_err(got, ref)
        diff = (got.double() - ref.double()).abs().cpu()
        scale = ref.double().abs().max().item() if ref.numel() else 0.0
        res["far"][k] = float((diff > 1e-3 * scale).double().mean()) if ref.numel() else 0.0
        res["nan"][k] = int(torch.isnan(got).sum())
    truth = quantized_expert_mlp_fp64(**{k: p[k] for k in ("x", "tokens_per_expert", "w1", "w2", "b1", "b2", "probs")},
                                      recipe=recipe, activation=activation, dy=dy)
    for k in outs["triton"]:
        res["fp64"][k] = rel_err(outs["triton"][k], truth[k])
    routed = int(p["tokens_per_expert"].sum())
    zero = {"y_pad": outs["triton"]["y"][routed:]}
    if "x" in outs["triton"]:
        zero["dx_pad"] = outs["triton"]["x"][routed:]
    empty = [e for e, c in enumerate(p["tokens_per_expert"].tolist()) if c == 0]
    for k in ("w1", "w2", "b1", "b2"):
        if k in outs["triton"] and empty:
            zero[f"d{k}_empty"] = outs["triton"][k][empty]
    res["nonzero"] = {k: int((v != 0).sum()) + int(torch.isnan(v).sum()) for k, v in zero.items()}
    res["grads"] = sorted(outs["triton"])
    return res


# hidden / FFN sizes that are not multiples of the 128-wide tile (the zero-padded path), and one that is
DISPATCH_SHAPES = {"hidden": (96, 128), "ffn": (128, 160), "both": (200, 72), "aligned": (128, 128)}


def check_dispatch(recipe, device: str) -> dict:
    """``fused_moe_mlp(backend='triton')`` with a block-scaled FP8 recipe at :data:`DISPATCH_SHAPES`:
    which autograd Function ran (the zero-padded one where a size is not a tile multiple), its output's
    relative error vs ``backend='reference'`` (BF16 ``h``, the default), whether ``backend='auto'``
    gave the same bits, the recipe named by the Function's kernels, and whether y and the gradients
    are dense in their own sizes (autograd copies a gradient laid out unlike its parameter)."""
    from moe_reference import random_problem, rel_err

    from te_fused_moe import fused_moe_mlp

    out = {}
    for name, (hidden, ffn) in DISPATCH_SHAPES.items():
        p = random_problem(64, hidden, ffn, 2, activation="swiglu", dtype=torch.bfloat16, device=device, seed=3)
        run = lambda backend, x, w1, w2: fused_moe_mlp(x, p["tokens_per_expert"], w1, w2, recipe=recipe,
                                                       backend=backend)
        leaves = [p[key].clone().requires_grad_(True) for key in ("x", "w1", "w2")]
        y = run("triton", *leaves)
        grads = torch.autograd.grad(y, leaves, torch.randn_like(y))  # as the Function returned them
        out[name] = {"node": type(y.grad_fn).__name__, "kernels": y.grad_fn.kernels.recipe_name,
                     "err": rel_err(y.detach(), run("reference", p["x"], p["w1"], p["w2"])),
                     "auto_same": bool(torch.equal(y.detach(), run("auto", p["x"], p["w1"], p["w2"]))),
                     "shape": list(y.shape),
                     "dense": y.is_contiguous() and all(g.is_contiguous() and g.shape == leaf.shape
                                                        for g, leaf in zip(grads, leaves))}
    return out


def assert_dispatch(d: dict, recipe_name: str, bound: float) -> None:
    """:func:`check_dispatch`'s result: tile multiples on the tile-aligned Function, other sizes on the
    zero-padded one, each within ``bound`` of the reference emulation and what ``auto`` runs too."""
    for name, (hidden, _) in DISPATCH_SHAPES.items():
        r = d[name]
        expected = "BlockScaledExpertMLPBackward" if name == "aligned" else "PaddedExpertMLPBackward"
        assert r["node"] == expected and r["kernels"] == recipe_name, (name, r)
        assert r["shape"] == [64, hidden] and r["err"] <= bound and r["auto_same"] and r["dense"], (name, r)


@contextlib.contextmanager
def no_host_syncs():
    """CUDA sync-debug mode 'error' inside: any host read of device data raises."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def assert_no_host_syncs_after_warmup(recipe) -> None:
    """A second forward + backward of ``recipe`` on ``backend='triton'`` (kernels compiled, weights
    cached) under sync-debug mode 'error', with finite outputs and gradients."""
    from moe_reference import random_problem

    from te_fused_moe import fused_moe_mlp

    T, H, F, E, act = 2048, 256, 256, 8, "swiglu"
    p = random_problem(T, H, F, E, activation=act, dtype=torch.bfloat16, device="cuda", bias=True, probs=True,
                       routing="empty", padding=5, seed=11)
    leaves = {k: (p[k].clone().requires_grad_(True) if (k in GRADS and p[k] is not None) else p[k]) for k in p}
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)

    def fwd_bwd():
        y = fused_moe_mlp(leaves["x"], leaves["tokens_per_expert"], leaves["w1"], leaves["w2"], activation=act,
                          recipe=recipe, b1=leaves["b1"], b2=leaves["b2"], probs=leaves["probs"], backend="triton")
        y.backward(dy)
        return y

    fwd_bwd()
    with no_host_syncs():
        y = fwd_bwd()
    torch.cuda.synchronize()
    assert torch.isfinite(y).all() and all(torch.isfinite(leaves[k].grad).all() for k in GRADS)


def assert_within(case_id: str, res: dict, bound: float, fp64_bound: float) -> None:
    """:func:`compare_with_reference`'s result: no NaN, every output within ``bound`` of the reference
    emulation and ``fp64_bound`` of the FP64 truth, zeros where zeros are due."""
    for name, err in res["err"].items():
        assert res["nan"][name] == 0, (case_id, name, res)
        assert err <= bound, f"{case_id}: {name} rel. error vs reference emulation {err:.3g} > {bound}"
        assert res["fp64"][name] <= fp64_bound, f"{case_id}: {name} vs FP64 {res['fp64'][name]:.3g}"
    for name, bad in res["nonzero"].items():
        assert bad == 0, (case_id, name, res["nonzero"])


def bench_unfused_vs_fused(recipe: str, p, device) -> dict:
    """Relative errors (y and the x, w1, w2 gradients) between the benchmark's ``<recipe>_unfused``
    and ``<recipe>_fused`` (``te_fused_moe/bench_recipes.py``) on problem ``p``, swiglu, one random dy."""
    from moe_reference import rel_err

    from te_fused_moe import bench_recipes

    outs = {}
    for name in (f"{recipe}_unfused", f"{recipe}_fused"):
        x, w1, w2 = (p[k].clone().requires_grad_(True) for k in ("x", "w1", "w2"))
        y = bench_recipes.IMPLEMENTATIONS[name](x, p["tokens_per_expert"], w1, w2, "swiglu")
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=y.dtype))
        outs[name] = {"y": y, "x": x.grad, "w1": w1.grad, "w2": w2.grad}
    unfused, fused = outs[f"{recipe}_unfused"], outs[f"{recipe}_fused"]
    return {k: rel_err(unfused[k], fused[k]) for k in fused}


# the benchmark baseline's sizes: tile multiples, and sizes off the tile (run zero-padded, as padded.py)
BENCH_BASELINE_SHAPES = {"aligned": (256, 128), "padded": (200, 72)}


def check_bench_baseline(recipe: str, device: str) -> dict:
    """:func:`bench_unfused_vs_fused` at :data:`BENCH_BASELINE_SHAPES` (300 tokens, 3 experts, one of
    them empty, every row routed as the benchmark routes them)."""
    from moe_reference import random_problem

    out = {}
    for name, (hidden, ffn) in BENCH_BASELINE_SHAPES.items():
        p = random_problem(300, hidden, ffn, 3, dtype=torch.bfloat16, device=device, routing="empty", padding=0,
                           seed=2)
        p["tokens_per_expert"][-1] += p["x"].shape[0] - int(p["tokens_per_expert"].sum())
        out[name] = bench_unfused_vs_fused(recipe, p, device)
    return out


def assert_bench_baseline(res: dict) -> None:
    """The unfused baseline computes the fused path's recipe at every size, up to rounding ``a`` and
    ``dh`` to BF16 before their quantize kernels, which moves a few FP8 codes (~1.7e-2 seen)."""
    assert set(res) == set(BENCH_BASELINE_SHAPES), res
    for name, errs in res.items():
        assert set(errs) == {"y", "x", "w1", "w2"}, (name, errs)
        assert all(0 < e < 5e-2 for e in errs.values()), (name, errs)
