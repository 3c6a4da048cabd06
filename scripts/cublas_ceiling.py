#!/usr/bin/env python
"""FP8 GEMMs without block scaling at the expert MLP's six GEMM shapes (te_fused_moe/bench_ceiling.py),
four ways, in interleaved rounds:

- promoted: cuBLAS (torch._scaled_mm, per-tensor scales) with its own FP32 promotion of the tensor
  cores' partial sums, its default and what the recipe benchmark reports; token GEMMs dense;
- fast_accum: the same without that promotion (the tensor cores alone);
- per_expert: as promoted, but the token GEMMs one per expert, each reading its own weights;
- grouped: torch._scaled_grouped_mm (rowwise scales applied after the K loop), one grouped GEMM each.

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
    counts = bench.make_inputs(shape)["counts"].tolist()
    n1 = 2 * shape.ffn if shape.activation in ("swiglu", "geglu", "gpt_oss_swiglu") else shape.ffn
    modes = {"promoted": {}, "fast_accum": dict(fast_accum=True), "per_expert": dict(per_expert_tokens=True),
             "grouped": dict(grouped=True)}
    rounds = {mode: [] for mode in modes}
    for _ in range(args.rounds):
        for mode, kw in modes.items():
            rounds[mode].append(bench_ceiling.measure(counts, shape.hidden, shape.ffn, n1, **kw))
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  {args.shape}, medians of {args.rounds} rounds")
    medians = {mode: {name: statistics.median(r[name]["ms"] for r in rs) for name in bench_ceiling.OUR_GEMM_KERNEL}
               for mode, rs in rounds.items()}
    medians["sum"] = {mode: sum(m.values()) for mode, m in medians.items()}
    print(f"  {'ms':10} " + " ".join(f"{mode:>11}" for mode in modes) + "   promoted / fast_accum")
    for name in list(bench_ceiling.OUR_GEMM_KERNEL) + ["sum"]:
        row = medians[name] if name == "sum" else {mode: medians[mode][name] for mode in modes}
        print(f"  {name:10} " + " ".join(f"{row[mode]:11.3f}" for mode in modes) +
              f"   {row['promoted'] / row['fast_accum']:.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": args.shape,
                       "counts": counts, "rounds": rounds, "medians_ms": medians}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
