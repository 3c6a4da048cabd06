"""Run 21e (session 11), not part of the package: does a tile-contiguous columnwise layout make the columnwise copy as cheap as the rowwise one?"""
import os, statistics, sys
import torch, triton, triton.language as tl
sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "tests")]
from moe_reference import make_counts
from te_fused_moe.backends.triton.fp8_block import quantize as Q
from te_fused_moe.backends.triton.fp8_block.codec import block_scale, encode_fp8, nan_free_abs
from te_fused_moe.backends.triton.schedule import build_schedule, max_m_tiles, tile_rows, total_tiles


@triton.jit
def colwise_kernel(x_ptr, stride_xm, qt_ptr, stride_qtk, qts_ptr, stride_qtst, sched_ptr, K, value_for_inf, NUM_GROUPS,
                   MAX_M_TILES, TILED: tl.constexpr, MANT: tl.constexpr, EBIAS: tl.constexpr, FP8_MAX: tl.constexpr,
                   POW2: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    if pid_m >= total_tiles(sched_ptr, NUM_GROUPS):
        return
    _, row0, row_end = tile_rows(sched_ptr, pid_m, BM, NUM_GROUPS)
    rows = row0 + tl.arange(0, BM)
    col0 = pid_k * BK
    cols = col0 + tl.arange(0, BK)
    x = tl.load(x_ptr + row0.to(tl.int64) * stride_xm + col0 + (tl.arange(0, BM) * stride_xm)[:, None] + tl.arange(0, BK)[None, :],
                mask=(rows < row_end)[:, None], other=0.0).to(tl.float32)
    scale_c, inv_c = block_scale(tl.max(nan_free_abs(x), axis=0), FP8_MAX, POW2, value_for_inf)
    codes_c = tl.trans(encode_fp8(x * scale_c[None, :], MANT, EBIAS, FP8_MAX))
    if TILED:  # tile (pid_k, pid_m) owns 16 KB in one piece
        base = qt_ptr + (pid_k.to(tl.int64) * MAX_M_TILES + pid_m) * (BM * BK)
        ptrs = base + (tl.arange(0, BK) * BM)[:, None] + tl.arange(0, BM)[None, :]
    else:
        ptrs = qt_ptr + col0.to(tl.int64) * stride_qtk + pid_m * BM + (tl.arange(0, BK) * stride_qtk)[:, None] + tl.arange(0, BM)[None, :]
    tl.store(ptrs, codes_c)
    tl.store(qts_ptr + pid_m * stride_qtst + cols, inv_c)


T, K, E = 32768, 7168, 32
x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
counts = make_counts(T, E, "balanced", generator=torch.Generator().manual_seed(0)).cuda()
sched = build_schedule(counts, T, 128)
mt = max_m_tiles(T, E, 128)
qt = torch.empty(K, 128 * mt, device="cuda", dtype=torch.uint8)
qts = torch.empty(mt, K, device="cuda", dtype=torch.float32)
spec = Q.FP8Spec()

def launch(tiled):
    colwise_kernel[(mt, K // 128)](x, x.stride(0), qt, qt.stride(0), qts, qts.stride(0), sched, K, 3.4e38, E + 1, mt,
                                   TILED=tiled, **spec.constexprs(), BM=128, BK=128, num_warps=8, maxnreg=128)

fns = {"pass_row_col": lambda: Q.quantize_rows(x, sched, E, spec, rowwise=True, colwise=True),
       "pass_row_only": lambda: Q.quantize_rows(x, sched, E, spec, rowwise=True, colwise=False),
       "pass_col_only": lambda: Q.quantize_rows(x, sched, E, spec, rowwise=False, colwise=True),
       "col_kernel_strided": lambda: launch(False),
       "col_kernel_tiled": lambda: launch(True)}
launch(False); ref = qt.clone(); Q_ = Q.quantize_rows(x, sched, E, spec, rowwise=False, colwise=True)
print("strided col kernel == pass's data_t on written slots:", bool(torch.equal(ref[:, :128 * 280], Q_.data_t.view(torch.uint8)[:, :128 * 280])))
times = {n: [] for n in fns}
for r in range(5):
    for n, f in fns.items():
        f(); torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(20):
            f()
        e.record(); torch.cuda.synchronize()
        times[n].append(s.elapsed_time(e) / 20)
for n in fns:
    print(f"{n:22s} {statistics.median(times[n]):.3f} ms  rounds {[round(t, 3) for t in times[n]]}")
