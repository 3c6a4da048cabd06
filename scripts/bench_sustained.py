#!/usr/bin/env python
"""Forward + backward under sustained load (the GPU at its power limit), with the SM clock beside each timing:
``te_fused_moe.bench_sustained``.

    python scripts/bench_sustained.py --impls bf16_unfused,mxfp8_unfused,mxfp8_fused --out "$OUT/sustained"
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from te_fused_moe import bench_sustained  # noqa: E402

if __name__ == "__main__":
    sys.exit(bench_sustained.main())
