"""MXFP8's weight expansions and the weight cache's refresh at DSv3 E = 32, against a copy of the same bytes.

The expansions (``quantize.expand_values`` of w1 [32, 4096, 7168], w2 [32, 7168, 2048] and their transposed copies:
3.2 ms of every forward + backward, fused and unfused alike, run 31) at the shipped launch and a few others. A
measurement tool, not a test: every variant's output is compared bit for bit with the shipped one's. Run 40a (H100):
the shipped launch at 88% of the copy rate, every other launch slower.

Variants (``BLK`` rows and columns per program, warps): the shipped kernel (128 x 128, 8 warps) and at 4 warps;
``rows3d``: a probe-only kernel that loads each row's codes as [rows, blocks of 32, 32] so that the E8M0 scale
broadcasts along the last axis without a reshape of the tile (offline sm_90a: 6.4 against 7.4 instructions per
element, both within what the bytes allow: this asks whether the launch or the layout leaves bandwidth unused).

The refresh (``quantize.quantize_weight``, once per optimizer step, and every replay of a captured CUDA graph), with
the GB/s of the bytes it moves (BF16 read, two FP8 copies written). Run 40h (H100) timed the kernel of then (the whole
tile by 3-D reshapes) at 6.08 ms and the chunked one, shipped since, at 3.31, the same bytes.

  usage: python scripts/probe_mx_expand.py [--out DIR]
"""

from __future__ import annotations

import triton
import triton.language as tl

from probe_results import run_and_save
from te_fused_moe.backends.triton.mxfp8.codec import mx_dequant_scale

EXPERTS, HIDDEN, FFN = 32, 7168, 2048


@triton.jit
def rows3d_kernel(q_ptr, stride_qe, stride_qr, s_ptr, stride_se, stride_sr, stride_sb, v_ptr, stride_ve, stride_vr,
                  ROWS, BR: tl.constexpr, BC: tl.constexpr):
    """``expand_kernel``'s values, the codes loaded as [BR, BC / 32, 32] (the scale's broadcast axis last)."""
    e = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BR + tl.arange(0, BR)
    blocks = tl.program_id(2) * (BC // 32) + tl.arange(0, BC // 32)
    cols = blocks[None, :, None] * 32 + tl.arange(0, 32)[None, None, :]
    rows64 = rows.to(tl.int64)
    ok = (rows < ROWS)[:, None, None]
    codes = tl.load(q_ptr + e * stride_qe + rows64[:, None, None] * stride_qr + cols, mask=ok, other=0.0)
    sc = tl.load(s_ptr + e * stride_se + rows64[:, None] * stride_sr + blocks[None, :] * stride_sb,
                 mask=(rows < ROWS)[:, None], other=127)
    values = codes.to(tl.float32) * mx_dequant_scale(sc)[:, :, None]
    tl.store(v_ptr + e * stride_ve + rows64[:, None, None] * stride_vr + cols, values.to(tl.bfloat16), mask=ok)


def launch(kind: str, data, scale, out, blk: int, warps: int) -> None:
    e, rows, cols = data.shape
    if kind == "shipped":
        from te_fused_moe.backends.triton.mxfp8.quantize import expand_kernel

        expand_kernel[(e, triton.cdiv(rows, blk), cols // blk)](
            data, data.stride(0), data.stride(1), scale, scale.stride(0), scale.stride(1), scale.stride(2),
            out, out.stride(0), out.stride(1), rows, UPCAST=False, BLK=blk, num_warps=warps)
    else:
        rows3d_kernel[(e, triton.cdiv(rows, blk), cols // blk)](
            data, data.stride(0), data.stride(1), scale, scale.stride(0), scale.stride(1), scale.stride(2),
            out, out.stride(0), out.stride(1), rows, BR=blk, BC=blk, num_warps=warps)


VARIANTS = [("shipped", 128, 8), ("shipped", 128, 4), ("shipped", 64, 4), ("rows3d", 128, 8), ("rows3d", 64, 4)]


def run() -> dict:
    import torch

    from te_fused_moe.backends.triton.mxfp8 import quantize as Q
    from te_fused_moe.bench import do_bench_ms

    torch.manual_seed(0)
    out = {"shape": [EXPERTS, HIDDEN, FFN], "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    spec = Q.MXSpec()
    total = {}
    for name, (n, k) in {"w1": (2 * FFN, HIDDEN), "w2": (HIDDEN, FFN)}.items():
        w = torch.randn(EXPERTS, n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        q = Q.quantize_weight(w, spec, transposed=True)
        del w
        for layout, (data, scale) in {"rows": (q.data, q.scale), "t": (q.data_t, q.scale_t)}.items():
            shipped = Q.expand_values(data, scale)
            moved = data.numel() * 3  # FP8 read, BF16 written (scales: 1/32 of a byte per element, not counted)
            src = torch.empty(moved // 2, device="cuda", dtype=torch.uint8)
            dst = torch.empty_like(src)
            copy_ms = do_bench_ms(lambda: dst.copy_(src))  # moves the same bytes: read + write of moved / 2
            entry = {"copy_ms": round(copy_ms, 4), "copy_GB/s": round(moved / copy_ms / 1e6)}
            for kind, blk, warps in VARIANTS:
                res = torch.empty_like(shipped)
                launch(kind, data, scale, res, blk, warps)
                ms = do_bench_ms(lambda: launch(kind, data, scale, res, blk, warps))
                entry[f"{kind}_{blk}_{warps}w"] = {"ms": round(ms, 4), "GB/s": round(moved / ms / 1e6),
                                                  "of_copy": round(copy_ms / ms, 3),
                                                  "same": bool(torch.equal(res.view(torch.int16),
                                                                           shipped.view(torch.int16)))}
                total[f"{kind}_{blk}_{warps}w"] = total.get(f"{kind}_{blk}_{warps}w", 0.0) + ms
            total["copy"] = total.get("copy", 0.0) + copy_ms
            out[f"{name}_{layout}"] = entry
            del shipped
        del q
    # forward + backward expand each of the four once
    out["all_four_ms"] = {k: round(v, 4) for k, v in total.items()}
    out["refresh"] = refresh_times(spec)
    return out


def refresh_times(spec) -> dict:
    """ms of quantizing w1 and w2 (both copies) as the weight cache does."""
    import torch

    from te_fused_moe.backends.triton.mxfp8 import quantize as Q
    from te_fused_moe.bench import do_bench_ms

    out = {}
    for name, (n, k) in {"w1": (2 * FFN, HIDDEN), "w2": (HIDDEN, FFN)}.items():
        w = torch.randn(EXPERTS, n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        ms = do_bench_ms(lambda: Q.quantize_weight(w, spec))
        out[name] = {"ms": round(ms, 4), "GB/s": round(w.numel() * 4 / ms / 1e6)}  # BF16 read, two FP8 copies
    return out


if __name__ == "__main__":
    run_and_save(run, __doc__.splitlines()[0], "probe_mx_expand.json")
