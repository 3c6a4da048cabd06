#!/usr/bin/env python
"""cuBLAS FP8 (per-tensor scales) at the expert MLP's six GEMM shapes, with cuBLAS's FP32 promotion
of the tensor cores' partial sums (its default, as the recipe benchmark reports it) and without it
(fast accumulation: the tensor cores alone), in interleaved rounds. See te_fused_moe/bench_ceiling.py.

    python scripts/cublas_ceiling.py --shape dsv3-e32 --rounds 3 --out "$OUT/cublas_ceiling.json"
"""

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from te_fused_moe import bench, bench_ceiling  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="dsv3-e32", choices=sorted(bench.SHAPES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="", help="JSON file for the per-round times")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("times cuBLAS FP8 GEMMs on a CUDA GPU")
    shape = bench.SHAPES[args.shape]
    inputs = bench.make_inputs(shape)  # the recipe benchmark's routing, and w1's rows (n1)
    counts, n1 = inputs["counts"].tolist(), inputs["w1"].shape[1]
    del inputs  # only the GEMMs' own operands stay on the GPU while they are timed
    rounds = {"promoted": [], "fast_accum": []}
    for _ in range(args.rounds):
        for mode in rounds:
            rounds[mode].append(bench_ceiling.measure(counts, shape.hidden, shape.ffn, n1, mode == "fast_accum"))
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  {args.shape}, medians of {args.rounds} rounds")
    medians = {mode: {name: statistics.median(r[name]["ms"] for r in rs) for name in bench_ceiling.OUR_GEMM_KERNEL}
               for mode, rs in rounds.items()}
    for name in bench_ceiling.OUR_GEMM_KERNEL:
        p, f = medians["promoted"][name], medians["fast_accum"][name]
        print(f"  {name:10} promoted {p:7.3f} ms  fast accum {f:7.3f} ms  ({p / f:.2f}x)")
    total = {mode: sum(m.values()) for mode, m in medians.items()}
    print(f"  {'sum':10} promoted {total['promoted']:7.3f} ms  fast accum {total['fast_accum']:7.3f} ms  "
          f"({total['promoted'] / total['fast_accum']:.2f}x)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": args.shape,
                       "counts": counts, "rounds": rounds, "medians_ms": medians}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
