"""The Gluon FP8 block GEMMs (``fp8_block/wgmma_ws.py``, warp-specialised, on the mainloop of
``fp8_block/wgmma_gemm.py``) on a CPU machine: Gluon has no interpreter, so CI builds them for sm_90a
offline and checks the properties they exist for, and the engine choice. Their numerics run on the
H200: tests/gpu/test_fp8_block_wgmma_gpu.py.

Build checks (ptxas from the Triton wheel), for the plain GEMM and the wgrad, as launched by default
and in their other supported shapes (one or two consumer partitions, with and without the TMA store
of the output, BF16 or FP32 out; the wgrad at 64x128 on one warpgroup at two CTAs per SM): no spills; 4 FP8 wgmmas per
128-wide K block at each of the four issue sites (first block, the loop's two, the odd tail) per
consumer partition; the wgmmas of a block share one commit group (when a non-wgmma instruction touches
an in-flight accumulator, ptxas serialises every wgmma and gives each its own group: C7514); waits
that leave one group in flight (the promotion under the next wgmma); shared memory within the H200's
227 KB; the consumers' ``setmaxnreg``: the producer warp's registers must reach them; the wgrad
producer's proxy fence before each TMA refill (its consumers read the column scales with ordinary loads).
The same builds with the CUDA toolkit's ptxas (``TE_FUSED_MOE_PTXAS=toolkit``) keep all of that and
interleave yield hints into the promotions' FFMAs, which Triton's own ptxas does not.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton", reason="the Triton backend's CPU tests need the triton package (pip install triton)")


def sm90_build_report() -> dict:
    """Builds the plain GEMM as FC2 (E4M3 A, bias) and as FC1 dgrad (E5M2 A) launch it, and the wgrad
    (E5M2 gradient, E4M3 input). Needs TRITON_INTERPRET unset."""
    from sm90_build import build_gluon_sm90
    from triton.runtime.jit import mangle_type

    from te_fused_moe.backends.triton.fp8_block import wgmma_gemm as W, wgmma_ws as WS
    from te_fused_moe.backends.triton.fp8_block.quantize import new_row_scales
    from te_fused_moe.backends.triton.fp8_block.wgrad import default_config

    def build(kernel, types, consts, warps, ctas_per_sm, tile_elements, consumers, prefetch=WS.TILE_PREFETCH):
        launch = WS._partitions(warps, consumers, ctas_per_sm, tile_elements)
        return dict(build_gluon_sm90(kernel, types, dict(consts, CONSUMERS=consumers, PREFETCH=prefetch,
                                                         CONSUMER_REGISTERS=launch["CONSUMER_REGISTERS"]),
                                     num_warps=launch["num_warps"], maxnreg=launch["maxnreg"]), consumers=consumers)

    # the plain GEMM's scales by TMA with each stage (wgmma_ws.RING_SCALES), T off a multiple of 4
    as_desc, bs_desc = W.ring_scale_descriptors(new_row_scales(1023, 2048, torch.empty(0)),
                                                torch.empty(4, 8, 16), 1024)

    report = {}
    # FC2 / FC1 dgrad (BF16 out) and the FC1 / dGLU GEMMs whose epilogues run alone (FP32 out: a 64 KB
    # staging tile), stored by TMA (the default) or not
    plain_types = {}
    for name, a_dtype, has_bias, c_dtype, tma_store in (
            ("fc2_e4m3_bias", torch.float8_e4m3fn, True, torch.bfloat16, True),
            ("dgrad_e5m2", torch.float8_e5m2, False, torch.bfloat16, True),
            ("acc_fp32", torch.float8_e4m3fn, False, torch.float32, True),
            ("fc2_no_tma", torch.float8_e4m3fn, True, torch.bfloat16, False)):
        a_desc, b_desc = W.descriptors(torch.empty(1024, 2048, dtype=a_dtype),
                                       torch.empty(4, 1024, 2048, dtype=torch.float8_e4m3fn))
        c_gl = "fp32" if c_dtype == torch.float32 else "bf16"
        types = dict(a_desc=mangle_type(a_desc), b_desc=mangle_type(b_desc), as_ptr="*fp32", bs_ptr="*fp32",
                     as_desc=mangle_type(as_desc), bs_desc=mangle_type(bs_desc), c_ptr=f"*{c_gl}", bias_ptr="*bf16",
                     sched_ptr="*i32")
        for consumers in (1, 2):
            c_desc = W.store_descriptor(torch.empty(1024, 1024, dtype=c_dtype), W.BM // consumers, W.BN)
            types["c_desc"] = mangle_type(c_desc) if tma_store else types["a_desc"]
            report[f"{name}_{consumers}"] = build(WS.fp8_block_gemm_ws_kernel, types,
                                                  dict(HAS_BIAS=has_bias, GROUP_M=8, NUM_STAGES=W.STAGES,
                                                       TMA_STORE=tma_store, RING_SCALES=True),
                                                  W.NUM_WARPS, 1, W.BM * W.BN, consumers)
            plain_types[f"{name}_{consumers}"] = dict(types)
    # the tiles' schedule reads as they were before TILE_PREFETCH (kept for the benchmark's comparison)
    report["fc2_e4m3_bias_2_no_prefetch"] = build(WS.fp8_block_gemm_ws_kernel, plain_types["fc2_e4m3_bias_2"],
                                                  dict(HAS_BIAS=True, GROUP_M=8, NUM_STAGES=W.STAGES, TMA_STORE=True,
                                                       RING_SCALES=True),
                                                  W.NUM_WARPS, 1, W.BM * W.BN, 2, prefetch=False)
    # the scales loaded by the consumers from global memory (where TMA cannot read them; before run 32)
    for name in ("fc2_e4m3_bias_2", "fc2_no_tma_1"):
        report[f"{name}_load_scales"] = build(WS.fp8_block_gemm_ws_kernel, plain_types[name],
                                              dict(HAS_BIAS=True, GROUP_M=8, NUM_STAGES=W.STAGES,
                                                   TMA_STORE=name != "fc2_no_tma_1", RING_SCALES=False),
                                              W.NUM_WARPS, 1, W.BM * W.BN, int(name[-1]))

    def wgrad(block_n, block_k, warps, stages, ctas_per_sm, tma_store, consumers, prefetch=WS.TILE_PREFETCH):
        g_t, x_t = torch.empty(4096, 1024, dtype=torch.float8_e5m2), torch.empty(7168, 1024, dtype=torch.float8_e4m3fn)
        types = dict(g_desc=mangle_type(W.descriptor(g_t, block_n)), x_desc=mangle_type(W.descriptor(x_t, block_k)),
                     xs_desc=mangle_type(W.scale_descriptor(torch.empty(8, 7168), block_k)), gs_ptr="*fp32",
                     dw_ptr="*bf16", sched_ptr="*i32")
        dw_desc = WS._wgrad_store_descriptor(torch.empty(4, 4096, 7168, dtype=torch.bfloat16), block_n // consumers,
                                             block_k)
        types["dw_desc"] = mangle_type(dw_desc) if tma_store else types["g_desc"]
        return build(WS.fp8_block_wgrad_ws_kernel, types, dict(GROUP_N=8, NUM_STAGES=stages, TMA_STORE=tma_store),
                     warps, ctas_per_sm, block_n * block_k, consumers, prefetch)

    c = default_config(gluon=True)
    report["wgrad_default"] = wgrad(c.block_n, c.block_k, c.num_warps, c.num_stages, c.ctas_per_sm, c.tma_store,
                                    c.consumers)
    for consumers, stages in ((1, 5), (2, 4)):
        for tma_store in (False, True):
            report[f"wgrad_{consumers}{'_tma' if tma_store else ''}"] = wgrad(128, 128, 8, stages, 1, tma_store,
                                                                              consumers)
    report["wgrad_64x128"] = wgrad(64, 128, 4, 3, 2, True, 1)
    report["wgrad_default_no_prefetch"] = wgrad(c.block_n, c.block_k, c.num_warps, c.num_stages, c.ctas_per_sm,
                                                c.tma_store, c.consumers, prefetch=False)
    return report


def _most_registers_asked(name: str, consumers: int) -> int:
    """The consumers take the producer's registers: 232 at one consumer warpgroup and two CTAs per SM,
    240 at two warpgroups in one partition and one CTA; with two consumer partitions Triton gives the
    default one 256, the other 240."""
    return 232 if name == "wgrad_64x128" else 256 if consumers == 2 else 240


def _check_build_report(report: dict) -> None:
    plain = {f"{n}_{c}" for n in ("fc2_e4m3_bias", "dgrad_e5m2", "acc_fp32", "fc2_no_tma") for c in (1, 2)}
    assert set(report) == plain | {"fc2_e4m3_bias_2_no_prefetch", "fc2_e4m3_bias_2_load_scales",
                                   "fc2_no_tma_1_load_scales", "wgrad_default", "wgrad_1", "wgrad_1_tma", "wgrad_2",
                                   "wgrad_2_tma", "wgrad_64x128", "wgrad_default_no_prefetch"}
    assert report["wgrad_default"]["consumers"] == 2
    for name, r in report.items():
        # no spills, also at 232-256 registers: the wgrad's column scales are read from shared memory at
        # the promotion, not held in registers
        assert r["stack"] == 0, (name, r)
        copies = r["consumers"]  # two consumer partitions: two copies of the loop
        assert r["qgmma"] == 16 * copies, (name, r)  # 4 per block x 4 issue sites
        assert r["qgmma_grouped"] == 12 * copies, (name, r)  # 3 of each block's 4 join the group the 4th commits
        assert r["wait_le1"] >= 3 * copies, (name, r)  # the loop's two waits and the tail's first
        assert r["shared"] <= 227 * 1024, (name, r)
        assert r["setmaxnreg_max"] == _most_registers_asked(name, copies), (name, r)
    # wgmma_ws.TILE_PREFETCH: the schedule reads of the tile ahead, made in each tile loop and carried to
    # the next trip, are still in the loops of the TTGIR. Triton 3.6 dropped such carried reads from the
    # wgrad's producer loop (the frontend IR had them), whose token-block range then stayed its first
    # tile's: wrong dw from each program's second tile on (run 28); that producer reads each tile's
    # entries at its start since. In the loops: wgrad, the producer's 2 and 2 per consumer (with or
    # without the prefetch); plain GEMM, 4 per consumer (the next tile's rows, the tile after's group)
    # and the producer's 3 (what the compiler merges), 5 per partition less one without it
    for name, r in report.items():
        prefetch, consumers = not name.endswith("_no_prefetch"), r["consumers"]
        if name.startswith("wgrad"):
            want = 2 + 2 * consumers
        else:
            want = 3 + 4 * consumers if prefetch else 4 + 5 * consumers
        assert r["scalar_i32_loads_in_loops"] == want, (name, r["scalar_i32_loads_in_loops"], want)
    # two CTAs of the 64x128 wgrad share an SM's 227 KB
    assert 2 * report["wgrad_64x128"]["shared"] <= 227 * 1024, report["wgrad_64x128"]
    # the producer fences the async proxy before each TMA refill of a stage whose scales the consumers
    # read with ordinary loads (the wgrad's column scales; the plain GEMM's row scales and block scalars
    # with RING_SCALES; the mbarrier init has one too, so a plain GEMM loading its scales itself, without
    # TMA stores, has only that one): without it a refill can overwrite them early, a race only seen once
    # the ring wraps at full size (run 21, in a Gluon quantize pass)
    assert report["fc2_no_tma_1_load_scales"]["fence_async"] == 1, report["fc2_no_tma_1_load_scales"]
    for name in ("wgrad_1", "wgrad_2", "fc2_no_tma_1"):
        assert report[name]["fence_async"] == 2, (name, report[name])


def test_builds_for_sm90a_with_promotion_under_the_next_wgmma():
    from sm90_build import have_tools, report_in_subprocess, tools_dir

    if not have_tools():
        pytest.skip(f"the Triton wheel has no NVIDIA tools in {tools_dir()}: cannot build for sm_90a offline")
    report = report_in_subprocess("test_fp8_block_wgmma", env={"TE_FUSED_MOE_PTXAS": "triton"})
    _check_build_report(report)
    # Triton's own ptxas (12.8) leaves the yield hint set on the promotions' FFMAs: no warp switch
    # inside a promotion (the reason for TE_FUSED_MOE_PTXAS, tests/test_ptxas.py)
    for name, r in report.items():
        assert r["ffma"] >= 320 and r["ffma_yield"] <= 0.02 * r["ffma"], (name, r)


def test_builds_with_the_toolkit_ptxas_keep_their_shape_and_interleave_the_promotion():
    """TE_FUSED_MOE_PTXAS=toolkit (ptxas >= 12.9): the same build properties, and about every other
    promotion FFMA may hand the issue slot to another warp."""
    from sm90_build import have_tools, report_in_subprocess, tools_dir

    from te_fused_moe.backends.triton import ptxas

    if not have_tools():
        pytest.skip(f"the Triton wheel has no NVIDIA tools in {tools_dir()}: cannot build for sm_90a offline")
    found = ptxas.toolkit(os.environ)
    if found is None or not found.interleaves_ffma:
        pytest.skip(f"no CUDA toolkit ptxas >= 12.9 on this machine (found {found}): nothing to build with")
    report = report_in_subprocess("test_fp8_block_wgmma", env={"TE_FUSED_MOE_PTXAS": "toolkit"})
    _check_build_report(report)
    for name, r in report.items():
        assert r["ffma"] >= 320 and 0.45 * r["ffma"] <= r["ffma_yield"] <= 0.6 * r["ffma"], (name, r)


def _operands(device="cpu"):
    a = torch.zeros(256, 256, dtype=torch.float8_e4m3fn, device=device)
    b = torch.zeros(2, 256, 256, dtype=torch.float8_e4m3fn, device=device)
    return a, b


def test_engine_choice_and_errors():
    import dataclasses

    from te_fused_moe.backends.triton.fp8_block import gemm

    a, b = _operands()
    cfg = gemm.default_config("fc2")
    assert cfg.plain_engine is None and gemm.PLAIN_ENGINE == "auto"
    # auto: the Triton kernel where the Gluon one cannot run (here: no GPU)
    assert not gemm._plain_on_gluon(cfg, a, b)
    assert not gemm._plain_on_gluon(dataclasses.replace(cfg, plain_engine="triton"), a, b)
    with pytest.raises(ValueError, match=r"plain_engine='gluon': the Gluon FP8 block GEMM needs an sm_90 GPU"):
        gemm._plain_on_gluon(dataclasses.replace(cfg, plain_engine="gluon"), a, b)
    with pytest.raises(ValueError, match=r"plain_engine: expected 'auto', 'gluon' or 'triton', got 'cutlass'"):
        gemm._plain_on_gluon(dataclasses.replace(cfg, plain_engine="cutlass"), a, b)


def test_usable_needs_fp8_tma_layouts():
    from te_fused_moe.backends.triton.fp8_block.wgmma_gemm import usable

    a, b = _operands()
    assert not usable(a, b)  # CPU tensors
    assert not usable(a.float(), b)


def test_ring_scales_need_tma_layouts():
    """Where the plain GEMM's producer can load the scales by TMA (``wgmma_ws.RING_SCALES``) and where they
    are loaded as before: the row scales as ``new_row_scales`` stores them (K-block-major, runs padded to
    16 bytes, also at T off a multiple of 4), the weight scales contiguous with 16-byte rows (K a
    multiple of 512; the dgrad's transposed view is copied contiguous first), B's rows whole tiles."""
    from te_fused_moe.backends.triton.fp8_block import wgmma_gemm as W, wgmma_ws as WS
    from te_fused_moe.backends.triton.fp8_block.quantize import new_row_scales

    like = torch.empty(0)
    for rows in (1, 1023, 1024):
        a_scale = new_row_scales(rows, 512, like)
        assert a_scale.shape == (rows, 4) and a_scale.stride(0) == 1 and a_scale.stride(1) % 4 == 0
        assert W.ring_scale_descriptors(a_scale, torch.empty(2, 3, 4), 384) is not None, rows
    a_scale = new_row_scales(1023, 512, like)
    row_major = torch.empty(1023, 4)  # rows' scales together: a K block's run is strided
    assert W.ring_scale_descriptors(row_major, torch.empty(2, 3, 4), 384) is None
    assert W.ring_scale_descriptors(a_scale, torch.empty(2, 3, 3), 384) is None  # K = 384: 12-byte rows
    assert W.ring_scale_descriptors(a_scale, torch.empty(2, 3, 4), 320) is None  # B's rows off the tile
    assert W.ring_scale_descriptors(a_scale, torch.empty(2, 3, 4, dtype=torch.float64), 384) is None
    transposed = torch.empty(2, 4, 3).transpose(1, 2)  # a weight's scales seen as its transposed copy's
    assert W.ring_scale_descriptors(a_scale, transposed, 384) is None
    assert W.ring_scale_descriptors(a_scale, WS._contiguous_scales(transposed), 384) is not None
    assert WS._contiguous_scales(transposed).equal(transposed)


def test_wgrad_engine_choice_and_errors():
    import dataclasses

    from te_fused_moe.backends.triton.fp8_block import wgrad as W
    from te_fused_moe.backends.triton.fp8_block.quantize import QuantizedRows

    a, _ = _operands()
    g = x = QuantizedRows(data_t=a, scale_t=torch.ones(2, 256))
    cfg = W.default_config()
    assert W.WGRAD_ENGINE == "auto" and not W._on_gluon(None, g, x) and not W._on_gluon(cfg, g, x)  # no GPU here
    assert not W._on_gluon(dataclasses.replace(cfg, engine="triton"), g, x)
    with pytest.raises(ValueError, match=r"engine='gluon': the Gluon FP8 block wgrad needs an sm_90 GPU"):
        W._on_gluon(dataclasses.replace(cfg, engine="gluon"), g, x)
    with pytest.raises(ValueError, match=r"engine: expected 'auto', 'gluon' or 'triton', got 'cublas'"):
        W._on_gluon(dataclasses.replace(cfg, engine="cublas"), g, x)


def test_gluon_needs_triton_3_6(monkeypatch):
    import dataclasses

    import triton

    from te_fused_moe.backends.triton.fp8_block import gemm

    assert gemm.gluon_kernels_available() is None  # the Triton this suite runs with
    monkeypatch.setattr(triton, "__version__", "3.5.1")
    assert gemm.gluon_kernels_available() == ("the Gluon kernels need triton>=3.6 (Gluon's Hopper API), "
                                              "found 3.5.1")
    a, b = _operands()
    cfg = dataclasses.replace(gemm.default_config("fc2"), plain_engine="gluon")
    with pytest.raises(ValueError, match=r"plain_engine='gluon': the Gluon kernels need triton>=3.6"):
        gemm._plain_on_gluon(cfg, a, b)


def test_engines_on_names_the_kernels_and_why(monkeypatch):
    from te_fused_moe.backends.triton.fp8_block import gemm, wgrad

    cpu = torch.device("cpu")
    why = "the Gluon kernels are written for sm_90 (Hopper); this is cpu"
    assert gemm.engines_on(cpu) == {"plain GEMMs": f"triton ({why})", "FC1 / dGLU": "fc1: one kernel, dact: one kernel",
                                    "wgrad": f"triton ({why})"}
    monkeypatch.setattr(gemm, "FC1_EPILOGUE", "separate")
    monkeypatch.setattr(wgrad, "WGRAD_ENGINE", "gluon")
    e = gemm.engines_on(cpu)
    assert e["FC1 / dGLU"] == "fc1: GEMM + epilogue alone, dact: one kernel" and e["wgrad"] == f"triton ({why})", e
    # where the Gluon kernels run (the check of the GPU passed)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    e = gemm.engines_on(torch.device("cuda", 0))
    assert e["plain GEMMs"] == "gluon, warp-specialised" and e["wgrad"] == "gluon, warp-specialised", e
    monkeypatch.setattr(wgrad, "WGRAD_ENGINE", "triton")
    assert gemm.engines_on(torch.device("cuda", 0))["wgrad"] == "triton (WGRAD_ENGINE)"


def test_warp_specialized_register_budget():
    """The launch register cap of the warp-specialised kernels: CTAs per SM x (consumer warps + the
    producer's warpgroup) fill the register file; a cap too small for the tile's accumulator is a clear
    error naming ctas_per_sm (ptxas would fail with C7602)."""
    from te_fused_moe.backends.triton.fp8_block import wgmma_ws as WS

    assert WS.launch_maxnreg(4, 2, 64 * 128) == 128  # 2 x 8 warps x 128 = the 64 K registers
    assert WS.launch_maxnreg(8, 1) == 168  # 12 warps
    assert WS.launch_maxnreg(4, 3, 64 * 64) == 80
    with pytest.raises(ValueError, match="ctas_per_sm: 3 CTAs per SM .* need at least 96"):
        WS.launch_maxnreg(4, 3, 64 * 128)
    with pytest.raises(ValueError, match="ctas_per_sm: 2 CTAs"):
        WS.launch_maxnreg(8, 2)
