"""Where ``wgmma_ws.RING_SCALES`` dies (run 32-33: "illegal instruction" on the GPU, nothing wrong in the
offline sm_90a build): the plain FP8 block GEMM, forward orientation, E4M3, one problem, run in a fresh
process per variant (an illegal instruction ends the CUDA context), CUDA_LAUNCH_BLOCKING=1:

- ``loads``: RING_SCALES off (the control);
- ``ring``: RING_SCALES on, as shipped;
- ``ring_no_smem_reads``: on, but the consumers take constant scales instead of reading the stage's
  (``wgmma_gemm._ring_scales`` swapped for a Gluon function with no shared-memory read): survives if
  the consumers' reads are what dies, dies if the producer's TMA copies are;
- ``ring_rows_only`` / ``ring_scalar_only``: the consumers read one of the two scale buffers, the other
  a constant;
- ``ring_scalar_box_on_rows``: the scalar's descriptor made over the row scales (the tensor whose TMA load
  runs) with the scalar's box: dies if the box or the second copy per stage is what fails, runs if the
  weight scales' tensor is (its numbers are then wrong: only the exit code counts);
- ``ring_scalar_box128``: the scalar's box 128 scales wide, as the row scales' is.

Run 34 (H100): ``ring`` and every variant above die at the scalar's TMA copy (compute-sanitizer:
illegal instruction). The producer's copies (``wgmma_ws._copy_stage_scales`` swapped), run 35:

- ``ring_rows_copy_only`` / ``ring_scalar_copy_only``: the producer copies one of the two scale tiles (the
  consumers read it, and a constant for the other): which copy dies alone, if either;
- ``ring_scalar_copy_first``: the scalar's copy issued before the row scales': does the fault follow the
  copy or its place (the stage's second scale copy);
- ``ring_rows_copied_twice``: the row scales' very copy (its descriptor, its coordinates) issued a second
  time into the scalar's buffer (made as wide): dies if a second copy or that buffer is the fault.

Run 35a (H200): all four die, the row scales' copy alone too: no scale copy works in this kernel, though
the wgrad's producer copies its FP32 column scales the same way. So, without any scale copy (the
consumers reading constants):

- ``ring_no_copies``: RING_SCALES on, the producer expecting only A's and B's bytes: dies if the fault
  is not a TMA copy at all (the ring's extra buffers, the consumers' RING_SCALES path);
- ``ring_fence_only``: as ``ring_no_copies`` plus the proxy fence before the stage's refill;
- ``ring_rows_copy_no_fence``: the row scales' copy alone, without that fence.

Run 36a (H100): ``ring_no_copies`` and ``ring_fence_only`` run, ``ring_rows_copy_no_fence`` dies: the TMA
copy of the scales itself faults.

At K = 512 (RING_DEBUG_KS: a comma list). A measurement tool, not a test: prints and saves each
variant's exit code, its last stderr line and whether its output matched ``loads``.

  usage: python scripts/probe_ring_debug.py [--out DIR]       (a GPU)
         python scripts/probe_ring_debug.py --variant NAME --k K  (one case; what the parent runs)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from probe_results import write_and_print
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from te_fused_moe.backends.triton.fp8_block import gluon_names as G, wgmma_gemm as W

VARIANTS = ["loads", "ring", "ring_no_smem_reads", "ring_rows_only", "ring_scalar_only", "ring_scalar_box_on_rows",
            "ring_scalar_box128", "ring_rows_copy_only", "ring_scalar_copy_only", "ring_scalar_copy_first",
            "ring_rows_copied_twice", "ring_no_copies", "ring_fence_only", "ring_rows_copy_no_fence"]
COPY_VARIANTS = VARIANTS[7:]
# the variants the parent runs (RING_DEBUG_VARIANTS: a comma list; run 36a: the controls and the last three)
RUN = os.environ.get("RING_DEBUG_VARIANTS", ",".join(["loads", "ring"] + VARIANTS[11:])).split(",")
KS = [int(k) for k in os.environ.get("RING_DEBUG_KS", "512").split(",")]  # K values the parent runs
COUNTS = [0, 0, 0, 130, 1, 0, 0, 0, 0, 128, 300, 0, 1, 257, 0, 0]


# which of the stage's two scale buffers _some_ring_scales reads (set before the first compile)
READ_ROWS = gl.constexpr(False)
READ_SCALAR = gl.constexpr(False)


@gluon.jit
def _constant_ring_scales(ring, j, mma: gl.constexpr, NUM_STAGES: gl.constexpr, BAND: gl.constexpr,
                          BANDS: gl.constexpr):
    BLOCK_M: gl.constexpr = ring[2].shape[1] // BANDS
    return gl.full([BLOCK_M, 1], 1.0, gl.float32, mma), gl.full([1, 1], 1.0, gl.float32, mma)


@gluon.jit
def _some_ring_scales(ring, j, mma: gl.constexpr, NUM_STAGES: gl.constexpr, BAND: gl.constexpr, BANDS: gl.constexpr):
    BLOCK_M: gl.constexpr = ring[2].shape[1] // BANDS
    stage = W.ring_slot(j, NUM_STAGES)[0]
    if READ_ROWS:
        rows = ring[6].index(stage).permute((1, 0)).slice(BAND * BLOCK_M, BLOCK_M).load(mma)
    else:
        rows = gl.full([BLOCK_M, 1], 1.0, gl.float32, mma)
    if READ_SCALAR:
        scalar = ring[9].index(stage).slice(0, 1, dim=1).load(mma)
    else:
        scalar = gl.full([1, 1], 1.0, gl.float32, mma)
    return rows, scalar


# which scale tile _copy_one copies, and whether it and _copy_none fence first (set before the first compile)
COPY_SCALAR = gl.constexpr(False)
FENCE = gl.constexpr(True)


@gluon.jit
def _copy_one(ring, stage, blk, a_row, b_block_row, nbytes: gl.constexpr):
    bar = ring[4].index(stage)
    if FENCE:
        fence_async_shared()
    if COPY_SCALAR:
        mbarrier.expect(bar, nbytes + ring[8].block_type.nbytes)
        G.tma_load(ring[8], [b_block_row, blk], bar, ring[9].index(stage))
    else:
        mbarrier.expect(bar, nbytes + ring[5].block_type.nbytes)
        G.tma_load(ring[5], [blk, a_row], bar, ring[6].index(stage))


@gluon.jit
def _copy_scalar_first(ring, stage, blk, a_row, b_block_row, nbytes: gl.constexpr):
    cs_desc, ws_desc, bar = ring[5], ring[8], ring[4].index(stage)
    fence_async_shared()
    mbarrier.expect(bar, nbytes + cs_desc.block_type.nbytes + ws_desc.block_type.nbytes)
    G.tma_load(ws_desc, [b_block_row, blk], bar, ring[9].index(stage))
    G.tma_load(cs_desc, [blk, a_row], bar, ring[6].index(stage))


@gluon.jit
def _copy_rows_twice(ring, stage, blk, a_row, b_block_row, nbytes: gl.constexpr):
    cs_desc, bar = ring[5], ring[4].index(stage)
    fence_async_shared()
    mbarrier.expect(bar, nbytes + 2 * cs_desc.block_type.nbytes)
    G.tma_load(cs_desc, [blk, a_row], bar, ring[6].index(stage))
    G.tma_load(cs_desc, [blk, a_row], bar, ring[9].index(stage))


@gluon.jit
def _copy_none(ring, stage, blk, a_row, b_block_row, nbytes: gl.constexpr):
    if FENCE:
        fence_async_shared()
    mbarrier.expect(ring[4].index(stage), nbytes)


def _swap_copies(variant: str) -> None:
    """Replaces ``wgmma_ws._copy_stage_scales`` (and the consumers' reads to match) for the copy variants."""
    from te_fused_moe.backends.triton.fp8_block import wgmma_ws

    global READ_ROWS, READ_SCALAR, COPY_SCALAR, FENCE
    COPY_SCALAR = gl.constexpr(variant == "ring_scalar_copy_only")
    FENCE = gl.constexpr(variant not in ("ring_rows_copy_no_fence", "ring_no_copies"))
    READ_ROWS = gl.constexpr(variant in ("ring_rows_copy_only", "ring_scalar_copy_first", "ring_rows_copied_twice",
                                         "ring_rows_copy_no_fence"))
    READ_SCALAR = gl.constexpr(variant in ("ring_scalar_copy_only", "ring_scalar_copy_first"))
    W._ring_scales = _some_ring_scales
    wgmma_ws._copy_stage_scales = {"ring_rows_copy_only": _copy_one, "ring_scalar_copy_only": _copy_one,
                                   "ring_scalar_copy_first": _copy_scalar_first,
                                   "ring_rows_copied_twice": _copy_rows_twice, "ring_no_copies": _copy_none,
                                   "ring_fence_only": _copy_none, "ring_rows_copy_no_fence": _copy_one}[variant]
    if variant == "ring_rows_copied_twice":  # the scalar's "descriptor" is the row scales': its buffer as wide
        shipped = W.ring_scale_descriptors

        def descriptors(a_scale, b_scale, b_rows):
            descs = shipped(a_scale, b_scale, b_rows)
            return None if descs is None else (descs[0], descs[0])

        W.ring_scale_descriptors = descriptors


def _swap_ring_reads(variant: str) -> None:
    """Replaces ``wgmma_gemm._ring_scales`` for the variants that drop one or both shared-memory reads."""
    global READ_ROWS, READ_SCALAR, COPY_SCALAR, FENCE
    COPY_SCALAR = gl.constexpr(variant == "ring_scalar_copy_only")
    FENCE = gl.constexpr(variant not in ("ring_rows_copy_no_fence", "ring_no_copies"))
    READ_ROWS = gl.constexpr(variant == "ring_rows_only")
    READ_SCALAR = gl.constexpr(variant == "ring_scalar_only")
    W._ring_scales = _constant_ring_scales if variant == "ring_no_smem_reads" else _some_ring_scales


def _swap_scalar_descriptor(variant: str) -> None:
    """Replaces ``wgmma_gemm.ring_scale_descriptors`` for the variants that change the scalar's descriptor."""
    shipped = W.ring_scale_descriptors
    unswizzled = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)

    def descriptors(a_scale, b_scale, b_rows):
        descs = shipped(a_scale, b_scale, b_rows)
        if descs is None:
            return None
        if variant == "ring_scalar_box_on_rows":
            return descs[0], W._tma_descriptor(a_scale.t(), [1, W.SCALAR_BOX], unswizzled)
        flat_b = b_scale.view(b_scale.shape[0] * b_scale.shape[1], b_scale.shape[2])
        return descs[0], W._tma_descriptor(flat_b, [1, W.BM], unswizzled)

    W.ring_scale_descriptors = descriptors


def one_case(variant: str, k: int) -> None:
    import torch

    from te_fused_moe.backends.triton.fp8_block import gemm, quantize as Q, wgmma_ws
    from te_fused_moe.backends.triton.schedule import build_schedule

    wgmma_ws.RING_SCALES = variant != "loads"
    if variant in COPY_VARIANTS:
        _swap_copies(variant)
    elif variant.startswith("ring_scalar_box"):
        _swap_scalar_descriptor(variant)
    elif variant not in ("loads", "ring"):
        _swap_ring_reads(variant)
    g = torch.Generator().manual_seed(70)
    counts = torch.tensor(COUNTS, dtype=torch.int32)
    T, N, E = int(counts.sum()) + 7, 384, len(COUNTS)
    spec = Q.FP8Spec.of("e4m3", True)
    a = (torch.randn(T, k, generator=g)).cuda().bfloat16()
    w = (torch.randn(E, N, k, generator=g) * 0.05).cuda().bfloat16()
    counts = counts.cuda()
    sched = build_schedule(counts, T, 128)
    aq = Q.quantize_rows(a, sched, E, spec, rowwise=True)
    wq = Q.quantize_weight(w, spec, transposed=False)
    c = torch.full((T, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    gemm.launch("fc2", aq.data, aq.scale, wq.data, wq.scale, N, sched, E, Q.FP8Spec(), c=c)
    torch.cuda.synchronize()
    torch.save(c.cpu(), f"/tmp/ring_debug_{variant}_{k}.pt")
    print("ok", variant, k)


def run_all() -> dict:
    import torch

    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    out = {}
    for k in KS:
        for variant in RUN:
            p = subprocess.run([sys.executable, __file__, "--variant", variant, "--k", str(k)], env=env,
                               capture_output=True, text=True, timeout=300)
            lines = [l for l in (p.stderr + p.stdout).splitlines() if l.strip()]
            entry = {"rc": p.returncode, "last": lines[-1][-300:] if lines else ""}
            path = f"/tmp/ring_debug_{variant}_{k}.pt"
            if p.returncode == 0 and variant != "loads" and os.path.exists(f"/tmp/ring_debug_loads_{k}.pt"):
                ref, got = torch.load(f"/tmp/ring_debug_loads_{k}.pt"), torch.load(path)
                entry["equal_to_loads"] = bool(torch.equal(ref, got))
                entry["nan"] = int(got.isnan().sum())
            out[f"{variant}_k{k}"] = entry
            print(variant, k, entry, flush=True)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--variant", choices=VARIANTS)
    parser.add_argument("--k", type=int, default=512)
    args = parser.parse_args()
    if args.variant:
        one_case(args.variant, args.k)
    else:
        write_and_print(run_all(), args.out, "probe_ring_debug.json")
