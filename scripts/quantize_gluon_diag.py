"""Run 21 (session 11): where the Gluon quantize pass differs from the Triton one at DSv3 size."""
import os, sys
import torch
sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "tests")]
from moe_reference import make_counts
from te_fused_moe.backends.triton.fp8_block import quantize as Q, wgmma_gemm as W
from te_fused_moe.backends.triton.schedule import build_schedule

def run(T, K, E, grid=None, group=16, stages=3, ctas=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=g).to(torch.bfloat16).cuda()
    counts = make_counts(T, E, "balanced", generator=g).cuda()
    sched = build_schedule(counts, T, 128)
    Q.QUANTIZE_GLUON_GROUP_M, Q.QUANTIZE_GLUON_STAGES, Q.QUANTIZE_GLUON_CTAS_PER_SM = group, stages, ctas
    orig = W.persistent_grid
    if grid:
        W.persistent_grid = lambda tiles, device, c: min(tiles, grid)
    try:
        a = Q.quantize_rows(x, sched, E, Q.FP8Spec(), rowwise=True, colwise=True, engine="gluon")
    finally:
        W.persistent_grid = orig
    b = Q.quantize_rows(x, sched, E, Q.FP8Spec(), rowwise=True, colwise=True, engine="triton")
    torch.cuda.synchronize()
    bad = (a.data.view(torch.uint8) != b.data.view(torch.uint8))
    sbad = (a.scale.contiguous().view(torch.int32) != b.scale.contiguous().view(torch.int32))
    rows = bad.any(1).nonzero().flatten()
    cols = bad.any(0).nonzero().flatten()
    print(f"T={T} K={K} E={E} grid={grid} group={group} stages={stages} ctas={ctas}: data bad {int(bad.sum())} "
          f"rows {rows.numel()} ({rows[:6].tolist()}) col blocks {sorted(set((cols // 128).tolist()))[:12]} "
          f"scale bad {int(sbad.sum())}", flush=True)

run(1024, 1024, 4)
run(1024, 1024, 4, grid=1)
run(1024, 1024, 4, grid=3)
run(4096, 2048, 8)
run(4096, 2048, 8, grid=7)
run(32768, 7168, 32, group=1)
run(32768, 7168, 32, group=16)
run(32768, 7168, 32, ctas=1)
run(32768, 7168, 32, stages=3, ctas=1)
run(32768, 7168, 32, grid=132)
