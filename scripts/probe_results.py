"""What the probe scripts (``probe_wgrad.py``, ``probe_plain.py``, ...) share: what they do with their results, and
timing in interleaved rounds."""

from __future__ import annotations

import argparse
import json
import os
from typing import Callable, Dict, Optional


def write_and_print(results: dict, out_dir: Optional[str], filename: str) -> None:
    """Saves ``results`` as ``out_dir/filename`` (JSON) where ``out_dir`` is given, and prints them."""
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, filename), "w") as f:
            json.dump(results, f, indent=1)
    print(json.dumps(results, indent=1))


def run_and_save(run: Callable[[], dict], description: str, filename: str) -> None:
    """The command line of a one-process probe: ``[--out DIR]``, then ``run()``'s results written and printed."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", default=None)
    write_and_print(run(), p.parse_args().out, filename)


def timed_in_rounds(fns: Dict[str, Callable[[], object]], rounds: int) -> Dict[str, dict]:
    """Each of ``fns`` timed by ``do_bench`` once per round, the rounds interleaved (A B C, A B C, ...: the GPU runs
    at its power cap, so each sees the same ramp): label -> ``{"ms": median, "rounds_ms": [...]}``, or ``{"error":
    ...}`` for one whose build or launch failed (a config that does not fit shared memory)."""
    import statistics

    from te_fused_moe.bench import do_bench_ms

    times, out = {label: [] for label in fns}, {}
    for _ in range(rounds):
        for label, fn in fns.items():
            if label in out:
                continue
            try:
                times[label].append(do_bench_ms(fn))
            except Exception as e:
                out[label] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    for label, ts in times.items():
        if label not in out:
            out[label] = {"ms": round(statistics.median(ts), 4), "rounds_ms": [round(t, 4) for t in ts]}
    return out


def add_bandwidth(entry: Dict[str, dict], nbytes: Callable[[str], float]) -> Dict[str, dict]:
    """Each timed label's GB/s (``nbytes(label)``: the bytes one call moves) next to its ms in ``entry`` (labels
    that failed or are not timings are left as they are)."""
    for label, timing in entry.items():
        if isinstance(timing, dict) and "ms" in timing:
            timing["GBps"] = round(nbytes(label) / timing["ms"] / 1e6, 1)
    return entry
