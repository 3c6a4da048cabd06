"""Hidden / FFN sizes off the block-scaled GEMMs' 128-wide tile (te_fused_moe/backends/triton/padded.py).

Host logic on the CPU: the padding helpers, the weight cache's ``padded_to`` entries and which recipes
take which sizes. The GLU passes (glu_rows.py) under Triton's interpreter, against the activations'
PyTorch definitions in FP64 on random data: gate / up pairs whose columns straddle the passes' column
tiles, padding rows, an expert without tokens, outputs poisoned with NaN before the kernels write them.
The whole MLP at such sizes is checked against the reference backend in the recipes' interpreter tests
(MLP_CASES ``padded-*``) and, on the GPU, at GPT-OSS's 2880 (tests/gpu/).
"""

from __future__ import annotations

import contextlib
import os
import sys
from unittest import mock

import pytest
import torch

from block_scaled_checks import poison_alloc, unwritten
from moe_reference import run_in_triton_interpreter

pytest.importorskip("triton", reason="the Triton backend's CPU tests need the triton package (pip install triton)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_padded_sizes_and_zero_padding():
    from te_fused_moe.backends.triton.padded import padded_size, zero_padded

    assert [padded_size(s, 128) for s in (1, 127, 128, 129, 2880)] == [128, 128, 128, 256, 2944]
    w = torch.randn(2, 3, 5) + 10.0  # never zero
    out = zero_padded(w, (2, 4, 8))
    assert out.shape == (2, 4, 8) and torch.equal(out[:, :3, :5], w)
    assert int((out != 0).sum()) == w.numel()  # the rest is zeros
    assert zero_padded(w, (2, 3, 5)) is w and zero_padded(None, (1,)) is None


def test_weight_cache_keeps_padded_copies_apart():
    from te_fused_moe.backends.triton.fp8_block.quantize import WeightCache

    seen = []
    cache = WeightCache(follow_optimizer_steps=False,
                        quantize_fn=lambda w, spec, transposed: seen.append(w.clone()) or w.clone())
    w = torch.randn(2, 72, 96) + 5.0
    q = cache.get(w, "spec", padded_to=(2, 128, 128))
    assert q.shape == (2, 128, 128) and torch.equal(q[:, :72, :96], w) and int((q != 0).sum()) == w.numel()
    assert cache.get(w, "spec", padded_to=(2, 128, 128)) is q and cache.hits == 1 and cache.misses == 1
    assert cache.get(w, "spec").shape == w.shape and cache.misses == 2  # another layout: quantized again
    with torch.no_grad():
        w.add_(1.0)  # an update through the parameter: a fresh padded copy
    assert torch.equal(cache.get(w, "spec", padded_to=(2, 128, 128))[:, :72, :96], w) and cache.misses == 3


def test_which_recipes_take_which_sizes():
    """Every block-scaled recipe takes every size: FP8 block and MXFP8 tile multiples on the tile-aligned
    Function and others on the zero-padded one (check_shapes names the size that sends a call there),
    NVFP4 both in its one Function (the backend's verdict: test_backend_routes_gpt_oss_sizes_...)."""
    from te_fused_moe.backends.triton.fp8_block.autograd import KERNELS as FP8_BLOCK
    from te_fused_moe.backends.triton.mxfp8.autograd import KERNELS as MXFP8

    for kernels in (FP8_BLOCK, MXFP8):
        assert kernels.check_shapes(256, 128) is None
        assert "w1:" in kernels.check_shapes(2880, 256) and "got 2880" in kernels.check_shapes(2880, 256)


def test_backend_routes_gpt_oss_sizes_to_triton_for_every_recipe():
    from te_fused_moe.activations import ActivationConfig
    from te_fused_moe.backends import get_backend
    from te_fused_moe.backends.base import ExpertMLPArgs
    from te_fused_moe.recipes import Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling

    backend = get_backend("triton")
    x = torch.empty(4, 2880)
    w1, w2 = torch.empty(2, 5760, 2880), torch.empty(2, 2880, 2880)
    verdicts = {}
    for recipe in (Float8BlockScaling(), MXFP8BlockScaling(), NVFP4BlockScaling()):
        args = ExpertMLPArgs(x=x, tokens_per_expert=torch.tensor([2, 2]), w1=w1, w2=w2,
                             activation=ActivationConfig("gpt_oss_swiglu"), recipe=recipe)
        verdicts[type(recipe).__name__] = backend.supports_args(args)
    assert all(verdicts.values()), verdicts


def test_fc1_off_the_tile_runs_its_epilogue_alone_or_the_passes():
    """FC1 at an F off the tile needs the epilogue alone: a launch asking for the one-kernel epilogue is
    refused with the reason, and padded.py takes the GLU passes while FC1_ / DACT_EPILOGUE say "fused"."""
    from te_fused_moe.backends.triton.fp8_block import gemm
    from te_fused_moe.backends.triton.fp8_block.autograd import KERNELS
    from te_fused_moe.backends.triton.fp8_block.quantize import FP8Spec

    a = torch.empty(16, 128, dtype=torch.float8_e4m3fn)
    b = torch.empty(2, 256, 128, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"N=80 off the 128 tile runs its epilogue alone; epilogue='fused'"):
        gemm.launch("fc1", a, torch.ones(16, 1), b, torch.ones(2, 2, 1), 80, torch.zeros(64, dtype=torch.int32), 2,
                    FP8Spec.of("e4m3", True), b_up_rows=80, config=gemm.FP8GemmConfig(epilogue="fused"))
    assert KERNELS.fc1_off_tile() and KERNELS.dglu_off_tile() is not None
    gemm.FC1_EPILOGUE = gemm.DACT_EPILOGUE = "fused"
    try:
        assert not KERNELS.fc1_off_tile() and KERNELS.dglu_off_tile() is None
    finally:
        gemm.FC1_EPILOGUE = gemm.DACT_EPILOGUE = "auto"


# --- the GLU passes under the interpreter ----------------------------------------------------------

# (activation, T, F, width of h, experts, padding rows)
GLU_CASES = [("swiglu", 300, 72, 256, 3, 5), ("gpt_oss_swiglu", 200, 100, 256, 4, 9), ("geglu", 130, 64, 128, 2, 0),
             ("srelu", 260, 90, 128, 3, 7), ("gelu", 140, 128, 128, 2, 3)]


def check_glu_passes(device: str, seed: int = 0) -> dict:
    """Per case: the GLU passes' max relative error vs FP64 (``a``, ``dh``, ``dprob``), NaNs left in
    their outputs (unwritten elements), and nonzeros where zeros are due (past the units, padding rows)."""
    from moe_reference import make_counts

    from te_fused_moe.activations import ActivationConfig
    from te_fused_moe.backends.triton.glu_rows import glu_backward, glu_forward
    from te_fused_moe.backends.triton.schedule import build_schedule

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, T, F, width, E, padding in GLU_CASES:
        act = ActivationConfig(name)
        units = 2 * F if act.gated else F
        a_width = -(-F // 128) * 128
        counts = make_counts(T, E, "empty", generator=g, padding=padding)
        schedule = build_schedule(counts.to(device), T, 128)
        h = (torch.randn(T, width, generator=g) * 3).to(device=device, dtype=torch.bfloat16)
        da = torch.randn(T, a_width, generator=g).to(device=device, dtype=torch.bfloat16)
        probs = torch.rand(T, generator=g).to(device) + 0.1
        a = glu_forward(h, F, a_width, schedule, E, probs, act.launch_args, alloc=poison_alloc)
        dh, dprob = glu_backward(da, h, F, schedule, E, probs, act.launch_args, True, alloc=poison_alloc)
        routed = int(counts.sum())
        h64, da64 = h[:routed, :units].double().cpu(), da[:routed, :F].double().cpu()
        p64 = probs[:routed].double().cpu()
        a_ref = act.forward(h64) * p64[:, None]
        dh_ref = act.backward(h64, da64 * p64[:, None])
        dprob_ref = (da64 * act.forward(h64)).sum(1)
        rel = lambda got, ref: float((got.double().cpu() - ref).abs().max() / ref.abs().max())
        out[name] = {
            "a": rel(a[:routed, :F], a_ref), "dh": rel(dh[:routed, :units], dh_ref),
            "dprob": float(((dprob[:routed].double().cpu() - dprob_ref).abs()
                            / (da64.abs() * act.forward(h64).abs()).sum(1).clamp_min(1e-30)).max()),
            "nan": int(torch.isnan(a).sum() + torch.isnan(dh).sum() + torch.isnan(dprob).sum()),
            "nonzero": int((a[:, F:] != 0).sum() + (a[routed:] != 0).sum() + (dh[:, units:] != 0).sum()
                           + (dh[routed:] != 0).sum() + (dprob[routed:] != 0).sum()),
            "padding_rows": T - routed, "straddles": bool(F % 64),
        }
    return out


# (activation, T, H, F, experts, padding rows): F off the tile, the gate / up boundary inside a tile
FC1_CASES = [("swiglu", 260, 192, 80, 3, 5), ("gpt_oss_swiglu", 200, 128, 136, 4, 9), ("srelu", 150, 96, 72, 2, 7)]


def _fc1_variants():
    """(name, recipe kernels, spec, h's dtype, the FP8 block EPILOGUE_INPUT_DTYPE): FP8 block's epilogue
    alone reading BF16 h or the FP32 GEMM output; MXFP8's one kernel, its h in FP32 (the passes then
    act on the accumulator's values too)."""
    from te_fused_moe.backends.triton.fp8_block.autograd import KERNELS as FP8_BLOCK
    from te_fused_moe.backends.triton.fp8_block.quantize import FP8Spec
    from te_fused_moe.backends.triton.mxfp8.autograd import KERNELS as MXFP8
    from te_fused_moe.backends.triton.mxfp8.quantize import MXSpec

    return [("fp8_block-h", FP8_BLOCK, FP8Spec.of("e4m3", True), torch.bfloat16, None),
            ("fp8_block-fp32", FP8_BLOCK, FP8Spec.of("e4m3", True), torch.bfloat16, torch.float32),
            ("mxfp8-fp32", MXFP8, MXSpec.of("e4m3"), torch.float32, None)]


def check_fc1_epilogue_off_tile(device: str, seed: int = 0) -> dict:
    """Per case and recipe variant: FC1 at an F off the tile as padded.py runs it (the recipe's FC1
    epilogue reading gate / up wherever F falls) against the plain GEMM + GLU pass + quantize pass
    it replaced, on poisoned buffers: bytes and scales that differ (both copies), codes or scales left
    unwritten in the rowwise copy, codes not zero past F, and gate / up columns of h that differ."""
    from moe_reference import make_counts

    from te_fused_moe.activations import ActivationConfig
    from te_fused_moe.backends.triton.fp8_block import gemm as fp8_gemm
    from te_fused_moe.backends.triton.glu_rows import glu_forward
    from te_fused_moe.backends.triton.padded import padded_size, zero_padded
    from te_fused_moe.backends.triton.schedule import build_schedule

    bits = lambda t: t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, T, H, F, E, padding in FC1_CASES:
        act = ActivationConfig(name).launch_args
        n1 = 2 * F if act["gated"] else F
        H_p, n1_p, F_p = padded_size(H, 128), padded_size(n1, 128), padded_size(F, 128)
        counts = make_counts(T, E, "empty", generator=g, padding=padding)
        schedule = build_schedule(counts.to(device), T, 128)
        x = torch.randn(T, H, generator=g).to(device=device, dtype=torch.bfloat16)
        w1 = zero_padded(torch.randn(E, n1, H, generator=g) * 0.1, (E, n1_p, H_p)).to(device=device,
                                                                                      dtype=torch.bfloat16)
        b1 = zero_padded(torch.randn(E, n1, generator=g), (E, n1_p)).to(device=device, dtype=torch.bfloat16)
        probs = (torch.rand(T, generator=g) + 0.1).to(device)
        for variant, k, spec, h_dtype, input_dtype in _fc1_variants():
            read = k.operand_reader()
            xq = k.quantize_rows(x, schedule, E, spec, alloc=poison_alloc, width=H_p)
            w1q = k.quantize_weight(w1, spec, transposed=False)
            x_op, w1_op = read(xq.data, xq.scale), read(w1q.data, w1q.scale)
            fp8_gemm.EPILOGUE_INPUT_DTYPE = input_dtype
            try:
                h = poison_alloc((T, n1_p), device=device, dtype=h_dtype)
                fused = k.new_rows(T, F_p, x, spec, E, True, True, poison_alloc)
                k.gemm.launch("fc1", x_op, xq.scale, w1_op, w1q.scale, F, schedule, E, spec, q=fused, h=h,
                              h_up_offset=F, b_up_rows=F, bias=b1, bias_up_offset=F, probs=probs, **act)
            finally:
                fp8_gemm.EPILOGUE_INPUT_DTYPE = None
            # the same values through the passes: act of h, or of the FP32 GEMM output the epilogue read
            h_in = poison_alloc((T, n1_p), device=device, dtype=input_dtype or h_dtype)
            k.gemm.launch("fc2", x_op, xq.scale, w1_op, w1q.scale, n1_p, schedule, E, spec, c=h_in, bias=b1)
            a = glu_forward(h_in, F, F_p, schedule, E, probs, act, poison_alloc)
            passes = k.quantize_rows(a, schedule, E, spec, colwise=True, alloc=poison_alloc)
            r = {part: int((bits(getattr(fused, part)) != bits(getattr(passes, part))).sum())
                 for part in ("data", "scale", "data_t", "scale_t")}
            r["unwritten"] = unwritten(fused.data) + unwritten(fused.scale)
            r["nonzero_past_f"] = int((fused.data[:, F:].view(torch.uint8) != 0).sum())
            r["h"] = int((bits(h[:, :n1]) != bits(h_in[:, :n1].to(h_dtype))).sum())
            out[f"{name}-{variant}"] = r
    return out


def check_quantize_width(device: str, seed: int = 2) -> dict:
    """Per recipe's quantize pass: ``quantize_rows(x, width=W)`` (x [T, 200] read as zero-padded to
    W = 256, as padded.py quantizes x and dy) against ``quantize_rows`` of x explicitly padded with
    zeros, on poisoned buffers: elements of each copy, scale and amax (NVFP4's tensor scales; RHT on
    its columnwise copy; stochastic rounding with given bits) and of the column sums that differ."""
    from moe_reference import make_counts

    from te_fused_moe.backends.triton.fp8_block.quantize import FP8Spec, quantize_rows as fp8_rows
    from te_fused_moe.backends.triton.mxfp8.quantize import MXSpec, quantize_rows as mx_rows
    from te_fused_moe.backends.triton.nvfp4.quantize import NVSpec, quantize_rows as nv_rows
    from te_fused_moe.backends.triton.padded import zero_padded
    from te_fused_moe.backends.triton.schedule import build_schedule, max_m_tiles

    bits = lambda t: t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)
    g = torch.Generator().manual_seed(seed)
    T, cols, width, E = 300, 200, 256, 3
    counts = make_counts(T, E, "empty", generator=g, padding=9)
    schedule = build_schedule(counts.to(device), T, 128)
    x = (torch.randn(T, cols, generator=g) * 4).to(device=device, dtype=torch.bfloat16)
    slots = 128 * max_m_tiles(T, E, 128)
    given = (torch.randint(0, 256, (T, width), generator=g, dtype=torch.uint8).to(device),
             torch.randint(0, 256, (slots, width), generator=g, dtype=torch.uint8).to(device))
    recipes = {"fp8_block": (fp8_rows, FP8Spec.of("e4m3", False), {}),
               "mxfp8": (mx_rows, MXSpec.of("e4m3"), {}),
               "nvfp4_rht": (nv_rows, NVSpec(stochastic=False, rht=True), {}),
               "nvfp4_stochastic": (nv_rows, NVSpec(stochastic=True, rht=True), {"random_bits": given})}
    out = {}
    for name, (quantize, spec, extra) in recipes.items():
        sums = [poison_alloc((max_m_tiles(T, E, 128), width), device=device, dtype=torch.float32) for _ in range(2)]
        read_padded = quantize(x, schedule, E, spec, colwise=True, alloc=poison_alloc, col_sums=sums[0], width=width,
                               **extra)
        copied = quantize(zero_padded(x, (T, width)), schedule, E, spec, colwise=True, alloc=poison_alloc,
                          col_sums=sums[1], **extra)
        parts = [p for p in ("data", "scale", "data_t", "scale_t", "amax", "amax_t")
                 if getattr(copied, p, None) is not None]
        out[name] = {p: int((bits(getattr(read_padded, p)) != bits(getattr(copied, p))).sum()) for p in parts}
        out[name]["col_sums"] = int((bits(sums[0]) != bits(sums[1])).sum())
        out[name]["parts"] = len(parts)
    return out


# (id, activation, T, F, E, padding rows, dglu_rows flags): F % 128 = 80, 8, 64 (GPT-OSS's), 80 over
# four blocks of units, 0 (gated: H alone off the tile), a non-gated activation; the grid with the M
# tile fastest, chosen or forced by more M tiles than the grid's second dimension may hold
DGLU_CASES = [("swiglu-80", "swiglu", 260, 80, 3, 5, {}), ("gpt_oss-136", "gpt_oss_swiglu", 200, 136, 4, 9, {}),
              ("swiglu-320", "swiglu", 260, 320, 3, 5, {}), ("gpt_oss-464", "gpt_oss_swiglu", 200, 464, 4, 9, {}),
              ("swiglu-256", "swiglu", 150, 256, 2, 7, {}), ("srelu-72", "srelu", 150, 72, 2, 7, {}),
              ("gpt_oss-464-m-fastest", "gpt_oss_swiglu", 200, 464, 4, 9, {"BLOCKS_FASTEST": False}),
              ("swiglu-320-grid-y-full", "swiglu", 260, 320, 3, 5, {"MAX_GRID_Y": 2})]


def check_dglu_off_tile(device: str, seed: int = 1) -> dict:
    """Per case (DGLU_CASES; E5M2 gradients for the GPT-OSS ones): FP8 block's one-pass dGLU + quantize
    at an F off the tile (fp8_block/dglu_rows.py) against the GLU pass + quantize pass it replaced, on
    poisoned buffers: bytes and scales that differ (both copies), rowwise codes or scales left
    unwritten, codes not zero past the gate / up units, and the dprob / db1 partials' largest
    difference relative to their largest magnitude."""
    from moe_reference import make_counts

    from te_fused_moe.activations import ActivationConfig
    from te_fused_moe.backends.triton.fp8_block import dglu_rows as D
    from te_fused_moe.backends.triton.fp8_block.dglu_rows import dglu_quantized
    from te_fused_moe.backends.triton.fp8_block.quantize import FP8Spec, quantize_rows
    from te_fused_moe.backends.triton.glu_rows import glu_backward
    from te_fused_moe.backends.triton.padded import padded_size
    from te_fused_moe.backends.triton.schedule import build_schedule, max_m_tiles

    bits = lambda t: t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)
    rel = lambda got, ref: float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
    g = torch.Generator().manual_seed(seed)
    out = {}
    for case, name, T, F, E, padding, flags in DGLU_CASES:
        act = ActivationConfig(name).launch_args
        spec = FP8Spec.of("e5m2" if name == "gpt_oss_swiglu" else "e4m3", name != "srelu")
        n1 = 2 * F if act["gated"] else F
        n1_p, F_p = padded_size(n1, 128), padded_size(F, 128)
        counts = make_counts(T, E, "empty", generator=g, padding=padding)
        schedule = build_schedule(counts.to(device), T, 128)
        h = (torch.randn(T, n1_p, generator=g) * 3).to(device=device, dtype=torch.bfloat16)
        da = torch.randn(T, F_p, generator=g).to(device=device, dtype=torch.bfloat16)
        probs = (torch.rand(T, generator=g) + 0.1).to(device)
        sums = [poison_alloc((max_m_tiles(T, E, 128), n1_p), device=device, dtype=torch.float32) for _ in range(2)]
        with mock.patch.multiple(D, **flags) if flags else contextlib.nullcontext():
            fused, dprob = dglu_quantized(da, h, F, schedule, E, probs, act, True, spec, rowwise=True, colwise=True,
                                          col_sums=sums[0], alloc=poison_alloc)
        dh, dprob_ref = glu_backward(da, h, F, schedule, E, probs, act, True, poison_alloc)
        passes = quantize_rows(dh, schedule, E, spec, colwise=True, alloc=poison_alloc, col_sums=sums[1])
        r = {part: int((bits(getattr(fused, part)) != bits(getattr(passes, part))).sum())
             for part in ("data", "scale", "data_t", "scale_t")}
        r["unwritten"] = unwritten(fused.data) + unwritten(fused.scale)
        r["nonzero_past_units"] = int((fused.data[:, n1:].view(torch.uint8) != 0).sum())
        tiles = int(schedule[2 * (E + 1) - 1])  # the tiles in use (the padding group's end)
        r["dprob"], r["db1"] = rel(dprob, dprob_ref), rel(sums[0][:tiles, :n1], sums[1][:tiles, :n1])
        r["nan"] = int(torch.isnan(dprob).sum() + torch.isnan(sums[0][:tiles]).sum())
        out[case] = r
    return out


def sm90_build_report() -> dict:
    """Offline sm_90a builds of both GLU passes and FP8 block's one-pass dGLU (tests/sm90_build.py), gated
    with router probs."""
    from sm90_build import build_sm90

    from te_fused_moe.backends.triton import glu_rows as G
    from te_fused_moe.backends.triton.act_math import ACT_IDS
    from te_fused_moe.backends.triton.fp8_block import dglu_rows as D
    from te_fused_moe.backends.triton.fp8_block.quantize import FP8Spec

    common = dict(ACT=ACT_IDS["gpt_oss_swiglu"], GATED=True, HAS_PROBS=True, BM=G.BLOCK_M)
    floats = {"alpha": "fp32", "limit": "fp32"}
    return {
        "forward": build_sm90(G.glu_forward_kernel, dict(h_ptr="*bf16", probs_ptr="*fp32", a_ptr="*fp32",
                                                         sched_ptr="*i32", **floats), dict(common, BN=G.BLOCK_N),
                               num_warps=G.NUM_WARPS),
        "backward": build_sm90(G.glu_backward_kernel, dict(da_ptr="*bf16", h_ptr="*bf16", probs_ptr="*fp32",
                                                           dh_ptr="*fp32", dprob_ptr="*fp32", sched_ptr="*i32",
                                                           **floats),
                                dict(common, WRITE_DPROB=True, BN=G.BACKWARD_BLOCK_N),
                                num_warps=G.NUM_WARPS),
        # FP8 block's one-pass dGLU + quantize at an F off the tile, both copies, E4M3 power-of-2 scales
        "fp8_block_dglu": build_sm90(D.dglu_quantize_kernel, dict(da_ptr="*bf16", h_ptr="*bf16", probs_ptr="*fp32",
                                                                  q_ptr="*u8", qs_ptr="*fp32", qt_ptr="*u8",
                                                                  qts_ptr="*fp32", dprob_ptr="*fp32",
                                                                  colsum_ptr="*fp32", sched_ptr="*i32",
                                                                  value_for_inf="fp32", **floats),
                                     dict(common, WRITE_DPROB=True, COLSUM=True, ROWWISE=True, COLWISE=True,
                                          BLOCKS_FASTEST=True, **FP8Spec.of("e4m3", True).constexprs()),
                                     num_warps=D.NUM_WARPS),
    }


def test_glu_passes_build_for_sm90a():
    from sm90_build import have_tools, report_in_subprocess, tools_dir

    if not have_tools():
        pytest.skip(f"the Triton wheel has no NVIDIA tools in {tools_dir()}: cannot build for sm_90a offline")
    for name, r in report_in_subprocess("test_padded").items():
        # no spills in the GLU passes; the one-pass dGLU holds a 128 x 128 block's da, gate, up and both
        # gradients as the tile-aligned dGLU epilogue does, and may spill as little as it is allowed to
        allowed = 128 if name == "fp8_block_dglu" else 0
        assert r["stack"] <= allowed and r["instructions"] > 0, (name, r)


def _worker() -> None:
    import json

    assert os.environ.get("TRITON_INTERPRET") == "1"
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
    print("RESULTS" + json.dumps({"glu": check_glu_passes("cpu"), "fc1": check_fc1_epilogue_off_tile("cpu"),
                                  "dglu": check_dglu_off_tile("cpu"), "width": check_quantize_width("cpu")}))


@pytest.fixture(scope="module")
def results():
    return run_in_triton_interpreter("import test_padded as t; t._worker()")


@pytest.mark.parametrize("case", GLU_CASES, ids=[c[0] for c in GLU_CASES])
def test_glu_passes_match_fp64(results, case):
    r = results["glu"][case[0]]
    assert r["nan"] == 0 and r["nonzero"] == 0, r
    assert r["a"] <= 1e-5 and r["dh"] <= 1e-5 and r["dprob"] <= 1e-5, r
    assert r["padding_rows"] > 0 or case[5] == 0, r


@pytest.mark.parametrize("case", [f"{c[0]}-{v}" for c in FC1_CASES for v in ("fp8_block-h", "fp8_block-fp32",
                                                                             "mxfp8-fp32")])
def test_fc1_epilogue_off_the_tile_equals_the_passes(results, case):
    """padded.py's FC1 at F off the tile (FP8 block: the epilogue alone; MXFP8: its one kernel) writes
    the bytes and scales the plain GEMM + GLU pass + quantize pass write, both copies, zero codes
    past F."""
    r = results["fc1"][case]
    assert all(r[k] == 0 for k in ("data", "scale", "data_t", "scale_t", "unwritten", "nonzero_past_f", "h")), r


@pytest.mark.parametrize("case", [c[0] for c in DGLU_CASES])
def test_fp8_block_dglu_off_the_tile_equals_the_passes(results, case):
    """padded.py's FP8 block dGLU (one pass: dh formed and quantized, its 1x128 blocks straddling gate and
    up) writes the bytes and scales of the GLU pass + quantize pass, both copies, zero codes past the
    units; dprob and db1's partials agree to FP32 summation order."""
    r = results["dglu"][case]
    assert all(r[k] == 0 for k in ("data", "scale", "data_t", "scale_t", "unwritten", "nonzero_past_units",
                                   "nan")), r
    assert r["dprob"] <= 1e-6 and r["db1"] <= 1e-6, r


@pytest.mark.parametrize("recipe", ["fp8_block", "mxfp8", "nvfp4_rht", "nvfp4_stochastic"])
def test_quantize_rows_width_equals_quantizing_zero_padded_x(results, recipe):
    """The quantize passes read x's own columns and write the padded width (padded.py's x and dy, and
    NVFP4's): the same bytes, scales and tensor amaxes as quantizing x copied into zeros."""
    r = results["width"][recipe]
    assert r["parts"] >= 4 and all(v == 0 for k, v in r.items() if k != "parts"), r


def test_glu_cases_cover_straddling_tiles():
    assert any(f % 64 for _, _, f, _, _, _ in GLU_CASES) and any(act == "srelu" for act, *_ in GLU_CASES)


if __name__ == "__main__":
    _worker()
