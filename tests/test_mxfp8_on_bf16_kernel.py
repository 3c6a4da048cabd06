"""MXFP8's plain GEMMs whose operands are both BF16 values (``mxfp8.gemm.PLAIN_VALUES_KERNEL``), on CPU
through Triton's interpreter, in a fresh process (``moe_reference.run_in_triton_interpreter``).

On random data and a routing with an empty expert and padding rows, B's rows padded past the output's
width (as padded.py's weights are) and a bias, into a NaN-poisoned output:

- ``"bf16"`` (the default) runs the BF16 backend's persistent grouped GEMM
  (``grouped_gemm.launch_scheduled``), ``"mx"`` MXFP8's own kernel; an FP8 operand always takes MXFP8's
  kernel (the routing counts the calls);
- both match the FP64 product within BF16 output rounding (``block_scaled_checks.far_from_fp64``: 2^-8 of
  each element plus 2^-12 of the sum of |products|), write every element (no NaN left), zeros on the
  padding rows;
- both are bitwise equal: under the interpreter the routed GEMM takes MXFP8's K step, so its FP32 sums run
  in that kernel's order, as the two kernels' wgmma steps do on the GPU (run 35a, DSv3: bitwise equal).

And offline (sm_90a builds, no GPU): the routed kernel at the configs it is given fits the GPU's shared
memory for every output dtype it writes (run 36a: an FP32 da at 128 x 256 tiles needed 278-328 KB).
"""

from __future__ import annotations

import os

import pytest

from moe_reference import run_in_triton_interpreter

pytest.importorskip("triton", reason="the Triton backend's CPU tests need the triton package (pip install triton)")

COUNTS = [70, 0, 131, 40]  # an empty expert; tiles end inside experts
PADDING, K, N, B_ROWS = 9, 256, 160, 256


def _worker():
    import json

    import torch
    from block_scaled_checks import far_from_fp64

    from te_fused_moe.backends.triton import grouped_gemm
    from te_fused_moe.backends.triton.mxfp8 import gemm, quantize as Q
    from te_fused_moe.backends.triton.schedule import build_schedule

    calls = []
    launch_scheduled = grouped_gemm.launch_scheduled

    def counted(*args, **kwargs):
        calls.append(args[0])
        return launch_scheduled(*args, **kwargs)

    grouped_gemm.launch_scheduled = counted
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))  # fresh data every run
    counts = torch.tensor(COUNTS, dtype=torch.int32)
    routed, experts = sum(COUNTS), len(COUNTS)
    rows = routed + PADDING
    a = torch.randn(rows, K, generator=g).bfloat16()
    b = (torch.randn(experts, B_ROWS, K, generator=g) * 0.1).bfloat16()
    bias = torch.randn(experts, N, generator=g).bfloat16()
    sched = build_schedule(counts, rows, Q.TILE)
    no_scale_a, no_scale_b = torch.zeros(1, 1, dtype=torch.uint8), torch.zeros(1, 1, 1, dtype=torch.uint8)

    def over_bound(c):
        starts = [0] + torch.tensor(COUNTS).cumsum(0).tolist()
        return sum(far_from_fp64(c[first:end], a[first:end], b[e, :N].T, bias[e])
                   for e, (first, end) in enumerate(zip(starts, starts[1:])))

    out, report = {}, {}
    shipped = gemm.PLAIN_VALUES_KERNEL
    try:
        for kernel in ("bf16", "mx"):
            gemm.PLAIN_VALUES_KERNEL = kernel
            before = len(calls)
            c = torch.full((rows, N), float("nan"), dtype=torch.bfloat16)
            gemm.launch("fc2", a, no_scale_a, b, no_scale_b, N, sched, experts, Q.MXSpec(), c=c, bias=bias)
            out[kernel] = c
            report[kernel] = {"routed_calls": len(calls) - before, "unwritten": int(c.isnan().sum()),
                              "over_bound": over_bound(c),
                              "padding_nonzero": int((c[routed:] != 0).sum())}
        # an FP8 operand (codes with unit E8M0 scales): MXFP8's kernel, whatever the switch says
        gemm.PLAIN_VALUES_KERNEL = "bf16"
        before = len(calls)
        codes = a.float().clamp(-448, 448).to(torch.float8_e4m3fn)
        gemm.launch("fc2", codes, torch.full((rows, K // 32), 127, dtype=torch.uint8), b, no_scale_b, N, sched,
                    experts, Q.MXSpec(), c=torch.empty(rows, N, dtype=torch.bfloat16), bias=bias)
        report["fp8_operand_routed_calls"] = len(calls) - before
    finally:
        gemm.PLAIN_VALUES_KERNEL = shipped
    report["shipped"] = shipped
    report["bitwise_equal"] = bool(torch.equal(out["bf16"], out["mx"]))
    print("RESULTS" + json.dumps(report))


def sm90_build_report() -> dict:
    """The routed kernel built for sm_90a (interpreter off) at :func:`gemm.plain_values_config` for BF16 and
    FP32 outputs at a short and a long K (4 and 3 stages in the FC2 config)."""
    import torch
    from sm90_build import build_sm90

    from te_fused_moe.backends.triton import grouped_gemm
    from te_fused_moe.backends.triton.act_math import ACT_IDS
    from te_fused_moe.backends.triton.mxfp8 import gemm

    report = {}
    for out_dtype, out_type in ((torch.bfloat16, "*bf16"), (torch.float32, "*fp32")):
        for k in (256, 7168):
            cfg = gemm.plain_values_config(2048, k, out_dtype)
            types = dict(a_src=f"tensordesc<bf16[{cfg.block_m}, {cfg.block_k}]>",
                         b_src=f"tensordesc<bf16[{cfg.block_n}, {cfg.block_k}]>", c_ptr=out_type, h_ptr=out_type,
                         bias_ptr="*bf16", probs_ptr="*fp32", dprob_ptr="*fp32", sched_ptr="*i32", alpha="fp32",
                         limit="fp32")
            consts = dict(MODE=grouped_gemm.MODE_PLAIN, ACT=ACT_IDS["swiglu"], GATED=False, HAS_BIAS=True,
                          HAS_PROBS=False, WRITE_DPROB=False, DPROB_PARTIALS=False, EVEN_K=True, EVEN_N=True,
                          N_VEC8=True, USE_TMA=True, B_KMAJOR=True, SPLIT_EPILOGUE=False, UPCAST=False,
                          PERSISTENT=cfg.persistent, FLATTEN=cfg.flatten, GATE_UP_BOX=False, BM=cfg.block_m,
                          BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m)
            report[f"{out_type[1:]}_k{k}"] = build_sm90(grouped_gemm.grouped_gemm_kernel, types, consts,
                                                        cfg.num_warps, cfg.num_stages)
    return report


def test_routed_kernel_fits_shared_memory_for_every_output_dtype():
    from sm90_build import have_tools, report_in_subprocess, tools_dir

    if not have_tools():
        pytest.skip(f"the Triton wheel has no NVIDIA tools in {tools_dir()}: cannot build for sm_90a offline")
    report = report_in_subprocess("test_mxfp8_plain_kernel")
    assert len(report) == 4, report
    for name, r in report.items():
        assert r["shared"] <= 227 * 1024, (name, r)  # the sm_90 limit: else the launch fails on the GPU
        assert r["hgmma"] > 0 and r["loop_found"] and r["loop_spills"] == 0 and r["stack"] == 0, (name, r)


@pytest.fixture(scope="module")
def results():
    return run_in_triton_interpreter("import test_mxfp8_plain_kernel as t; t._worker()")


def test_bf16_values_route_to_the_persistent_kernel_by_default(results):
    assert results["shipped"] == "bf16", results
    assert results["bf16"]["routed_calls"] == 1 and results["mx"]["routed_calls"] == 0, results
    assert results["fp8_operand_routed_calls"] == 0, results


@pytest.mark.parametrize("kernel", ["bf16", "mx"])
def test_both_kernels_match_fp64_and_write_every_element(results, kernel):
    r = results[kernel]
    assert r["unwritten"] == 0 and r["over_bound"] == 0 and r["padding_nonzero"] == 0, r


def test_both_kernels_sum_in_the_same_order(results):
    assert results["bitwise_equal"], results
