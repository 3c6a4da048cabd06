"""Benchmark of the expert MLP on one GPU: our Triton backend vs the unfused PyTorch path.

In one process: measure the ceilings (cuBLAS BF16 8192^3 matmul, device-to-device copy), then for each
shape time forward, backward and forward+backward of

- ``unfused``: ``torch._grouped_mm`` FC1 -> activation as separate PyTorch ops -> ``torch._grouped_mm``
  FC2, autograd backward (a per-expert ``mm`` loop where ``_grouped_mm`` is missing);
- ``triton``:  ``fused_moe_mlp(..., backend="triton")``;

and each of our kernels alone (FC1 with its GLU epilogue, FC2, the dGLU dgrad, FC1 dgrad, the two
wgrads), as TFLOP/s and as a fraction of the measured dense peak. TFLOP/s counts routed tokens only;
forward+backward counts 3x the forward FLOPs, backward 2x. Inputs are random (never zeros). Also:
peak memory of each path, and what ``deterministic=True`` costs (with router probs).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
from typing import Callable, Dict, List, Optional

import torch


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    experts: int
    hidden: int
    ffn: int
    tokens: int
    activation: str = "swiglu"
    routing: str = "balanced"  # balanced | zipf | empty


SHAPES = {
    s.name: s
    for s in (
        Shape("dsv3-e32", 32, 7168, 2048, 32768),
        Shape("dsv3-e32-zipf", 32, 7168, 2048, 32768, routing="zipf"),
        Shape("dsv3-e8", 8, 7168, 2048, 16384),
        Shape("qwen3-30b-a3b", 128, 2048, 768, 65536),
        Shape("gpt-oss", 32, 2880, 2880, 32768, activation="gpt_oss_swiglu"),
        Shape("mixtral", 8, 4096, 14336, 16384),
        Shape("qwen3-empty", 128, 2048, 768, 65536, routing="empty"),
    )
}


# --- inputs ----------------------------------------------------------------------------------------

def routing_counts(shape: Shape, generator: torch.Generator) -> torch.Tensor:
    """Tokens per expert (host tensor) summing to ``shape.tokens``."""
    E, T = shape.experts, shape.tokens
    if shape.routing == "balanced":
        counts = torch.full((E,), T // E, dtype=torch.int64)
        counts[: T - int(counts.sum())] += 1
        return counts
    if shape.routing == "zipf":
        weights = 1.0 / (torch.randperm(E, generator=generator).double() + 1) ** 1.2
    elif shape.routing == "empty":  # a quarter of the experts get no token, the rest are balanced
        weights = torch.ones(E, dtype=torch.float64)
        weights[torch.randperm(E, generator=generator)[: E // 4]] = 0
    else:
        raise ValueError(f"routing: unknown kind {shape.routing!r}")
    counts = torch.floor(weights / weights.sum() * T).long()
    counts[int(torch.argmax(weights))] += T - int(counts.sum())
    return counts


def make_inputs(shape: Shape, device="cuda", dtype=torch.bfloat16, seed=0) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    gated = shape.activation in ("swiglu", "geglu", "gpt_oss_swiglu")
    n1 = 2 * shape.ffn if gated else shape.ffn
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*size, scale=1.0):
        return (torch.randn(*size, device=device, generator=gen, dtype=torch.float32) * scale).to(dtype)

    return dict(
        x=randn(shape.tokens, shape.hidden),
        w1=randn(shape.experts, n1, shape.hidden, scale=shape.hidden ** -0.5),
        w2=randn(shape.experts, shape.hidden, shape.ffn, scale=shape.ffn ** -0.5),
        dy=randn(shape.tokens, shape.hidden),
        counts=routing_counts(shape, g).to(device),
    )


def forward_flops(shape: Shape, routed_tokens: int) -> float:
    gated = shape.activation in ("swiglu", "geglu", "gpt_oss_swiglu")
    n1 = 2 * shape.ffn if gated else shape.ffn
    return 2.0 * routed_tokens * shape.hidden * (n1 + shape.ffn)


# --- the two implementations -------------------------------------------------------------------------

def unfused_mlp(x, counts, w1, w2, activation: str):
    """FC1 grouped GEMM -> separate activation -> FC2 grouped GEMM (autograd backward)."""
    from .activations import ActivationConfig

    act = ActivationConfig(activation)
    if hasattr(torch, "_grouped_mm"):
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        h = torch._grouped_mm(x, w1.transpose(1, 2), offs=offsets)
        a = act.forward(h)
        return torch._grouped_mm(a, w2.transpose(1, 2), offs=offsets)
    rows = torch.split(x, counts.tolist())  # host sync: fallback only
    outs = [act.forward(xe @ w1[e].T) @ w2[e].T for e, xe in enumerate(rows)]
    return torch.cat(outs)


def fused_mlp(x, counts, w1, w2, activation: str):
    from .ops import fused_moe_mlp

    return fused_moe_mlp(x, counts, w1, w2, activation=activation, backend="triton")


IMPLEMENTATIONS = {"unfused": unfused_mlp, "triton": fused_mlp}


# --- timing ------------------------------------------------------------------------------------------

def do_bench_ms(fn: Callable, grad_to_none=None) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median"))


def backward_ms(forward: Callable, dy: torch.Tensor, params, reps: int = 30) -> float:
    """Median GPU time of backward alone. Each repetition runs a fresh forward first (untimed): the
    fused backend frees its saved activations in backward, so one graph cannot be replayed with
    ``retain_graph=True``. Events bracket only the backward's work on the stream."""
    times = []
    for _ in range(reps + 3):
        for p in params:
            p.grad = None
        y = forward()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        y.backward(dy)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times = sorted(times[3:])  # the first few warm the allocator
    return float(times[len(times) // 2])


def time_kernels(kernels: Dict, peak_tflops: float) -> Dict[str, Dict[str, float]]:
    """``kernels``: name -> (fn, flops or None, bytes moved or None). Runs each once, then times it:
    ms, TFLOP/s and share of ``peak_tflops`` (``of_fp8_peak``) or GB/s. Failures are recorded."""
    out = {}
    for name, (fn, flops, nbytes) in kernels.items():
        try:
            fn()
            ms = do_bench_ms(fn)
            entry = {"ms": ms}
            if flops:
                entry.update(tflops=flops / ms / 1e9, of_fp8_peak=flops / ms / 1e9 / peak_tflops)
            if nbytes:
                entry["gbps"] = nbytes / ms / 1e6
            out[name] = entry
        except Exception as exc:  # recorded: the other kernels still run
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def measure_ceilings() -> Dict[str, float]:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = do_bench_ms(lambda: torch.mm(a, b))
    src = torch.empty(1 << 30, device="cuda", dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    copy_ms = do_bench_ms(lambda: dst.copy_(src))
    del a, b, src, dst
    return {"bf16_gemm_tflops": 2 * n ** 3 / ms / 1e9, "d2d_copy_tbps": 2 * (1 << 30) / copy_ms / 1e9}


def training_step(fn: Callable, inputs, activation: str):
    """(forward, step, params): leaf copies of ``inputs``' x, w1 and w2 (``params``), ``forward()`` of ``fn`` on
    them (called as ``fn(x, counts, w1, w2, activation)``), and ``step()``: their gradients cleared, then forward +
    backward with ``inputs["dy"]``, what every timing tool repeats."""
    params = [inputs[key].clone().requires_grad_(True) for key in ("x", "w1", "w2")]
    x, w1, w2 = params

    def forward():
        return fn(x, inputs["counts"], w1, w2, activation)

    def step():
        for p in params:
            p.grad = None
        forward().backward(inputs["dy"])

    return forward, step, params


def bench_implementation(name: str, shape: Shape, inputs, peak_tflops: float,
                         fn: Optional[Callable] = None) -> Dict[str, float]:
    """Times ``fn`` (default: ``IMPLEMENTATIONS[name]``), called as ``fn(x, counts, w1, w2, activation)``."""
    forward, fwd_bwd, params = training_step(fn or IMPLEMENTATIONS[name], inputs, shape.activation)
    dy = inputs["dy"]
    flops = forward_flops(shape, int(inputs["counts"].sum()))

    fwd_bwd()  # compile / warm up
    torch.cuda.synchronize()
    out = {
        "fwd_ms": do_bench_ms(forward),
        "bwd_ms": backward_ms(forward, dy, params),
        "fwd_bwd_ms": do_bench_ms(fwd_bwd, grad_to_none=params),
    }
    for x_ in params:
        x_.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    y = forward()
    # y and what backward keeps (saved activations): what each layer holds until its backward runs
    out["after_forward_gib"] = (torch.cuda.memory_allocated() - before) / 2 ** 30
    y.backward(dy)
    del y
    torch.cuda.synchronize()
    out["peak_mem_gib"] = (torch.cuda.max_memory_allocated() - before) / 2 ** 30
    out["fwd_tflops"] = flops / out["fwd_ms"] / 1e9
    out["bwd_tflops"] = 2 * flops / out["bwd_ms"] / 1e9
    out["fwd_bwd_tflops"] = 3 * flops / out["fwd_bwd_ms"] / 1e9
    out["fwd_bwd_of_peak"] = out["fwd_bwd_tflops"] / peak_tflops
    with torch.no_grad():
        out["_y"] = forward().float()
    return out


def bench_kernels(shape: Shape, inputs, peak_tflops: float, fc1_config=None, fc2_config=None,
                  dact_config=None, dgrad_config=None, wgrad_config=None) -> Dict[str, Dict[str, float]]:
    """Each Triton kernel alone (optionally with a given block config): ms, TFLOP/s, fraction of peak."""
    from .activations import ActivationConfig
    from .backends.triton import grouped_gemm as gg
    from .backends.triton.schedule import build_schedule
    from .backends.triton.wgrad import default_wgrad_config, grouped_wgrad

    act = ActivationConfig(shape.activation)
    x, w1, w2, counts, dy = (inputs[k] for k in ("x", "w1", "w2", "counts", "dy"))
    T, H, F, n1 = x.shape[0], shape.hidden, shape.ffn, w1.shape[1]
    routed = int(counts.sum())
    kw = act.launch_args
    h = torch.empty(T, n1, device=x.device, dtype=x.dtype)
    a = torch.empty(T, F, device=x.device, dtype=x.dtype)
    y = torch.empty(T, H, device=x.device, dtype=x.dtype)
    dh = torch.empty_like(h)
    dx = torch.empty_like(x)
    dw1, dw2 = torch.empty_like(w1), torch.empty_like(w2)
    wcfg = wgrad_config or default_wgrad_config(0, 0)
    sched = build_schedule(counts, T, wcfg.block_m)
    kernels = {
        "fc1_glu": (lambda: gg.fc1_forward(x, w1, counts, h, a, config=fc1_config, **kw), 2 * routed * H * n1),
        "fc2": (lambda: gg.fc2_forward(a, w2, counts, y, config=fc2_config), 2 * routed * F * H),
        "fc2_dgrad_dglu": (lambda: gg.fc2_dgrad_dact(dy, w2, counts, h, dh, config=dact_config, **kw),
                           2 * routed * H * F),
        "fc1_dgrad": (lambda: gg.fc1_dgrad(dh, w1, counts, dx, config=dgrad_config), 2 * routed * n1 * H),
        "wgrad_w2": (lambda: grouped_wgrad(dy, a, sched, dw2, config=wgrad_config), 2 * routed * H * F),
        "wgrad_w1": (lambda: grouped_wgrad(dh, x, sched, dw1, config=wgrad_config), 2 * routed * n1 * H),
    }
    if wgrad_config is None:  # the previous default (clamped tail: scalar loads), for comparison
        from .backends.triton.wgrad import WgradConfig

        clamped = WgradConfig(vector_tail=False)
        kernels["wgrad_w2_clamped_tail"] = (lambda: grouped_wgrad(dy, a, sched, dw2, config=clamped),
                                            2 * routed * H * F)
        kernels["wgrad_w1_clamped_tail"] = (lambda: grouped_wgrad(dh, x, sched, dw1, config=clamped),
                                            2 * routed * n1 * H)
    out = {}
    for name, (fn, flops) in kernels.items():
        fn()
        ms = do_bench_ms(fn)
        out[name] = {"ms": ms, "tflops": flops / ms / 1e9, "of_peak": flops / ms / 1e9 / peak_tflops}
    return out


def bench_determinism(shape: Shape, inputs) -> Dict[str, float]:
    """What ``deterministic=True`` costs: fused fwd+bwd with router probs (whose gradient is the only
    reduction that uses atomics; bias gradients are always summed in order), atomics vs ordered."""
    from .ops import fused_moe_mlp

    x = inputs["x"].clone().requires_grad_(True)
    w1 = inputs["w1"].clone().requires_grad_(True)
    w2 = inputs["w2"].clone().requires_grad_(True)
    probs = torch.rand(x.shape[0], device=x.device, dtype=torch.float32).add_(0.05).requires_grad_(True)
    counts, dy = inputs["counts"], inputs["dy"]
    params = [x, w1, w2, probs]
    out = {}
    for label, deterministic in (("atomic", False), ("deterministic", True)):
        def fwd_bwd():
            fused_moe_mlp(x, counts, w1, w2, activation=shape.activation, probs=probs, backend="triton",
                          deterministic=deterministic).backward(dy)

        fwd_bwd()
        out[f"fwd_bwd_ms_{label}"] = do_bench_ms(fwd_bwd, grad_to_none=params)
    out["cost"] = out["fwd_bwd_ms_deterministic"] / out["fwd_bwd_ms_atomic"]
    return out


def run(shape_names: List[str], out_dir: Optional[str] = None, kernels: bool = True, progress: bool = True) -> Dict:
    import triton

    torch.manual_seed(0)
    ceilings = measure_ceilings()
    peak = ceilings["bf16_gemm_tflops"]
    report = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "unfused_impl": "torch._grouped_mm" if hasattr(torch, "_grouped_mm") else "per-expert mm loop",
        "ceilings": ceilings,
        "shapes": {},
    }
    iterator = shape_names
    if progress:
        try:
            from tqdm import tqdm

            iterator = tqdm(shape_names, desc="shapes")
        except ImportError:
            pass
    for name in iterator:
        shape = SHAPES[name]
        inputs = make_inputs(shape)
        entry = {"shape": dataclasses.asdict(shape), "counts": inputs["counts"].tolist()}
        for impl in IMPLEMENTATIONS:
            entry[impl] = bench_implementation(impl, shape, inputs, peak)
        y_unfused, y_fused = entry["unfused"].pop("_y"), entry["triton"].pop("_y")
        routed = int(inputs["counts"].sum())
        entry["rel_err_vs_unfused"] = float(
            (y_fused[:routed] - y_unfused[:routed]).norm() / y_unfused[:routed].norm().clamp_min(1e-30))
        entry["speedup"] = {k: entry["unfused"][f"{k}_ms"] / entry["triton"][f"{k}_ms"]
                            for k in ("fwd", "bwd", "fwd_bwd")}
        entry["determinism"] = bench_determinism(shape, inputs)
        if kernels:
            entry["kernels"] = bench_kernels(shape, inputs, peak)
        report["shapes"][name] = entry
        del inputs
        torch.cuda.empty_cache()
    if out_dir:
        save(report, out_dir)
    return report


def summary_table(report: Dict) -> str:
    peak = report["ceilings"]["bf16_gemm_tflops"]
    lines = [f"{report['gpu']}  torch {report['torch']}  triton {report['triton']}  "
             f"peak bf16 {peak:.0f} TFLOP/s  copy {report['ceilings']['d2d_copy_tbps']:.2f} TB/s",
             f"{'shape':16} {'unf fwd+bwd':>11} {'ours fwd+bwd':>12} {'x fwd':>6} {'x bwd':>6} {'x f+b':>6} "
             f"{'TFLOP/s':>8} {'of peak':>7} {'FC1':>6} {'mem unf/ours GiB':>17} {'err':>8} {'determ':>6}"]
    for name, e in report["shapes"].items():
        fc1 = e.get("kernels", {}).get("fc1_glu", {}).get("of_peak", float("nan"))
        lines.append(
            f"{name:16} {e['unfused']['fwd_bwd_ms']:9.2f}ms {e['triton']['fwd_bwd_ms']:10.2f}ms "
            f"{e['speedup']['fwd']:6.2f} {e['speedup']['bwd']:6.2f} {e['speedup']['fwd_bwd']:6.2f} "
            f"{e['triton']['fwd_bwd_tflops']:8.0f} {e['triton']['fwd_bwd_of_peak']:7.0%} {fc1:6.0%} "
            f"{e['unfused']['peak_mem_gib']:8.2f}/{e['triton']['peak_mem_gib']:<8.2f} {e['rel_err_vs_unfused']:8.1e} "
            f"{e.get('determinism', {}).get('cost', float('nan')):6.3f}")
    return "\n".join(lines)


def save(report: Dict, out_dir: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    stamp = report["date"][:10]
    gpu = report["gpu"].replace(" ", "_")
    base = os.path.join(out_dir, f"experts_{gpu}_{stamp}")
    with open(base + ".json", "w") as f:
        json.dump(report, f, indent=1)
    with open(base + ".txt", "w") as f:
        f.write(summary_table(report) + "\n")
    try:
        plot(report, base + ".png")
    except ImportError:
        pass
    return base


def plot(report: Dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["shapes"])
    peak = report["ceilings"]["bf16_gemm_tflops"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.38
    xs = range(len(names))
    for ax, key, title in ((axes[0], "fwd_tflops", "forward"), (axes[1], "fwd_bwd_tflops", "forward + backward")):
        for i, impl in enumerate(("unfused", "triton")):
            vals = [report["shapes"][n][impl][key] for n in names]
            ax.bar([x + (i - 0.5) * width for x in xs], vals, width, label=impl)
        ax.axhline(peak, color="k", ls="--", lw=1, label=f"cuBLAS 8192^3 ({peak:.0f})")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(names, rotation=30, ha="right")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"{title} — {report['gpu']}")
        ax.legend(fontsize=8)
    fig.suptitle(f"expert MLP, BF16, torch {report['torch']}, triton {report['triton']}, {report['date'][:10]}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- block-size variants (run on the device to choose the defaults) ---------------------------------

def variant_sets():
    """A few block configurations per kernel, named; ``default`` is what the backend uses."""
    from .backends.triton.grouped_gemm import GemmConfig
    from .backends.triton.wgrad import WgradConfig

    G, W = GemmConfig, WgradConfig

    def persistent(stages, **kw):
        return {f"{kind}_config": G(block_n=bn, num_stages=stages, persistent=True, gate_up_box=True, **kw)
                for kind, bn in (("fc1", 128), ("fc2", 256), ("dact", 128), ("dgrad", 256))}

    return {
        "default": {},
        "ptr": dict(fc1_config=G(block_n=128, num_stages=4, use_tma=False), fc2_config=G(block_n=256, use_tma=False),
                    dact_config=G(block_n=128, num_stages=4, use_tma=False),
                    dgrad_config=G(block_n=256, num_stages=4, use_tma=False), wgrad_config=W(use_tma=False)),
        "run2": dict(fc2_config=G(block_n=256, num_stages=3), dact_config=G(block_n=64, num_stages=4),
                     dgrad_config=G(block_n=256, num_stages=3), wgrad_config=W(block_k=128)),
        # NB: wgrad 128x256 (block_k=256) computed wrong dW on the H200 in run 4; timing only.
        "v1": dict(fc1_config=G(block_n=128, num_stages=3), fc2_config=G(block_n=128, num_stages=4),
                   dact_config=G(block_n=128, num_stages=3), dgrad_config=G(block_n=128, num_stages=4),
                   wgrad_config=W(num_stages=4)),
        "v3": dict(fc1_config=G(block_n=128, num_stages=4, group_m=16), fc2_config=G(block_n=256, group_m=16),
                   dact_config=G(block_n=128, num_stages=4, group_m=16), dgrad_config=G(block_n=256, group_m=16),
                   wgrad_config=W(block_n=256, block_k=128)),
        # persistent grouped GEMMs (one program per SM; default block sizes, FC1 through the gate/up box,
        # wgrad as default), with 3 and 4 stages; "noflat" keeps the tile loop and the K loop apart (no
        # cross-tile overlap) to isolate what the flattening buys; "gateup": the per-tile FC1 with the box
        "persistent": persistent(3),
        "persistent_s4": persistent(4),
        "persistent_noflat": persistent(4, flatten=False),
        "gateup": dict(fc1_config=G(block_n=128, num_stages=4, gate_up_box=True)),
    }


def tune(shape_names: List[str], out_dir: Optional[str] = None) -> Dict:
    """Time every kernel under each variant set; report the best per kernel and shape."""
    peak = measure_ceilings()["bf16_gemm_tflops"]
    results: Dict = {"peak_tflops": peak, "shapes": {}}
    for name in shape_names:
        shape = SHAPES[name]
        inputs = make_inputs(shape)
        per_variant = {}
        for variant, configs in variant_sets().items():
            try:
                per_variant[variant] = bench_kernels(shape, inputs, peak, **configs)
            except Exception as exc:  # a config that does not compile/fit: record why, keep going
                per_variant[variant] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        results["shapes"][name] = per_variant
        del inputs
        torch.cuda.empty_cache()
    lines = [f"{'shape':16} {'kernel':15} " + " ".join(f"{v:>8}" for v in variant_sets()) + "   (TFLOP/s)"]
    for name, per_variant in results["shapes"].items():
        kernels = next((v for v in per_variant.values() if "error" not in v), {})
        for kernel in kernels:
            vals = [per_variant[v].get(kernel, {}).get("tflops", float("nan")) if "error" not in per_variant[v]
                    else float("nan") for v in variant_sets()]
            lines.append(f"{name:16} {kernel:15} " + " ".join(f"{x:8.0f}" for x in vals))
    results["table"] = "\n".join(lines)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "tune.json"), "w") as f:
            json.dump(results, f, indent=1)
    return results


def main(argv: Optional[List[str]] = None) -> int:
    """``te-fused-moe bench`` / ``scripts/bench_experts.py``."""
    import argparse

    parser = argparse.ArgumentParser(prog="te-fused-moe bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="all", help=f"comma-separated from {sorted(SHAPES)} or 'all'")
    parser.add_argument("--out", default="benchmarks/results", help="folder for the JSON, text table and PNG plot")
    parser.add_argument("--no-kernels", action="store_true", help="skip the per-kernel timings")
    parser.add_argument("--tune", action="store_true", help="time block-size variants of each kernel instead")
    args = parser.parse_args(argv)
    names = list(SHAPES) if args.shapes == "all" else args.shapes.split(",")
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        parser.error(f"--shapes: unknown {unknown}; expected names from {sorted(SHAPES)}")
    if not torch.cuda.is_available():
        parser.error("the benchmark times the Triton backend against torch._grouped_mm and needs a CUDA GPU")
    if args.tune:
        print(tune(names, out_dir=args.out)["table"])
        return 0
    report = run(names, out_dir=args.out, kernels=not args.no_kernels)
    print(summary_table(report))
    return 0
