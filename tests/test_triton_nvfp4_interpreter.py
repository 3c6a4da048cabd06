"""The NVFP4 recipe (NVFP4BlockScaling) on the Triton backend, on CPU through Triton's interpreter.

The checks are device-agnostic functions (``check_*``) that tests/gpu/test_triton_nvfp4_gpu.py runs
again on the GPU. Under the interpreter they run in one fresh subprocess (``_worker``) and report
numbers that the tests assert on.

What is checked, and the bounds:

1. Device functions (``nvfp4/codec.py``): the E2M1 nearest-even and stochastic encodings bit-exact
   vs ``formats.encode`` / ``formats.stochastic_round_e2m1`` on the grid's midpoints, signed zeros,
   NaN/Inf, FP32 subnormals, random FP32 values and every 16385th FP32 bit pattern of (-8, 8); the E4M3
   scale decode on all 127 finite codes;
   the BF16 expansion of packed codes times scales vs ``nvfp4.unpack_e2m1`` x ``formats.decode``.
2. Quantize kernels: packed codes and E4M3 scales bit-exact vs ``te_fused_moe.quantize.nvfp4``
   per expert (each expert its own tensor scale): rowwise 1x16; columnwise 16-token blocks
   restarting at each expert, with RHT (on integer-valued data, where the FP32 transform is exact,
   as the reference's FP64 one; also the columnwise copy alone) and without (random data with
   NaN/Inf/zero rows); stochastic
   rounding with given bits; weights in 16x16 tiles and in 1x16 blocks, both copies.
3. Stochastic rounding from Philox: two draws differ, and the mean of 64 draws is closer to the
   input than one draw by at least 4x (unbiased: the error of the mean falls as 1/sqrt(draws)); the
   random bytes equal a host Philox4x32-10 (one call per 16 columns, 16 bytes) at a tile off the origin.
4. The whole MLP forward + backward vs the reference backend's emulation of the same recipe with
   stochastic rounding off (the draws cannot match): token counts that are multiples of 16 (what
   TE requires for RHT, and what Megatron's padding for quantized recipes gives): norm-relative
   <= 5e-3 with ``h`` saved in FP32 (1e-5 to 4e-4 typical), except the wgrads with RHT: <= 2e-2.
   Their operands' columnwise copies are transformed in FP32 by the kernels and in FP64 by the
   reference, so now and then one E2M1 code or E4M3 block scale lands a step away; at these sizes
   one such flip moves dw by ~5e-3 (seed 206094 of ``swiglu-x16-empty``: dw2 5.4e-3, everything
   else <= 5e-5, the rowwise forward exact). The forward's rowwise codes can flip too, though rarer
   (``FLIP_SHARE``): an output over its bound passes if at most 1% of its elements are off by more than
   1e-3 of its max and it stays within 1e-2 of the FP64 fake-quantized truth. Other counts: the reference crops the zero-padded tail of an
   expert's transformed slice after its inverse RHT, the kernels multiply the transformed blocks
   (TE's definition), so the wgrads differ by ~2e-3: bound 1e-2. With ``h`` in BF16 (the default),
   ``dh`` sees ``h`` rounded and a code next to an E2M1 midpoint moves a whole step: 6e-2. Stochastic
   rounding on: ``y`` (forward: no stochastic rounding) <= 5e-3, gradients within the rounding's
   own noise (<= 0.5, ~0.25 seen). Buffers are NaN-poisoned before the kernels write them.
5. Dispatch, validation and the benchmark's unfused baseline (the same recipe).
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from moe_reference import run_in_triton_interpreter
from te_fused_moe.bench_recipes import _module_flags  # module flags set for one check, restored after

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ != "__main__":
    pytest.importorskip("triton", reason="the Triton backend's CPU tests need the triton package (pip install triton)")

TIGHT, RAGGED_RHT, WGRAD_RHT, LOOSE, SR_NOISE = 5e-3, 1e-2, 2e-2, 6e-2, 0.5
# One E2M1 code or E4M3 block scale of a GEMM operand a step away from the reference's: a value on a
# rounding boundary, reached in another FP32 order. At these sizes it moves one token's row of an output
# by ~1e-2 (seed 897699 of gptoss-x16-ptr: y 1.1e-2 from the reference, 0.36% of y's elements, y 1.7e-3
# from the FP64 truth, every gradient <= 4e-5). An output over its bound passes if no more elements than
# such a flip moves are off and it stays on the FP64 truth.
FLIP_SHARE, FLIP_FP64 = 0.01, 1e-2
SM90_MAX_SHARED = 227 * 1024  # shared memory one block may use on sm_90

# (id, T, H, F, E, activation, bias, probs, counts or routing, padding, h_fp32, tma, frozen, recipe options)
MLP_CASES = [
    ("swiglu-x16-empty", 300, 256, 128, 3, "swiglu", True, True, [96, 0, 160], 44, True, True, (), {}),
    ("gptoss-x16-ptr", 260, 128, 256, 4, "gpt_oss_swiglu", True, True, [16, 64, 32, 112], 36, True, False, (), {}),
    ("srelu-ragged-1d-nornt", 200, 128, 128, 3, "srelu", False, True, "zipf", 7, True, True, (),
     dict(disable_rht=True, disable_2d_quantization=True)),
    ("geglu-ragged-rht", 150, 128, 128, 2, "geglu", True, False, "balanced", 9, True, True, (), {}),
    ("swiglu-hbf16", 300, 256, 128, 3, "swiglu", True, True, [128, 48, 80], 44, False, True, (), {}),
    ("gelu-frozen-x", 170, 128, 128, 3, "gelu", True, True, [64, 0, 96], 10, True, True, ("x", "probs"), {}),
    ("silu-allpad", 64, 128, 128, 3, "silu", True, True, [0, 0, 0], 64, True, True, (), {}),
    ("swiglu-T0", 0, 128, 128, 2, "swiglu", True, True, [0, 0], 0, True, True, (), {}),
    # the weight cache's BF16 expansions read by the GEMMs instead of the packed weights
    ("swiglu-x16-bf16w", 300, 256, 128, 3, "swiglu", True, True, [96, 0, 160], 44, True, True, (), {}),
    # the GEMMs expanding their packed operands in the K loop (autograd.EXPAND_BEFORE_GEMM off)
    ("swiglu-ragged-rht-kloop", 300, 256, 128, 3, "swiglu", True, True, [100, 37, 163], 0, True, True, (), {}),
    ("gelu-frozen-x-kloop", 170, 128, 128, 3, "gelu", True, True, [64, 0, 96], 10, True, False, ("x", "probs"), {}),
    # sizes off the 128 tile (zero-padded operands): F = 80 puts gate and up in one 128-row tile of w1;
    # 200 and 72 are not multiples of 16 either (1x16 blocks end short, 16x16 weight blocks straddle)
    ("padded-swiglu-rht", 200, 160, 80, 3, "swiglu", True, True, [64, 0, 129], 7, True, True, (), {}),
    ("padded-gptoss-ptr-1d", 150, 200, 72, 2, "gpt_oss_swiglu", True, True, [60, 83], 7, True, False, (),
     dict(disable_2d_quantization=True)),
    ("padded-srelu-hbf16-kloop", 160, 136, 200, 2, "srelu", False, True, "zipf", 5, False, True, (), {}),
    # the wgrads on torch._grouped_mm (on CPU its fallback, through the same path), one at a size off the tile
    ("swiglu-ragged-rht-cublaswgrad", 300, 256, 128, 3, "swiglu", True, True, [100, 0, 163], 37, True, True, (), {}),
    ("padded-gptoss-cublaswgrad", 150, 200, 72, 2, "gpt_oss_swiglu", True, True, [60, 83], 7, True, True, (), {}),
    # x's and dy's RHT on BF16 tensor cores (quantize.RHT_TENSOR_CORES; the interpreter runs its dot in FP32)
    ("swiglu-ragged-rhtmma", 300, 256, 128, 3, "swiglu", True, True, [100, 37, 163], 0, True, True, (), {}),
]
# module flags of nvfp4.autograd that a case id's suffix sets for that case
CASE_FLAGS = {"-bf16w": {"BF16_WEIGHT_VALUES": True}, "-kloop": {"EXPAND_BEFORE_GEMM": False},
              "-cublaswgrad": {"VALUES_WGRAD_KERNEL": "cublas"}, "-tritonwgrad": {"VALUES_WGRAD_KERNEL": "triton"}}


# flags of nvfp4.quantize that a case id's suffix sets for that case
QUANTIZE_CASE_FLAGS = {"-rhtmma": {"RHT_TENSOR_CORES": True}}


def case_flags(case_id: str, table: dict = CASE_FLAGS) -> dict:
    """The flags a case id's suffix sets: of ``nvfp4.autograd`` (:data:`CASE_FLAGS`) or of the module whose table is
    given (:data:`QUANTIZE_CASE_FLAGS`)."""
    return {name: value for suffix, named in table.items() if case_id.endswith(suffix)
            for name, value in named.items()}


def library_wgrads_expected(case_id: str, device: str) -> int:
    """How many of a case's two wgrads run on ``torch._grouped_mm``: both where its flags (or the default) put them on
    cuBLAS, the operands are expanded first, and the route applies (CUDA; on CPU only the "-cublaswgrad" cases, whose
    run patches it in)."""
    from te_fused_moe.backends.triton.nvfp4 import autograd

    flags = {"VALUES_WGRAD_KERNEL": autograd.VALUES_WGRAD_KERNEL, "EXPAND_BEFORE_GEMM": autograd.EXPAND_BEFORE_GEMM,
             **case_flags(case_id)}
    applies = device == "cuda" or case_id.endswith("-cublaswgrad")
    return 2 if flags["VALUES_WGRAD_KERNEL"] == "cublas" and flags["EXPAND_BEFORE_GEMM"] and applies else 0
SR_CASE = ("swiglu-sr", 300, 256, 128, 3, "swiglu", True, True, [96, 32, 128], 44, True, True, (),
           dict(disable_stochastic_rounding=False))


# --- 1. device functions ------------------------------------------------------------------------------

_KERNELS = {}
e2m1_encode = e2m1_encode_stochastic = e4m3_to_float = e2m1_expand_halves = None  # bound by _codec_kernels()
random_bytes = None  # bound by _random_bytes_kernel()


def _codec_kernels():
    if "codec" not in _KERNELS:
        import triton
        import triton.language as tl

        from te_fused_moe.backends.triton.nvfp4 import codec

        globals().update(e2m1_encode=codec.e2m1_encode, e2m1_encode_stochastic=codec.e2m1_encode_stochastic,
                         e4m3_to_float=codec.e4m3_to_float, e2m1_expand_halves=codec.e2m1_expand_halves)

        @triton.jit
        def encode_kernel(v_ptr, bits_ptr, rne_ptr, sr_ptr, code_ptr, dec_ptr, n, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            ok = offs < n
            v = tl.load(v_ptr + offs, mask=ok, other=0.0)
            tl.store(rne_ptr + offs, e2m1_encode(v), mask=ok)
            tl.store(sr_ptr + offs, e2m1_encode_stochastic(v, tl.load(bits_ptr + offs, mask=ok, other=0).to(tl.int32)),
                     mask=ok)
            tl.store(dec_ptr + offs, e4m3_to_float(tl.load(code_ptr + offs, mask=ok, other=0)), mask=ok)

        @triton.jit
        def expand_kernel(p_ptr, s_ptr, out_ptr, ROWS: tl.constexpr, COLS: tl.constexpr, UPCAST: tl.constexpr):
            r = tl.arange(0, ROWS)[:, None]
            packed = tl.load(p_ptr + r * (COLS // 2) + tl.arange(0, COLS // 2)[None, :])
            scales = tl.load(s_ptr + r * (COLS // 16) + tl.arange(0, COLS // 16)[None, :])
            even, odd = e2m1_expand_halves(packed, scales, ROWS, COLS, UPCAST)
            half = tl.arange(0, COLS // 2)[None, :]
            tl.store(out_ptr + r * COLS + 2 * half, even.to(tl.float32))
            tl.store(out_ptr + r * COLS + 2 * half + 1, odd.to(tl.float32))

        _KERNELS["codec"] = (encode_kernel, expand_kernel)
    return _KERNELS["codec"]


def _e2m1_edge_values() -> torch.Tensor:
    """Grid points, midpoints and one ulp either side, signed; zeros, subnormals, NaN, Inf, huge."""
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 100.0])
    bits = grid.view(torch.int32)
    near = torch.cat([grid, (bits + 1).view(torch.float32), (bits[1:] - 1).view(torch.float32)])
    special = torch.tensor([1e-40, 1e-30, float("inf"), float("nan"), 3.4e38])
    v = torch.cat([near, special])
    return torch.cat([v, -v])


def check_codec(device: str, n_random: int = 50000) -> dict:
    """Mismatch counts of the device functions vs the reference formats."""
    from te_fused_moe.backends.triton.grouped_gemm import interpreting
    from te_fused_moe.quantize import formats, nvfp4

    encode_kernel, expand_kernel = _codec_kernels()
    g = torch.Generator().manual_seed(0)
    random = (torch.randn(n_random, generator=g) * torch.exp2(torch.randint(-6, 6, (n_random,), generator=g).float()))
    # every 16385th FP32 bit pattern in [0, 8) from a fresh start (reported): the encoding rounds by
    # adding and subtracting powers of two, so every binade and every spacing of the grid gets swept
    start = int(torch.randint(0, 16385, (1,)))
    sweep = torch.arange(start, 0x41000000, 16385, dtype=torch.int64).to(torch.int32).view(torch.float32)
    v = torch.cat([_e2m1_edge_values(), random, sweep, -sweep]).float()
    bits = torch.randint(0, 256, v.shape, generator=g, dtype=torch.uint8)
    codes = torch.arange(v.numel(), dtype=torch.int64).remainder(127).to(torch.uint8)  # every finite E4M3 code
    rne, sr = torch.empty(v.shape, dtype=torch.uint8, device=device), torch.empty(v.shape, dtype=torch.uint8,
                                                                                   device=device)
    dec = torch.empty(v.shape, dtype=torch.float32, device=device)
    n = v.numel()
    encode_kernel[((n + 1023) // 1024,)](v.to(device), bits.to(device), rne, sr, codes.to(device), dec, n,
                                         BLOCK=1024)
    out = {"n": n, "sweep_start": start,
           "rne": int((rne.cpu() != formats.encode(v, formats.E2M1)).sum()),
           "stochastic": int((sr.cpu() != formats.stochastic_round_e2m1(v, bits)).sum()),
           "e4m3_decode": int((dec.cpu() != formats.decode(codes, formats.E4M3)).sum())}
    rows, cols = 64, 128
    packed = torch.randint(0, 256, (rows, cols // 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 127, (rows, cols // 16), generator=g, dtype=torch.uint8)
    expanded = torch.empty(rows, cols, dtype=torch.float32, device=device)
    expand_kernel[(1,)](packed.to(device), scales.to(device), expanded, ROWS=rows, COLS=cols, UPCAST=interpreting())
    values = formats.decode(nvfp4.unpack_e2m1(packed, 1, cols), formats.E2M1)
    truth = values * formats.decode(scales, formats.E4M3).repeat_interleave(16, dim=1)
    out["expand"] = int((expanded.cpu() != truth).sum())
    return out


# --- 2. quantize kernels --------------------------------------------------------------------------

def _expert_slices(counts):
    """(expert, first row, rows, first schedule tile) of each non-empty expert (tiles of 128 rows)."""
    start = tile = 0
    for e, n in enumerate(counts):
        if n:
            yield e, start, n, tile
        start += n
        tile += -(-n // 128)


def _rows_mismatches(q, x, counts, spec, bits=None) -> dict:
    """Mismatches of quantize_rows' output ``q`` against the reference quantizer, expert by expert."""
    from te_fused_moe.quantize import hadamard, nvfp4

    bad = {"data": 0, "scale": 0, "amax": 0, "data_t": 0, "scale_t": 0, "amax_t": 0}
    for e, r0, n, tile in _expert_slices(counts):
        xe = x[r0: r0 + n].float().cpu()
        row_bits = bits[0][r0: r0 + n] if bits is not None else None
        ref = nvfp4.quantize(xe, axis=1, stochastic_rounding=spec.stochastic, random_bits=row_bits)
        if q.data is not None:
            bad["data"] += int((q.data[r0: r0 + n].cpu() != ref.data).sum())
            bad["scale"] += int((q.scale[r0: r0 + n].cpu() != ref.scale.view(torch.uint8)).sum())
            bad["amax"] += int(q.amax[e].cpu() != ref.global_amax)
        if q.data_t is None:
            continue
        t = hadamard.apply_rht(xe, 0) if spec.rht else xe
        slots = t.shape[0] if spec.rht else -(-n // 16) * 16
        col_bits = bits[1][128 * tile: 128 * tile + t.shape[0]] if bits is not None else None
        ref_t = nvfp4.quantize(t, axis=0, stochastic_rounding=spec.stochastic, random_bits=col_bits)
        got = q.data_t[:, 64 * tile: 64 * tile + slots // 2].cpu()
        want = torch.nn.functional.pad(ref_t.data.t(), (0, slots // 2 - ref_t.data.shape[0]))
        bad["data_t"] += int((got != want).sum())
        got_s = q.scale_t[8 * tile: 8 * tile + -(-t.shape[0] // 16)].cpu()
        bad["scale_t"] += int((got_s != ref_t.scale.view(torch.uint8)).sum())
        bad["amax_t"] += int(q.amax_t[e].cpu() != ref_t.global_amax)
    return bad


def split_order(t: torch.Tensor, block: int = 128) -> torch.Tensor:
    """``t`` [R, C] with each ``block`` of columns reordered even columns first (the weight cache's
    BF16 values layout)."""
    r, c = t.shape
    blocks = t.reshape(r, c // block, block // 2, 2)
    return torch.cat((blocks[..., 0], blocks[..., 1]), dim=2).reshape(r, c)


def _values_mismatches(q, counts) -> dict:
    """Mismatches of ``quantize.with_values(q)`` (the BF16 values an expansion pass writes before a
    GEMM) against each code times its block scale, in split order: rowwise, and columnwise over the
    slots of the tiles in use."""
    from te_fused_moe.backends.triton.nvfp4.quantize import with_values
    from te_fused_moe.quantize import formats, nvfp4

    def expected(data, scale):
        codes = formats.decode(nvfp4.unpack_e2m1(data.cpu(), 1, 2 * data.shape[1]), formats.E2M1)
        return split_order(codes * formats.decode(scale.cpu(), formats.E4M3).repeat_interleave(16, 1))

    v = with_values(q, rowwise=q.data is not None, colwise=q.data_t is not None)
    bad = {"values": 0, "values_t": 0}
    if q.data is not None:
        bad["values"] = int((v.values.float().cpu() != expected(q.data, q.scale)).sum())
    if q.data_t is not None:
        got, want = v.values_t.float().cpu(), expected(q.data_t, q.scale_t.t())
        for _, _, n, tile in _expert_slices(counts):
            used = slice(128 * tile, 128 * (tile + -(-n // 128)))
            bad["values_t"] += int((got[:, used] != want[:, used]).sum())
    return bad


def check_quantize_kernels(device: str) -> dict:
    """Per case, mismatch counts of every output of quantize_rows / quantize_weight."""
    from te_fused_moe.backends.triton.nvfp4.quantize import TILE, NVSpec, quantize_rows, quantize_weight
    from te_fused_moe.backends.triton.schedule import build_schedule, max_m_tiles
    from te_fused_moe.quantize import formats, nvfp4

    g = torch.Generator().manual_seed(1)
    out = {}
    counts = [100, 0, 170, 5]
    T, K = 300, 128
    sched = build_schedule(torch.tensor(counts, device=device), T, TILE)
    # integer multiples of 1/4 spanning a few binades: the FP32 RHT is exact, as the reference's FP64 one
    ints = (torch.randint(-12, 13, (T, K), generator=g).float() * 0.25) * torch.exp2(
        torch.randint(0, 3, (T, 1), generator=g).float())
    rand = torch.randn(T, K, generator=g)
    rand[7] = float("nan")
    rand[8, :5] = float("inf")
    rand[9] = 0.0
    rand[150, 3] = 1e-30
    slots = TILE * max_m_tiles(T, len(counts), TILE)
    from te_fused_moe.backends.triton.nvfp4 import quantize as Q

    # (name, x, spec, stochastic bits given, quantize.RHT_TENSOR_CORES: BF16 inputs' RHT on tensor cores)
    for name, x, spec, stochastic_bits, rht_mma in (
            ("rht_ints_bf16", ints.to(torch.bfloat16), NVSpec(rht=True), False, False),
            ("rht_ints_fp32", ints, NVSpec(rht=True), False, False),
            ("no_rht_random_nan_inf", rand, NVSpec(rht=False), False, False),
            ("sr_rht_given_bits", ints, NVSpec(stochastic=True, rht=True), True, False),
            ("sr_no_rht_given_bits", rand.to(torch.bfloat16), NVSpec(stochastic=True, rht=False), True, False),
            # the columnwise copy alone (a gradient whose rowwise copy nobody needs): its own kernel build,
            # which on the H200 once gave wrong codes where the two-copy build did not (run 14d)
            ("colwise_only_rht", ints, NVSpec(rht=True), False, False),
            ("rht_ints_bf16_mma", ints.to(torch.bfloat16), NVSpec(rht=True), False, True),
            ("sr_rht_given_bits_bf16_mma", ints.to(torch.bfloat16), NVSpec(stochastic=True, rht=True), True, True),
            ("colwise_only_rht_bf16_mma", ints.to(torch.bfloat16), NVSpec(rht=True), False, True)):
        bits = (torch.randint(0, 256, (T, K), generator=g, dtype=torch.uint8),
                torch.randint(0, 256, (slots, K), generator=g, dtype=torch.uint8)) if stochastic_bits else None
        xd = x.to(device)
        with _module_flags(Q.__name__, dict(RHT_TENSOR_CORES=rht_mma)):
            q = quantize_rows(xd, sched, len(counts), spec, rowwise=not name.startswith("colwise_only"), colwise=True,
                              random_bits=tuple(b.to(device) for b in bits) if bits else None)
        out[name] = {**_rows_mismatches(q, x, counts, spec, bits), **_values_mismatches(q, counts)}
    w = torch.randn(2, 256, 384, generator=g)
    w[1, 17, 200] = 40.0  # one tile's outlier

    # 16x16 tiles with the transposed copy's codes encoded again and taken from the rowwise codes, and 1x16 blocks
    for label, block_2d, codes_t in (("2d_True", True, False), ("2d_True_codes_t", True, True),
                                     ("2d_False", False, Q.WEIGHT_CODES_TRANSPOSED)):
        with _module_flags(Q.__name__, dict(WEIGHT_CODES_TRANSPOSED=codes_t)):
            wq = quantize_weight(w.to(device=device, dtype=torch.bfloat16),
                                 NVSpec(rht=False, block_2d=block_2d, bf16_values=True))
        bad = {"data": 0, "scale": 0, "data_t": 0, "scale_t": 0, "amax": 0, "values": 0, "values_t": 0}
        for e in range(2):
            we = w[e].to(torch.bfloat16).float()
            ref = nvfp4.quantize(we, axis=1, block_2d=block_2d)
            ref_t = nvfp4.quantize(we, axis=0, block_2d=block_2d)
            scale, scale_t = ref.scale.view(torch.uint8), ref_t.scale.view(torch.uint8)
            if block_2d:  # the kernels' layout repeats a tile's scale on each of its 16 rows / columns
                scale, scale_t = scale.repeat_interleave(16, 0), scale_t.repeat_interleave(16, 1)
            bad["data"] += int((wq.data[e].cpu() != ref.data).sum())
            bad["scale"] += int((wq.scale[e].cpu() != scale).sum())
            bad["data_t"] += int((wq.data_t[e].cpu() != ref_t.data.t()).sum())
            bad["scale_t"] += int((wq.scale_t[e].cpu() != scale_t.t()).sum())
            bad["amax"] += int(wq.amax[e].cpu() != ref.global_amax)
            # BF16 values: each code times its block scale, exactly (the tensor scale stays apart)
            codes = formats.decode(nvfp4.unpack_e2m1(ref.data, 1, we.shape[1]), formats.E2M1)
            codes_t = formats.decode(nvfp4.unpack_e2m1(ref_t.data, 0, we.shape[0]), formats.E2M1)
            block = lambda sc, dim: formats.decode(sc, formats.E4M3).repeat_interleave(16, dim)
            bad["values"] += int((wq.values[e].float().cpu() != split_order(codes * block(scale, 1))).sum())
            bad["values_t"] += int((wq.values_t[e].float().cpu() != split_order((codes_t * block(scale_t, 0)).t())).sum())
        out[f"weight_{label}"] = bad
    return out


def check_stochastic_rounding(device: str, draws: int = 64) -> dict:
    """Philox draws (no given bits): two calls differ; the mean of ``draws`` dequantized draws vs one."""
    from te_fused_moe.backends.triton.nvfp4.quantize import TILE, NVSpec, quantize_rows
    from te_fused_moe.backends.triton.schedule import build_schedule
    from te_fused_moe.quantize import formats, nvfp4

    g = torch.Generator().manual_seed(2)
    T, K = 128, 128
    x = torch.randn(T, K, generator=g)
    sched = build_schedule(torch.tensor([T], device=device), T, TILE)
    spec = NVSpec(stochastic=True, rht=False)
    total = torch.zeros(T, K, dtype=torch.float64)
    first = None
    for i in range(draws):
        q = quantize_rows(x.to(device), sched, 1, spec, rowwise=True, colwise=False)
        values = formats.decode(nvfp4.unpack_e2m1(q.data.cpu(), 1, K), formats.E2M1, torch.float64)
        scale = formats.decode(q.scale.cpu().contiguous(), formats.E4M3, torch.float64).repeat_interleave(16, 1)
        deq = values * scale * float(q.amax[0]) / 2688.0
        total += deq
        if i == 0:
            first, first_codes = deq, q.data.cpu().clone()
        elif i == 1:
            second_codes = q.data.cpu()
    err = lambda t: float((t - x.double()).norm() / x.double().norm())
    return {"draws_differ": bool((first_codes != second_codes).any()), "one_draw_err": err(first),
            "mean_err": err(total / draws)}


def _random_bytes_kernel():
    if "random_bytes" not in _KERNELS:
        import triton
        import triton.language as tl

        from te_fused_moe.backends.triton.nvfp4 import quantize

        globals().update(random_bytes=quantize.random_bytes)

        @triton.jit
        def bytes_kernel(seed_ptr, out_ptr, row0, col0, K, BM: tl.constexpr, BK: tl.constexpr):
            i = tl.arange(0, BM)[:, None]
            j = tl.arange(0, BK)[None, :]
            tl.store(out_ptr + i * BK + j, random_bytes(tl.load(seed_ptr), row0 + tl.arange(0, BM), col0, K, BM, BK))

        _KERNELS["random_bytes"] = bytes_kernel
    return _KERNELS["random_bytes"]


def _mul32(a: int, b: torch.Tensor):
    """(low, high) 32 bits of the 64-bit product of 32-bit ``a`` and ``b``, in int64 without overflow
    (16-bit halves of ``b``)."""
    b_hi, b_lo = b >> 16, b & 0xFFFF
    low = (a * b_lo + (((a * b_hi) & 0xFFFF) << 16)) & 0xFFFFFFFF
    high = (a * b_hi + ((a * b_lo) >> 16)) >> 16
    return low, high


def philox4x32_10(seed: int, counters: torch.Tensor) -> torch.Tensor:
    """Philox4x32 with 10 rounds (Salmon et al. 2011; the constants of Triton's ``randint4x``), key
    ``(seed, 0)``, counter ``(c, 0, 0, 0)``: ``[n, 4]`` 32-bit words in int64, computed on the host."""
    mask = 0xFFFFFFFF
    c0 = counters.to(torch.int64) & mask
    c1, c2, c3 = (torch.zeros_like(c0) for _ in range(3))
    k0, k1 = seed & mask, 0
    for _ in range(10):
        lo0, hi0 = _mul32(0xD2511F53, c0)
        lo2, hi2 = _mul32(0xCD9E8D57, c2)
        c0, c1, c2, c3 = hi2 ^ c1 ^ k0, lo2, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + 0x9E3779B9) & mask, (k1 + 0xBB67AE85) & mask
    return torch.stack([c0, c1, c2, c3], dim=-1)


def check_random_bytes(device: str) -> dict:
    """The stochastic passes' random bytes (``random_bytes``) at a [32, 64] tile of a 320-wide tensor
    (rows 96-127, columns 192-255) vs their definition: byte b of word w of Philox4x32-10 at counter
    row * 20 + column // 16 goes to column 16 (column // 16) + 4 w + b."""
    bytes_kernel = _random_bytes_kernel()
    seed = int(torch.randint(1, 2**31 - 1, (1,)))
    BM, BK, K, row0, col0 = 32, 64, 320, 96, 192
    out = torch.full((BM, BK), -1, dtype=torch.int32, device=device)
    bytes_kernel[(1,)](torch.tensor([seed], dtype=torch.int32, device=device), out, row0, col0, K, BM=BM, BK=BK)
    rows = torch.arange(row0, row0 + BM)[:, None]
    cols = torch.arange(col0, col0 + BK)[None, :]
    words = philox4x32_10(seed, (rows * (K // 16) + cols // 16).reshape(-1)).reshape(BM, BK, 4)
    word = torch.gather(words, 2, ((cols % 16) // 4).expand(BM, BK)[..., None])[..., 0]
    expected = (word >> (8 * (cols % 4))) & 0xFF
    got = out.cpu().to(torch.int64)
    return {"seed": seed, "bad": int((got != expected).sum()), "distinct": int(got.unique().numel())}


def check_weight_cache(device: str) -> dict:
    """Quantized once per optimizer step (fp8_block's cache rules) with NVFP4 copies."""
    from te_fused_moe.backends.triton.fp8_block.quantize import WeightCache
    from te_fused_moe.backends.triton.nvfp4.quantize import NVSpec, quantize_weight
    from te_fused_moe.quantize import nvfp4

    cache = WeightCache(quantize_fn=quantize_weight, follow_optimizer_steps=True)
    spec = NVSpec(rht=False, block_2d=True)
    w = torch.nn.Parameter(torch.randn(2, 256, 128, device=device, dtype=torch.bfloat16))
    first = cache.get(w, spec)
    same = all(cache.get(w, spec) is first for _ in range(3))
    misses_before = cache.misses
    with torch.no_grad():
        w.mul_(3.0)
    fresh = cache.get(w, spec)
    ref = nvfp4.quantize(w[1].detach().float().cpu(), axis=1, block_2d=True)
    out = dict(same_object=same, misses_before=misses_before, misses_after=cache.misses, refreshed=fresh is not first,
               fresh_bad=int((fresh.data[1].cpu() != ref.data).sum()), nbytes=cache.nbytes,
               expected_nbytes=w.numel() + 2 * w.numel() // 16 + 4 * 2)
    other = torch.nn.Parameter(torch.ones(1, device=device))
    opt = torch.optim.SGD([other], lr=0.1)
    other.grad = torch.ones_like(other)
    w.data.copy_(w.data * 2)
    out["stale_without_step"] = cache.get(w, spec) is fresh
    opt.step()
    out["refreshed_after_step"] = cache.get(w, spec) is not fresh
    cache._hook.remove()
    return out


# --- 4. the whole MLP ---------------------------------------------------------------------------------

def run_mlp_case(case, device: str, poison: bool = True, triton_context=None) -> dict:
    from block_scaled_checks import compare_with_reference
    from moe_reference import poison_, random_problem

    from te_fused_moe.backends.triton import library_wgrad
    from te_fused_moe.backends.triton.nvfp4 import autograd, gemm, quantize
    from te_fused_moe.recipes import NVFP4BlockScaling

    _, T, H, F, E, act, bias, probs, counts, padding, h_fp32, tma, frozen, options = case
    routing = counts if isinstance(counts, str) else "balanced"
    seed = int(torch.randint(1 << 20, (1,)))  # fresh data each run; reported with the result
    p = random_problem(T, H, F, E, activation=act, dtype=torch.bfloat16, device=device, bias=bias, probs=probs,
                       routing=routing, padding=padding, seed=seed)
    if not isinstance(counts, str):
        p["tokens_per_expert"] = torch.tensor(counts, device=device)
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(5)).to(device=device, dtype=torch.bfloat16)
    recipe = NVFP4BlockScaling(**{"disable_stochastic_rounding": True, **options})
    alloc = (lambda *a, **k: poison_(torch.empty(*a, **k))) if poison else torch.empty
    flags = case_flags(case[0])
    calls, values_wgrad = [], library_wgrad.values_wgrad
    library_flags = dict(values_wgrad=lambda *args: calls.append(1) or values_wgrad(*args))
    if case[0].endswith("-cublaswgrad") and device == "cpu":
        library_flags["runs_on"] = lambda like: True
    with _module_flags(autograd.__name__, flags), _module_flags(library_wgrad.__name__, library_flags), \
            _module_flags(quantize.__name__, case_flags(case[0], QUANTIZE_CASE_FLAGS)):
        res = compare_with_reference(p, recipe, act, dy, frozen, alloc, h_fp32, gemm, tma, triton_context)
    res["seed"], res["library_wgrads"] = seed, len(calls)  # wgrads that ran on torch._grouped_mm
    return res


def mlp_bound(case, output: str) -> float:
    """The bound for ``output``'s norm-relative error vs the reference (see the module doc, item 4)."""
    counts, h_fp32, options = case[8], case[10], case[13]
    if not h_fp32:
        return LOOSE
    rht = not options.get("disable_rht")
    ragged = isinstance(counts, str) or any(c % 16 for c in counts)
    if rht and output in ("w1", "w2"):
        return WGRAD_RHT
    return RAGGED_RHT if ragged and rht else TIGHT


# --- 5. dispatch, validation, the benchmark's baseline ---------------------------------------------------

def check_dispatch(device: str) -> dict:
    """``fused_moe_mlp(backend='triton')`` at sizes on and off the 128 tile (block_scaled_checks'
    DISPATCH_SHAPES): which Function ran, y's error vs ``backend='reference'``, whether ``auto`` gave
    the same bits, and whether y and the x / w1 / w2 gradients come dense in their own sizes."""
    from block_scaled_checks import DISPATCH_SHAPES

    from te_fused_moe import fused_moe_mlp
    from te_fused_moe.backends import select_backend
    from te_fused_moe.activations import ActivationConfig
    from te_fused_moe.recipes import NVFP4BlockScaling

    from moe_reference import random_problem, rel_err

    out = {}
    recipe = NVFP4BlockScaling(disable_stochastic_rounding=True)
    for label, (H, F) in DISPATCH_SHAPES.items():
        p = random_problem(64, H, F, 2, dtype=torch.bfloat16, device=device, seed=3)
        run = lambda backend, x, w1, w2: fused_moe_mlp(x, p["tokens_per_expert"], w1, w2, recipe=recipe,
                                                       backend=backend)
        leaves = [p[key].clone().requires_grad_(True) for key in ("x", "w1", "w2")]
        y = run("triton", *leaves)
        grads = torch.autograd.grad(y, leaves, torch.randn_like(y))
        out[label] = {"node": type(y.grad_fn).__name__, "shape": list(y.shape),
                      "err": rel_err(y.detach(), run("reference", p["x"], p["w1"], p["w2"])),
                      "auto_same": bool(torch.equal(y.detach(), run("auto", p["x"], p["w1"], p["w2"]))),
                      "dense": y.is_contiguous() and all(g.is_contiguous() and g.shape == leaf.shape
                                                         for g, leaf in zip(grads, leaves))}
    out["auto"] = select_backend("auto", torch.device(device), ActivationConfig("swiglu"), recipe, torch.bfloat16,
                                 None).name
    return out


def check_bench_baseline(device: str) -> dict:
    """The benchmark's ``nvfp4_unfused`` computes the same recipe as ``nvfp4_fused`` (stochastic
    rounding on in both: gradients within its noise)."""
    from block_scaled_checks import bench_unfused_vs_fused
    from moe_reference import random_problem

    p = random_problem(256, 256, 128, 2, dtype=torch.bfloat16, device=device, seed=2)
    p["tokens_per_expert"] = torch.tensor([96, 160], device=device)
    return bench_unfused_vs_fused("nvfp4", p, device)


def check_routed_gemms(device: str) -> dict:
    """FC2, FC1's dgrad, FC1 (GEMM + SwiGLU, FP32 ``a``, h saved) and the dGLU (FP32 dh, dprob partials) on BF16
    values run on the BF16 backend's kernel (``gemm.VALUES_ON_BF16_KERNEL``) and on this recipe's, random data and
    counts with an empty expert, outputs poisoned before each: per output, whether the two agree bitwise and their
    largest difference over the output's largest magnitude (NaN where either left an element unwritten). dprob is
    compared as the sum of its partials: the two kernels' N tiles differ, so their partials do."""
    import triton
    from moe_reference import poison_

    from te_fused_moe.backends.triton.nvfp4 import autograd as A, gemm, quantize as Q
    from te_fused_moe.backends.triton.schedule import build_schedule
    from te_fused_moe.recipes import NVFP4BlockScaling

    g = torch.Generator().manual_seed(int(torch.randint(1 << 20, (1,))))
    T, H, F, E = 300, 256, 128, 3
    counts = torch.tensor([int(torch.randint(40, 200, (1,), generator=g)), 0, 0])
    counts[2] = T - 20 - counts[0]  # 20 padding rows
    randn = lambda *size, scale=1.0: (torch.randn(*size, generator=g) * scale).to(device=device, dtype=torch.bfloat16)
    spec, _, wspec = A.specs_of(NVFP4BlockScaling(disable_stochastic_rounding=True))
    schedule = build_schedule(counts.to(device), T, Q.TILE)
    w1q, w2q = Q.quantize_weight(randn(E, 2 * F, H, scale=H ** -0.5), wspec), Q.quantize_weight(randn(E, H, F), wspec)
    rows = lambda width: A.gemm_rows(Q.quantize_rows(randn(T, width), schedule, E, spec), True, rowwise=True)
    bias1, bias2, probs = randn(E, 2 * F), randn(E, H), torch.rand(T, device=device)
    cases = {  # output name: (kind, a, b, n, output shape, dtype, launch keywords)
        "fc2_y": ("fc2", rows(F), A.gemm_weight(w2q, True, False), H, (T, H), torch.bfloat16, dict(bias=bias2)),
        "dgrad_dx": ("dgrad", rows(2 * F), A.gemm_weight(w1q, True, True), H, (T, H), torch.bfloat16,
                     dict(b_transposed=True)),
        "fc1_a": ("fc1", rows(H), A.gemm_weight(w1q, True, False), F, (T, F), torch.float32,
                  dict(b_up_rows=F, bias=bias1, bias_up_offset=F, probs=probs, gated=True, activation="swiglu",
                       h_up_offset=F)),
        "dact_dh": ("dact", rows(H), A.gemm_weight(w2q, True, True), F, (T, 2 * F), torch.float32,
                    dict(b_transposed=True, c_up_offset=F, h_up_offset=F, probs=probs, gated=True,
                         activation="swiglu")),
    }
    h_saved = randn(T, 2 * F)  # the dGLU's input h (FC1's pre-activation)
    out = {}
    for name, (kind, a, b, n, shape, dtype, kw) in cases.items():
        got = {}
        for routed in (True, False):
            with _module_flags(gemm.__name__, dict(VALUES_ON_BF16_KERNEL=routed)):
                c = poison_(torch.empty(shape, device=device, dtype=dtype))
                extra = {}
                if kind == "fc1":  # h written
                    extra["h"] = poison_(torch.empty((T, 2 * F), device=device, dtype=torch.bfloat16))
                elif kind == "dact":  # h read, dprob partials written
                    cfg = gemm.default_config("dact", True)
                    dprob = poison_(torch.empty((triton.cdiv(F, cfg.block_n), T), device=device))
                    extra = dict(h=h_saved, dprob=dprob, config=cfg)
                gemm.launch(kind, a, b, n, schedule, E, c=c, **kw, **extra)
            got[routed] = (c, extra.get("h") if kind == "fc1" else extra.get("dprob", torch.zeros(1)).sum(0))
        pairs = [(name, got[True][0], got[False][0])]
        if kind == "fc1":
            pairs.append(("fc1_h", got[True][1], got[False][1]))
        elif kind == "dact":
            pairs.append(("dact_dprob", got[True][1], got[False][1]))
        for label, routed_out, own in pairs:
            diff = (routed_out.float() - own.float()).abs().max() / own.float().abs().max()
            out[label] = {"bitwise": bool(torch.equal(routed_out, own)), "rel_diff": float(diff)}
    return out


def check_wgrad_steps(device: str) -> dict:
    """The BF16-valued wgrad at half a tile slot per step (``wgrad.NVWgradConfig.block_t = 64``; by TMA and by
    pointer loads) and at a slot per step (two dots), and the wgrad expanding the packed codes in its K loop: random
    data with RHT, an empty expert and a partial last slot, dW poisoned before each. Per variant, whether it is
    bitwise equal to the half-step one and their largest difference over its largest magnitude (NaN where an element
    was left unwritten): the same dots in the same order give the same sums."""
    from dataclasses import replace

    from moe_reference import poison_

    from te_fused_moe.backends.triton.nvfp4 import autograd as A, gemm as nv_gemm, quantize as Q, wgrad as W
    from te_fused_moe.backends.triton.schedule import build_schedule
    from te_fused_moe.recipes import NVFP4BlockScaling

    g = torch.Generator().manual_seed(int(torch.randint(1 << 20, (1,))))
    T, N, K, E = 400, 256, 128, 3
    counts = torch.tensor([int(torch.randint(140, 260, (1,), generator=g)), 0, 0])
    counts[2] = T - 16 - counts[0]  # 16 padding rows
    randn = lambda *size: torch.randn(*size, generator=g).to(device=device, dtype=torch.bfloat16)
    spec, _, _ = A.specs_of(NVFP4BlockScaling(disable_stochastic_rounding=True))
    schedule = build_schedule(counts.to(device), T, Q.TILE)
    gq, xq = (Q.quantize_rows(randn(T, width), schedule, E, spec, rowwise=False, colwise=True) for width in (N, K))
    gv, xv = (Q.with_values(q, colwise=True) for q in (gq, xq))
    half = replace(W.default_config(True), block_t=W.HALF_SLOT)
    variants = {"half_slot": (gv, xv, half, True), "half_slot_pointers": (gv, xv, half, False),
                "slot": (gv, xv, replace(half, block_t=None), True),
                "packed_codes": (gq, xq, W.default_config(False), True)}
    dws = {}
    for name, (gg, xx, cfg, tma) in variants.items():
        dws[name] = poison_(torch.empty(E, N, K, device=device, dtype=torch.bfloat16))
        # not tma: pointer loads instead of TMA descriptors
        with _module_flags(nv_gemm.__name__, dict(USE_TMA_DEFAULT=tma and nv_gemm.USE_TMA_DEFAULT)):
            W.nv_grouped_wgrad(gg, xx, schedule, dws[name], config=cfg)
    ref = dws["half_slot"].float()
    out = {"empty_expert_zero": bool((ref[1] == 0).all())}
    for name, dw in dws.items():
        out[name] = {"bitwise": bool(torch.equal(dw, dws["half_slot"])),
                     "rel_diff": float((dw.float() - ref).abs().max() / ref.abs().max())}
    return out


def check_library_wgrad(device: str) -> dict:
    """The wgrad on cuBLAS's grouped GEMM (``autograd.VALUES_WGRAD_KERNEL = "cublas"``; on CPU PyTorch's fallback of
    ``torch._grouped_mm``): x's columnwise values expanded with both tensor scales of each slot's expert (poisoned
    buffer; bitwise against the plain values times the factor, rounded once), then dW against the Triton kernel's
    and an FP64 product of the dequantized operands. Random data with RHT, an empty expert, a partial last slot and
    padding rows."""
    from moe_reference import poison_

    from te_fused_moe.backends.triton import library_wgrad
    from te_fused_moe.backends.triton.nvfp4 import autograd as A, quantize as Q
    from te_fused_moe.backends.triton.schedule import TILE_END, TILE_START, build_schedule
    from te_fused_moe.recipes import NVFP4BlockScaling

    g = torch.Generator().manual_seed(int(torch.randint(1 << 20, (1,))))
    T, N, K, E = 420, 256, 128, 3
    counts = torch.tensor([int(torch.randint(140, 260, (1,), generator=g)), 0, 0])
    counts[2] = T - 20 - counts[0]  # 20 padding rows
    randn = lambda *size: (torch.randn(*size, generator=g) * torch.rand(1, generator=g) * 4).to(
        device=device, dtype=torch.bfloat16)
    spec, _, _ = A.specs_of(NVFP4BlockScaling(disable_stochastic_rounding=True))
    schedule = build_schedule(counts.to(device), T, Q.TILE)
    gq, xq = (Q.quantize_rows(randn(T, width), schedule, E, spec, rowwise=False, colwise=True) for width in (N, K))
    poisoned = lambda *a, **k: poison_(torch.empty(*a, **k))
    gv, xv = (Q.with_values(q, colwise=True, alloc=poisoned) for q in (gq, xq))
    xs = Q.with_values(xq, colwise=True, alloc=poisoned, colwise_scaled_by=(gq, schedule))
    table = schedule.cpu()
    starts, ends = table[TILE_START * (E + 1):][:E + 1], table[TILE_END * (E + 1):][:E + 1]
    d = torch.tensor(1.0 / 2688.0, dtype=torch.float32)
    factors = (gq.amax_t.cpu() * d) * (xq.amax_t.cpu() * d)
    slot_factor = torch.zeros(xv.values_t.shape[1] // Q.TILE)
    for group in range(E + 1):
        slot_factor[int(starts[group]):int(ends[group])] = factors[group]
    written = Q.TILE * int(ends[E])  # slots past the last tile hold no codes (allocated, never quantized)
    expect = (xv.values_t.cpu()[:, :written].float() * slot_factor[:int(ends[E])].repeat_interleave(Q.TILE)).to(
        torch.bfloat16)
    out = {"scaled_values_bitwise": bool(torch.equal(xs.values_t.cpu()[:, :written], expect))}
    dw_lib = library_wgrad.values_wgrad(gv.values_t, xs.values_t, schedule, (E, N, K)).cpu().double()
    with _module_flags(A.__name__, dict(VALUES_WGRAD_KERNEL="triton")):
        dw_triton = A.weight_grad(gq, xq, schedule, torch.empty(E, N, K, device=device, dtype=torch.bfloat16), True)
    truth, magnitude = torch.zeros(E, N, K, dtype=torch.float64), torch.zeros(E, N, K, dtype=torch.float64)
    for e in range(E):
        cols = slice(Q.TILE * int(starts[e]), Q.TILE * int(ends[e]))
        ge, xe = gv.values_t.cpu()[:N, cols].double(), xv.values_t.cpu()[:K, cols].double()
        truth[e] = (ge @ xe.t()) * float(factors[e])
        magnitude[e] = (ge.abs() @ xe.abs().t()) * float(factors[e])
    scale = truth.abs().max()
    out["empty_expert_zero"] = bool((dw_lib[1] == 0).all())
    # what rounding each of x's values once more may move a sum by at most, over dW's largest magnitude
    out["values_rounding_bound"] = float(2 ** -8 * magnitude.max() / scale)
    out["lib_err"] = float((dw_lib - truth).abs().max() / scale)
    out["triton_err"] = float((dw_triton.cpu().double() - truth).abs().max() / scale)
    out["lib_vs_triton"] = float((dw_lib - dw_triton.cpu().double()).abs().max() / scale)
    return out


# --- the interpreter run ------------------------------------------------------------------------------

def sm90_build_report() -> dict:
    """Offline sm_90a builds of every default NVFP4 kernel and of the opt-in ones (tests/sm90_build.py)."""
    from dataclasses import replace

    from sm90_build import build_sm90 as build

    from te_fused_moe.backends.triton.act_math import ACT_IDS
    from te_fused_moe.backends.triton.block_scaled_launch import GEMM_MODES, MODE_DACT, MODE_PLAIN
    from te_fused_moe.backends.triton.nvfp4 import gemm, quantize as Q, wgrad as W

    ptrs = dict(as_ptr="*u8", bs_ptr="*u8", amax_a_ptr="*fp32", amax_b_ptr="*fp32", c_ptr="*bf16", h_ptr="*bf16",
                bias_ptr="*bf16", probs_ptr="*fp32", dprob_ptr="*fp32", sched_ptr="*i32", alpha="fp32", limit="fp32")
    report = {}
    for name, kind, gated, act, a_bf16, b_bf16 in (
            ("fc1_swiglu", "fc1", True, "swiglu", False, False), ("fc1_srelu", "fc1", False, "srelu", False, False),
            ("fc2", "fc2", False, "swiglu", False, False), ("dact_gptoss", "dact", True, "gpt_oss_swiglu", False, False),
            ("dgrad", "dgrad", False, "swiglu", False, False), ("fc1_swiglu_bf16w", "fc1", True, "swiglu", False, True),
            ("dgrad_bf16w", "dgrad", False, "swiglu", False, True),
            # both operands' BF16 values, expanded before the GEMM (the default path)
            ("fc1_swiglu_values", "fc1", True, "swiglu", True, True), ("fc2_values", "fc2", False, "swiglu", True, True),
            ("dact_swiglu_values", "dact", True, "swiglu", True, True),
            ("dgrad_values", "dgrad", False, "swiglu", True, True)):
        cfg = gemm.own_config(kind, a_bf16)  # this recipe's kernel (the routed ones: routed_build_report)
        mode = GEMM_MODES[kind]
        box = lambda bf16, rows: f"tensordesc<{'bf16' if bf16 else 'u8'}[{rows}, {gemm.BLOCK_K // 2}]>"
        types = dict(ptrs, a_src=box(a_bf16, 128), b_src=box(b_bf16, cfg.block_n))
        if mode != MODE_PLAIN:
            types["c_ptr"] = "*fp32"
        consts = dict(MODE=mode, ACT=ACT_IDS[act], GATED=gated, HAS_BIAS=True, HAS_PROBS=True,
                      WRITE_DPROB=mode == MODE_DACT, USE_TMA=True, UPCAST=False,
                      SPLIT_EPILOGUE=mode == MODE_DACT and cfg.split_epilogue, A_BF16=a_bf16, B_BF16=b_bf16,
                      BM=128, BN=cfg.block_n, BK=gemm.BLOCK_K, GROUP_M=cfg.group_m)
        report[name] = build(gemm.nv_grouped_gemm_kernel, types, consts, cfg.num_warps, cfg.num_stages)
    for label, bf16, block_t in (("wgrad", False, None), ("wgrad_values", True, None),
                                 ("wgrad_values_half_slot", True, W.HALF_SLOT)):
        wc = replace(W.default_config(bf16), block_t=block_t)
        elem = "bf16" if bf16 else "u8"
        report[label] = build(
            W.nv_wgrad_kernel, dict(g_src=f"tensordesc<{elem}[{wc.block_n}, 64]>",
                                    x_src=f"tensordesc<{elem}[{wc.block_k}, 64]>", gs_ptr="*u8", xs_ptr="*u8",
                                    amax_g_ptr="*fp32", amax_x_ptr="*fp32", dw_ptr="*bf16", sched_ptr="*i32"),
            dict(USE_TMA=True, UPCAST=False, BF16=bf16, BN=wc.block_n, BK=wc.block_k, BT=128, GROUP_N=wc.group_n,
                 HALF_STEPS=wc.block_t == W.HALF_SLOT),
            wc.num_warps, wc.num_stages)
    # the RHT by FP32 FMAs and (BF16 inputs, quantize.RHT_TENSOR_CORES) on tensor cores
    for mma in (False, True):
        report["amax_rht_mma" if mma else "amax_rht"] = build(
            Q.group_amax_kernel, dict(x_ptr="*bf16", amax_ptr="*fp32", amax_t_ptr="*fp32", sched_ptr="*i32"),
            dict(RHT_AMAX=True, NEG_MASK=Q.RHT_NEG_MASK, BM=128, BK=Q.QUANT_COLS, RHT_MMA=mma, UPCAST=False))
    for sr, x_type, mma in ((False, "fp32", False), (True, "fp32", False), (False, "bf16", False),
                            (True, "bf16", False), (False, "bf16", True), (True, "bf16", True)):
        label = f"quantize_rht_sr{int(sr)}" + ("" if x_type == "fp32" else "_bf16") + ("_mma" if mma else "")
        report[label] = build(
            Q.quantize_tiles_kernel, dict(x_ptr=f"*{x_type}", q_ptr="*u8", qs_ptr="*u8", amax_ptr="*fp32", qt_ptr="*u8",
                                          qts_ptr="*u8", amax_t_ptr="*fp32", colsum_ptr="*fp32", seed_ptr="*i32",
                                          bits_ptr="*u8", bits_t_ptr="*u8", sched_ptr="*i32"),
            dict(ROWWISE=True, COLWISE=True, COLSUM=True, RHT=True, STOCHASTIC=sr, GIVEN_BITS=False,
                 NEG_MASK=Q.RHT_NEG_MASK, BM=128, BK=Q.QUANT_COLS, RHT_MMA=mma, UPCAST=False))
    report["quantize_weight_1d"] = build(Q.quantize_weight_kernel, dict(w_ptr="*bf16", amax_ptr="*fp32", q_ptr="*u8",
                                                                        s_ptr="*u8", qt_ptr="*u8", st_ptr="*u8"),
                                         dict(TRANSPOSED=True, BLOCK_2D=False, BLK=128))
    for label, codes_t in (("quantize_weight_2d", False), ("quantize_weight_2d_codes_t", True)):
        report[label] = build(Q.quantize_weight_kernel, dict(w_ptr="*bf16", amax_ptr="*fp32", q_ptr="*u8", s_ptr="*u8",
                                                             qt_ptr="*u8", st_ptr="*u8"),
                              dict(TRANSPOSED=True, BLOCK_2D=True, BLK=128, CODES_T_FROM_CODES=codes_t))
    expand_ptrs = dict(q_ptr="*u8", s_ptr="*u8", v_ptr="*bf16", amax_a_ptr="*fp32", amax_b_ptr="*fp32",
                       sched_ptr="*i32")
    for scaled in (False, True):  # the columnwise values with the tensor scales (autograd.VALUES_WGRAD_KERNEL "cublas")
        report["expand_scaled" if scaled else "expand"] = build(Q.expand_kernel, expand_ptrs,
                                                                dict(UPCAST=False, BLK=128, TENSOR_SCALES=scaled))
    report.update(routed_build_report(build))
    return report


def routed_build_report(build) -> dict:
    """The GEMMs that run on the BF16 backend's kernel (``gemm.VALUES_ON_BF16_KERNEL``) at their configs
    (``gemm.bf16_kernel_config``), DSv3's sizes: FC2 and FC1's dgrad (BF16 out), FC1 (FP32 ``a``, h in BF16), the
    dGLU (FP32 dh, h in BF16, dprob partials)."""
    from te_fused_moe.backends.triton import grouped_gemm
    from te_fused_moe.backends.triton.act_math import ACT_IDS
    from te_fused_moe.backends.triton.nvfp4 import gemm

    report = {}
    for name, kind, n, k in (("fc2_routed", "fc2", 7168, 2048), ("dgrad_routed", "dgrad", 7168, 4096),
                             ("fc1_routed", "fc1", 2048, 7168), ("dact_routed", "dact", 2048, 7168)):
        cfg = gemm.bf16_kernel_config(kind, n, k)
        fc1, dact = kind == "fc1", kind == "dact"
        b_box = f"[2, {cfg.block_n}, {cfg.block_k}]" if fc1 and cfg.gate_up_box else f"[{cfg.block_n}, {cfg.block_k}]"
        types = dict(a_src=f"tensordesc<bf16[{cfg.block_m}, {cfg.block_k}]>", b_src=f"tensordesc<bf16{b_box}>",
                     c_ptr="*fp32" if fc1 or dact else "*bf16", h_ptr="*bf16", bias_ptr="*bf16", probs_ptr="*fp32",
                     dprob_ptr="*fp32", scale_ptr="*fp32", sched_ptr="*i32", alpha="fp32", limit="fp32")
        mode = {"fc1": grouped_gemm.MODE_ACT_FWD, "dact": grouped_gemm.MODE_ACT_BWD}.get(kind, grouped_gemm.MODE_PLAIN)
        consts = dict(MODE=mode, ACT=ACT_IDS["swiglu"], GATED=fc1 or dact, HAS_BIAS=not dact, HAS_PROBS=fc1 or dact,
                      WRITE_DPROB=dact, DPROB_PARTIALS=dact, EVEN_K=True, EVEN_N=True, N_VEC8=True, USE_TMA=True,
                      B_KMAJOR=True, SPLIT_EPILOGUE=dact and cfg.block_n >= 32, UPCAST=False,
                      PERSISTENT=cfg.persistent, FLATTEN=cfg.flatten, GATE_UP_BOX=fc1 and cfg.gate_up_box,
                      EPI_STORE=grouped_gemm.store_gate_up_grads if dact else grouped_gemm.store_activation,
                      EPI_STORE_CONSTS=(), HAS_SCALE=True, BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k,
                      GROUP_M=cfg.group_m)
        report[name] = build(grouped_gemm.grouped_gemm_kernel, types, consts, cfg.num_warps, cfg.num_stages)
    return report


def _worker() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
    results = {
        "codec": check_codec("cpu"),
        "quantize": check_quantize_kernels("cpu"),
        "sr": check_stochastic_rounding("cpu", draws=32),
        "random_bytes": check_random_bytes("cpu"),
        "cache": check_weight_cache("cpu"),
        "dispatch": check_dispatch("cpu"),
        "bench_baseline": check_bench_baseline("cpu"),
        "routed": check_routed_gemms("cpu"),
        "wgrad_steps": check_wgrad_steps("cpu"),
        "library_wgrad": check_library_wgrad("cpu"),
        "mlp": {case[0]: run_mlp_case(case, "cpu") for case in MLP_CASES + [SR_CASE]},
    }
    print("RESULTS" + json.dumps(results))


@pytest.fixture(scope="module")
def results():
    return run_in_triton_interpreter("import test_triton_nvfp4_interpreter as t; t._worker()", timeout=1500)


def test_kernels_build_for_sm90a_without_k_loop_spills():
    """Offline sm_90a build of every default NVFP4 kernel: the GEMMs run BF16 wgmma and none spills
    inside its K loop (the expansion works on 16-bit halves; on 32-bit codes FC1, FC2, the dgrad and
    the wgrad spilled 67-168 loads/stores per iteration). Only FC1's epilogue (two 128x128 FP32
    accumulators, BN = 128) may spill, outside the loop (inside it on the BF16 backend's persistent kernel,
    whose loop holds the epilogue). The GEMMs routed to that kernel fit its shared memory too."""
    from sm90_build import have_tools, report_in_subprocess, tools_dir

    if not have_tools():
        pytest.skip(f"the Triton wheel has no NVIDIA tools in {tools_dir()}: cannot build for sm_90a offline")
    report = report_in_subprocess("test_triton_nvfp4_interpreter")
    for name, r in report.items():
        if name.startswith(("fc", "dact", "dgrad", "wgrad")):
            assert r["qgmma"] == 0 and r["hgmma"] > 0 and r["loop_found"], (name, r)
            # the routed FC1's flattened persistent loop holds its epilogue (two FP32 accumulators, FP32 a), which
            # spills there, as MXFP8's routed FC1 does (tests/test_mxfp8_on_bf16_kernel.py)
            assert r["loop_spills"] == 0 or name == "fc1_routed", (name, r)
        assert r["stack"] <= (512 if name.startswith("fc1") else 0), (name, r)
        assert r["shared"] <= SM90_MAX_SHARED, (name, r)  # else the launch fails on the GPU
    # half a slot per step: two programs share an SM (shared memory and 256 threads' registers for two)
    half = report["wgrad_values_half_slot"]
    assert 2 * half["shared"] <= SM90_MAX_SHARED and half["registers"] <= 128, half
    # the transposed weight copy's codes from the rowwise ones: the tile is encoded once
    codes_t, twice = report["quantize_weight_2d_codes_t"], report["quantize_weight_2d"]
    assert codes_t["instructions"] < 0.7 * twice["instructions"], (codes_t, twice)
    # BF16 inputs' RHT on tensor cores (quantize.RHT_TENSOR_CORES): mma.sync in place of the FMA chain, fewer
    # instructions and registers (the amax pass about half)
    for mma, fma in (("amax_rht_mma", "amax_rht"), ("quantize_rht_sr0_bf16_mma", "quantize_rht_sr0_bf16"),
                     ("quantize_rht_sr1_bf16_mma", "quantize_rht_sr1_bf16")):
        assert report[mma]["hmma"] > 0 and report[fma]["hmma"] == 0, (report[mma], report[fma])
        assert report[mma]["instructions"] < report[fma]["instructions"], (report[mma], report[fma])
        assert report[mma]["registers"] < report[fma]["registers"], (report[mma], report[fma])
    assert report["amax_rht_mma"]["instructions"] < 0.7 * report["amax_rht"]["instructions"], report["amax_rht_mma"]


def test_codec_is_bit_exact(results):
    c = results["codec"]
    assert c["n"] > 50000 + 2 * 66000
    assert c["rne"] == 0 and c["stochastic"] == 0 and c["e4m3_decode"] == 0 and c["expand"] == 0, c


def test_quantize_kernels_are_bit_exact(results):
    assert len(results["quantize"]) == 12
    for key, bad in results["quantize"].items():
        assert all(v == 0 for v in bad.values()), (key, bad)


def test_stochastic_rounding_draws_are_unbiased(results):
    s = results["sr"]
    assert s["draws_differ"], s
    assert s["mean_err"] < s["one_draw_err"] / 4, s


def test_random_bytes_are_philox_per_16_columns(results):
    r = results["random_bytes"]
    assert r["bad"] == 0 and r["distinct"] > 200, r  # 2048 bytes: all 256 values expected


def test_weight_cache_refreshes_once_per_step(results):
    c = results["cache"]
    assert c["same_object"] and c["misses_before"] == 1, c
    assert c["refreshed"] and c["misses_after"] == 2 and c["fresh_bad"] == 0, c
    assert c["nbytes"] == c["expected_nbytes"], c
    assert c["stale_without_step"] and c["refreshed_after_step"], c


@pytest.mark.parametrize("case", MLP_CASES, ids=[c[0] for c in MLP_CASES])
def test_mlp_matches_reference_emulation(results, case):
    res = results["mlp"][case[0]]
    frozen, bias, probs = case[12], case[6], case[7]
    expected = {"y", "x", "w1", "w2"} | ({"b1", "b2"} if bias else set()) | ({"probs"} if probs else set())
    assert set(res["grads"]) == expected - set(frozen)
    for name, err in res["err"].items():
        bound = mlp_bound(case, name)
        assert res["nan"][name] == 0, (case[0], name, res)
        if err > bound:  # a code flip (see FLIP_SHARE), or a bug
            assert res["far"][name] <= FLIP_SHARE and res["fp64"][name] <= FLIP_FP64, \
                (f"{case[0]} (seed {res['seed']}): {name} rel. error vs reference {err:.3g} > {bound}, with "
                 f"{res['far'][name]:.3g} of its elements off and {res['fp64'][name]:.3g} vs FP64")
    for name, bad in res["nonzero"].items():
        assert bad == 0, (case[0], name, res["nonzero"])
    assert res["library_wgrads"] == library_wgrads_expected(case[0], "cpu"), res["library_wgrads"]


def test_mlp_with_stochastic_rounding(results):
    res = results["mlp"][SR_CASE[0]]
    assert res["err"]["y"] <= TIGHT, res["err"]  # no stochastic rounding in the forward pass
    for name, err in res["err"].items():
        assert res["nan"][name] == 0 and err <= SR_NOISE, (name, res)
    assert max(res["err"][k] for k in ("x", "w1", "w2")) > 10 * TIGHT, res["err"]  # the rounding is on


def test_gemms_on_the_bf16_kernel_match_the_nvfp4_kernel(results):
    """The BF16 backend's kernel with the tensor scales as one factor per group sums each K block's halves in
    this recipe's order: the same bits under the interpreter, every element written."""
    routed = results["routed"]
    assert set(routed) == {"fc2_y", "dgrad_dx", "fc1_a", "fc1_h", "dact_dh", "dact_dprob"}, routed
    for name, r in routed.items():
        if name == "dact_dprob":  # sums of partials over different N tiles: FP32 rounding apart
            assert r["rel_diff"] <= 1e-6, (name, r)
        else:
            assert r["bitwise"] and r["rel_diff"] == 0.0, (name, r)


def test_wgrad_half_slot_steps_match_slot_steps(results):
    """The BF16-valued wgrad at half a slot per step runs the slot-per-step loop's dots in the same order: the same
    bits under the interpreter, every element written, an empty expert's dW zero; the K loop expanding packed codes
    gives the same products (exact expansions) in the same order too."""
    r = results["wgrad_steps"]
    assert r["empty_expert_zero"], r
    for name in ("half_slot", "half_slot_pointers", "slot", "packed_codes"):
        assert r[name]["bitwise"] and r[name]["rel_diff"] == 0.0, (name, r)


def test_wgrad_on_library_folds_the_tensor_scales(results):
    """cuBLAS's wgrad route: x's columnwise values carry each expert's two tensor scales (bitwise: one FP32 product,
    one rounding), and dW stays within one BF16 rounding (2^-8 of dW's largest magnitude) of the FP64 product of the
    dequantized operands, as the Triton kernel's does, plus what the rounding of x's scaled values may add (2^-8 of
    each product's magnitude, summed); an empty expert's dW is zero."""
    assert_library_wgrad(results["library_wgrad"])


def assert_library_wgrad(r: dict) -> None:
    """The bounds of :func:`check_library_wgrad`'s result (CPU and GPU tests)."""
    assert r["scaled_values_bitwise"] and r["empty_expert_zero"], r
    assert r["triton_err"] <= 2 ** -8 and r["lib_err"] <= 2 ** -8 + r["values_rounding_bound"], r
    assert r["lib_vs_triton"] <= 2 ** -7 + r["values_rounding_bound"], r


def test_every_size_runs_on_triton_and_auto_picks_it(results):
    """Sizes off the 128 tile run zero-padded in the same Function, within the forward's bound of the
    reference, with results dense in their own sizes."""
    from block_scaled_checks import DISPATCH_SHAPES

    d = results["dispatch"]
    for label, (hidden, _) in DISPATCH_SHAPES.items():
        r = d[label]
        assert r["node"] == "NVFP4ExpertMLPBackward" and r["shape"] == [64, hidden], (label, r)
        assert r["err"] <= LOOSE and r["auto_same"] and r["dense"], (label, r)
    assert d["auto"] == "triton", d  # the interpreter counts as available here, as the GPU does on the H200


def test_bench_unfused_baseline_is_the_same_recipe(results):
    errs = results["bench_baseline"]
    assert set(errs) == {"y", "x", "w1", "w2"}
    assert 0 < errs["y"] < 5e-2 and all(0 < e < SR_NOISE for e in errs.values()), errs


def test_supports_every_nvfp4_option():
    from te_fused_moe.activations import ActivationConfig
    from te_fused_moe.backends import get_backend
    from te_fused_moe.recipes import NVFP4BlockScaling

    backend = get_backend("triton")
    act = ActivationConfig("swiglu")
    for options in ({}, dict(disable_rht=True), dict(disable_stochastic_rounding=True),
                    dict(disable_2d_quantization=True)):
        assert backend.supports(act, NVFP4BlockScaling(**options), torch.bfloat16), options
    verdict = backend.supports(act, NVFP4BlockScaling(), torch.float32)
    assert not verdict and "bfloat16 or float16" in verdict.reason, verdict


def test_kernel_arguments_are_validated():
    from te_fused_moe.backends.triton.nvfp4.quantize import NVSpec, expand_values, quantize_rows, quantize_weight

    with pytest.raises(ValueError, match="x: the NVFP4 quantize kernels need a width that is a multiple of 128, got 96"):
        quantize_rows(torch.randn(4, 96), torch.zeros(20, dtype=torch.int32), 1, NVSpec())
    with pytest.raises(ValueError, match=r"x: expected unit stride"):
        quantize_rows(torch.randn(128, 4).t(), torch.zeros(20, dtype=torch.int32), 1, NVSpec())
    with pytest.raises(ValueError, match="random_bits: only used with a stochastic-rounding spec"):
        quantize_rows(torch.randn(4, 128), torch.zeros(20, dtype=torch.int32), 1, NVSpec(),
                      random_bits=(torch.zeros(4, 128, dtype=torch.uint8),) * 2)
    with pytest.raises(ValueError, match="w: the NVFP4 weight quantizer needs both sizes to be multiples of 128"):
        quantize_weight(torch.randn(2, 96, 128), NVSpec())
    with pytest.raises(ValueError, match="w: expected a contiguous"):
        quantize_weight(torch.randn(2, 128, 128).transpose(1, 2), NVSpec())
    # the columnwise values' tensor scales (cuBLAS's wgrad route): amaxes per group, a schedule covering the slots
    codes, scales = torch.zeros(128, 128, dtype=torch.uint8), torch.zeros(128, 16, dtype=torch.uint8)
    amax, schedule = torch.ones(3), torch.zeros(4 * 3 + 2, dtype=torch.int32)
    for bad in ((amax, torch.ones(2), schedule), (amax, amax.double(), schedule), (amax, amax, schedule.float()),
                (amax, amax, schedule[:13])):
        with pytest.raises(ValueError, match=r"tensor_scales: expected two FP32 \[E \+ 1\] amaxes"):
            expand_values(codes, scales, tensor_scales=bad)
    with pytest.raises(ValueError, match="tensor_scales: .* for 2 matrices"):
        expand_values(codes.expand(2, 128, 128), scales.expand(2, 128, 16), tensor_scales=(amax, amax, schedule))



def test_gemm_launch_arguments_are_validated():
    """The GEMM launch refuses dprob partials sized for another N tile, and the BF16 backend's kernel for packed
    operands, before anything runs (no kernel is launched: CPU tensors)."""
    from dataclasses import replace

    from te_fused_moe.backends.triton.nvfp4 import gemm
    from te_fused_moe.backends.triton.nvfp4.quantize import NVRows, NVWeight

    T, K, N, E = 256, 128, 128, 2
    u8 = lambda *size: torch.randint(0, 255, size, dtype=torch.uint8)
    a = NVRows(data=u8(T, K // 2), scale=u8(T, K // 16), amax=torch.rand(E + 1),
               values=torch.randn(T, K, dtype=torch.bfloat16))
    w = NVWeight(u8(E, 2 * N, K // 2), u8(E, 2 * N, K // 16), None, None, torch.rand(E),
                 values=torch.randn(E, 2 * N, K, dtype=torch.bfloat16))
    schedule = torch.zeros(64, dtype=torch.int32)
    cfg = gemm.default_config("dact", True)
    wrong = torch.empty(N // cfg.block_n + 1, T)
    with pytest.raises(ValueError, match=r"dprob: expected one row of partials per N tile"):
        gemm.launch("dact", a, w, N, schedule, E, c=torch.empty(T, 2 * N), c_up_offset=N, h=torch.empty(T, 2 * N),
                    h_up_offset=N, dprob=wrong, config=cfg)
    packed = replace(a, values=None)
    with pytest.raises(ValueError, match="config: bf16_kernel .* needs both operands as BF16 values"):
        gemm.launch("fc2", packed, w, N, schedule, E, c=torch.empty(T, N), config=replace(cfg, bf16_kernel=True))


def test_wgrad_steps_are_validated():
    """Half a slot per step needs both operands' BF16 values, and a step is a slot or half of one; refused before
    any launch (CPU tensors)."""
    from dataclasses import replace

    from te_fused_moe.backends.triton.nvfp4 import wgrad as W
    from te_fused_moe.backends.triton.nvfp4.quantize import NVRows

    T, N, K, E = 128, 128, 128, 2
    u8 = lambda *size: torch.randint(0, 255, size, dtype=torch.uint8)
    rows = lambda width: NVRows(data_t=u8(width, T // 2), scale_t=u8(T // 16, width), amax_t=torch.rand(E + 1))
    dw, schedule = torch.empty(E, N, K, dtype=torch.bfloat16), torch.zeros(64, dtype=torch.int32)
    half = replace(W.default_config(False), block_t=W.HALF_SLOT)
    with pytest.raises(ValueError, match=r"config: block_t=64 must be None or 128 .* or 64 \(half a slot\) with both "
                                         r"operands as BF16 values"):
        W.nv_grouped_wgrad(rows(N), rows(K), schedule, dw, config=half)
    with pytest.raises(ValueError, match="config: block_t=32 must be"):
        W.nv_grouped_wgrad(rows(N), rows(K), schedule, dw, config=replace(half, block_t=32))
