"""Forward + backward under sustained load, with the GPU's clocks beside each timing.

``bench_recipes`` times each implementation with ``triton.testing.do_bench``: ~125 ms of calls, started from
whatever power state the previous measurement left. Run 41 logged the clocks through such a run on an H100: within
~0.5 s of GEMM-heavy work the GPU reaches its 700 W software power cap and the SM clock falls from 1980 MHz to
1.2-1.9 GHz, so a 100 ms window can land anywhere on that ramp. Training runs at the cap. Here each implementation
runs back to back for ``warm_s`` seconds first (the GPU settles at its limit), then ``calls`` calls are timed as
one queued stretch (the host kept ahead, at most two calls queued before it waits); the SM clock, power draw and
the clock-limit reasons are sampled the whole time by ``nvidia-smi``. The implementations take turns over
``rounds`` (A B C, A B C, ...) and each keeps the median of its rounds; ratios are taken against the baselines
named in the same run.

    python scripts/bench_sustained.py --impls bf16_unfused,mxfp8_unfused,mxfp8_fused \\
        --ratios mxfp8_fused:mxfp8_unfused,mxfp8_fused:bf16_unfused --out "$OUT/sustained"
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

POWER_CAP_BITS = 0x4 | 0x80  # NVML's clock-event reasons: software power cap, hardware power brake
FIELDS = "clocks.sm,power.draw"


class ClockLog:
    """``nvidia-smi`` sampling the SM clock (MHz), the power draw (W) and the clock-limit reasons every
    ``interval_ms`` in a background thread; each sample is stamped with ``time.monotonic()`` when read.
    Without ``nvidia-smi`` the log stays empty and every window summary is ``None``."""

    def __init__(self, interval_ms: int = 50, gpu: Optional[str] = None):
        self.samples: List[Tuple[float, float, float, int]] = []
        self._proc = None
        exe = shutil.which("nvidia-smi")
        if exe is None:
            return
        gpu = gpu or os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
        reasons = "clocks_event_reasons.active"
        probe = subprocess.run([exe, f"--query-gpu={reasons}", "--format=csv"], capture_output=True)
        if probe.returncode != 0:  # drivers before the rename
            reasons = "clocks_throttle_reasons.active"
        self._proc = subprocess.Popen(
            [exe, "-i", gpu, f"--query-gpu={FIELDS},{reasons}", "--format=csv,noheader,nounits",
             "-lms", str(interval_ms)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self._proc.stdout:
            sample = parse_sample(line, time.monotonic())
            if sample is not None:
                self.samples.append(sample)

    def window(self, start: float, end: float) -> Optional[Dict[str, float]]:
        return summarize(self.samples, start, end)

    def close(self):
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait()


def parse_sample(line: str, stamp: float) -> Optional[Tuple[float, float, float, int]]:
    """One ``nvidia-smi`` CSV line (``MHz, W, 0x..``) as ``(stamp, MHz, W, reasons)``; ``None`` if it is not one
    (a header, "[N/A]")."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 3:
        return None
    try:
        return stamp, float(parts[0]), float(parts[1]), int(parts[2], 16)
    except ValueError:
        return None


def summarize(samples: Sequence[Tuple[float, float, float, int]], start: float, end: float
              ) -> Optional[Dict[str, float]]:
    """Mean SM clock and power over the samples stamped within ``[start, end]``, their lowest clock, and the
    share of them with a power-cap reason set; ``None`` with no sample there."""
    inside = [s for s in samples if start <= s[0] <= end]
    if not inside:
        return None
    return {"sm_mhz": statistics.fmean(s[1] for s in inside), "sm_mhz_min": min(s[1] for s in inside),
            "power_w": statistics.fmean(s[2] for s in inside),
            "power_capped": sum(bool(s[3] & POWER_CAP_BITS) for s in inside) / len(inside), "samples": len(inside)}


def sustained_ms(step: Callable[[], None], warm_s: float, calls: int, clocks: ClockLog) -> Dict:
    """``step`` back to back for ``warm_s`` seconds, then ``calls`` calls timed as one stretch: ms per call, and
    the clocks over the timed stretch."""
    import torch

    def run(n_calls: Optional[int], until: Optional[float]):
        queued: List = []  # an event per call: the host waits on the one two calls back
        done = 0
        while (n_calls is not None and done < n_calls) or (until is not None and time.monotonic() < until):
            step()
            event = torch.cuda.Event()
            event.record()
            queued.append(event)
            if len(queued) > 2:
                queued.pop(0).synchronize()
            done += 1

    torch.cuda.synchronize()
    run(None, time.monotonic() + warm_s)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    began = time.monotonic()
    start.record()
    run(calls, None)
    end.record()
    end.synchronize()
    out = {"ms": start.elapsed_time(end) / calls}
    window = clocks.window(began, time.monotonic())
    if window:
        out.update(window)
    return out


def ratios(medians: Dict[str, float], pairs: Sequence[Tuple[str, str]]) -> Dict[str, float]:
    """``"a:b"`` -> time of ``b`` over time of ``a`` (how many times faster ``a`` runs), for each named pair."""
    out = {}
    for a, b in pairs:
        for name in (a, b):
            if name not in medians:
                raise ValueError(f"--ratios: {name!r} is not among the timed implementations {sorted(medians)}")
        out[f"{a}:{b}"] = medians[b] / medians[a]
    return out


def parse_pairs(text: str) -> List[Tuple[str, str]]:
    pairs = []
    for item in filter(None, text.split(",")):
        a, sep, b = item.partition(":")
        if not sep or not a or not b:
            raise ValueError(f"--ratios: expected 'fast:baseline' pairs separated by commas, got {item!r}")
        pairs.append((a, b))
    return pairs


def run(impls: Sequence[str], pairs: Sequence[Tuple[str, str]], shape_name: str, rounds: int, warm_s: float,
        calls: int) -> Dict:
    import torch

    from . import bench, bench_recipes

    unknown = [name for name in impls if name not in bench_recipes.IMPLEMENTATIONS]
    if unknown:
        raise ValueError(f"--impls: unknown {unknown}; choose from {sorted(bench_recipes.IMPLEMENTATIONS)}")
    ratios({name: 1.0 for name in impls}, pairs)  # a pair naming an untimed implementation fails before the run
    shape = bench.SHAPES[shape_name]
    inputs = bench.make_inputs(shape)
    clocks = ClockLog()
    timed: Dict[str, List[Dict]] = {name: [] for name in impls}
    try:
        for _ in range(rounds):
            for name in impls:
                fn = bench_recipes.IMPLEMENTATIONS[name]
                _, step, _ = bench.training_step(fn, inputs, shape.activation)
                with getattr(fn, "context", contextlib.nullcontext)():  # a variant's flags
                    timed[name].append(sustained_ms(step, warm_s, calls, clocks))
                torch.cuda.empty_cache()
    finally:
        clocks.close()
    medians = {name: statistics.median(r["ms"] for r in rs) for name, rs in timed.items()}
    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": shape_name,
            "date": time.strftime("%Y-%m-%d"), "rounds": rounds, "warm_s": warm_s, "calls": calls,
            "median_ms": medians, "ratios": ratios(medians, pairs), "timings": timed}


def report(result: Dict) -> str:
    lines = [f"{result['gpu']}  torch {result['torch']}  {result['shape']}: forward + backward after "
             f"{result['warm_s']} s back to back, {result['calls']} calls timed, median of {result['rounds']} rounds"]
    lines.append(f"  {'implementation':34s} {'ms':>7s}  rounds (ms @ mean SM MHz, share of samples power-capped)")
    for name, ms in result["median_ms"].items():
        rounds = "  ".join(
            f"{r['ms']:.2f}" + (f" @{r['sm_mhz']:.0f} {r['power_capped']:.0%}" if "sm_mhz" in r else "")
            for r in result["timings"][name])
        lines.append(f"  {name:34s} {ms:7.2f}  {rounds}")
    for pair, ratio in result["ratios"].items():
        lines.append(f"  {pair}: {ratio:.3f}x")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from . import bench

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impls", default="bf16_unfused,mxfp8_unfused,mxfp8_fused")
    parser.add_argument("--ratios", default="mxfp8_fused:mxfp8_unfused,mxfp8_fused:bf16_unfused",
                        help="fast:baseline pairs, comma separated")
    parser.add_argument("--shape", default="dsv3-e32", choices=sorted(bench.SHAPES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warm-seconds", type=float, default=2.0)
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    pairs = parse_pairs(args.ratios)
    result = run(args.impls.split(","), pairs, args.shape, args.rounds, args.warm_seconds, args.calls)
    text = report(result)
    print(text, flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        stem = os.path.join(args.out, f"sustained_{result['gpu'].replace(' ', '_')}_{result['date']}")
        with open(stem + ".json", "w") as f:
            json.dump(result, f, indent=1)
        with open(stem + ".txt", "w") as f:
            f.write(text + "\n")
    return 0
