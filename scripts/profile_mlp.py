#!/usr/bin/env python
"""Where one expert-MLP implementation's forward + backward spends its GPU time: the kernels under
torch.profiler, per iteration, largest first, with the gradients landing in ``.grad`` as in training
(so the copies autograd makes of gradients that break a parameter's layout show up too).

    python scripts/profile_mlp.py --impls fp8_block_fused,bf16_fused --shape gpt-oss --out "$OUT"

``--impls``: names from ``te_fused_moe.bench_recipes.IMPLEMENTATIONS``. Writes ``profile_<impl>_<shape>.txt``.
``--as-do-bench``: each profiled call as ``triton.testing.do_bench`` times it (the L2 cleared before it, its own
pair of events), with the host's activity too and a Chrome trace per implementation (``trace_<impl>_<shape>.json``):
where the benchmark's fused timings spend the ~0.7 ms they sit above their kernels' sum (run 40).
"""

import argparse
import contextlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from te_fused_moe import bench, bench_recipes  # noqa: E402


def kernel_table(step, iterations: int, as_do_bench: bool = False, trace: str = None) -> str:
    """The profiled kernels of ``iterations`` calls of ``step()`` (a forward + backward, ``bench.training_step``),
    per call (``as_do_bench``: each call behind an L2 clear and between two events, as ``do_bench`` times it, the
    host profiled too; ``trace``: a Chrome trace written there)."""
    from torch.profiler import ProfilerActivity, profile
    from triton.runtime import driver

    cache = driver.active.get_empty_cache_for_benchmark() if as_do_bench else None

    def timed_step():
        driver.active.clear_cache(cache)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        return start, end

    for _ in range(3):  # compile, warm the caches
        step()
    torch.cuda.synchronize()
    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if as_do_bench else [])
    events = []
    with profile(activities=activities) as prof:
        for _ in range(iterations):
            if as_do_bench:
                events.append(timed_step())
            else:
                step()
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    rows = {}
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    for event in kernels:
        name = event.name[:90]
        total, count = rows.get(name, (0.0, 0))
        rows[name] = (total + event.time_range.elapsed_us(), count + 1)
    lines, grand = [], sum(total for total, _ in rows.values()) / iterations / 1e3
    for name, (total, count) in sorted(rows.items(), key=lambda item: -item[1][0]):
        lines.append(f"{total / iterations / 1e3:8.3f} ms  x{count / iterations:4.1f}  {name}")
    timed = ""
    if events:
        per_call = sorted(start.elapsed_time(end) for start, end in events)
        timed = f"events per call (as do_bench): median {per_call[len(per_call) // 2]:.3f} ms, {per_call}\n"
    return (f"GPU time per fwd+bwd: {grand:.3f} ms (kernels back to back, no gaps)\n" + timed
            + idle_gaps(kernels, iterations) + "\n" + "\n".join(lines))


def idle_gaps(kernels, iterations: int, largest: int = 12) -> str:
    """The GPU's idle time between the profiled kernels (the span from the first kernel's start to the last's end,
    less the time some kernel ran), per call, and the largest gaps with the kernels either side."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name[:60]) for e in kernels)
    gaps, busy_until, before = [], spans[0][0], spans[0][2]
    for start, end, name in spans:
        if start > busy_until:
            gaps.append((start - busy_until, before, name))
        if end > busy_until:
            busy_until, before = end, name
    idle = sum(g for g, _, _ in gaps)
    lines = [f"span per fwd+bwd: {(busy_until - spans[0][0]) / iterations / 1e3:.3f} ms, idle between kernels "
             f"{idle / iterations / 1e3:.3f} ms ({len(gaps) / iterations:.0f} gaps); largest:"]
    for gap, prev, nxt in sorted(gaps, reverse=True)[:largest]:
        lines.append(f"  {gap / 1e3:7.3f} ms  after {prev}  before {nxt}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impls", default="fp8_block_fused,bf16_fused")
    parser.add_argument("--shape", default="gpt-oss", choices=sorted(bench.SHAPES))
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--out", default=None)
    parser.add_argument("--as-do-bench", action="store_true",
                        help="each call behind an L2 clear and between events, the host profiled, a Chrome trace")
    args = parser.parse_args()
    shape = bench.SHAPES[args.shape]
    inputs = bench.make_inputs(shape)
    for name in args.impls.split(","):
        fn = bench_recipes.IMPLEMENTATIONS[name]
        _, step, _ = bench.training_step(fn, inputs, shape.activation)
        with getattr(fn, "context", contextlib.nullcontext)():  # a variant's flags (bench_recipes.VARIANTS)
            trace = (os.path.join(args.out, f"trace_{name}_{args.shape}.json")
                     if args.out and args.as_do_bench else None)
            if trace:
                os.makedirs(args.out, exist_ok=True)
            table = kernel_table(step, args.iterations, args.as_do_bench, trace)
        finished = time.strftime("%H:%M:%S")  # to match the call with a clock log (device_recipes.sh CLOCKS=1)
        text = f"{name} at {args.shape} ({torch.cuda.get_device_name()}), profiled up to {finished}\n{table}\n"
        print(text, flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"profile_{name}_{args.shape}.txt"), "w") as f:
                f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
