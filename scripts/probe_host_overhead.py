"""Why an MLP's forward + backward takes longer than its kernels: the GPU idle between them, and the host work
that leaves it idle. Run 40a (H100, DSv3): MXFP8 fused timed 17.22 ms with 16.46 ms of kernels, its unfused path
22.23 with 22.05. Runs 40d-g with this probe: no call waits on the GPU, the host spends 3.7-5.5 ms of Python per
fused forward + backward under cProfile (0.7-0.8 for BF16 unfused), and queued the fused path takes 0.1-0.3 ms less
per call than timed call by call while the unfused path takes the same
(``benchmarks/results/run40_keep_values_refresh/``).

Per implementation (names from ``te_fused_moe.bench_recipes.IMPLEMENTATIONS``, their variant flags set):

- ``eager_ms``: forward + backward under ``do_bench``, as ``bench_recipes`` times it;
- ``pipelined_ms``: ten calls queued behind a sleep kernel and timed as one stretch, per call, with the L2 cleared
  before each call (as ``do_bench`` does) and without: the GPU's time with the host far ahead;
- ``host_fwd_ms`` / ``host_bwd_ms``: the CPU time of the forward call and of the backward call while a sleep
  kernel queued first keeps the GPU busy, so that only host work is timed; ``host_waited`` says whether a call
  returned only after that kernel ended, i.e. the code waited on the GPU (a sync);
- ``top``: cProfile's functions by their own time over those host calls.

  usage: python scripts/probe_host_overhead.py [--impls a,b] [--shape dsv3-e32] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from probe_results import write_and_print  # noqa: E402
from te_fused_moe import bench, bench_recipes  # noqa: E402

SLEEP_CYCLES = 2_000_000_000  # ~1 s of GPU time: far more than the host calls below take
HOST_CALLS = 5


def pipelined_ms(step, calls: int = 10) -> dict:
    """``calls`` calls of ``step`` queued behind a sleep kernel (so the host is far ahead when the GPU reaches them)
    and timed as one stretch, per call: the GPU's own time with no host-induced gaps; with the L2 cleared before
    each call as ``do_bench`` does (``flushed``) and without (``warm``)."""
    from triton.runtime import driver

    cache = driver.active.get_empty_cache_for_benchmark()
    out = {}
    for label, flush in (("flushed", True), ("warm", False)):
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES // 10)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            if flush:
                driver.active.clear_cache(cache)
            step()
        end.record()
        torch.cuda.synchronize()
        out[label] = round(start.elapsed_time(end) / calls, 3)
    return out


def host_times(forward, dy, params) -> dict:
    """CPU ms of each forward call and backward call behind a sleep kernel, and cProfile's top own times."""
    fwd, bwd, waited = [], [], False
    profiler = cProfile.Profile()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    sleep_done = torch.cuda.Event()
    sleep_done.record()
    for _ in range(HOST_CALLS):
        for p in params:
            p.grad = None
        profiler.enable()
        t0 = time.perf_counter()
        y = forward()
        t1 = time.perf_counter()
        y.backward(dy)
        t2 = time.perf_counter()
        profiler.disable()
        fwd.append((t1 - t0) * 1e3)
        bwd.append((t2 - t1) * 1e3)
        waited = waited or sleep_done.query()  # the GPU got past the sleep: something waited for it
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    return {"host_fwd_ms": round(statistics.median(fwd), 3), "host_bwd_ms": round(statistics.median(bwd), 3),
            "host_waited": waited, "top": text.getvalue().splitlines()[:60]}


def run(impls, shape_name: str) -> dict:
    shape = bench.SHAPES[shape_name]
    inputs = bench.make_inputs(shape)
    out = {"shape": shape_name, "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for name in impls:
        fn = bench_recipes.IMPLEMENTATIONS[name]
        forward, step, params = bench.training_step(fn, inputs, shape.activation)
        entry = {}
        with getattr(fn, "context", contextlib.nullcontext)():
            for _ in range(3):
                step()
            entry["eager_ms"] = round(bench.do_bench_ms(step), 3)
            entry["pipelined_ms"] = pipelined_ms(step)
            entry.update(host_times(forward, inputs["dy"], params))
        out[name] = entry
        print(name, {k: v for k, v in entry.items() if k != "top"}, flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impls", default="bf16_unfused,mxfp8_fused,mxfp8_unfused")
    parser.add_argument("--shape", default="dsv3-e32", choices=sorted(bench.SHAPES))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    write_and_print(run(args.impls.split(","), args.shape), args.out, f"probe_host_overhead_{args.shape}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
