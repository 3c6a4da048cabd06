"""Run 21 (session 11): the FP8 block quantize pass under engines / work orders / stages (interleaved rounds)."""
import json, os, statistics, sys
import torch
sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "tests")]
from moe_reference import make_counts
from te_fused_moe.backends.triton.fp8_block import quantize as Q
from te_fused_moe.backends.triton.schedule import build_schedule

T, K, E = 32768, 7168, 32
x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
counts = make_counts(T, E, "balanced", generator=torch.Generator().manual_seed(0)).cuda()
sched = build_schedule(counts, T, 128)
spec = Q.FP8Spec()
configs = {"triton": dict(engine="triton")}
for g, st, c in ((16, 2, 2), (1, 2, 2), (16, 3, 1)):
    configs[f"gluon_g{g}_s{st}_c{c}"] = dict(engine="gluon", GROUP_M=g, STAGES=st, CTAS=c)
configs["triton_row_only"] = dict(engine="triton", colwise=False)
configs["gluon_row_only"] = dict(engine="gluon", colwise=False)
configs["triton_col_only"] = dict(engine="triton", rowwise=False)
configs["gluon_col_only"] = dict(engine="gluon", rowwise=False)

def call(cfg):
    Q.QUANTIZE_GLUON_GROUP_M = cfg.get("GROUP_M", 16)
    Q.QUANTIZE_GLUON_STAGES = cfg.get("STAGES", 2)
    Q.QUANTIZE_GLUON_CTAS_PER_SM = cfg.get("CTAS", 2)
    return Q.quantize_rows(x, sched, E, spec, rowwise=cfg.get("rowwise", True), colwise=cfg.get("colwise", True),
                           engine=cfg["engine"])

ref = call(configs["triton"])
times = {n: [] for n in configs}
for n, cfg in configs.items():  # compile + count differing rowwise bytes
    out = call(cfg)
    if out.data is not None:
        print(n, "rowwise bytes differing from triton:", int((out.data.view(torch.uint8) != ref.data.view(torch.uint8)).sum()), flush=True)
for r in range(5):
    for n, cfg in configs.items():
        call(cfg); torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(20):
            call(cfg)
        e.record(); torch.cuda.synchronize()
        times[n].append(s.elapsed_time(e) / 20)
res = {}
for n, cfg in configs.items():
    ms = statistics.median(times[n])
    nbytes = T * K * 2 + T * K * (int(cfg.get("rowwise", True)) + int(cfg.get("colwise", True)))
    res[n] = dict(ms=ms, tbps=nbytes / ms / 1e9, rounds=times[n])
    print(f"{n:28s} {ms:.3f} ms  {nbytes / ms / 1e9:.2f} TB/s")
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "qbench.json"), "w"), indent=1)
