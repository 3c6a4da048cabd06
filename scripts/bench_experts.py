#!/usr/bin/env python
"""Benchmark the fused expert MLP (Triton backend) against the unfused PyTorch path on this GPU.

    python scripts/bench_experts.py --shapes all --out benchmarks/results     (same as: te-fused-moe bench)
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from te_fused_moe import bench  # noqa: E402

if __name__ == "__main__":
    sys.exit(bench.main())
