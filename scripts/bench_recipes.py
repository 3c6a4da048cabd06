#!/usr/bin/env python
"""Benchmark the FP8 block recipe on this GPU: FP8-block fused vs FP8-block unfused vs
torch._scaled_grouped_mm (FP8 rowwise) vs BF16 unfused/fused, forward, backward and both.

    python scripts/bench_recipes.py --out "$OUT"            (DeepSeek-V3 E=32 shapes, ~2-3 minutes on an H200)
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from te_fused_moe import bench_recipes  # noqa: E402

if __name__ == "__main__":
    sys.exit(bench_recipes.main())
