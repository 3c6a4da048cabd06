"""NVFP4's quantize passes of its two BF16 inputs at DSv3 (x [32768, 7168]; dy [32768, 7168] with stochastic rounding;
both copies, RHT on the columnwise one; 32 experts, 1024 tokens each) with the RHT as FP32 FMAs (the default) and on
BF16 tensor cores (``quantize.RHT_TENSOR_CORES``, opt-in since session 39), each with its amax pass alone; how many
bytes of the two results differ (the tensor cores' FP32 sums may round differently in the last bit, which moves a
code only next to an E2M1 rounding boundary). A measurement tool, not a test: ms (median over interleaved rounds)
and GB/s (the input read twice: amax and quantize).

  usage: python scripts/probe_nv_rht.py [--out DIR]
"""

from __future__ import annotations

from mx_probe_problem import EXPERTS, HIDDEN, ROUTED
from probe_results import add_bandwidth, run_and_save, timed_in_rounds

ROUNDS = 3


def _differing(a, b, slots: int) -> dict:
    """Per copy of two quantized results, how many of its bytes differ (the columnwise copies over the ``slots``
    token columns their tiles wrote: past them the buffers are as allocated)."""
    import torch

    differ = lambda x, y: int((x != y).sum())
    return {"data": differ(a.data, b.data), "scale": differ(a.scale, b.scale),
            "data_t": differ(a.data_t[:, :slots // 2], b.data_t[:, :slots // 2]),
            "scale_t": differ(a.scale_t[:slots // 16], b.scale_t[:slots // 16]),
            "amax_t": differ(a.amax_t, b.amax_t), "amax_t_max_rel": float(
                ((a.amax_t - b.amax_t).abs() / a.amax_t.clamp(min=torch.finfo(torch.float32).tiny)).max())}


def run() -> dict:
    import torch

    from te_fused_moe.backends.triton.nvfp4 import autograd as A, quantize as Q
    from te_fused_moe.backends.triton.schedule import build_schedule
    from te_fused_moe.bench_recipes import _call_under
    from te_fused_moe.recipes import NVFP4BlockScaling

    torch.manual_seed(0)
    counts = torch.full((EXPERTS,), ROUTED // EXPERTS, dtype=torch.int32, device="cuda")
    schedule = build_schedule(counts, ROUTED, Q.TILE)
    spec, grad_spec, _ = A.specs_of(NVFP4BlockScaling())
    out = {"shape": [ROUTED, HIDDEN, EXPERTS], "torch": torch.__version__, "device": torch.cuda.get_device_name(),
           "rounds": ROUNDS}
    for name, s in (("x", spec), ("dy", grad_spec)):
        t = torch.randn(ROUTED, HIDDEN, device="cuda", dtype=torch.bfloat16)

        def under(mma: bool, fn):  # fn with quantize.RHT_TENSOR_CORES set to mma while it runs
            return lambda: _call_under(Q.__name__, dict(RHT_TENSOR_CORES=mma), fn)

        both = lambda: Q.quantize_rows(t, schedule, EXPERTS, s, rowwise=True, colwise=True)
        amaxes = lambda: Q.group_amaxes(t, schedule, EXPERTS, torch.zeros(EXPERTS + 1, device="cuda"),
                                        torch.zeros(EXPERTS + 1, device="cuda"), True, HIDDEN)
        fns = {"fma": under(False, both), "tensor_cores": under(True, both),
               "amax_fma": under(False, amaxes), "amax_tensor_cores": under(True, amaxes)}
        if s.stochastic:  # the same Philox bits both ways: seed the generator that draws the keys
            torch.manual_seed(1)
            a = fns["fma"]()
            torch.manual_seed(1)
            b = fns["tensor_cores"]()
        else:
            a, b = fns["fma"](), fns["tensor_cores"]()
        entry = add_bandwidth({"bytes_differing": _differing(a, b, ROUTED), **timed_in_rounds(fns, ROUNDS)},
                              lambda label: (1 if label.startswith("amax") else 2) * t.numel() * 2)
        out[name] = entry
        print(name, entry, flush=True)
    return out


if __name__ == "__main__":
    run_and_save(run, __doc__.splitlines()[0], "probe_nv_rht.json")
