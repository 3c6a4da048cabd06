"""Where the Gluon FP8 block wgrad's time goes: ablations of its per-block promotion (a measurement
tool: the ablations but ``col_then_row`` compute wrong dw on purpose).

Each variant runs in its own process (a Gluon kernel's dependencies are fixed at its first compile),
with ``wgmma_gemm``'s promotion helpers replaced before the first launch:
- ``base``: the kernel as it ships. (Run 24's ``scales_first``, a second mainloop with one wgmma in
  flight and the scales' outer product formed under it, measured the same and was not kept: commit
  3ba001f.)
- ``col_then_row``: ``base`` with each partial product scaled by its column scales first, then FMA'd
  with the row scales (as many FP32 ops; fewer register reads: each column scale serves two rows, each
  row scale 32 columns); the same dw where the scales are powers of two (the recipe's default).
- ``factor_by_fma``: ``base`` with each element's factor (row scale x column scale) formed by an FFMA
  adding -0.0 instead of an FMUL: the same bits (``a * b + -0.0 == a * b`` in every case, signed zeros
  included), so a promotion is one run of 128 FFMAs per thread per block instead of 64 FMULs + 64 FFMAs.
  ptxas >= 12.9 interleaves yield hints into FFMA runs only (offline sm_90a, CUDA 13.0: 339 of the
  default wgrad's 640 FFMAs yield, none of its 640 FMULs): under ``--ptxas toolkit`` this variant lets
  the scheduler switch warps over the whole promotion, not half of it.
- ``row_scale_only``: no column scales (no shared-memory loads of them, one FFMA per element, as the
  plain GEMM).
- ``add_only``: no scales at all (acc + part, one FADD per element). The row scales' loads stay in the
  source but ptxas drops them, unused: the mainloop of a GEMM summing its 128-token partial products.
Timed at DSv3's w1 and w2 wgrads (T routed rows over E experts; w1: N = 4096, K = 7168; w2: N = 7168,
K = 2048), and w1 with E = 2 (128 token blocks per tile instead of 8) to separate per-tile costs from
per-block ones. ``--ptxas triton,toolkit`` runs each variant once per ptxas (``TE_FUSED_MOE_PTXAS``,
see ``te_fused_moe/backends/triton/ptxas.py``): the toolkit's interleaves the promotions' FFMA yield
hints; dw must stay bitwise the same.

  usage: python scripts/probe_wgrad.py [--out DIR] [--variants A,B] [--ptxas S1,S2]   (each in a subprocess)
         python scripts/probe_wgrad.py --variant NAME [--shape S] [--once | --spin SECONDS]   (one, prints JSON)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from probe_results import write_and_print
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from te_fused_moe.backends.triton.fp8_block import wgmma_gemm as W

VARIANTS = ("base", "col_then_row", "factor_by_fma", "row_scale_only", "add_only")
SHAPES = {"dsv3_w1_e32": (32768, 32, 4096, 7168), "dsv3_w2_e32": (32768, 32, 7168, 2048),
          "w1_e2": (32768, 2, 4096, 7168)}


SHIPPED_RETIRE, SHIPPED_PROMOTE = W._retire, W._promote  # before _patch rebinds them


@gluon.jit
def retire_without_col_scales(ring, token, outstanding: gl.constexpr, j, NUM_STAGES: gl.constexpr,
                              OUTER: gl.constexpr):
    return SHIPPED_RETIRE(ring, token, outstanding, j, NUM_STAGES, False)


@gluon.jit
def promote_by_row(acc, part, row_scale, col_scale, OUTER: gl.constexpr):
    return SHIPPED_PROMOTE(acc, part, row_scale, col_scale, False)


@gluon.jit
def promote_col_then_row(acc, part, row_scale, col_scale, OUTER: gl.constexpr):
    scaled = gl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", list(gl.broadcast(part, col_scale)),
                                       dtype=gl.float32, is_pure=False, pack=1)
    return SHIPPED_PROMOTE(acc, scaled, row_scale, col_scale, False)


@gluon.jit
def promote_factor_by_fma(acc, part, row_scale, col_scale, OUTER: gl.constexpr):
    rows, cols = gl.broadcast(row_scale, col_scale)
    factor = gl.inline_asm_elementwise("fma.rn.f32 $0, $1, $2, 0f80000000;", "=r,r,r", [rows, cols],
                                       dtype=gl.float32, is_pure=True, pack=1)
    return gl.inline_asm_elementwise("fma.rn.f32 $0, $1, $2, $3;", "=r,r,r,r", [part, factor, acc], dtype=gl.float32,
                                     is_pure=False, pack=1)


@gluon.jit
def promote_by_add(acc, part, row_scale, col_scale, OUTER: gl.constexpr):
    return gl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=r,r,r", [part, acc], dtype=gl.float32,
                                     is_pure=False, pack=1)


def _patch(variant: str) -> None:
    """Replaces the promotion helpers of ``wgmma_gemm`` that the wgrad's consumers call."""
    if variant == "base":
        return
    if variant in ("col_then_row", "factor_by_fma"):
        W._promote = promote_col_then_row if variant == "col_then_row" else promote_factor_by_fma
        return
    W._retire = retire_without_col_scales
    W._promote = promote_by_row if variant == "row_scale_only" else promote_by_add


def _operands(routed: int, experts: int, n: int, k: int):
    """Columnwise FP8 block copies of random g [routed, n] and x [routed, k] (BF16) over equal expert
    counts, their schedule and a BF16 dw."""
    import torch

    from te_fused_moe.bench_recipes import recipe_kernels
    from te_fused_moe.backends.triton.schedule import build_schedule

    torch.manual_seed(0)  # the same operands in every variant's process: dw_bits compare across them
    kernels, spec = recipe_kernels("fp8_block")
    counts = torch.full((experts,), routed // experts, dtype=torch.int32, device="cuda")
    sched = build_schedule(counts, routed, kernels.tile)
    g = torch.randn(routed, n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(routed, k, device="cuda", dtype=torch.bfloat16)
    cols = lambda t: kernels.quantize_rows(t, sched, experts, spec, rowwise=False, colwise=True)
    gq, xq = cols(g), cols(x)
    dw = torch.empty(experts, n, k, device="cuda", dtype=torch.bfloat16)
    return kernels, gq, xq, sched, dw


def run_variant(variant: str, shapes=tuple(SHAPES), once: bool = False, spin: float = 0.0) -> dict:
    """Times ``variant`` at ``shapes``; ``once``: one launch each, untimed (for a profiler); ``spin``:
    launches back to back for that many seconds each, untimed (to sample clocks and power meanwhile)."""
    import torch

    from te_fused_moe.bench import do_bench_ms

    _patch(variant)
    out = {}
    for name in shapes:
        routed, experts, n, k = SHAPES[name]
        kernels, gq, xq, sched, dw = _operands(routed, experts, n, k)
        fn = lambda: kernels.grouped_wgrad(gq, xq, sched, dw)
        fn()
        if once:
            continue
        if spin:
            import time

            end, launches = time.time() + spin, 0
            while time.time() < end:
                for _ in range(20):
                    fn()
                torch.cuda.synchronize()
                launches += 20
            out[name] = {"launches": launches, "seconds": spin}
            continue
        ms = do_bench_ms(fn)
        # an exact fingerprint of dw's bits (``main`` compares it with base's: col_then_row must match)
        weights = (torch.arange(dw.numel(), device=dw.device, dtype=torch.int32) % 7 + 1).view_as(dw)
        bits = int(dw.view(torch.int16).to(torch.int32).mul_(weights).sum(dtype=torch.int64))
        out[name] = {"ms": round(ms, 4), "tflops": round(2.0 * routed * n * k / ms / 1e9, 1), "dw_bits": bits}
    from te_fused_moe.backends.triton.ptxas import in_use

    used = in_use()
    out["ptxas"] = f"{used.path} ({used.version})"
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", choices=VARIANTS)
    p.add_argument("--shape", choices=sorted(SHAPES), help="with --variant: this shape only")
    p.add_argument("--once", action="store_true", help="with --variant: one untimed launch per shape (profiling)")
    p.add_argument("--spin", type=float, default=0.0,
                   help="with --variant: launch back to back for this many seconds per shape (nvidia-smi meanwhile)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="without --variant: these, comma-separated")
    p.add_argument("--ptxas", default="triton",
                   help="without --variant: TE_FUSED_MOE_PTXAS settings, comma-separated, each variant under each")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args.variant, (args.shape,) if args.shape else tuple(SHAPES), args.once,
                                     args.spin)))
        return
    variants = [v for v in args.variants.split(",") if v]
    settings = [s for s in args.ptxas.split(",") if s]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        p.error(f"--variants: expected names from {', '.join(VARIANTS)}, got {', '.join(unknown)}")
    from te_fused_moe.backends.triton.ptxas import triton_env

    triton_var = triton_env()  # TRITON_PTXAS_PATH in Triton 3.6
    results = {}
    for setting in settings:
        for variant in variants:
            key = first = variant if len(settings) == 1 else f"{variant}@{setting}"
            for repeat in range(2, len(settings) + 1):  # a setting named twice: its variants run again
                if key not in results:
                    break
                key = f"{first}#{repeat}"
            # each child chooses its own ptxas: none inherits the variable a choice here exported
            env = {k: v for k, v in os.environ.items() if k != triton_var}
            proc = subprocess.run([sys.executable, __file__, "--variant", variant], capture_output=True, text=True,
                                  env=dict(env, TE_FUSED_MOE_PTXAS=setting))
            if proc.returncode:
                results[key] = {"error": proc.stderr[-2000:]}
            else:
                results[key] = json.loads(proc.stdout.strip().splitlines()[-1])
            print(key, json.dumps(results[key])[:400], flush=True)
    # ratios and dw against base (under the first ptxas setting)
    base = results.get("base" if len(settings) == 1 else f"base@{settings[0]}", {})
    for variant, res in results.items():
        for shape, r in res.items():
            if isinstance(r, dict) and shape in base:
                r["vs_base"] = round(base[shape]["ms"] / r["ms"], 3)
                r["dw_as_base"] = r["dw_bits"] == base[shape]["dw_bits"]
    write_and_print(results, args.out, "probe_wgrad.json")


if __name__ == "__main__":
    main()
