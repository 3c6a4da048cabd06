"""The MXFP8 recipe (MXFP8BlockScaling) on the Triton backend, on CPU through Triton's interpreter.

The checks are device-agnostic functions (``check_*``) that tests/gpu/test_triton_mxfp8_gpu.py runs
again on the GPU. Under the interpreter they run in one fresh subprocess (``_worker``; see
tests/moe_reference.run_in_triton_interpreter) and report numbers that the tests assert on.

What is checked, and the bounds:

1. E8M0 device functions (``mxfp8/codec.py``): bit-exact vs ``formats.e8m0_encode`` /
   ``e8m0_decode`` / ``e8m0_reciprocal`` on edge values (0, Inf, NaN, FP32 subnormals around the
   2^-127 rounding point, exact powers of two and one ulp either side, the largest finite) and
   random non-negative FP32 bit patterns; and every 256 codes decoded.
2. Quantize kernels: bytes and scales bit-exact vs ``te_fused_moe.quantize.mxfp8.quantize``: rowwise
   1x32, columnwise 32-token blocks restarting at each expert (empty experts, padding rows), weights
   along K and their transposed copy along N; NaN/Inf/zero/tiny rows; E4M3 and E5M2; BF16 and FP32.
3. Every kernel on integer-valued x, w1, w2, dy in [-3, 3] (``check_kernels_exact``): these
   quantize exactly and their GEMM sums are small integers, exact in any order, so ``h`` is exact
   and the epilogues' quantized ``a`` / ``dh`` (rowwise and columnwise bytes + scales) must equal
   the reference quantizer applied to the same FP32 values, bit for bit. The GEMMs that read
   ``a`` / ``dh`` (y, dx, dw1, dw2) are checked against FP64 on the dequantized operands:
   ``|out - ref| <= 2^-8 |ref| + 2^-12 (|A| @ |B|)``; db1 and dprob to 1e-6 of their abs sums.
4. The whole MLP forward + backward vs the reference backend's emulation of the same recipe
   (``fused_moe_mlp(..., recipe=MXFP8BlockScaling(), backend='reference')``) on random data and
   routings (empty experts, one expert, padding rows, all padding, T = 0). The only differences
   are the order of FP32 sums, which can move a value on an FP8 rounding boundary (or an amax next
   to a power of two) by one FP8 step. Bound with ``h`` saved in FP32 (as the reference keeps it):
   norm-relative <= 2e-3 per output and at most 1% of elements off by more than 1e-3 of the
   output's max. With ``h`` saved in BF16 (the default) ``dh`` sees ``h`` rounded: <= 3e-2. Also vs
   the FP64 fake-quantized ground truth (tests/fake_quant_reference.py) within 2e-2 (BF16 outputs).
   Every buffer is poisoned (NaN) before the kernels write it.
5. Dispatch and validation: shapes the kernels do not take raise naming the argument, ``auto``
   falls back to the reference, recipe subsets are named; the benchmark's unfused baseline
   (``te_fused_moe/bench_recipes.py``) computes the same recipe as the fused path.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys

import pytest
import torch

from block_scaled_checks import far_from_fp64 as far, poison_alloc, poisoned
from moe_reference import run_in_triton_interpreter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ != "__main__":
    pytest.importorskip("triton", reason="the Triton backend's CPU tests need the triton package (pip install triton)")

TIGHT, LOOSE, FP64_BOUND = 2e-3, 3e-2, 2e-2

# (id, T, H, F, E, activation, bias, probs, routing, padding, h_fp32, tma, frozen, fp8_format[, dtype])
MLP_CASES = [
    ("swiglu-empty-pad", 300, 256, 128, 3, "swiglu", True, True, "empty", 5, True, True, (), "E4M3"),
    ("gptoss-zipf", 260, 128, 256, 4, "gpt_oss_swiglu", True, True, "zipf", 3, True, True, (), "E4M3"),
    ("srelu-one-ptr", 200, 128, 128, 3, "srelu", False, True, "one", 0, True, False, (), "E4M3"),
    ("geglu-noprobs-e1", 150, 128, 128, 1, "geglu", True, False, "balanced", 9, True, True, (), "E4M3"),
    ("swiglu-hbf16", 300, 256, 128, 3, "swiglu", True, True, "zipf", 4, False, True, (), "E4M3"),
    ("gelu-frozen-x-probs", 170, 128, 128, 3, "gelu", True, True, "empty", 2, True, True, ("x", "probs"), "E4M3"),
    ("silu-allpad", 64, 128, 128, 3, "silu", True, True, "balanced", 64, True, True, (), "E4M3"),
    ("swiglu-T0", 0, 128, 128, 2, "swiglu", True, True, "balanced", 0, True, True, (), "E4M3"),
    ("swiglu-hybrid-e5m2-grads", 260, 256, 128, 3, "swiglu", True, True, "zipf", 3, True, True, (), "HYBRID"),
    ("srelu-fp16", 180, 128, 128, 2, "srelu", True, True, "balanced", 4, True, True, (), "E4M3", torch.float16),
    # the GEMMs expanding FP8 operands in their K loops (autograd.EXPAND_BEFORE_GEMM off), TMA and pointers
    ("swiglu-empty-pad-kloop", 300, 256, 128, 3, "swiglu", True, True, "empty", 5, True, True, (), "E4M3"),
    ("gptoss-ptr-hybrid-kloop", 260, 128, 256, 4, "gpt_oss_swiglu", True, True, "zipf", 3, True, False, (), "HYBRID"),
    # the weight cache keeping the weights' BF16 values, which the GEMMs read (autograd.BF16_WEIGHT_VALUES)
    ("gptoss-zipf-hybrid-bf16w", 260, 128, 256, 4, "gpt_oss_swiglu", True, True, "zipf", 3, True, True, (), "HYBRID"),
    ("padded-swiglu-bf16w", 200, 160, 96, 3, "swiglu", True, True, "empty", 5, True, True, (), "E4M3"),
    # the quantize passes and epilogues writing FP8 codes, expanded before each GEMM (QUANTIZE_TO_VALUES off)
    ("swiglu-empty-pad-hybrid-codes", 300, 256, 128, 3, "swiglu", True, True, "empty", 5, True, True, (), "HYBRID"),
    ("geglu-ptr-frozen-x-codes", 170, 128, 128, 3, "geglu", True, True, "zipf", 2, True, False, ("x", "probs"),
     "E4M3"),
    # the dGLU as its GEMM + the epilogue alone (gemm.DACT_EPILOGUE = "separate")
    ("swiglu-empty-pad-sepdglu", 300, 256, 128, 3, "swiglu", True, True, "empty", 5, True, True, (), "E4M3"),
    ("gptoss-ptr-hybrid-sepdglu", 260, 128, 256, 4, "gpt_oss_swiglu", True, True, "zipf", 3, True, False, (), "HYBRID"),
    # the dGLU on BF16 values fused on the BF16 backend's kernel with this recipe's quantizing store of dh
    # (gemm.DGLU_VALUES_KERNEL = "bf16"; the other cases run it on this recipe's kernel), TMA and pointers, h in
    # FP32 and BF16
    ("swiglu-empty-pad-bf16dglu", 300, 256, 128, 3, "swiglu", True, True, "empty", 5, True, True, (), "E4M3"),
    ("gptoss-ptr-hbf16-bf16dglu", 260, 128, 256, 4, "gpt_oss_swiglu", True, True, "zipf", 3, False, False, (),
     "E4M3"),
    # ... on the GEMM kernel's epilogue (gemm.SEPARATE_DGLU_KERNEL = "gemm"; the default is the chunked kernel)
    ("swiglu-empty-pad-sepdglu-gemm", 300, 256, 128, 3, "swiglu", True, True, "empty", 5, True, True, (), "E4M3"),
    # the plain GEMMs on BF16 values on this recipe's kernel (gemm.PLAIN_VALUES_KERNEL = "mx"; the other cases
    # run them on the BF16 backend's persistent kernel), TMA and pointer loads, the separate dGLU's GEMM too
    ("swiglu-empty-pad-sepdglu-mxplain", 300, 256, 128, 3, "swiglu", True, True, "empty", 5, True, True, (), "E4M3"),
    ("gptoss-ptr-hybrid-mxplain", 260, 128, 256, 4, "gpt_oss_swiglu", True, True, "zipf", 3, True, False, (),
     "HYBRID"),
    ("padded-swiglu-mxplain", 200, 160, 96, 3, "swiglu", True, True, "empty", 5, True, True, (), "E4M3"),
    # FC1 on BF16 values on this recipe's kernel (gemm.FC1_VALUES_KERNEL = "mx"; the other cases run it on the
    # BF16 backend's persistent kernel with this recipe's quantizing store of a), TMA and pointer loads, gated
    # and not, h in FP32 and BF16
    ("swiglu-empty-pad-sepdglu-fc1mx", 300, 256, 128, 3, "swiglu", True, True, "empty", 5, True, True, (), "E4M3"),
    ("gptoss-ptr-hybrid-hbf16-fc1mx", 260, 128, 256, 4, "gpt_oss_swiglu", True, True, "zipf", 3, False, False, (),
     "HYBRID"),
    ("srelu-frozenw2-fc1mx", 260, 128, 128, 2, "srelu", False, True, "balanced", 0, True, True, ("w2",), "E4M3"),
    # the wgrads reading x's and a's columnwise copies as the FP8 codes they were saved as, expanded in their K
    # loops (autograd.X_CODES_IN_WGRAD), through shared memory or as the wgmma's A operand (wgrad.X_CODES_AS_A),
    # TMA and pointer loads, and on the zero-padded path
    ("swiglu-empty-pad-hybrid-xcodes", 300, 256, 128, 3, "swiglu", True, True, "empty", 5, True, True, (), "HYBRID"),
    ("gptoss-ptr-hbf16-xcodesa", 260, 128, 256, 4, "gpt_oss_swiglu", True, True, "zipf", 3, False, False, (), "E4M3"),
    ("padded-swiglu-xcodesa", 200, 160, 96, 3, "swiglu", True, True, "empty", 5, True, True, (), "E4M3"),
    # the BF16-valued wgrads on torch._grouped_mm (autograd.VALUES_WGRAD_KERNEL = "cublas"; here its CPU
    # fallback through the same path: the slot offsets, empty experts, padding rows, the zero-padded copies)
    ("swiglu-empty-pad-hybrid-cublaswgrad", 300, 256, 128, 3, "swiglu", True, True, "empty", 5, True, True, (),
     "HYBRID"),
    ("padded-swiglu-cublaswgrad", 200, 160, 96, 3, "swiglu", True, True, "empty", 5, True, True, (), "E4M3"),
    # the forward keeping x's and a's columnwise copies as BF16 values (autograd.KEEP_COLUMNWISE_VALUES): TMA and
    # pointer loads, E5M2 gradients, h in BF16
    ("swiglu-empty-pad-hybrid-keepvalues", 300, 256, 128, 3, "swiglu", True, True, "empty", 5, True, True, (),
     "HYBRID"),
    ("gptoss-ptr-hbf16-keepvalues", 260, 128, 256, 4, "gpt_oss_swiglu", True, True, "zipf", 3, False, False, (),
     "E4M3"),
    # sizes off the 128 tile: the zero-padded path (padded.py); F = 50 also ends with a short 1x32 block
    ("padded-swiglu", 200, 160, 96, 3, "swiglu", True, True, "empty", 5, True, True, (), "E4M3"),
    ("padded-gptoss-ptr-hybrid-kloop", 260, 224, 160, 4, "gpt_oss_swiglu", True, True, "zipf", 3, True, False, (),
     "HYBRID"),
    ("padded-srelu-fp16-short-blocks", 150, 100, 50, 2, "srelu", True, True, "balanced", 7, True, True, (), "E4M3",
     torch.float16),
]


# --- 1. E8M0 codec --------------------------------------------------------------------------------

_KERNELS = {}
e8m0_encode = e8m0_to_float = mx_scale = mx_dequant_scale = None  # bound by _codec_kernel() (jit reads globals)


def _codec_kernel():
    if "codec" not in _KERNELS:
        import triton
        import triton.language as tl

        from te_fused_moe.backends.triton.mxfp8 import codec

        globals().update(e8m0_encode=codec.e8m0_encode, e8m0_to_float=codec.e8m0_to_float, mx_scale=codec.mx_scale,
                         mx_dequant_scale=codec.mx_dequant_scale)

        @triton.jit
        def codec_kernel(v_ptr, enc_ptr, code_ptr, dec_ptr, rcp_ptr, deq_ptr, sc_ptr, mult_ptr, n,
                         MAX_NORM_RCP: tl.constexpr, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            ok = offs < n
            v = tl.load(v_ptr + offs, mask=ok, other=0.0)
            tl.store(enc_ptr + offs, e8m0_encode(v), mask=ok)
            c = tl.load(code_ptr + offs, mask=ok, other=0)
            tl.store(dec_ptr + offs, e8m0_to_float(c, False), mask=ok)
            tl.store(rcp_ptr + offs, e8m0_to_float(c, True), mask=ok)
            tl.store(deq_ptr + offs, mx_dequant_scale(c), mask=ok)
            a = tl.where(v == v, v, 0.0)  # amax is NaN-free
            sc, mult = mx_scale(a, MAX_NORM_RCP)
            tl.store(sc_ptr + offs, sc, mask=ok)
            tl.store(mult_ptr + offs, mult, mask=ok)

        _KERNELS["codec"] = codec_kernel
    return _KERNELS["codec"]


def _e8m0_edge_values() -> torch.Tensor:
    """Non-negative FP32 values where E8M0's round-up decides: 0, subnormals around 2^-127 (bit 22),
    every power of two and one ulp either side, the largest finite, Inf, NaN."""
    powers = torch.ldexp(torch.ones(277, dtype=torch.float64), torch.arange(-149, 128)).float()
    bits = powers.view(torch.int32)
    near = torch.cat([(bits + 1).view(torch.float32), (bits - 1).view(torch.float32)])
    sub = torch.tensor([0x3FFFFF, 0x400000, 0x400001, 0x7FFFFF, 1, 2], dtype=torch.int32).view(torch.float32)
    specials = torch.tensor([0.0, float("inf"), float("nan"), torch.finfo(torch.float32).max,
                             torch.finfo(torch.float32).tiny])
    out = torch.cat([powers, near, sub, specials])
    return out[(out >= 0) | torch.isnan(out)]


def check_codec(device: str, seed: int = 0) -> dict:
    """Mismatches of the E8M0 device functions vs te_fused_moe.quantize.formats."""
    from te_fused_moe.backends.triton.mxfp8.quantize import MXSpec
    from te_fused_moe.quantize import formats

    g = torch.Generator().manual_seed(seed)
    rand = torch.randint(0, 2**31 - 1, (40000,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    v = torch.cat([_e8m0_edge_values(), rand]).contiguous()
    n = v.numel()
    codes = torch.arange(n, dtype=torch.int64).remainder(256).to(torch.uint8)
    out = {"n": n}
    for fmt in ("e4m3", "e5m2"):
        spec = MXSpec.of(fmt)
        bufs = [torch.empty(n, dtype=dt, device=device) for dt in (torch.uint8, torch.float32, torch.float32,
                                                                     torch.float32, torch.uint8, torch.float32)]
        enc, dec, rcp, deq, sc, mult = bufs
        _codec_kernel()[(math.ceil(n / 1024),)](v.to(device), enc, codes.to(device), dec, rcp, deq, sc, mult, n,
                                                MAX_NORM_RCP=spec.constexprs()["MAX_NORM_RCP"], BLOCK=1024)
        bits = lambda t: t.cpu().contiguous().view(torch.int32)
        amax = torch.where(torch.isnan(v), torch.zeros_like(v), v)  # NaN skipped, Inf kept (nan_ignoring_amax)
        ref_sc = formats.e8m0_encode(amax * torch.full((), 1.0 / spec.max_value, dtype=torch.float32))
        finite = codes != 255
        out[fmt] = {
            "encode": int((enc.cpu() != formats.e8m0_encode(v)).sum()),
            "decode": int((bits(dec) != bits(formats.e8m0_decode(codes))).sum()),
            "reciprocal": int((bits(rcp) != bits(formats.e8m0_reciprocal(codes))).sum()),
            "dequant_scale": int((bits(deq)[finite] != bits(formats.e8m0_decode(codes))[finite]).sum()),
            "scale": int((sc.cpu() != ref_sc).sum()),
            "multiplier": int((bits(mult) != bits(formats.e8m0_reciprocal(ref_sc))).sum()),
        }
    return out


# --- 2. quantize kernels ---------------------------------------------------------------------------

def _nasty(t: torch.Tensor) -> torch.Tensor:
    """Rows of NaN, Inf, zeros and tiny values, and a wide dynamic range across rows."""
    t = t * torch.exp(torch.randn(t.shape[0], 1, device=t.device) * 3).to(t.dtype)
    t[3, 7] = float("nan")
    t[4, :] = 0
    t[5, 3] = float("inf")
    t[6, :] = 1e-30
    t[7, 1] = -float("inf")
    t[8, 40:72] = 1e-39 if t.dtype == torch.float32 else 1e-30  # a block near E8M0's bottom
    return t



def _diff8(a, b) -> int:
    return int((a.cpu().contiguous().view(torch.uint8) != b.cpu().contiguous().view(torch.uint8)).sum())


def _copy_bad(data, r) -> int:
    """Elements of a kernel's quantized copy ``data`` that differ from the reference's ``r`` (a
    ``quantize.mxfp8`` result of the same shape): its FP8 codes' bytes, or, where the kernel wrote the
    copy as BF16 values, those values against ``r`` dequantized (bits; NaN matches NaN)."""
    from te_fused_moe.quantize import mxfp8 as ref

    if data.dtype != torch.bfloat16:
        return _diff8(data, r.data)
    got, want = data.cpu().float(), ref.dequantize(r).float()
    same = (got.view(torch.int32) == want.view(torch.int32)) | (torch.isnan(got) & torch.isnan(want))
    return int((~same).sum())


def check_quantize_kernels(device: str, seed: int = 0) -> dict:
    from moe_reference import make_counts

    from te_fused_moe.backends.triton.mxfp8 import quantize as Q
    from te_fused_moe.backends.triton.schedule import build_schedule, schedule_table
    from te_fused_moe.quantize import mxfp8 as ref

    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    out = {}
    for dtype, fmt, routing, T, K in (
        (torch.bfloat16, "e4m3", "empty", 300, 256),
        (torch.float32, "e4m3", "one", 200, 128),
        (torch.bfloat16, "e5m2", "zipf", 257, 384),
    ):
        spec = Q.MXSpec.of(fmt)
        x = _nasty(torch.randn(T, K, generator=g).to(dtype)).to(device)
        E = 4
        counts = make_counts(T, E, routing, generator=g, padding=11).to(device)
        sched = build_schedule(counts, T, 128)
        # codes, then both copies written as their BF16 values (autograd.QUANTIZE_TO_VALUES)
        q = Q.quantize_rows(x, sched, E, spec, rowwise=True, colwise=True, alloc=poison_alloc)
        qv = Q.quantize_rows(x, sched, E, spec, rowwise=True, colwise=True, alloc=poison_alloc, row_values=True,
                             col_values=True)
        xr = x.cpu()
        r = ref.quantize(xr, axis=1, fp8_format=fmt)
        bad = {"row_data": _diff8(q.data, r.data), "row_scale": _diff8(q.scale, r.scale), "col_data": 0,
               "col_scale": 0, "col_tail_nonzero": 0, "row_values": _copy_bad(qv.data, r),
               "row_values_scale": _diff8(qv.scale, r.scale), "col_values": 0, "col_values_scale": 0,
               "values_dtype": int(qv.data.dtype != torch.bfloat16) + int(qv.data_t.dtype != torch.bfloat16)}
        tab = schedule_table(sched, E).cpu()
        for grp in range(E + 1):
            ts, te_, rs, re_ = (int(v) for v in tab[:, grp])
            if re_ == rs:
                continue
            rc = ref.quantize(xr[rs:re_], axis=0, fp8_format=fmt)
            bad["col_data"] += _diff8(Q.expert_columns(q.data_t, ts, re_ - rs).T, rc.data)
            bad["col_scale"] += _diff8(Q.expert_col_scales(q.scale_t, ts, re_ - rs), rc.scale)
            bad["col_values"] += _copy_bad(Q.expert_columns(qv.data_t, ts, re_ - rs).T, rc)
            bad["col_values_scale"] += _diff8(Q.expert_col_scales(qv.scale_t, ts, re_ - rs), rc.scale)
            # the slot's columns past the group's end are zeros (the wgrad reads whole blocks)
            for copy in (q.data_t, qv.data_t):
                tail = copy[:, 128 * ts + (re_ - rs): 128 * te_].cpu().contiguous().view(torch.uint8)
                bad["col_tail_nonzero"] += int((tail != 0).sum())
        w = _nasty(torch.randn(3 * 256, K, generator=g).to(dtype)).reshape(3, 256, K).to(device)
        qw = Q.quantize_weight(w, spec, alloc=poison_alloc)
        bad.update(w_data=0, w_scale=0, w_data_t=0, w_scale_t=0)
        for e in range(3):
            rw = ref.quantize(w[e].cpu(), axis=1, fp8_format=fmt)
            rt = ref.quantize(w[e].cpu(), axis=0, fp8_format=fmt)
            bad["w_data"] += _diff8(qw.data[e], rw.data)
            bad["w_scale"] += _diff8(qw.scale[e], rw.scale)
            bad["w_data_t"] += _diff8(qw.data_t[e].T, rt.data)
            bad["w_scale_t"] += _diff8(qw.scale_t[e].T, rt.scale)
        out[f"{dtype}-{fmt}-{routing}-T{T}-K{K}"] = bad
    return out


def check_weight_cache(device: str) -> dict:
    """Quantized once per optimizer step: micro-batches reuse the copy; an in-place update or an
    optimizer step refreshes it (fp8_block's cache rules, MXFP8 copies)."""
    from te_fused_moe.backends.triton.fp8_block.quantize import WeightCache
    from te_fused_moe.backends.triton.mxfp8.quantize import MXSpec, quantize_weight
    from te_fused_moe.quantize import mxfp8 as ref

    cache = WeightCache(quantize_fn=quantize_weight)
    spec = MXSpec()
    w = torch.nn.Parameter(torch.randn(2, 256, 128, device=device, dtype=torch.bfloat16))
    first = cache.get(w, spec)
    again = [cache.get(w, spec) for _ in range(3)]
    same_object = all(q is first for q in again)
    misses_before = cache.misses
    with torch.no_grad():
        w.add_(1.0)
    fresh = cache.get(w, spec)
    rw = ref.quantize(w[1].detach().cpu(), axis=0)
    out = dict(same_object=same_object, misses_before=misses_before, misses_after=cache.misses,
               refreshed=fresh is not first, fresh_bad=_diff8(fresh.data_t[1].T, rw.data), nbytes=cache.nbytes,
               expected_nbytes=2 * w.numel() + 2 * w.numel() // 32)
    other = torch.nn.Parameter(torch.ones(1, device=device))
    opt = torch.optim.SGD([other], lr=0.1)
    other.grad = torch.ones_like(other)
    w.data.copy_(w.data * 2)
    out["stale_without_step"] = cache.get(w, spec) is fresh
    opt.step()
    after_step = cache.get(w, spec)
    rw = ref.quantize(w[1].detach().cpu(), axis=1)
    out["refreshed_after_step"] = after_step is not fresh and _diff8(after_step.data[1], rw.data) == 0
    out["hit_after_step"] = cache.get(w, spec) is after_step
    cache._hook.remove()
    out.update(check_weight_values(device, w.detach()))
    return out


def check_weight_values(device: str, w: torch.Tensor) -> dict:
    """With ``bf16_values`` the cache's entry also holds both layouts' BF16 values: bit-equal to the
    reference's dequantized FP8 values (code times E8M0 scale, exact in BF16), the FP8 copies as without
    it, and the values counted in ``nbytes``; a spec without it is another entry."""
    import dataclasses

    from te_fused_moe.backends.triton.fp8_block.quantize import WeightCache
    from te_fused_moe.backends.triton.mxfp8.quantize import MXSpec, quantize_weight
    from te_fused_moe.quantize import mxfp8 as ref

    cache = WeightCache(follow_optimizer_steps=False, quantize_fn=quantize_weight)
    spec = MXSpec()
    with_values = cache.get(w, dataclasses.replace(spec, bf16_values=True))
    bad = dict(values=0, values_t=0, data=0)
    for e in range(w.shape[0]):
        along_k, along_n = ref.quantize(w[e].cpu(), axis=1), ref.quantize(w[e].cpu(), axis=0)
        bad["values"] += _diff8(with_values.values[e].float(), ref.dequantize(along_k).float())
        bad["values_t"] += _diff8(with_values.values_t[e].T.float(), ref.dequantize(along_n).float())
        bad["data"] += _diff8(with_values.data[e], along_k.data)
    without = cache.get(w, spec)
    return dict(values_bad=bad, values_dtype=str(with_values.values.dtype),
                values_nbytes=with_values.nbytes, values_expected_nbytes=2 * w.numel() * 3 + 2 * w.numel() // 32,
                plain_entry_has_no_values=without is not with_values and without.values is None)


@contextlib.contextmanager
def _expansions_counted(**flags):
    """``mxfp8.autograd``'s ``flags`` set and its ``expand_values`` spied on inside; yields the list the spy
    fills with each expanded operand's rank (2: an activation or gradient copy, 3: a weight)."""
    from te_fused_moe.backends.triton.mxfp8 import autograd

    shipped = {name: getattr(autograd, name) for name in ("expand_values", *flags)}
    dims = []

    def spy(data, scale, alloc=torch.empty):
        dims.append(data.dim())
        return shipped["expand_values"](data, scale, alloc=alloc)

    autograd.expand_values = spy
    for name, value in flags.items():
        setattr(autograd, name, value)
    try:
        yield dims
    finally:
        for name, value in shipped.items():
            setattr(autograd, name, value)


def check_weight_reads(device: str) -> dict:
    """How many weight expansions (3-D operands through the reader) the second of two forward +
    backward passes runs: with ``BF16_WEIGHT_VALUES`` none (the GEMMs read the cache's values), without
    it four (w1 and w2 forward, their transposed copies backward). Also the two passes' dx, the same
    bits either way (the values are the same numbers)."""
    from moe_reference import random_problem

    from te_fused_moe import fused_moe_mlp
    from te_fused_moe.recipes import MXFP8BlockScaling

    p = random_problem(256, 128, 128, 2, dtype=torch.bfloat16, device=device, seed=11)
    dy = torch.randn(256, 128, generator=torch.Generator().manual_seed(12)).to(device=device, dtype=torch.bfloat16)
    out = {}
    for flag in (True, False):
        with _expansions_counted(BF16_WEIGHT_VALUES=flag) as dims:
            for _ in range(2):
                dims.clear()
                x = p["x"].clone().requires_grad_()
                y = fused_moe_mlp(x, p["tokens_per_expert"], p["w1"], p["w2"], activation="swiglu",
                                  recipe=MXFP8BlockScaling(), backend="triton")
                y.backward(dy)
            out[f"weight_expansions_{flag}"] = dims.count(3)
            out[f"activation_expansions_{flag}"] = dims.count(2)
            out[f"dx_{flag}"] = x.grad.float().cpu()
    out["dx_bad"] = _diff8(out.pop("dx_True"), out.pop("dx_False"))
    return out


def _mlp_with_flag_off_and_on(device: str, seed: int, flag: str) -> tuple:
    """The MLP's forward + backward with ``mxfp8.autograd``'s ``flag`` off and on, on the same random problem
    (HYBRID: E5M2 gradients; bias, probs, an empty expert, padding rows): (``{"activation_expansions_<on>":
    the activation expansion passes, 2-D operands through ``expand_values``, it ran}``, the compared
    outputs' differing elements ``bad``, their NaNs with it on), and each run's y and gradients."""
    from moe_reference import random_problem

    from te_fused_moe import fused_moe_mlp
    from te_fused_moe.recipes import Format, MXFP8BlockScaling

    p = random_problem(300, 256, 128, 3, dtype=torch.bfloat16, device=device, bias=True, probs=True, routing="empty",
                       padding=5, seed=seed)
    dy = torch.randn(300, 256, generator=torch.Generator().manual_seed(seed + 1)).to(device=device,
                                                                                   dtype=torch.bfloat16)
    out, results = {}, {}
    for on in (False, True):
        with _expansions_counted(**{flag: on}) as dims:
            leaves = {k: p[k].detach().clone().requires_grad_() for k in ("x", "w1", "w2", "b1", "b2", "probs")}
            y = fused_moe_mlp(leaves["x"], p["tokens_per_expert"], leaves["w1"], leaves["w2"], b1=leaves["b1"],
                              b2=leaves["b2"], probs=leaves["probs"], activation="swiglu",
                              recipe=MXFP8BlockScaling(fp8_format=Format.HYBRID), backend="triton")
            y.backward(dy)
            results[on] = {"y": y.detach(), **{k: t.grad for k, t in leaves.items()}}
            out[f"activation_expansions_{on}"] = dims.count(2)
    out["bad"] = {k: _diff8(results[False][k], results[True][k]) for k in results[False]}
    out["nan"] = sum(int(torch.isnan(t).sum()) for t in results[True].values())
    return out, results


def check_saved_codes_in_wgrad(device: str, as_a: bool, seed: int = 23) -> dict:
    """:func:`_mlp_with_flag_off_and_on` of ``X_CODES_IN_WGRAD`` (``wgrad.X_CODES_AS_A`` = ``as_a``): 2 activation
    expansion passes off (x's and a's columnwise copies), 0 on, and no element of any output may differ (the
    wgrads multiply the same values in the same order, the other kernels are the same)."""
    from te_fused_moe.backends.triton.mxfp8 import autograd, wgrad

    # the values path on the same wgrad kernel (cuBLAS would sum in another order)
    shipped, wgrad.X_CODES_AS_A = wgrad.X_CODES_AS_A, as_a
    values_wgrad, autograd.VALUES_WGRAD_KERNEL = autograd.VALUES_WGRAD_KERNEL, "triton"
    try:
        return _mlp_with_flag_off_and_on(device, seed, "X_CODES_IN_WGRAD")[0]
    finally:
        wgrad.X_CODES_AS_A, autograd.VALUES_WGRAD_KERNEL = shipped, values_wgrad


def assert_saved_codes_in_wgrad(r: dict) -> None:
    assert r["activation_expansions_False"] == 2 and r["activation_expansions_True"] == 0, r
    assert all(v == 0 for v in r["bad"].values()) and r["nan"] == 0, r


def check_kept_values(device: str, seed: int = 25) -> dict:
    """:func:`_mlp_with_flag_off_and_on` of ``KEEP_COLUMNWISE_VALUES``: 2 activation expansion passes off (x's and
    a's columnwise copies, kept as FP8), 0 on (kept as the values the wgrads read), and no element of any output
    may differ (the same values reach the same kernels), nor the kept copies' bytes per element (BF16 on)."""
    from te_fused_moe.backends.triton import block_scaled

    kept, keep_columnwise = [], block_scaled.keep_columnwise

    def spy(ctx, kernels, xq, aq):
        kept.append((xq.data_t.dtype, aq.data_t.dtype))
        keep_columnwise(ctx, kernels, xq, aq)

    block_scaled.keep_columnwise = spy
    try:
        out = _mlp_with_flag_off_and_on(device, seed, "KEEP_COLUMNWISE_VALUES")[0]
    finally:
        block_scaled.keep_columnwise = keep_columnwise
    out["kept_dtypes"] = [str(dtype) for pair in kept for dtype in pair]
    return out


def assert_kept_values(r: dict) -> None:
    assert r["activation_expansions_False"] == 2 and r["activation_expansions_True"] == 0, r
    assert r["kept_dtypes"] == ["torch.float8_e4m3fn"] * 2 + ["torch.bfloat16"] * 2, r
    assert all(v == 0 for v in r["bad"].values()) and r["nan"] == 0, r


def check_values_in_pass(device: str, seed: int = 21) -> dict:
    """:func:`_mlp_with_flag_off_and_on` of ``QUANTIZE_TO_VALUES``: the same bits in y and in the GEMMs'
    gradients (they read the same values, only who writes them changes), and 8 activation expansion passes
    off, 2 on (x and a columnwise, kept as FP8 for backward)."""
    out, results = _mlp_with_flag_off_and_on(device, seed, "QUANTIZE_TO_VALUES")
    out["sums_step"] = {k: float((results[False][k].float() - results[True][k].float()).abs().max()
                                 / results[False][k].float().abs().max()) for k in ("b1", "b2", "probs")}
    return out


def assert_values_in_pass(r: dict) -> None:
    """The GEMMs' outputs bit for bit; the bias and probs gradients, sums of FP32 partials whose order
    follows the kernels' register layouts (which the values' BF16 stores may change on the GPU), within
    one BF16 step of their largest element."""
    assert r["activation_expansions_False"] == 8 and r["activation_expansions_True"] == 2, r
    assert all(r["bad"][k] == 0 for k in ("y", "x", "w1", "w2")) and r["nan"] == 0, r
    assert all(r["sums_step"][k] <= 2.0**-8 for k in ("b1", "b2", "probs")), r


# --- 3. every kernel bit-exact on integer data ------------------------------------------------------

def check_kernels_exact(device: str, seed: int = 0, use_tma: bool = True, fmt: str = "e4m3",
                        T: int = 300, H: int = 256, epilogue=None, plain=None, wgrad=None, values: bool = False,
                        h_dtype: torch.dtype = torch.float32, written_values: bool = False,
                        dglu_kernel: str = None, dglu_route: bool = False, saved_codes: bool = False) -> dict:
    """Integer operands in [-3, 3]: quantization is exact (amax <= 3 gives an E8M0 scale with
    3 * 2^(127 - e) representable), GEMM sums are small integers (exact in any order, also in the
    FP8 wgmma), so every kernel output has one right answer. ``srelu`` keeps the epilogue math to
    multiplies that PyTorch reproduces bit for bit. ``fmt`` is the format of a, dy and dh;
    ``epilogue``, ``plain``, ``wgrad``: overrides of the FC1 / dGLU, FC2 / dgrad and wgrad configs
    (e.g. ``block_n=128, split_epilogue=False``); ``values``: every GEMM reads its operands as the BF16
    values an expansion pass writes before it (``autograd.read_expanded``), as the fused path does;
    ``written_values`` too, the quantize passes and epilogues writing those values themselves where the
    fused path's GEMMs of the same pass read them (``autograd.QUANTIZE_TO_VALUES``: x, a rowwise; dy, dh
    both ways). ``dglu_kernel``: the separate dGLU epilogue's kernel (``gemm.SEPARATE_DGLU_KERNEL``; None:
    the shipped one). ``dglu_route``: the dGLU at its own default config with ``gemm.DGLU_VALUES_KERNEL =
    "bf16"`` (on BF16 values: fused on the BF16 backend's kernel); else it runs FC1's config.
    ``h_dtype`` BF16: h is saved rounded (FC1, one kernel, acts on the FP32 sums); the dGLU reads
    that h, and a separate dGLU epilogue reads ``da`` rounded to BF16 too. ``saved_codes`` (with ``values``):
    the wgrads take x's and a's columnwise copies as FP8 codes next to the gradients' values and expand
    them in their K loops (``autograd.X_CODES_IN_WGRAD``)."""
    import dataclasses

    from moe_reference import make_counts

    from te_fused_moe.backends.triton.fp8_block.wgrad import tile_sums_to_experts
    from te_fused_moe.backends.triton.block_scaled import as_quantized
    from te_fused_moe.backends.triton.mxfp8 import gemm, quantize as Q
    from te_fused_moe.backends.triton.mxfp8.autograd import read_expanded
    from te_fused_moe.backends.triton.mxfp8.quantize import MXRows, new_rows
    from te_fused_moe.backends.triton.mxfp8.wgrad import default_config as wgrad_default, mx_grouped_wgrad
    from te_fused_moe.backends.triton.schedule import build_schedule, max_m_tiles, schedule_table
    from te_fused_moe.quantize import mxfp8 as ref

    gemm.USE_TMA_DEFAULT = use_tma
    shipped_dglu, gemm.SEPARATE_DGLU_KERNEL = gemm.SEPARATE_DGLU_KERNEL, dglu_kernel or gemm.SEPARATE_DGLU_KERNEL
    shipped_route, gemm.DGLU_VALUES_KERNEL = gemm.DGLU_VALUES_KERNEL, "bf16" if dglu_route else "mx"
    g = torch.Generator().manual_seed(seed)
    F, E, n1 = 128, 3, 128
    ints = lambda *shape: torch.randint(-3, 4, shape, generator=g).float()
    x, w1, w2, dy = ints(T, H), ints(E, n1, H), ints(E, H, F), ints(T, H)
    probs = torch.rand(T, generator=g) + 0.5
    counts = make_counts(T, E, "empty", generator=g, padding=6)
    d = lambda t, dt=torch.bfloat16: t.to(device=device, dtype=dt).contiguous()
    wspec, spec = Q.MXSpec(), Q.MXSpec.of(fmt)
    sched = build_schedule(d(counts, torch.int64), T, 128)
    tiles = max_m_tiles(T, E, 128)
    both = dict(row_values=written_values, col_values=written_values)
    xq = Q.quantize_rows(d(x), sched, E, wspec, rowwise=True, colwise=True, alloc=poison_alloc,
                         row_values=written_values)
    w1q, w2q = Q.quantize_weight(d(w1), wspec), Q.quantize_weight(d(w2), wspec)
    h = poisoned(torch.empty(T, n1, device=device, dtype=h_dtype))
    aq = new_rows(T, F, h, spec, E, True, True, alloc=poison_alloc, row_values=written_values)
    p = d(probs, torch.float32)
    read = read_expanded if values else as_quantized
    cols = lambda q: MXRows(data_t=read(q.data_t, q.scale_t, True), scale_t=q.scale_t)
    cfg = dataclasses.replace(gemm.default_config("fc1", values), **(epilogue or {}))
    gemm.launch("fc1", read(xq.data, xq.scale), xq.scale, read(w1q.data, w1q.scale), w1q.scale, F, sched, E, spec,
                q=aq, h=h, probs=p, activation="srelu", gated=False, config=cfg)
    y = poisoned(torch.empty(T, H, device=device, dtype=torch.bfloat16))
    pcfg = dataclasses.replace(gemm.default_config("fc2", values), **(plain or {}))
    wcfg = dataclasses.replace(wgrad_default(values), **(wgrad or {}))
    gemm.launch("fc2", read(aq.data, aq.scale), aq.scale, read(w2q.data, w2q.scale), w2q.scale, H, sched, E, wspec,
                c=y, config=pcfg)
    dyq = Q.quantize_rows(d(dy), sched, E, spec, rowwise=True, colwise=True, alloc=poison_alloc, **both)
    dhq = new_rows(T, n1, h, spec, E, True, True, alloc=poison_alloc, **both)
    dcfg = gemm.default_config("dact", values) if dglu_route else cfg
    dprob = poisoned(torch.empty(F // dcfg.block_n, T, device=device))
    dbias = poisoned(torch.empty(tiles, n1, device=device))
    gemm.launch("dact", read(dyq.data, dyq.scale), dyq.scale, read(w2q.data_t, w2q.scale_t), w2q.scale_t, F, sched,
                E, spec, q=dhq, h=h, probs=p, dprob=dprob, dbias=dbias, activation="srelu", gated=False, config=dcfg)
    dx = poisoned(torch.empty(T, H, device=device, dtype=torch.bfloat16))
    gemm.launch("dgrad", read(dhq.data, dhq.scale), dhq.scale, read(w1q.data_t, w1q.scale_t), w1q.scale_t, H, sched,
                E, spec, c=dx, config=pcfg)
    dw1 = poisoned(torch.empty(E, n1, H, device=device, dtype=torch.bfloat16))
    dw2 = poisoned(torch.empty(E, H, F, device=device, dtype=torch.bfloat16))
    saved = (lambda q: q) if saved_codes else cols
    mx_grouped_wgrad(cols(dyq), saved(aq), sched, dw2, config=wcfg)
    mx_grouped_wgrad(cols(dhq), saved(xq), sched, dw1, config=wcfg)
    db1 = poisoned(torch.empty(E, n1, device=device, dtype=torch.float32))
    tile_sums_to_experts(dbias, sched, db1)
    gemm.USE_TMA_DEFAULT, gemm.SEPARATE_DGLU_KERNEL, gemm.DGLU_VALUES_KERNEL = True, shipped_dglu, shipped_route

    tab = schedule_table(sched, E).cpu()
    bad = {k: 0 for k in ("h", "a_row", "a_col", "y", "dh_row", "dh_col", "dx", "dw1", "dw2", "db1", "dprob")}
    h_ref = torch.zeros(T, n1)
    da_ref = torch.zeros(T, F)
    for e in range(E):
        rs, re_ = int(tab[2, e]), int(tab[3, e])
        h_ref[rs:re_] = (x[rs:re_].double() @ w1[e].double().T).float()
        da_ref[rs:re_] = (dy[rs:re_].double() @ w2[e].double()).float()
    hc = h.cpu().float()
    routed = int(tab[3, E - 1])
    bad["h"] = int((hc[:routed] != h_ref[:routed].to(h_dtype).float()).sum())
    bad["h_rounded"] = int((h_ref != h_ref.to(h_dtype).float()).sum())
    a32 = torch.relu(h_ref) ** 2 * probs[:, None]
    a32[routed:] = 0
    r = torch.relu(hc)  # the dGLU reads the saved h
    bad["dglu_on_bf16_kernel"] = int(dcfg.bf16_kernel and (dcfg.epilogue or gemm.DACT_EPILOGUE) == "auto")
    if dcfg.epilogue == "separate":
        bad["da_rounded"] = int((da_ref != da_ref.to(h_dtype).float()).sum())  # values the rounding moved
        da_ref = da_ref.to(h_dtype).float()  # ...and its epilogue alone da in h's dtype
    dg32 = (da_ref * probs[:, None]) * 2.0 * r
    dg32[routed:] = 0
    qz = lambda t, axis: ref.quantize(t, axis=axis, fp8_format=fmt)
    ra, rdh = qz(a32, 1), qz(dg32, 1)
    bad["a_row"] = _copy_bad(aq.data, ra) + _diff8(aq.scale, ra.scale)
    bad["dh_row"] = _copy_bad(dhq.data, rdh) + _diff8(dhq.scale, rdh.scale)
    bad["wgrad_codes_operands"] = sum(saved(q).data_t.dtype != torch.bfloat16 for q in (aq, xq))
    bad["written_values"] = sum(t.dtype == torch.bfloat16 for t in (xq.data, aq.data, dyq.data, dyq.data_t, dhq.data,
                                                                     dhq.data_t))
    deq = lambda q: ref.dequantize(q, torch.float64)

    for grp in range(E + 1):
        ts, te_, rs, re_ = (int(v) for v in tab[:, grp])
        if re_ == rs:
            continue
        rc = qz(a32[rs:re_], 0)
        bad["a_col"] += (_copy_bad(Q.expert_columns(aq.data_t, ts, re_ - rs).T, rc)
                         + _diff8(Q.expert_col_scales(aq.scale_t, ts, re_ - rs), rc.scale))
        rc = qz(dg32[rs:re_], 0)
        bad["dh_col"] += (_copy_bad(Q.expert_columns(dhq.data_t, ts, re_ - rs).T, rc)
                          + _diff8(Q.expert_col_scales(dhq.scale_t, ts, re_ - rs), rc.scale))
        if grp == E:
            continue
        bad["y"] += far(y[rs:re_], deq(qz(a32[rs:re_], 1)), w2[grp].double().T)
        bad["dx"] += far(dx[rs:re_], deq(qz(dg32[rs:re_], 1)), w1[grp].double())
        bad["dw2"] += far(dw2[grp], dy[rs:re_].double().T, deq(qz(a32[rs:re_], 0)))
        bad["dw1"] += far(dw1[grp], deq(qz(dg32[rs:re_], 0)).T, x[rs:re_].double())
    for e in range(E):
        rs, re_ = int(tab[2, e]), int(tab[3, e])
        if re_ == rs:  # experts without tokens: exact zeros
            bad["dw1"] += int((dw1[e].cpu() != 0).sum())
            bad["dw2"] += int((dw2[e].cpu() != 0).sum())
        db1_ref = dg32[rs:re_].double().sum(0)
        bad["db1"] += int(((db1[e].cpu().double() - db1_ref).abs() > 1e-6 * dg32.abs().sum(0).double() + 1e-30).sum())
    bad["y"] += int((y[routed:].cpu() != 0).sum()) + int(torch.isnan(y).sum())
    bad["dx"] += int((dx[routed:].cpu() != 0).sum()) + int(torch.isnan(dx).sum())
    act_h = r * r
    dprob_ref = (da_ref.double() * act_h.double()).sum(1)
    dprob_ref[routed:] = 0
    bound = 1e-6 * (da_ref.double().abs() * act_h.double().abs()).sum(1)
    bad["dprob"] = int(((dprob.cpu().double().sum(0) - dprob_ref).abs() > bound).sum())
    bad["routed"] = routed
    bad["counts"] = counts.tolist()
    return bad


# --- 4. the whole MLP vs the reference backend ----------------------------------------------------

def run_mlp_case(case, device: str, poison: bool = True, seed: int = 0, triton_context=None) -> dict:
    """Forward + backward of the Triton MXFP8 path and of the reference backend on the same random
    problem; ``triton_context`` (a context-manager factory) wraps the Triton call only."""
    from block_scaled_checks import compare_with_reference
    from moe_reference import random_problem

    from te_fused_moe.backends.triton import library_wgrad
    from te_fused_moe.backends.triton.mxfp8 import autograd, gemm, wgrad
    from te_fused_moe.recipes import Format, MXFP8BlockScaling

    case_id, T, H, F, E, act, bias, probs, routing, padding, h_fp32, tma, frozen, fmt = case[:14]
    dtype = case[14] if len(case) > 14 else torch.bfloat16
    recipe = MXFP8BlockScaling(fp8_format=Format[fmt])
    p = random_problem(T, H, F, E, activation=act, dtype=dtype, device=device, bias=bias, probs=probs,
                       routing=routing, padding=padding, seed=seed)
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(seed + 1)).to(device=device, dtype=dtype)
    default, autograd.EXPAND_BEFORE_GEMM = autograd.EXPAND_BEFORE_GEMM, not case_id.endswith("-kloop")
    # the dGLU: the shipped "auto" (separate on the GPU, one kernel under the interpreter; with "-bf16dglu" on
    # BF16 values, fused on the BF16 backend's kernel, gemm.DGLU_VALUES_KERNEL), its GEMM + the epilogue alone,
    # or this recipe's kernel as one
    dglu, gemm.DACT_EPILOGUE = gemm.DACT_EPILOGUE, ("separate" if "-sepdglu" in case_id else
                                                    "fused" if "-mxdglu" in case_id else "auto")
    route, gemm.DGLU_VALUES_KERNEL = gemm.DGLU_VALUES_KERNEL, "bf16" if "-bf16dglu" in case_id else "mx"
    dglu_kernel = gemm.SEPARATE_DGLU_KERNEL
    gemm.SEPARATE_DGLU_KERNEL = "gemm" if case_id.endswith("-sepdglu-gemm") else dglu_kernel
    values, autograd.BF16_WEIGHT_VALUES = autograd.BF16_WEIGHT_VALUES, "-bf16w" in case_id
    written, autograd.QUANTIZE_TO_VALUES = autograd.QUANTIZE_TO_VALUES, "-codes" not in case_id
    plain = gemm.PLAIN_VALUES_KERNEL
    gemm.PLAIN_VALUES_KERNEL = "bf16" if "-bf16plain" in case_id else "mx" if "-mxplain" in case_id else plain
    fc1 = gemm.FC1_VALUES_KERNEL
    gemm.FC1_VALUES_KERNEL = "bf16" if "-fc1bf16" in case_id else "mx" if "-fc1mx" in case_id else fc1
    # the wgrads reading the saved columnwise copies as FP8 codes ("-xcodes"), as the wgmma's A operand ("-xcodesa")
    x_codes, autograd.X_CODES_IN_WGRAD = autograd.X_CODES_IN_WGRAD, "-xcodes" in case_id
    as_a, wgrad.X_CODES_AS_A = wgrad.X_CODES_AS_A, "-xcodesa" in case_id
    keep, autograd.KEEP_COLUMNWISE_VALUES = autograd.KEEP_COLUMNWISE_VALUES, "-keepvalues" in case_id
    # the BF16-valued wgrads on torch._grouped_mm ("-cublaswgrad"; on CPU its fallback, through the same path)
    values_wgrad, autograd.VALUES_WGRAD_KERNEL = autograd.VALUES_WGRAD_KERNEL, (
        "cublas" if "-cublaswgrad" in case_id else "triton" if "-tritonwgrad" in case_id else autograd.VALUES_WGRAD_KERNEL)
    runs_on, values_wgrad_fn, library_calls = library_wgrad.runs_on, library_wgrad.values_wgrad, []
    if "-cublaswgrad" in case_id and device == "cpu":
        library_wgrad.runs_on = lambda like: True
    library_wgrad.values_wgrad = lambda *args: library_calls.append(1) or values_wgrad_fn(*args)
    try:
        res = compare_with_reference(p, recipe, act, dy, frozen, poison_alloc if poison else torch.empty, h_fp32,
                                     gemm, tma, triton_context)
        res["library_wgrads"] = len(library_calls)  # wgrads that ran on torch._grouped_mm
        return res
    finally:
        library_wgrad.values_wgrad = values_wgrad_fn
        gemm.FC1_VALUES_KERNEL, gemm.DGLU_VALUES_KERNEL = fc1, route
        autograd.EXPAND_BEFORE_GEMM, gemm.DACT_EPILOGUE, autograd.BF16_WEIGHT_VALUES = default, dglu, values
        autograd.QUANTIZE_TO_VALUES = written
        gemm.SEPARATE_DGLU_KERNEL, gemm.PLAIN_VALUES_KERNEL = dglu_kernel, plain
        autograd.X_CODES_IN_WGRAD, wgrad.X_CODES_AS_A = x_codes, as_a
        autograd.KEEP_COLUMNWISE_VALUES = keep
        autograd.VALUES_WGRAD_KERNEL, library_wgrad.runs_on = values_wgrad, runs_on

# --- 5. dispatch, validation, benchmark baseline --------------------------------------------------

def check_dispatch(device: str) -> dict:
    """Which Function runs which sizes (:func:`block_scaled_checks.check_dispatch`)."""
    from block_scaled_checks import check_dispatch as check

    from te_fused_moe.recipes import MXFP8BlockScaling

    return check(MXFP8BlockScaling(), device)


# --- 6. offline sm_90a build (no GPU needed) ----------------------------------------------------------

def sm90_build_report() -> dict:
    """Compile every MXFP8 kernel variant the backend launches by default for sm_90a with the Triton
    wheel's ptxas (no GPU): per kernel the FP8 wgmma instructions (QGMMA) in its SASS, its stack
    (spill) bytes, and the spill loads/stores inside its K loop. Needs TRITON_INTERPRET unset."""
    import dataclasses

    from sm90_build import build_sm90 as build

    from te_fused_moe.backends.triton.act_math import ACT_IDS
    from te_fused_moe.backends.triton.block_scaled_launch import GEMM_MODES, MODE_DACT, MODE_PLAIN
    from te_fused_moe.backends.triton.mxfp8 import gemm, quantize as Q, wgrad as W

    spec = Q.MXSpec().constexprs()

    ptrs = dict(as_ptr="*u8", bs_ptr="*u8", c_ptr="*bf16", q_ptr="*u8", qs_ptr="*u8", qt_ptr="*u8", qts_ptr="*u8",
                h_ptr="*bf16", bias_ptr="*bf16", probs_ptr="*fp32", dprob_ptr="*fp32", dbias_ptr="*fp32",
                sched_ptr="*i32", alpha="fp32", limit="fp32")
    report = {}
    for name, kind, gated, act, a_dt in (("fc1_swiglu", "fc1", True, "swiglu", "fp8e4nv"),
                                         ("fc1_srelu", "fc1", False, "srelu", "fp8e4nv"),
                                         ("fc2", "fc2", False, "swiglu", "fp8e4nv"),
                                         ("dact_gptoss_e5m2", "dact", True, "gpt_oss_swiglu", "fp8e5"),
                                         ("dgrad_e5m2", "dgrad", False, "swiglu", "fp8e5"),
                                         # BF16 values expanded before the GEMM (the fused path's default)
                                         ("fc1_swiglu_values", "fc1", True, "swiglu", "bf16"),
                                         ("fc1_gptoss_values_off_tile", "fc1", True, "gpt_oss_swiglu", "bf16"),
                                         ("fc2_values", "fc2", False, "swiglu", "bf16"),
                                         ("dact_swiglu_values", "dact", True, "swiglu", "bf16"),
                                         ("dgrad_values", "dgrad", False, "swiglu", "bf16")):
        values = a_dt == "bf16"
        cfg = gemm.default_config(kind, values)
        if name.endswith("_off_tile"):  # F = 2880 (GPT-OSS, zero-padded path): 128-column tiles to reach 2944
            cfg = gemm.fc1_covering(cfg, 2880, values)
            assert cfg.block_n == 128
        mode = GEMM_MODES[kind]
        bk = gemm.EXPAND_BLOCK_K if cfg.expand_bf16 else 32
        b_dt = "bf16" if values else "fp8e4nv"
        types = dict(ptrs, a_src=f"tensordesc<{a_dt}[128, {bk}]>", b_src=f"tensordesc<{b_dt}[{cfg.block_n}, {bk}]>")
        quant = mode != MODE_PLAIN
        consts = dict(MODE=mode, ACT=ACT_IDS[act], GATED=gated, HAS_BIAS=True, HAS_PROBS=True,
                      WRITE_DPROB=mode == MODE_DACT, WRITE_DBIAS=mode == MODE_DACT, ROWWISE=quant,
                      COLWISE=quant, USE_TMA=True, UPCAST=False, ACC_IN=False,
                      SPLIT_EPILOGUE=quant and cfg.split_epilogue, **spec,
                      EXPAND=cfg.expand_bf16, A_BF16=values, B_BF16=values, BM=128, BN=cfg.block_n, BK=bk,
                      GROUP_M=cfg.group_m)
        report[name] = build(gemm.mx_grouped_gemm_kernel, types, consts, cfg.num_warps, cfg.num_stages)
        if values and quant:  # the epilogue writing the copies its pass's GEMMs read as values (QUANTIZE_TO_VALUES)
            written = dict(types, q_ptr="*bf16", qt_ptr="*bf16" if mode == MODE_DACT else "*u8")
            report[f"{name}_written"] = build(gemm.mx_grouped_gemm_kernel, written, consts, cfg.num_warps,
                                              cfg.num_stages)
    # the dGLU's epilogue alone (gemm.DACT_EPILOGUE = "separate"): no K loop, so no wgmma
    cfg = gemm.default_config("dact", True)
    consts.update(MODE=MODE_DACT, ACT=ACT_IDS["swiglu"], GATED=True, WRITE_DPROB=True, WRITE_DBIAS=True, ROWWISE=True,
                  COLWISE=True, USE_TMA=False, ACC_IN=True, SPLIT_EPILOGUE=cfg.split_epilogue, BN=cfg.block_n)
    report["dact_swiglu_epilogue_alone"] = build(gemm.mx_grouped_gemm_kernel,
                                                 dict(ptrs, a_src="*bf16", b_src="*bf16", c_ptr="*fp32"), consts,
                                                 cfg.num_warps, 1)
    # its chunked kernel (gemm.SEPARATE_DGLU_KERNEL), writing values (the default) and codes
    from te_fused_moe.backends.triton.mxfp8 import dglu_epilogue as D

    for name, qt in (("dglu_chunks_values", "*bf16"), ("dglu_chunks_codes", "*u8")):
        report[name] = build(D.dglu_chunks_kernel, dict(da_ptr="*bf16", h_ptr="*bf16", probs_ptr="*fp32",
                                                        dprob_ptr="*fp32", dbias_ptr="*fp32", q_ptr=qt, qs_ptr="*u8",
                                                        qt_ptr=qt, qts_ptr="*u8", sched_ptr="*i32", alpha="fp32",
                                                        limit="fp32"),
                             dict(ACT=ACT_IDS["swiglu"], GATED=True, HAS_PROBS=True, WRITE_DPROB=True, WRITE_DBIAS=True,
                                  ROWWISE=True, COLWISE=True, **spec, BM=128, BK=D.COLS, PART=cfg.block_n,
                                  UNROLL=D.UNROLL),
                             D.WARPS, 1, D.MAXNREG)
    # (and the BF16-valued wgrad at a tile slot and at 64 tokens a step, W.MXWgradConfig.block_t: two programs
    # per SM, the default since run 37a; then with x's FP8 codes expanded in its K loop, autograd.X_CODES_IN_WGRAD,
    # into shared memory or as the wgmma's A operand)
    for values, block_t, x_codes, x_as_a in ((False, None, False, False), (True, None, False, False),
                                             (True, 64, False, False), (True, 64, True, False), (True, 64, True, True)):
        wcfg = dataclasses.replace(W.default_config(values), block_t=block_t)
        bt = block_t or (128 if wcfg.expand_bf16 else 32)
        g_dt, x_dt = ("bf16", "fp8e4nv" if x_codes else "bf16") if values else ("fp8e5", "fp8e4nv")
        name = ("wgrad_values" if values else "wgrad") + (f"_t{block_t}" if block_t else "")
        report[name + ("_x_codes" if x_codes else "") + ("_as_a" if x_as_a else "")] = build(
            W.mx_wgrad_kernel, dict(g_src=f"tensordesc<{g_dt}[{wcfg.block_n}, {bt}]>",
                                    x_src=f"tensordesc<{x_dt}[{wcfg.block_k}, {bt}]>", gs_ptr="*u8", xs_ptr="*u8",
                                    dw_ptr="*bf16", sched_ptr="*i32"),
            dict(USE_TMA=True, UPCAST=False, EXPAND=wcfg.expand_bf16, BF16=values, BN=wcfg.block_n, BK=wcfg.block_k,
                 BT=bt, TILE_M=128, MX_BLOCK=32, GROUP_N=wcfg.group_n, X_CODES=x_codes, X_AS_A=x_as_a),
            wcfg.num_warps, wcfg.num_stages)
    report["expand"] = build(Q.expand_kernel, dict(q_ptr="*fp8e4nv", s_ptr="*u8", v_ptr="*bf16"),
                             dict(UPCAST=False, BLK=128))
    for name, qt in (("quantize_rows", "*u8"), ("quantize_rows_values", "*bf16")):
        report[name] = build(Q.quantize_chunks_kernel, dict(x_ptr="*bf16", q_ptr=qt, qs_ptr="*u8", qt_ptr=qt,
                                                            qts_ptr="*u8", colsum_ptr="*fp32", sched_ptr="*i32"),
                             dict(ROWWISE=True, COLWISE=True, COLSUM=True, **spec, BM=128, BK=Q.QUANT_COLS),
                             Q.QUANT_WARPS, 1)
    report["quantize_weight"] = build(Q.quantize_weight_kernel, dict(w_ptr="*bf16", q_ptr="*u8", s_ptr="*u8",
                                                                     qt_ptr="*u8", st_ptr="*u8"),
                                      dict(**spec, TRANSPOSED=True, BM=128, BK=Q.QUANT_COLS), Q.QUANT_WARPS, 1)
    return report


def _worker() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
    from block_scaled_checks import check_bench_baseline

    results = {
        "codec": check_codec("cpu"),
        "quantize": check_quantize_kernels("cpu"),
        "cache": check_weight_cache("cpu"),
        "weight_reads": check_weight_reads("cpu"),
        "values_in_pass": check_values_in_pass("cpu"),
        "saved_codes_in_wgrad": {x: check_saved_codes_in_wgrad("cpu", x == "as_a") for x in ("shared", "as_a")},
        "kept_values": check_kept_values("cpu"),
        "exact": check_kernels_exact("cpu"),
        "exact_ptr_e5m2": check_kernels_exact("cpu", seed=1, use_tma=False, fmt="e5m2", T=200, H=128),
        "exact_bn128_unsplit": check_kernels_exact("cpu", seed=2, T=200, H=128,
                                                   epilogue=dict(block_n=128, split_epilogue=False),
                                                   plain=dict(block_n=128), wgrad=dict(block_n=128)),
        # both inner loops, whichever is the default: per-32 promotion and BF16 expansion
        "exact_promote": check_kernels_exact("cpu", seed=3, T=200, H=128, epilogue=dict(expand_bf16=False),
                                             plain=dict(expand_bf16=False), wgrad=dict(expand_bf16=False)),
        "exact_expand": check_kernels_exact("cpu", seed=4, T=200, H=128, epilogue=dict(expand_bf16=True),
                                            plain=dict(expand_bf16=True), wgrad=dict(expand_bf16=True)),
        # BF16 values expanded before each GEMM (the fused path's default), TMA and pointers, E5M2 grads
        "exact_values": check_kernels_exact("cpu", seed=5, values=True),
        "exact_values_ptr_e5m2": check_kernels_exact("cpu", seed=6, use_tma=False, fmt="e5m2", T=200, H=128,
                                                     values=True),
        # the dGLU as its GEMM + the epilogue alone (gemm.DACT_EPILOGUE), on BF16 values and FP8 operands
        "exact_values_separate_dglu": check_kernels_exact("cpu", seed=7, values=True,
                                                          epilogue=dict(epilogue="separate")),
        # the quantize passes and epilogues writing those values themselves (autograd.QUANTIZE_TO_VALUES)
        "exact_written_values": check_kernels_exact("cpu", seed=10, values=True, written_values=True),
        "exact_written_values_ptr_e5m2_separate_dglu": check_kernels_exact(
            "cpu", seed=11, use_tma=False, fmt="e5m2", T=200, H=128, values=True, written_values=True,
            epilogue=dict(epilogue="separate")),
        "exact_separate_dglu": check_kernels_exact("cpu", seed=8, T=200, H=128, epilogue=dict(epilogue="separate")),
        "exact_written_values_separate_dglu_chunks": check_kernels_exact(
            "cpu", seed=12, T=200, H=128, values=True, written_values=True, dglu_kernel="chunks",
            epilogue=dict(epilogue="separate")),
        "exact_separate_dglu_gemm_kernel": check_kernels_exact("cpu", seed=13, T=200, H=128, dglu_kernel="gemm",
                                                               epilogue=dict(epilogue="separate")),
        # the chunked epilogue under 128-column dGLU tiles (dprob partials per 128 columns: wider programs)
        "exact_separate_dglu_chunks_bn128": check_kernels_exact(
            "cpu", seed=14, T=200, H=128, dglu_kernel="chunks",
            epilogue=dict(epilogue="separate", block_n=128, split_epilogue=False)),
        "exact_separate_dglu_bf16_h": check_kernels_exact("cpu", seed=9, H=512, h_dtype=torch.bfloat16,
                                                          epilogue=dict(epilogue="separate")),
        # the BF16-valued wgrad at a part of a tile slot per step (wgrad.MXWgradConfig.block_t), TMA and pointers
        "exact_values_wgrad_t64": check_kernels_exact("cpu", seed=15, values=True, wgrad=dict(block_t=64)),
        "exact_values_ptr_wgrad_t32": check_kernels_exact("cpu", seed=16, use_tma=False, T=200, H=128, values=True,
                                                          wgrad=dict(block_t=32)),
        # the dGLU on BF16 values fused on the BF16 backend's kernel with this recipe's quantizing store of dh
        # (gemm.DGLU_VALUES_KERNEL = "bf16"), TMA and pointers, written values, h in BF16
        "exact_values_dglu_bf16_kernel": check_kernels_exact("cpu", seed=17, values=True, dglu_route=True),
        "exact_written_values_ptr_e5m2_dglu_bf16_kernel_bf16_h": check_kernels_exact(
            "cpu", seed=18, use_tma=False, fmt="e5m2", T=200, H=512, values=True, written_values=True,
            h_dtype=torch.bfloat16, dglu_route=True),
        # the wgrads reading the saved columnwise copies of x and a as FP8 codes, expanded in their K loops
        # (autograd.X_CODES_IN_WGRAD), into shared memory or as the wgmma's A operand (MXWgradConfig.x_as_a)
        "exact_written_values_saved_codes_wgrad_t64": check_kernels_exact(
            "cpu", seed=19, values=True, written_values=True, wgrad=dict(block_t=64), saved_codes=True),
        "exact_written_values_ptr_e5m2_saved_codes_wgrad_a_t32": check_kernels_exact(
            "cpu", seed=20, use_tma=False, fmt="e5m2", T=200, H=128, values=True, written_values=True,
            wgrad=dict(block_t=32, x_as_a=True), saved_codes=True),
        "exact_values_saved_codes_wgrad_a": check_kernels_exact("cpu", seed=21, values=True, wgrad=dict(x_as_a=True),
                                                                saved_codes=True),
        "dispatch": check_dispatch("cpu"),
        "bench_baseline": check_bench_baseline("mxfp8", "cpu"),
        "mlp": {case[0]: run_mlp_case(case, "cpu") for case in MLP_CASES},
    }
    print("RESULTS" + json.dumps(results))


@pytest.fixture(scope="module")
def results():
    return run_in_triton_interpreter("import test_triton_mxfp8_interpreter as t; t._worker()")


def test_kernels_build_for_sm90a_without_k_loop_spills():
    """Offline sm_90a build of every default MXFP8 kernel (compile errors show on the CPU, before any
    GPU time): the GEMMs use wgmma and none spills inside its K loop; only the FC1 and dGLU epilogues
    may spill a little (outside the loop: 120 stack bytes seen)."""
    from sm90_build import have_tools, report_in_subprocess, tools_dir

    if not have_tools():
        pytest.skip(f"the Triton wheel has no NVIDIA tools in {tools_dir()}: cannot build for sm_90a offline")
    report = report_in_subprocess("test_triton_mxfp8_interpreter")
    assert "dact_swiglu_epilogue_alone" in report
    for name, r in report.items():
        if name.endswith("_epilogue_alone"):
            assert r["qgmma"] + r["hgmma"] == 0, (name, r)  # the K loop is compiled out
        elif name.startswith(("fc", "dact", "dgrad", "wgrad")):
            assert r["qgmma"] + r["hgmma"] > 0 and r["loop_found"] and r["loop_spills"] == 0, (name, r)
        # the quantizing epilogues (after the K loop) may spill a little: FC1 at BN = 128 (measured
        # faster than 64 anyway, run 13) and the dGLU (its chunked kernel too: 32-104 bytes)
        allowed = 512 if name.startswith(("dact", "fc1", "dglu")) else 0
        assert r["stack"] <= allowed, (name, r)
        assert r["shared"] <= 227 * 1024, (name, r)  # else the launch fails on the GPU


def test_e8m0_codec_is_bit_exact(results):
    c = results["codec"]
    assert c["n"] > 40000
    for fmt in ("e4m3", "e5m2"):
        assert all(v == 0 for v in c[fmt].values()), (fmt, c[fmt])


def test_quantize_kernels_are_bit_exact(results):
    assert len(results["quantize"]) == 3
    for key, bad in results["quantize"].items():
        assert all(v == 0 for v in bad.values()), (key, bad)


def test_weight_cache_refreshes_once_per_step(results):
    c = results["cache"]
    assert c["same_object"] and c["misses_before"] == 1, c
    assert c["refreshed"] and c["misses_after"] == 2 and c["fresh_bad"] == 0, c
    assert c["nbytes"] == c["expected_nbytes"], c
    assert c["stale_without_step"] and c["refreshed_after_step"] and c["hit_after_step"], c
    assert all(v == 0 for v in c["values_bad"].values()) and c["values_dtype"] == "torch.bfloat16", c
    assert c["values_nbytes"] == c["values_expected_nbytes"] and c["plain_entry_has_no_values"], c


def test_cached_weight_values_replace_the_expansions(results):
    assert_weight_reads(results["weight_reads"])


def test_quantize_passes_write_the_values_their_gemms_read(results):
    assert_values_in_pass(results["values_in_pass"])


@pytest.mark.parametrize("x_operand", ["shared", "as_a"])
def test_wgrads_expand_the_saved_codes_without_a_pass(results, x_operand):
    assert_saved_codes_in_wgrad(results["saved_codes_in_wgrad"][x_operand])


def test_forward_keeps_the_values_the_wgrads_read(results):
    assert_kept_values(results["kept_values"])


def assert_weight_reads(r: dict) -> None:
    assert r["weight_expansions_True"] == 0 and r["weight_expansions_False"] == 4, r
    # the activations' expansions do not depend on the flag (none here: only x needs a gradient, and the
    # passes write the values that dx's GEMMs read, QUANTIZE_TO_VALUES)
    assert r["activation_expansions_True"] == r["activation_expansions_False"] and r["dx_bad"] == 0, r


@pytest.mark.parametrize("key", ["exact", "exact_ptr_e5m2", "exact_bn128_unsplit", "exact_promote", "exact_expand",
                                 "exact_values", "exact_values_ptr_e5m2", "exact_values_separate_dglu",
                                 "exact_written_values", "exact_written_values_ptr_e5m2_separate_dglu",
                                 "exact_separate_dglu", "exact_written_values_separate_dglu_chunks",
                                 "exact_separate_dglu_gemm_kernel", "exact_separate_dglu_chunks_bn128",
                                 "exact_separate_dglu_bf16_h", "exact_values_wgrad_t64", "exact_values_ptr_wgrad_t32",
                                 "exact_values_dglu_bf16_kernel",
                                 "exact_written_values_ptr_e5m2_dglu_bf16_kernel_bf16_h",
                                 "exact_written_values_saved_codes_wgrad_t64",
                                 "exact_written_values_ptr_e5m2_saved_codes_wgrad_a_t32",
                                 "exact_values_saved_codes_wgrad_a"])
def test_every_kernel_bit_exact_on_integer_data(results, key):
    bad = results[key]
    assert 0 < bad["routed"] < 300, bad  # padding rows covered
    if key == "exact":
        assert 0 in bad["counts"], bad  # and experts without tokens
    for name in ("h", "a_row", "a_col", "y", "dh_row", "dh_col", "dx", "dw1", "dw2", "db1", "dprob"):
        assert bad[name] == 0, (name, bad)
    assert bad["written_values"] == (6 if "written_values" in key else 0), bad
    if key.endswith("bf16_h"):  # the BF16 rounding of h (and da, read by a separate epilogue) moved values
        assert bad["h_rounded"] > 0 and ("separate" not in key or bad["da_rounded"] > 0), bad
    assert bad["dglu_on_bf16_kernel"] == ("dglu_bf16_kernel" in key), bad
    # x's and a's columnwise copies reach the wgrads as FP8 codes but where an expansion pass read them
    assert bad["wgrad_codes_operands"] == (0 if "values" in key and "saved_codes" not in key else 2), bad


def test_sizes_off_the_tile_run_zero_padded(results):
    from block_scaled_checks import assert_dispatch

    assert_dispatch(results["dispatch"], "MXFP8BlockScaling", LOOSE)


def test_bench_unfused_baseline_is_the_same_recipe(results):
    from block_scaled_checks import assert_bench_baseline

    assert_bench_baseline(results["bench_baseline"])


@pytest.mark.parametrize("case", MLP_CASES, ids=[c[0] for c in MLP_CASES])
def test_mlp_matches_reference_emulation(results, case):
    res = results["mlp"][case[0]]
    frozen, bias, probs, h_fp32 = case[12], case[6], case[7], case[10]
    expected = {"y", "x", "w1", "w2"} | ({"b1", "b2"} if bias else set()) | ({"probs"} if probs else set())
    assert set(res["grads"]) == expected - set(frozen)
    bound = TIGHT if h_fp32 else LOOSE
    for name, err in res["err"].items():
        assert res["nan"][name] == 0, (case[0], name, res)
        assert err <= bound, f"{case[0]}: {name} rel. error vs reference {err:.3g} > {bound}"
        if h_fp32:
            assert res["far"][name] <= 0.01, (case[0], name, res["far"])
        assert res["fp64"][name] <= FP64_BOUND, f"{case[0]}: {name} rel. error vs FP64 {res['fp64'][name]:.3g}"
    for name, bad in res["nonzero"].items():
        assert bad == 0, (case[0], name, res["nonzero"])
    assert res["library_wgrads"] == (2 if "-cublaswgrad" in case[0] else 0), (case[0], res["library_wgrads"])


def test_supports_names_the_recipe_subset():
    """MXFP8 E4M3 and HYBRID are taken; a recipe outside that (only constructible by bypassing the
    recipe's own check) is refused naming fp8_format; bad dtypes are named."""
    from te_fused_moe.activations import ActivationConfig
    from te_fused_moe.backends import get_backend
    from te_fused_moe.recipes import Format, MXFP8BlockScaling, as_recipe

    backend = get_backend("triton")
    act = ActivationConfig("swiglu")
    assert backend.supports(act, MXFP8BlockScaling(), torch.bfloat16)
    assert backend.supports(act, MXFP8BlockScaling(fp8_format=Format.HYBRID), torch.bfloat16)
    assert backend.supports(act, as_recipe("mxfp8"), torch.float16)
    odd = MXFP8BlockScaling()
    object.__setattr__(odd, "fp8_format", Format.E5M2)
    verdict = backend.supports(act, odd, torch.bfloat16)
    assert not verdict and "MXFP8BlockScaling with fp8_format=E4M3 or HYBRID" in verdict.reason, verdict
    assert "fp8_format=E5M2" in verdict.reason, verdict
    verdict = backend.supports(act, MXFP8BlockScaling(), torch.float32)
    assert not verdict and "bfloat16 or float16" in verdict.reason, verdict


def test_recipe_and_kernel_arguments_are_validated():
    """Errors name the argument and what was expected (no kernel runs: these are host checks)."""
    from te_fused_moe.backends.triton.mxfp8 import gemm
    from te_fused_moe.backends.triton.mxfp8.quantize import MXRows, MXSpec, quantize_rows, quantize_weight
    from te_fused_moe.recipes import Format, MXFP8BlockScaling

    with pytest.raises(ValueError, match="fp8_format must be Format.E4M3 or Format.HYBRID"):
        MXFP8BlockScaling(fp8_format=Format.E5M2)
    with pytest.raises(ValueError, match="fmt: expected 'e4m3' or 'e5m2', got 'e2m1'"):
        MXSpec.of("e2m1")
    with pytest.raises(ValueError, match="x: the MXFP8 quantize kernel needs a width that is a multiple of 128, got 96"):
        quantize_rows(torch.randn(4, 96), torch.zeros(20, dtype=torch.int32), 1, MXSpec())
    with pytest.raises(ValueError, match=r"x: expected unit stride"):
        quantize_rows(torch.randn(128, 4).t(), torch.zeros(20, dtype=torch.int32), 1, MXSpec())
    with pytest.raises(ValueError, match=r"w: the MXFP8 weight quantizer needs both sizes to be multiples of 128"):
        quantize_weight(torch.randn(2, 128, 96), MXSpec())
    with pytest.raises(ValueError, match=r"w: expected \[E, N, K\]"):
        quantize_weight(torch.randn(128, 128), MXSpec())
    with pytest.raises(ValueError, match="kind: expected 'fc1', 'fc2', 'dact' or 'dgrad', got 'fc3'"):
        gemm.default_config("fc3")
    # a K step of its own (MXGemmConfig.block_k) needs both operands as BF16 values: FP8 codes carry 1x32
    # scales that the kernel reads per K step of 128
    sched, spec = torch.zeros(20, dtype=torch.int32), MXSpec()
    codes = torch.zeros(128, 256, dtype=torch.float8_e4m3fn)
    config = gemm.MXGemmConfig(expand_bf16=True, block_k=64)
    with pytest.raises(ValueError, match="config: block_k=64 needs both operands as BF16 values"):
        gemm.launch("fc2", codes, torch.zeros(128, 8, dtype=torch.uint8), torch.zeros(1, 128, 256), None, 128, sched,
                    1, spec, c=torch.empty(128, 128), config=config)
    with pytest.raises(ValueError, match="config: block_k=48 needs both operands as BF16 values .* multiple of 32"):
        gemm.launch("fc2", torch.zeros(128, 256, dtype=torch.bfloat16), None,
                    torch.zeros(1, 128, 256, dtype=torch.bfloat16), None, 128, sched, 1, spec,
                    c=torch.empty(128, 128), config=gemm.MXGemmConfig(expand_bf16=True, block_k=48))
    # the wgrad's tokens per step (MXWgradConfig.block_t) likewise: FP8 copies carry 32-token scales per slot
    from te_fused_moe.backends.triton.mxfp8.wgrad import MXWgradConfig, mx_grouped_wgrad

    cols = MXRows(data_t=torch.zeros(128, 128, dtype=torch.float8_e4m3fn), scale_t=torch.zeros(4, 128, dtype=torch.uint8))
    with pytest.raises(ValueError, match="config: block_t=64 needs g's columnwise copy as BF16 values and one of 32, "
                                         "64, 128"):
        mx_grouped_wgrad(cols, cols, sched, torch.empty(1, 128, 128),
                         config=MXWgradConfig(expand_bf16=True, block_t=64))
    values = MXRows(data_t=torch.zeros(128, 128, dtype=torch.bfloat16), scale_t=torch.zeros(4, 128, dtype=torch.uint8))
    with pytest.raises(ValueError, match="config: block_t=48 needs g's columnwise copy as BF16 values and one of"):
        mx_grouped_wgrad(values, values, sched, torch.empty(1, 128, 128),
                         config=MXWgradConfig(expand_bf16=True, block_t=48))
    # FP8 codes next to BF16 values only as (g's values, x's codes): the K loop expands x, never g
    with pytest.raises(ValueError, match="g, x: both columnwise copies FP8 .* or g's values with x's FP8 codes"):
        mx_grouped_wgrad(cols, values, sched, torch.empty(1, 128, 128))


def test_shape_check_names_w1_and_w2():
    """The host-side shape check (supports_args, before any kernel) names the weight and the size."""
    from te_fused_moe.backends.triton.mxfp8.autograd import check_shapes

    assert check_shapes(256, 384) is None
    assert "w1:" in check_shapes(200, 128) and "got 200" in check_shapes(200, 128)
    assert "w2:" in check_shapes(128, 100) and "got 100" in check_shapes(128, 100)


if __name__ == "__main__":
    _worker()
