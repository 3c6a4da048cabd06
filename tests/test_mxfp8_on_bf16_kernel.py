"""MXFP8's GEMMs on BF16 values hosted on the BF16 backend's persistent grouped GEMM, on CPU through Triton's
interpreter, in a fresh process (``moe_reference.run_in_triton_interpreter``).

Plain GEMMs whose operands are both BF16 values (``mxfp8.gemm.PLAIN_VALUES_KERNEL``): on random data and a
routing with an empty expert and padding rows, B's rows padded past the output's width (as padded.py's
weights are) and a bias, into a NaN-poisoned output:

- ``"bf16"`` (the default) runs the BF16 backend's persistent grouped GEMM
  (``grouped_gemm.launch_scheduled``), ``"mx"`` MXFP8's own kernel; an FP8 operand always takes MXFP8's
  kernel (the routing counts the calls);
- both match the FP64 product within BF16 output rounding (``block_scaled_checks.far_from_fp64``: 2^-8 of
  each element plus 2^-12 of the sum of |products|), write every element (no NaN left), zeros on the
  padding rows;
- both are bitwise equal: under the interpreter the routed GEMM takes MXFP8's K step, so its FP32 sums run
  in that kernel's order, as the two kernels' wgmma steps do on the GPU (run 35a, DSv3: bitwise equal).

FC1 on BF16 values (``mxfp8.gemm.FC1_VALUES_KERNEL``: ``"bf16"`` = the BF16 backend's kernel with MXFP8's
quantizing store of ``a``), gated with both copies of ``a`` and not gated with the rowwise copy alone, into
poisoned buffers: h against FP64, ``a``'s values against FP64 act(h) * p within E4M3's rounding, every
element written, zeros on the padding rows, and the same bytes from both kernels (h, ``a``'s codes,
values and scales).

The dGLU on BF16 values (``mxfp8.gemm.DGLU_VALUES_KERNEL = "bf16"``: fused on the BF16 backend's kernel with
MXFP8's quantizing store of dh, taken by the dGLU's default config; not the default, run 37b), gated with both copies of dh, db1 and
dprob, and not gated with the rowwise copy alone, into poisoned buffers: dh's values against the FP64 dGLU
of the FP64 product within E4M3's rounding, dprob against FP64, every element written, zeros on the padding
rows, and the same bytes as MXFP8's own kernel running the dGLU as one kernel from the same FP32 sums (dh's
codes, values and scales, the dprob partials, db1's per-tile sums).

And offline (sm_90a builds, no GPU): the routed kernels at the configs they are given fit the GPU's shared
memory for every output dtype they write (run 36a: an FP32 da at 128 x 256 tiles needed 278-328 KB).
"""

from __future__ import annotations

import os

import pytest

from moe_reference import run_in_triton_interpreter

pytest.importorskip("triton", reason="the Triton backend's CPU tests need the triton package (pip install triton)")

COUNTS = [70, 0, 131, 40]  # an empty expert; tiles end inside experts
# the types of ``copies_arguments``' run (the quantizing stores' first nine arguments): a's rowwise copy as values
# and its columnwise copy as codes, as the fused path writes them; dh's both as values
A_COPIES_ARGS = ("*bf16", "i32", "*u8", "i32", "i32", "*u8", "i32", "*u8", "i32")
DH_COPIES_ARGS = ("*bf16", "i32", "*u8", "i32", "i32", "*bf16", "i32", "*u8", "i32")
PADDING, K, N, B_ROWS = 9, 256, 160, 256


def _count_routed_launches(grouped_gemm) -> list:
    """Wraps ``grouped_gemm.launch_scheduled`` (the routed kernel's entry) in this worker process so that
    each call appends its kind to the returned list."""
    calls = []
    launch_scheduled = grouped_gemm.launch_scheduled

    def counted(*args, **kwargs):
        calls.append(args[0])
        return launch_scheduled(*args, **kwargs)

    grouped_gemm.launch_scheduled = counted
    return calls


def _fresh_generator():
    import torch

    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))  # fresh data every run


def _worker():
    import json

    import torch
    from block_scaled_checks import far_from_fp64

    from te_fused_moe.backends.triton import grouped_gemm
    from te_fused_moe.backends.triton.mxfp8 import gemm, quantize as Q
    from te_fused_moe.backends.triton.schedule import build_schedule

    calls, g = _count_routed_launches(grouped_gemm), _fresh_generator()
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
    """The routed kernels built for sm_90a (interpreter off): plain at :func:`gemm.plain_values_config` for
    BF16 and FP32 outputs at a short and a long K (4 and 3 stages in the FC2 config), FC1 at
    :func:`gemm.fc1_values_config` for h in BF16 and FP32."""
    import torch
    from sm90_build import build_sm90

    from te_fused_moe.backends.triton import grouped_gemm
    from te_fused_moe.backends.triton.act_math import ACT_IDS
    from te_fused_moe.backends.triton.mxfp8 import gemm, quantize as Q

    report = {}
    for out_dtype, out_type in ((torch.bfloat16, "*bf16"), (torch.float32, "*fp32")):
        for k in (256, 7168):
            cfg = gemm.plain_values_config(2048, k, out_dtype)
            types = dict(a_src=f"tensordesc<bf16[{cfg.block_m}, {cfg.block_k}]>",
                         b_src=f"tensordesc<bf16[{cfg.block_n}, {cfg.block_k}]>", c_ptr=out_type, h_ptr=out_type,
                         bias_ptr="*bf16", probs_ptr="*fp32", dprob_ptr="*fp32", sched_ptr="*i32",
                         scale_ptr="*fp32", alpha="fp32", limit="fp32")
            consts = dict(MODE=grouped_gemm.MODE_PLAIN, ACT=ACT_IDS["swiglu"], GATED=False, HAS_BIAS=True,
                          HAS_PROBS=False, WRITE_DPROB=False, DPROB_PARTIALS=False, EVEN_K=True, EVEN_N=True,
                          N_VEC8=True, USE_TMA=True, B_KMAJOR=True, SPLIT_EPILOGUE=False, UPCAST=False,
                          PERSISTENT=cfg.persistent, FLATTEN=cfg.flatten, GATE_UP_BOX=False, BM=cfg.block_m,
                          BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m, HAS_SCALE=False)
            report[f"{out_type[1:]}_k{k}"] = build_sm90(grouped_gemm.grouped_gemm_kernel, types, consts,
                                                        cfg.num_warps, cfg.num_stages)
    # FC1 with MXFP8's store of a (both copies, rowwise values), h in BF16 and FP32 (3 stages)
    spec = Q.MXSpec()
    cfg = gemm.fc1_values_config(2048, 7168)
    for h_type in ("*bf16", "*fp32"):
        types = dict(a_src=f"tensordesc<bf16[{cfg.block_m}, {cfg.block_k}]>",
                     b_src=f"tensordesc<bf16[2, {cfg.block_n}, {cfg.block_k}]>", c_ptr=h_type, h_ptr=h_type,
                     bias_ptr="*bf16", probs_ptr="*fp32", dprob_ptr="*fp32", sched_ptr="*i32",
                     scale_ptr="*fp32", alpha="fp32",
                     limit="fp32", epi_store_args=A_COPIES_ARGS)
        consts = dict(MODE=grouped_gemm.MODE_ACT_FWD, ACT=ACT_IDS["swiglu"], GATED=True, HAS_BIAS=True,
                      HAS_PROBS=True, WRITE_DPROB=False, DPROB_PARTIALS=False, EVEN_K=True, EVEN_N=True, N_VEC8=True,
                      USE_TMA=True, B_KMAJOR=True, SPLIT_EPILOGUE=False, UPCAST=False, PERSISTENT=cfg.persistent,
                      FLATTEN=cfg.flatten, GATE_UP_BOX=cfg.gate_up_box, EPI_STORE=gemm.store_mx_activation,
                      EPI_STORE_CONSTS=(True, True, *spec.constexprs().values()), BM=cfg.block_m, BN=cfg.block_n,
                      BK=cfg.block_k, GROUP_M=cfg.group_m, HAS_SCALE=False)
        report[f"fc1_h_{h_type[1:]}"] = build_sm90(grouped_gemm.grouped_gemm_kernel, types, consts, cfg.num_warps,
                                                   cfg.num_stages)
    # the dGLU with MXFP8's store of dh (both copies, values; db1 sums), h in BF16 and FP32, at its default config
    cfg = gemm.dglu_values_config(2048, 7168, gemm.DGLU_VALUES_BLOCK_N)
    for h_type in ("*bf16", "*fp32"):
        types = dict(a_src=f"tensordesc<bf16[{cfg.block_m}, {cfg.block_k}]>",
                     b_src=f"tensordesc<bf16[{cfg.block_n}, {cfg.block_k}]>", c_ptr=h_type, h_ptr=h_type,
                     bias_ptr=h_type, probs_ptr="*fp32", dprob_ptr="*fp32", sched_ptr="*i32",
                     scale_ptr="*fp32", alpha="fp32",
                     limit="fp32", epi_store_args=DH_COPIES_ARGS + ("i32", "*fp32", "i32"))
        consts = dict(MODE=grouped_gemm.MODE_ACT_BWD, ACT=ACT_IDS["swiglu"], GATED=True, HAS_BIAS=False,
                      HAS_PROBS=True, WRITE_DPROB=True, DPROB_PARTIALS=True, EVEN_K=True, EVEN_N=True, N_VEC8=True,
                      USE_TMA=True, B_KMAJOR=True, SPLIT_EPILOGUE=True, UPCAST=False, PERSISTENT=cfg.persistent,
                      FLATTEN=cfg.flatten, GATE_UP_BOX=False, EPI_STORE=gemm.store_mx_gate_up_grads,
                      EPI_STORE_CONSTS=(True, True, *spec.constexprs().values(), True), BM=cfg.block_m,
                      BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m, HAS_SCALE=False)
        report[f"dglu_h_{h_type[1:]}"] = build_sm90(grouped_gemm.grouped_gemm_kernel, types, consts, cfg.num_warps,
                                                    cfg.num_stages)
    return report


def test_routed_kernels_fit_shared_memory_for_every_output_dtype():
    from sm90_build import have_tools, report_in_subprocess, tools_dir

    if not have_tools():
        pytest.skip(f"the Triton wheel has no NVIDIA tools in {tools_dir()}: cannot build for sm_90a offline")
    report = report_in_subprocess("test_mxfp8_on_bf16_kernel")
    assert len(report) == 8, report
    for name, r in report.items():
        assert r["shared"] <= 227 * 1024, (name, r)  # the sm_90 limit: else the launch fails on the GPU
        assert r["hgmma"] > 0 and r["loop_found"], (name, r)
        if not name.startswith(("fc1", "dglu")):  # their flattened loops hold the quantizing stores, which spill
            assert r["loop_spills"] == 0 and r["stack"] == 0, (name, r)


# FC1 cases: (activation, gated, copies of a written: rowwise, colwise)
FC1_CASES = {"swiglu-both-copies": ("swiglu", True, True, True), "srelu-rowwise-only": ("srelu", False, True, False)}


def _epilogue_problem() -> tuple:
    """What the FC1 and dGLU workers share: the routed-launch counter, a fresh generator, the routing
    (``COUNTS`` + ``PADDING`` rows) and its 128-row schedule, the experts' tile count (the padding group's
    first tile), F = 128, and the scale stand-ins of BF16 operands (not read)."""
    import torch

    from te_fused_moe.backends.triton import grouped_gemm
    from te_fused_moe.backends.triton.mxfp8 import quantize as Q
    from te_fused_moe.backends.triton.schedule import build_schedule

    routed = sum(COUNTS)
    rows = routed + PADDING
    sched = build_schedule(torch.tensor(COUNTS, dtype=torch.int32), rows, Q.TILE)
    return (_count_routed_launches(grouped_gemm), _fresh_generator(), torch.tensor(COUNTS, dtype=torch.int32), routed,
            len(COUNTS), 128, rows, sched, int(sched[len(COUNTS)]), torch.zeros(1, 1, dtype=torch.uint8),
            torch.zeros(1, 1, 1, dtype=torch.uint8))


def _fc1_worker():
    """FC1 on BF16 values on both kernels (``gemm.FC1_VALUES_KERNEL``), from the same random inputs into
    poisoned buffers: h and a's copies compared bytewise, unwritten elements counted, h against FP64, a's
    rowwise values against FP64 act(h) * p."""
    import json

    import torch
    from block_scaled_checks import far_from_fp64, poison_alloc, unwritten

    from te_fused_moe.activations import get_activation
    from te_fused_moe.backends.triton.mxfp8 import gemm, quantize as Q

    calls, g, counts, routed, experts, ffn, rows, sched, tiles, no_scale_a, no_scale_b = _epilogue_problem()
    report = {"shipped": gemm.FC1_VALUES_KERNEL}
    shipped = gemm.FC1_VALUES_KERNEL
    try:
        for case, (activation, gated, rowwise, colwise) in FC1_CASES.items():
            width = 2 * ffn if gated else ffn
            x = torch.randn(rows, K, generator=g).bfloat16()
            w1 = (torch.randn(experts, width, K, generator=g) * 0.1).bfloat16()
            b1 = torch.randn(experts, width, generator=g).bfloat16()
            probs = torch.rand(rows, generator=g)
            runs = {}
            for kernel in ("bf16", "mx"):
                gemm.FC1_VALUES_KERNEL = kernel
                before = len(calls)
                h = poison_alloc((rows, width), dtype=torch.bfloat16)
                q = Q.new_rows(rows, ffn, x, Q.MXSpec(), experts, rowwise, colwise, poison_alloc, row_values=True)
                gemm.launch("fc1", x, no_scale_a, w1, no_scale_b, ffn, sched, experts, Q.MXSpec(), q=q, h=h,
                            h_up_offset=ffn, b_up_rows=ffn, bias=b1, bias_up_offset=ffn, probs=probs,
                            activation=activation, gated=gated)
                copies = [q.data[:routed], q.scale[:routed]] if rowwise else []
                if colwise:  # the experts' tiles' slots (the padding group's tiles write zeros past routed)
                    copies += [q.data_t[:, :tiles * Q.TILE], q.scale_t[:tiles * (Q.TILE // 32)]]
                runs[kernel] = [h[:routed]] + copies
                starts = [0] + counts.cumsum(0).tolist()
                h_far = sum(far_from_fp64(h[first:end], x[first:end], w1[e].T, b1[e])
                            for e, (first, end) in enumerate(zip(starts, starts[1:])))
                h64 = torch.cat([x[first:end].double() @ w1[e].T.double() + b1[e].double()
                                 for e, (first, end) in enumerate(zip(starts, starts[1:]))])
                a64 = get_activation(activation).forward(h64) * probs[:routed, None].double()
                # E4M3's rounding (2^-4 of a value), plus its subnormals' spacing in a block scaled to 448
                a_far = int(((q.data[:routed].double() - a64).abs() > 2.0**-4 * a64.abs()
                             + 2.0**-10 * a64.abs().amax(dim=1, keepdim=True)).sum())
                report[f"{case}_{kernel}"] = {"routed_calls": len(calls) - before, "h_far": h_far, "a_far": a_far,
                                              "unwritten": sum(unwritten(t) for t in runs[kernel]),
                                              "padding_rows_nonzero": int((q.data[routed:] != 0).sum())}
            report[f"{case}_bitwise_equal"] = all(
                torch.equal(b.contiguous().view(torch.uint8), m.contiguous().view(torch.uint8))
                for b, m in zip(runs["bf16"], runs["mx"]))
    finally:
        gemm.FC1_VALUES_KERNEL = shipped
    print("RESULTS" + json.dumps(report))


@pytest.fixture(scope="module")
def results():
    return run_in_triton_interpreter("import test_mxfp8_on_bf16_kernel as t; t._worker()")


@pytest.fixture(scope="module")
def fc1_results():
    return run_in_triton_interpreter("import test_mxfp8_on_bf16_kernel as t; t._fc1_worker()")


@pytest.mark.parametrize("case", list(FC1_CASES))
def test_fc1_on_both_kernels_matches_fp64_and_writes_every_element(fc1_results, case):
    assert fc1_results["shipped"] == "bf16", fc1_results  # the default since run 36
    assert_both_kernels_right(fc1_results, case, ("h_far", "a_far"))


def assert_both_kernels_right(results: dict, case: str, far_keys: tuple) -> None:
    """Each kernel's run of ``case``: the routed one launched the BF16 backend's kernel once and MXFP8's
    none, no output far from FP64 (``far_keys``), every element written, zeros on the padding rows."""
    for kernel, calls in (("bf16", 1), ("mx", 0)):
        r = results[f"{case}_{kernel}"]
        assert r["routed_calls"] == calls, (kernel, r)
        assert all(r[key] == 0 for key in far_keys) and r["unwritten"] == 0, (kernel, r)
        assert r["padding_rows_nonzero"] == 0, (kernel, r)


@pytest.mark.parametrize("case", list(FC1_CASES))
def test_fc1_on_both_kernels_writes_the_same_bytes(fc1_results, case):
    assert fc1_results[f"{case}_bitwise_equal"], fc1_results


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


# dGLU cases: (activation, gated, copies of dh written: rowwise, colwise, db1)
DGLU_CASES = {"swiglu-both-copies-db1": ("swiglu", True, True, True, True),
              "srelu-rowwise-only": ("srelu", False, True, False, False)}


def _dglu_worker():
    """The dGLU on BF16 values on the BF16 backend's kernel (its default config) and on MXFP8's kernel as one
    kernel (``epilogue="fused"``), from the same random inputs into poisoned buffers: dh's copies, the dprob
    partials and db1's per-tile sums compared bytewise, unwritten elements counted, dh's rowwise values
    against the FP64 dGLU of the FP64 product, dprob against FP64."""
    import dataclasses
    import json

    import torch
    from block_scaled_checks import poison_alloc, unwritten

    from te_fused_moe.activations import get_activation
    from te_fused_moe.backends.triton.mxfp8 import gemm, quantize as Q
    from te_fused_moe.backends.triton.schedule import max_m_tiles

    calls, g, counts, routed, experts, ffn, rows, sched, tiles, no_scale_a, no_scale_b = _epilogue_problem()
    m_tiles = max_m_tiles(rows, experts, Q.TILE)
    report = {"shipped": gemm.DGLU_VALUES_KERNEL, "shipped_takes_route": gemm.default_config("dact", True).bf16_kernel}
    gemm.DGLU_VALUES_KERNEL = "bf16"  # this process's: the default config then takes the route
    route = gemm.default_config("dact", True)
    report["default_takes_route"] = route.bf16_kernel
    starts = [0] + counts.cumsum(0).tolist()
    for case, (activation, gated, rowwise, colwise, db1) in DGLU_CASES.items():
        width = 2 * ffn if gated else ffn
        dy = torch.randn(rows, K, generator=g).bfloat16()
        w2t = (torch.randn(experts, ffn, K, generator=g) * 0.1).bfloat16()  # B_e [N, K]: w2's transposed copy
        h = torch.randn(rows, width, generator=g).bfloat16()
        h[routed:] = 0  # as FC1 leaves the padding rows
        probs = torch.rand(rows, generator=g)
        da64 = torch.cat([dy[first:end].double() @ w2t[e].T.double()
                          for e, (first, end) in enumerate(zip(starts, starts[1:]))])
        spec = get_activation(activation)
        dh64 = spec.backward(h[:routed].double(), da64 * probs[:routed, None].double())
        dprob64 = (da64 * spec.forward(h[:routed].double())).sum(1)
        runs = {}
        for kernel, cfg in (("bf16", route), ("mx", dataclasses.replace(route, bf16_kernel=False, epilogue="fused"))):
            before = len(calls)
            q = Q.new_rows(rows, width, h, Q.MXSpec(), experts, rowwise, colwise, poison_alloc, row_values=True,
                           col_values=True)
            dprob = poison_alloc((ffn // cfg.block_n, rows), dtype=torch.float32)
            dbias = poison_alloc((m_tiles, width), dtype=torch.float32) if db1 else None
            gemm.launch("dact", dy, no_scale_a, w2t, no_scale_b, ffn, sched, experts, Q.MXSpec(), q=q,
                        q_up_offset=ffn, h=h, h_up_offset=ffn, probs=probs, dprob=dprob, dbias=dbias,
                        activation=activation, gated=gated, config=cfg)
            outs = [q.data[:routed], q.scale[:routed], dprob[:, :routed]]
            if colwise:  # the experts' tiles' slots (the padding group's tiles write zeros past routed)
                outs += [q.data_t[:, :tiles * Q.TILE], q.scale_t[:tiles * (Q.TILE // 32)]]
            if db1:
                outs.append(dbias[:tiles])
            runs[kernel] = outs
            # E4M3's rounding (2^-4 of a value), plus its subnormals' spacing in a block scaled to 448
            dh_far = int(((q.data[:routed].double() - dh64).abs() > 2.0**-4 * dh64.abs()
                          + 2.0**-10 * dh64.abs().amax(dim=1, keepdim=True)).sum())
            dprob_far = int(((dprob[:, :routed].double().sum(0) - dprob64).abs()
                             > 1e-5 * (da64.abs() * spec.forward(h[:routed].double()).abs()).sum(1) + 1e-6).sum())
            report[f"{case}_{kernel}"] = {"routed_calls": len(calls) - before, "dh_far": dh_far,
                                          "dprob_far": dprob_far, "unwritten": sum(unwritten(t) for t in outs),
                                          "padding_rows_nonzero": int((q.data[routed:] != 0).sum())}
        report[f"{case}_bitwise_equal"] = all(
            torch.equal(b.contiguous().view(torch.uint8), m.contiguous().view(torch.uint8))
            for b, m in zip(runs["bf16"], runs["mx"]))
    print("RESULTS" + json.dumps(report))


@pytest.fixture(scope="module")
def dglu_results():
    return run_in_triton_interpreter("import test_mxfp8_on_bf16_kernel as t; t._dglu_worker()")


@pytest.mark.parametrize("case", list(DGLU_CASES))
def test_dglu_on_both_kernels_matches_fp64_and_writes_every_element(dglu_results, case):
    assert dglu_results["shipped"] == "mx" and not dglu_results["shipped_takes_route"], dglu_results  # run 37b
    assert dglu_results["default_takes_route"], dglu_results
    assert_both_kernels_right(dglu_results, case, ("dh_far", "dprob_far"))


@pytest.mark.parametrize("case", list(DGLU_CASES))
def test_dglu_on_both_kernels_writes_the_same_bytes(dglu_results, case):
    assert dglu_results[f"{case}_bitwise_equal"], dglu_results


def test_dglu_route_refuses_what_it_cannot_run():
    """A config asking for the dGLU on the BF16 backend's kernel with an FP8 operand or without dh's copies:
    a ValueError naming the config, raised before any launch (plain CPU tensors)."""
    import dataclasses

    import torch

    from te_fused_moe.backends.triton.mxfp8 import gemm, quantize as Q
    from te_fused_moe.backends.triton.schedule import build_schedule

    rows, k, ffn, experts = 256, 256, 128, 2
    sched = build_schedule(torch.tensor([100, 156], dtype=torch.int32), rows, Q.TILE)
    cfg = dataclasses.replace(gemm.default_config("dact", True), block_n=128, bf16_kernel=True, epilogue="auto")
    values = torch.randn(rows, k).bfloat16()
    w2t = torch.randn(experts, ffn, k).bfloat16()
    h = torch.randn(rows, 2 * ffn).bfloat16()
    q = Q.new_rows(rows, 2 * ffn, h, Q.MXSpec(), experts, True, False, row_values=True)
    scales = torch.full((rows, k // 32), 127, dtype=torch.uint8)
    codes = values.float().to(torch.float8_e4m3fn)
    no_scale = torch.zeros(1, 1, 1, dtype=torch.uint8)
    common = dict(q_up_offset=ffn, h=h, h_up_offset=ffn, gated=True, config=cfg)
    with pytest.raises(ValueError, match="bf16_kernel.*both operands as BF16 values"):
        gemm.launch("dact", codes, scales, w2t, no_scale, ffn, sched, experts, Q.MXSpec(), q=q, **common)
    with pytest.raises(ValueError, match="bf16_kernel needs dh's quantized copies"):
        gemm.launch("dact", values, scales, w2t, no_scale, ffn, sched, experts, Q.MXSpec(), q=None, **common)
