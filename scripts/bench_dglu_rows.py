"""FP8 block's one-pass dGLU at an FFN size off the 128 tile (``fp8_block/dglu_rows.py``), alone, at
GPT-OSS's shape (F = 2880: F % 128 = 64), same process: its grid with the block index fastest (the
default) and with the M tile fastest, against the GLU pass + FP8 block quantize pass it replaces.
Before timing, every variant's codes and scales (both copies) must equal the passes' bit for bit, and
its column sums and dprob agree to FP32 summation order. (Run 27c timed here a walk over units, since
removed: commit b86fe1e.)

  usage: python scripts/bench_dglu_rows.py [--shape gpt-oss] [--routing balanced|zipf] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from unittest import mock

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from te_fused_moe import bench  # noqa: E402
from te_fused_moe.activations import ActivationConfig  # noqa: E402
from te_fused_moe.backends.triton.fp8_block import dglu_rows  # noqa: E402
from te_fused_moe.backends.triton.fp8_block.quantize import FP8Spec, quantize_rows  # noqa: E402
from te_fused_moe.backends.triton.glu_rows import glu_backward  # noqa: E402
from te_fused_moe.backends.triton.padded import padded_size  # noqa: E402
from te_fused_moe.backends.triton.schedule import TILE_END, build_schedule, max_m_tiles, schedule_table  # noqa: E402

# (name, module flags); None: the passes
VARIANTS = [("passes", None), ("blocks_fastest", dict(BLOCKS_FASTEST=True)),
            ("m_tiles_fastest", dict(BLOCKS_FASTEST=False))]


def run(variant, inputs, alloc=torch.empty):
    """``(dhq, dprob, column sums)`` of one variant (``alloc``: zeros to compare slots no kernel writes)."""
    name, flags = variant
    da, h, ffn, schedule, experts, probs, act, spec = inputs
    sums = alloc((max_m_tiles(h.shape[0], experts, 128), h.shape[1]), device=h.device, dtype=torch.float32)
    if flags is None:
        dh, dprob = glu_backward(da, h, ffn, schedule, experts, probs, act, True, alloc)
        return quantize_rows(dh, schedule, experts, spec, colwise=True, col_sums=sums, alloc=alloc), dprob, sums
    with mock.patch.multiple(dglu_rows, **flags):
        dhq, dprob = dglu_rows.dglu_quantized(da, h, ffn, schedule, experts, probs, act, True, spec, rowwise=True,
                                              colwise=True, col_sums=sums, alloc=alloc)
    return dhq, dprob, sums


def differences(got, ref, n1: int, tiles: int) -> dict:
    bits = lambda t: t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)
    out = {part: int((bits(getattr(got[0], part)) != bits(getattr(ref[0], part))).sum())
           for part in ("data", "scale", "data_t")}
    out["scale_t"] = int((bits(got[0].scale_t[:tiles]) != bits(ref[0].scale_t[:tiles])).sum())  # the tiles in use
    rel = lambda a, b: float((a - b).abs().max() / b.abs().max())
    # sums: FP32 in each kernel's reduction order
    out["col_sums"], out["dprob"] = rel(got[2][:tiles, :n1], ref[2][:tiles, :n1]), rel(got[1], ref[1])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="gpt-oss")
    parser.add_argument("--routing", default="balanced")
    parser.add_argument("--out", default="benchmarks/results/dglu_rows")
    parser.add_argument("--tokens", type=int, default=None, help="routed rows (default: the shape's)")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run under TRITON_INTERPRET=1, untimed")
    args = parser.parse_args()
    shape = dataclasses.replace(bench.SHAPES[args.shape], routing=args.routing)
    if args.tokens:
        shape = dataclasses.replace(shape, tokens=args.tokens)
    dev = args.device
    act = ActivationConfig(shape.activation).launch_args
    ffn, T, E = shape.ffn, shape.tokens, shape.experts
    n1 = 2 * ffn if act["gated"] else ffn
    g = torch.Generator(device=dev).manual_seed(0)
    counts = bench.routing_counts(shape, torch.Generator().manual_seed(0)).to(dev)
    schedule = build_schedule(counts, T, 128)
    h = (torch.randn(T, padded_size(n1, 128), device=dev, generator=g) * 3).to(torch.bfloat16)
    da = torch.randn(T, padded_size(ffn, 128), device=dev, generator=g).to(torch.bfloat16)
    probs = torch.rand(T, device=dev, generator=g) + 0.1
    inputs = (da, h, ffn, schedule, E, probs, act, FP8Spec.of("e4m3", True))
    tiles = int(schedule_table(schedule, E)[TILE_END, -1])  # the tiles in use: the padding group's end

    ref = run(VARIANTS[0], inputs, torch.zeros)
    results = {}
    for variant in VARIANTS:
        name = variant[0]
        try:
            diff = differences(run(variant, inputs, torch.zeros), ref, n1, tiles)
            exact = (all(diff[k] == 0 for k in ("data", "scale", "data_t", "scale_t"))
                     and diff["col_sums"] <= 1e-6 and diff["dprob"] <= 1e-6)
            ms = bench.do_bench_ms(lambda: run(variant, inputs)) if exact and dev == "cuda" else None
            results[name] = {"ms": ms, "exact": exact, **diff}
        except Exception as exc:  # recorded: the other variants still run
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        r = results[name]
        print(f"{name:18s} " + (f"{r['ms']:.3f} ms  " if r.get("ms") else "") + json.dumps(r), flush=True)
    base = {k: results[k].get("ms") for k in ("passes", "m_tiles_fastest")}
    for name, r in results.items():
        for k, ms in base.items():
            if r.get("ms") and ms:
                r[f"x_vs_{k}"] = ms / r["ms"]
    print("\n".join(f"{n:18s} x{r.get('x_vs_m_tiles_fastest', 0):.2f} vs m_tiles_fastest, x{r.get('x_vs_passes', 0):.2f} vs passes"
                    for n, r in results.items() if r.get("ms")))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"dglu_rows_{args.shape}_{args.routing}.json")
    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if dev == "cuda" else dev, "torch": torch.__version__, "shape": dataclasses.asdict(shape),
                   "results": results}, f, indent=1)
    print("saved", path)


if __name__ == "__main__":
    main()
