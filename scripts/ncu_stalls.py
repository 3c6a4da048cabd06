#!/usr/bin/env python
"""Where a kernel's warps stall, per SASS instruction, from Nsight Compute's source page:

    ncu --section WarpStateStats --section SourceCounters -k regex:NAME -c 1 -o rep python ...
    ncu -i rep.ncu-rep --page source --csv --print-source sass > rep_sass.csv
    python scripts/ncu_stalls.py rep_sass.csv [--kernel I] [--top N] [--json OUT]

Prints the share of all warp samples per stall reason, per opcode, and the hottest instructions. The
samples count every resident warp, also warps that only wait for the kernel to end: in the
warp-specialised Gluon kernels the producer warpgroup's three idle warps sit at a ``NOP`` on a
barrier for the whole kernel (a quarter of all samples, "barrier" stalls that cost no issue slot), so
the ``NOP`` lines are left out unless ``--keep-idle``.
"""

from __future__ import annotations

import argparse
import collections
import csv
import json
import re
import sys
from typing import Dict, List

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def read_source_csv(path: str) -> List[List[Dict[str, str]]]:
    """The instruction rows of each kernel in an ``ncu --page source --csv`` export, in file order."""
    kernels, header = [], None
    with open(path, newline="") as f:
        for record in csv.reader(f):
            if not record:
                continue
            if record[0] == "Kernel Name":
                kernels.append([])
                header = None
            elif record[0] == "Address":
                header = record
            elif kernels and header:
                kernels[-1].append(dict(zip(header, record)))
    return kernels


def opcode(source: str) -> str:
    """The opcode of a SASS line (its predicate and modifiers dropped): ``@!P0 BRA 0x..`` -> ``BRA``."""
    match = re.match(r"\s*(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", source)
    return match.group(1) if match else "?"


def _count(value: str) -> int:
    return int(value.replace(",", "")) if value and value.strip() not in ("", "-") else 0


def summarize(rows: List[Dict[str, str]], top: int = 20, skip_idle: bool = True) -> Dict:
    """Stall shares (of the samples kept) by reason and by opcode, and the ``top`` hottest instructions.
    ``skip_idle``: leave out the ``NOP`` lines, where idle warps wait (see the module doc)."""
    reasons = [h for h in rows[0] if h.startswith("stall_") and "Not Issued" not in h] if rows else []
    kept = [r for r in rows if not (skip_idle and opcode(r["Source"]) == "NOP")]
    total = sum(_count(r[SAMPLES]) for r in kept) or 1
    by_reason, by_opcode = collections.Counter(), collections.defaultdict(collections.Counter)
    for r in kept:
        op = opcode(r["Source"])
        for reason in reasons:
            by_reason[reason[len("stall_"):]] += _count(r[reason])
            by_opcode[op][reason[len("stall_"):]] += _count(r[reason])
    hottest = sorted(kept, key=lambda r: -_count(r[SAMPLES]))[:top]
    return {
        "samples": total, "instructions": len(kept), "left_out": len(rows) - len(kept),
        "by_reason": {k: round(v / total, 4) for k, v in by_reason.most_common() if v},
        "by_opcode": {op: {"share": round(sum(c.values()) / total, 4),
                           "reasons": {k: round(v / total, 4) for k, v in c.most_common(3) if v}}
                      for op, c in sorted(by_opcode.items(), key=lambda kv: -sum(kv[1].values()))[:top]},
        "hottest": [{"address": r["Address"], "source": r["Source"].strip(), "executed": _count(r[EXECUTED]),
                     "share": round(_count(r[SAMPLES]) / total, 4),
                     "reasons": {k[len("stall_"):]: _count(r[k]) for k in reasons if _count(r[k])}}
                    for r in hottest],
    }


def _print(summary: Dict) -> None:
    print(f"{summary['samples']} samples over {summary['instructions']} instructions "
          f"({summary['left_out']} NOP lines of idle warps left out)")
    print("by reason: " + ", ".join(f"{k} {v:.3f}" for k, v in summary["by_reason"].items()))
    print("by opcode:")
    for op, entry in summary["by_opcode"].items():
        print(f"  {op:10s} {entry['share']:.3f}  " + ", ".join(f"{k} {v:.3f}" for k, v in entry["reasons"].items()))
    print("hottest instructions:")
    for h in summary["hottest"]:
        top3 = dict(collections.Counter(h["reasons"]).most_common(3))
        print(f"  {h['share']:.3f} {h['address'][-5:]} {h['source'][:64]:64s} x{h['executed']:<9d} {top3}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    parser.add_argument("--kernel", type=int, default=0, help="which profiled launch in the file (0: the first)")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--keep-idle", action="store_true", help="keep the instructions idle warps wait at")
    parser.add_argument("--json", default=None, help="also write the summary here")
    args = parser.parse_args(argv)
    kernels = read_source_csv(args.csv)
    if not 0 <= args.kernel < len(kernels):
        parser.error(f"--kernel: expected 0..{len(kernels) - 1} ({len(kernels)} launches in {args.csv}), "
                     f"got {args.kernel}")
    summary = summarize(kernels[args.kernel], args.top, not args.keep_idle)
    _print(summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
