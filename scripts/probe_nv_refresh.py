"""NVFP4's weight refresh at DSv3 (``quantize.quantize_weight`` on w1 [32, 4096, 7168] and w2 [32, 7168, 2048], the
recipe's 16x16 tiles, both copies: once per optimizer step in eager training, every replay of a captured graph)
with the transposed copy's codes taken from the rowwise copy's (``quantize.WEIGHT_CODES_TRANSPOSED``, opt-in since
session 38) and encoded again from the transposed tile (the default), next to the amax pass alone; whether the two
give the same bytes. A measurement tool, not a test: ms (median over interleaved rounds) and GB/s (the weight read
twice: amax and quantize).

  usage: python scripts/probe_nv_refresh.py [--out DIR]
"""

from __future__ import annotations

from mx_probe_problem import EXPERTS, FFN, HIDDEN
from probe_results import run_and_save

ROUNDS = 3


def run() -> dict:
    import statistics

    import torch

    from te_fused_moe.backends.triton.nvfp4 import autograd as A, quantize as Q
    from te_fused_moe.bench import do_bench_ms
    from te_fused_moe.recipes import NVFP4BlockScaling

    torch.manual_seed(0)
    _, _, weight_spec = A.specs_of(NVFP4BlockScaling())
    weights = {"w1": torch.randn(EXPERTS, 2 * FFN, HIDDEN, device="cuda", dtype=torch.bfloat16),
               "w2": torch.randn(EXPERTS, HIDDEN, FFN, device="cuda", dtype=torch.bfloat16)}
    default = Q.WEIGHT_CODES_TRANSPOSED
    out = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "rounds": ROUNDS}

    def under(flag, fn):
        def call():
            Q.WEIGHT_CODES_TRANSPOSED = flag
            try:
                return fn()
            finally:
                Q.WEIGHT_CODES_TRANSPOSED = default
        return call

    for name, w in weights.items():
        fns = {"codes_transposed": under(True, lambda: Q.quantize_weight(w, weight_spec)),
               "encoded_twice": under(False, lambda: Q.quantize_weight(w, weight_spec)),
               "amax_pass": lambda: Q.weight_amax(w)}
        a, b = fns["codes_transposed"](), fns["encoded_twice"]()
        same = all(torch.equal(x, y) for x, y in ((a.data, b.data), (a.scale, b.scale), (a.data_t, b.data_t),
                                                   (a.scale_t, b.scale_t), (a.amax, b.amax)))
        times = {label: [] for label in fns}
        for _ in range(ROUNDS):
            for label, fn in fns.items():
                times[label].append(do_bench_ms(fn))
        entry = {"same_bytes": same}
        for label, ts in times.items():
            ms = statistics.median(ts)
            reads = 1 if label == "amax_pass" else 2
            entry[label] = {"ms": round(ms, 4), "GBps": round(reads * w.numel() * 2 / ms / 1e6, 1),
                            "rounds_ms": [round(t, 4) for t in ts]}
        out[name] = entry
        print(name, entry, flush=True)
    return out


if __name__ == "__main__":
    run_and_save(run, __doc__.splitlines()[0], "probe_nv_refresh.json")
