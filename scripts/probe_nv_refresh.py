"""NVFP4's weight refresh at DSv3 (``quantize.quantize_weight`` on w1 [32, 4096, 7168] and w2 [32, 7168, 2048], the
recipe's 16x16 tiles, both copies: once per optimizer step in eager training, every replay of a captured graph)
with the transposed copy's codes taken from the rowwise copy's (``quantize.WEIGHT_CODES_TRANSPOSED``, the default
since run 42) and encoded again from the transposed tile (before run 42), next to the amax pass alone; whether the two
give the same bytes. A measurement tool, not a test: ms (median over interleaved rounds) and GB/s (the weight read
twice: amax and quantize).

  usage: python scripts/probe_nv_refresh.py [--out DIR]
"""

from __future__ import annotations

from mx_probe_problem import EXPERTS, FFN, HIDDEN
from probe_results import add_bandwidth, run_and_save, timed_in_rounds

ROUNDS = 3


def run() -> dict:
    import torch

    from te_fused_moe.backends.triton.nvfp4 import autograd as A, quantize as Q
    from te_fused_moe.bench_recipes import _call_under
    from te_fused_moe.recipes import NVFP4BlockScaling

    torch.manual_seed(0)
    _, _, weight_spec = A.specs_of(NVFP4BlockScaling())
    weights = {"w1": torch.randn(EXPERTS, 2 * FFN, HIDDEN, device="cuda", dtype=torch.bfloat16),
               "w2": torch.randn(EXPERTS, HIDDEN, FFN, device="cuda", dtype=torch.bfloat16)}
    out = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "rounds": ROUNDS}
    # the refresh with quantize.WEIGHT_CODES_TRANSPOSED set to codes_t while it runs
    refresh = lambda w, codes_t: lambda: _call_under(Q.__name__, dict(WEIGHT_CODES_TRANSPOSED=codes_t),
                                                     lambda: Q.quantize_weight(w, weight_spec))
    for name, w in weights.items():
        fns = {"codes_transposed": refresh(w, True), "encoded_twice": refresh(w, False),
               "amax_pass": lambda: Q.weight_amax(w)}
        a, b = fns["codes_transposed"](), fns["encoded_twice"]()
        same = all(torch.equal(x, y) for x, y in ((a.data, b.data), (a.scale, b.scale), (a.data_t, b.data_t),
                                                   (a.scale_t, b.scale_t), (a.amax, b.amax)))
        entry = add_bandwidth({"same_bytes": same, **timed_in_rounds(fns, ROUNDS)},
                              lambda label: (1 if label == "amax_pass" else 2) * w.numel() * 2)
        out[name] = entry
        print(name, entry, flush=True)
    return out


if __name__ == "__main__":
    run_and_save(run, __doc__.splitlines()[0], "probe_nv_refresh.json")
