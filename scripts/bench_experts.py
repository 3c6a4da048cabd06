#!/usr/bin/env python
"""Benchmark the fused expert MLP (Triton backend) against the unfused PyTorch path on this GPU.

    python scripts/bench_experts.py --shapes all --out benchmarks/results
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from te_fused_moe import bench  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="all", help=f"comma-separated from {sorted(bench.SHAPES)} or 'all'")
    parser.add_argument("--out", default="benchmarks/results", help="folder for the JSON, text table and PNG plot")
    parser.add_argument("--no-kernels", action="store_true", help="skip the per-kernel timings")
    parser.add_argument("--tune", action="store_true", help="time block-size variants of each kernel instead")
    args = parser.parse_args()
    names = list(bench.SHAPES) if args.shapes == "all" else args.shapes.split(",")
    unknown = [n for n in names if n not in bench.SHAPES]
    if unknown:
        parser.error(f"--shapes: unknown {unknown}; expected names from {sorted(bench.SHAPES)}")
    if args.tune:
        print(bench.tune(names, out_dir=args.out)["table"])
        return
    report = bench.run(names, out_dir=args.out, kernels=not args.no_kernels)
    print(bench.summary_table(report))


if __name__ == "__main__":
    main()
