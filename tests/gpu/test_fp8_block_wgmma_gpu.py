"""The Gluon FP8 block GEMMs (``fp8_block/wgmma_ws.py``: warp-specialised, the promotion under the next
wgmma) on the H200, against FP64 and bitwise against the Triton kernels they replace.

Run on the device machine: ``pytest -m gpu tests/gpu/test_fp8_block_wgmma_gpu.py -s``.

- Integer data in [-3, 3]: quantization is exact and every 128-block sum is a small integer (exact
  in the FP8 wgmma's reduced-precision accumulator), so every kernel must give exactly the BF16
  rounding of the FP64 product, over K = 1..16 blocks (the peeled first block, the two-block loop
  and the odd tail), empty experts, ragged counts and padding rows (zeros).
- Random data: vs FP64 on the dequantized operands, ``|out - ref| <= 2^-8 |ref| + 2^-9 (|A| @ |B|)``
  (BF16 output rounding; the wgmma's ~14-bit accumulation inside a 128-block), and bitwise equal to
  the Triton kernel (same 128-block partial sums, promoted in the same K order). Outputs are poisoned
  with NaN first; E4M3 and E5M2 A, with and without bias.
- No host syncs after the first launch (``set_sync_debug_mode("error")``).
- The wgrad kernel (``dw[e] = G_e^T X_e`` from the columnwise copies, token blocks restarting at each
  expert) the same ways: exact on integer data, and on random data vs FP64 on the dequantized copies
  (``2^-8 |ref| + 2^-9 (|G|^T |X|)``) and bitwise equal to the Triton wgrad; experts without tokens
  get zeros; the default tiles, 64x64 and 64x128 at 4 warps.
- Persistence: the producer partition walks the tiles ahead of the consumers, across tile
  boundaries; a grid forced down to 1-7 programs (many tiles each) must give the same exact results,
  with runs of empty experts and one-block experts in between, and so must 3 CTAs per SM.
- Engine labels: ``gluon`` (the default config: tiles stored by TMA; the plain GEMM and the wgrad
  in two consumer partitions, a warpgroup per half of each tile's rows), ``gluon-1`` (in one
  partition), ``gluon-no-tma`` (without the TMA store of their tiles), ``triton``. FP32 out too (the
  GEMMs of FC1 / the dGLU when their epilogues run alone).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from block_scaled_checks import no_host_syncs
from moe_reference import make_counts

pytestmark = pytest.mark.gpu


def _problem(T, K, N, E, fmt, integer, seed, routing="empty", padding=7, counts=None):
    from te_fused_moe.backends.triton.fp8_block import quantize as Q
    from te_fused_moe.backends.triton.schedule import build_schedule

    g = torch.Generator().manual_seed(seed)
    if integer:
        a = torch.randint(-3, 4, (T, K), generator=g).float()
        w = torch.randint(-3, 4, (E, N, K), generator=g).float()
    else:
        a = torch.randn(T, K, generator=g) * torch.rand(T, 1, generator=g) * 4
        w = torch.randn(E, N, K, generator=g) * 0.05
    counts = make_counts(T, E, routing, generator=g, padding=padding) if counts is None else counts
    sched = build_schedule(counts.cuda(), T, 128)
    aq = Q.quantize_rows(a.cuda().bfloat16(), sched, E, Q.FP8Spec.of(fmt, True), rowwise=True)
    wq = Q.quantize_weight(w.cuda().bfloat16(), Q.FP8Spec.of("e4m3", True), transposed=False)
    bias = (torch.randn(E, N, generator=g) * 0.1).cuda().bfloat16() if not integer else None
    return aq, wq, counts, sched, bias


def _reference(aq, wq, counts, bias):
    """FP64 per expert on the dequantized operands, and the |A| @ |B| bound term."""
    a = aq.data.double() * aq.scale.double().repeat_interleave(128, dim=1)
    w = wq.data.double() * wq.scale.double().repeat_interleave(128, dim=1).repeat_interleave(128, dim=2)
    ref = torch.zeros(a.shape[0], w.shape[1], dtype=torch.float64, device=a.device)
    mag = torch.zeros_like(ref)
    row = 0
    for e, n in enumerate(counts.tolist()):
        ref[row:row + n] = a[row:row + n] @ w[e].T + (bias[e].double() if bias is not None else 0)
        mag[row:row + n] = a[row:row + n].abs() @ w[e].abs().T
        row += n
    return ref, mag, row


PLAIN_GLUON = ("gluon", "gluon-1", "gluon-no-tma")
WGRAD_GLUON = ("gluon", "gluon-1", "gluon-no-tma")
# label -> (engine, config fields)
_PLAIN = {"triton": ("triton", {}), "gluon": ("gluon", {}), "gluon-1": ("gluon", dict(consumers=1)),
          "gluon-no-tma": ("gluon", dict(tma_store=False))}
_WGRAD = {"triton": ("triton", {}), "gluon": ("gluon", {}), "gluon-1": ("gluon", dict(consumers=1, num_stages=5)),
          "gluon-no-tma": ("gluon", dict(tma_store=False))}


def _run(label, aq, wq, counts, sched, bias, n, out_dtype=torch.bfloat16, **config):
    from te_fused_moe.backends.triton.fp8_block import gemm, quantize as Q

    engine, fields = _PLAIN[label]
    c = torch.full((aq.data.shape[0], n), float("nan"), device="cuda", dtype=out_dtype)
    cfg = dataclasses.replace(gemm.default_config("fc2"), plain_engine=engine, **{**fields, **config})
    gemm.launch("fc2", aq.data, aq.scale, wq.data, wq.scale, n, sched, counts.numel(), Q.FP8Spec(), c=c, bias=bias,
                config=cfg)
    return c


@pytest.mark.parametrize("k_blocks", [1, 2, 3, 4, 5, 16])
def test_exact_on_integer_data(k_blocks):
    aq, wq, counts, sched, _ = _problem(700, 128 * k_blocks, 256, 5, "e4m3", True, seed=k_blocks)
    ref, _, routed = _reference(aq, wq, counts, None)
    assert 0 in counts.tolist() and routed < 700
    for engine in PLAIN_GLUON + ("triton",):
        out = _run(engine, aq, wq, counts, sched, None, 256)
        bad = int((out[:routed] != ref[:routed].to(torch.bfloat16)).sum())
        pad = int((out[routed:] != 0).sum())  # also catches the NaN poison
        print("WGMMA_EXACT", engine, k_blocks, bad, pad)
        assert bad == 0 and pad == 0, (engine, k_blocks, bad, pad)


@pytest.mark.parametrize("k_blocks,fmt,with_bias,routing", [(16, "e4m3", True, "zipf"), (7, "e5m2", False, "empty"),
                                                           (32, "e5m2", True, "balanced"), (1, "e4m3", True, "one")])
def test_random_data_vs_fp64_and_triton(k_blocks, fmt, with_bias, routing):
    aq, wq, counts, sched, bias = _problem(1500, 128 * k_blocks, 384, 6, fmt, False, seed=10 + k_blocks,
                                           routing=routing)
    bias = bias if with_bias else None
    ref, mag, routed = _reference(aq, wq, counts, bias)
    errs, outs = {}, {}
    for engine in PLAIN_GLUON + ("triton",):
        out = outs[engine] = _run(engine, aq, wq, counts, sched, bias, 384)
        diff = (out[:routed].double() - ref[:routed]).abs()
        far = int((diff > 2.0 ** -8 * ref[:routed].abs() + 2.0 ** -9 * mag[:routed]).sum())
        errs[engine] = dict(far=far, nan=int(torch.isnan(out).sum()), pad=int((out[routed:] != 0).sum()),
                            rel=float(diff.norm() / ref[:routed].norm()))
    errs["bitwise_equal_fraction"] = float((outs["gluon"] == outs["triton"]).double().mean())
    print("WGMMA_RANDOM", k_blocks, fmt, json.dumps(errs))
    for engine in PLAIN_GLUON + ("triton",):
        e = errs[engine]
        assert e["far"] == 0 and e["nan"] == 0 and e["pad"] == 0, (engine, errs)
    # same tiles, same 128-block partial sums promoted in the same K order
    assert all(torch.equal(outs[label], outs["triton"]) for label in PLAIN_GLUON), errs


@pytest.mark.parametrize("routing", ["zipf", "balanced"])
def test_fp32_output_vs_fp64_and_triton(routing):
    """FP32 out (what the GEMMs of FC1 / the dGLU write when their epilogues run alone): a 64 KB staging
    tile per TMA store, whole tiles by TMA, an expert's last tile read back and stored masked."""
    aq, wq, counts, sched, _ = _problem(1100, 128 * 5, 256, 5, "e4m3", False, seed=41, routing=routing)
    ref, mag, routed = _reference(aq, wq, counts, None)
    outs = {label: _run(label, aq, wq, counts, sched, None, 256, torch.float32) for label in PLAIN_GLUON + ("triton",)}
    for label, out in outs.items():
        diff = (out[:routed].double() - ref[:routed]).abs()
        far = int((diff > 2.0 ** -16 * ref[:routed].abs() + 2.0 ** -9 * mag[:routed]).sum())
        print("WGMMA_FP32", routing, label, far, int(torch.isnan(out).sum()))
        assert far == 0 and not torch.isnan(out).any() and int((out[routed:] != 0).sum()) == 0, label
        assert torch.equal(out, outs["triton"]), label


def test_no_host_syncs_and_dgrad_shapes():
    """FC1 dgrad's operands (dh [T, 2F] with E5M2 codes, w1's transposed copy) through the fused
    path's own call, repeated under sync-debug "error" after a warm-up launch."""
    from te_fused_moe.backends.triton.fp8_block import gemm, quantize as Q

    aq, wq, counts, sched, _ = _problem(2048, 512, 256, 4, "e5m2", False, seed=3, routing="balanced", padding=0)
    assert gemm._plain_on_gluon(gemm.default_config("dgrad"), aq.data, wq.data)  # the default on sm_90
    ref, mag, routed = _reference(aq, wq, counts, None)
    c = torch.empty(2048, 256, device="cuda", dtype=torch.bfloat16)
    launch = lambda: gemm.launch("dgrad", aq.data, aq.scale, wq.data, wq.scale, 256, sched, 4, Q.FP8Spec.of("e5m2", True),
                                 c=c)
    launch()
    with no_host_syncs():
        for _ in range(3):
            launch()
    diff = (c.double() - ref).abs()
    assert int((diff > 2.0 ** -8 * ref.abs() + 2.0 ** -9 * mag).sum()) == 0


def _wgrad_problem(T, N, K, E, integer, seed, routing="empty", padding=5, counts=None):
    from te_fused_moe.backends.triton.fp8_block import quantize as Q
    from te_fused_moe.backends.triton.schedule import build_schedule

    gen = torch.Generator().manual_seed(seed)
    if integer:
        g, x = (torch.randint(-3, 4, (T, c), generator=gen).float() for c in (N, K))
    else:
        g = torch.randn(T, N, generator=gen) * torch.rand(1, N, generator=gen) * 3
        x = torch.randn(T, K, generator=gen) * torch.rand(T, 1, generator=gen)
    counts = make_counts(T, E, routing, generator=gen, padding=padding) if counts is None else counts
    sched = build_schedule(counts.cuda(), T, 128)
    gq = Q.quantize_rows(g.cuda().bfloat16(), sched, E, Q.FP8Spec.of("e5m2", True), rowwise=False, colwise=True)
    xq = Q.quantize_rows(x.cuda().bfloat16(), sched, E, Q.FP8Spec.of("e4m3", True), rowwise=False, colwise=True)
    return gq, xq, counts, sched


def _dequantized_columns(q, tile_start, rows):
    """An expert's columnwise copy dequantized: [width, rows] in FP64."""
    blocks = [q.data_t[:, 128 * t: 128 * t + min(128, rows - 128 * i)].double() * q.scale_t[t].double()[:, None]
              for i, t in enumerate(range(tile_start, tile_start + -(-rows // 128)))]
    return torch.cat(blocks, dim=1)


def _wgrad_reference(gq, xq, counts, sched, N, K):
    from te_fused_moe.backends.triton.schedule import schedule_table

    tab = schedule_table(sched, counts.numel()).cpu()
    ref = torch.zeros(counts.numel(), N, K, dtype=torch.float64, device="cuda")
    mag = torch.zeros_like(ref)
    for e, rows in enumerate(counts.tolist()):
        if rows:
            g, x = _dequantized_columns(gq, int(tab[0, e]), rows), _dequantized_columns(xq, int(tab[0, e]), rows)
            ref[e], mag[e] = g @ x.T, g.abs() @ x.abs().T
    return ref, mag


def _run_wgrad(label, gq, xq, sched, dw_shape, **tiles):
    """The wgrad under engine ``label``'s config, with ``tiles`` on top (4-warp tiles: one consumer
    partition, since two need 8 warps)."""
    from te_fused_moe.backends.triton.fp8_block import wgrad as W

    engine, fields = _WGRAD[label]
    dw = torch.full(dw_shape, float("nan"), device="cuda", dtype=torch.bfloat16)
    cfg = dataclasses.replace(W.default_config(gluon=engine == "gluon"), engine=engine, **{**fields, **tiles})
    if engine == "gluon" and cfg.num_warps < 8:
        cfg = dataclasses.replace(cfg, consumers=1)
    W.fp8_grouped_wgrad(gq, xq, sched, dw, config=cfg)
    return dw


@pytest.mark.parametrize("tiles", [{}, dict(block_n=64, block_k=64, num_warps=4),
                                   dict(block_n=64, block_k=128, num_warps=4, num_stages=3)],
                         ids=["default", "64x64-w4", "64x128-w4"])
def test_wgrad_exact_on_integer_data(tiles):
    gq, xq, counts, sched = _wgrad_problem(900, 256, 384, 6, True, seed=1)
    ref, _ = _wgrad_reference(gq, xq, counts, sched, 256, 384)
    assert 0 in counts.tolist() and max(counts.tolist()) > 128  # empty experts, several token blocks
    for engine, kw in [(label, tiles) for label in WGRAD_GLUON] + [("triton", {})]:
        dw = _run_wgrad(engine, gq, xq, sched, (6, 256, 384), **kw)
        bad = int((dw != ref.to(torch.bfloat16)).sum())
        print("WGRAD_EXACT", engine, tiles, bad)
        assert bad == 0, (engine, tiles, bad)


@pytest.mark.parametrize("routing", ["zipf", "empty", "one"])
def test_wgrad_random_data_vs_fp64_and_triton(routing):
    gq, xq, counts, sched = _wgrad_problem(3000, 512, 640, 8, False, seed=7, routing=routing)
    ref, mag = _wgrad_reference(gq, xq, counts, sched, 512, 640)
    errs, outs = {}, {}
    for engine in WGRAD_GLUON + ("triton",):
        dw = outs[engine] = _run_wgrad(engine, gq, xq, sched, (8, 512, 640))
        diff = (dw.double() - ref).abs()
        errs[engine] = dict(far=int((diff > 2.0 ** -8 * ref.abs() + 2.0 ** -9 * mag).sum()),
                            nan=int(torch.isnan(dw).sum()), rel=float(diff.norm() / ref.norm()))
    print("WGRAD_RANDOM", routing, json.dumps(errs))
    for e in errs.values():
        assert e["far"] == 0 and e["nan"] == 0, errs
    assert all(torch.equal(outs[label], outs["triton"]) for label in WGRAD_GLUON), errs


# experts: runs of empty ones, one-block ones (1 and 128 tokens), several blocks; 7 padding rows
_PERSISTENT_COUNTS = [0, 0, 0, 130, 1, 0, 0, 0, 0, 128, 300, 0, 1, 257, 0, 0]


def _forced_grid(monkeypatch, programs):
    """Launch ``programs`` persistent programs however many tiles and SMs there are."""
    from te_fused_moe.backends.triton.fp8_block import wgmma_gemm

    monkeypatch.setattr(wgmma_gemm, "persistent_grid", lambda tiles, device, ctas_per_sm: min(tiles, programs))


@pytest.mark.parametrize("engine", PLAIN_GLUON)
@pytest.mark.parametrize("programs", [1, 3, 7])
def test_persistent_plain_exact_on_integer_data(monkeypatch, programs, engine):
    counts = torch.tensor(_PERSISTENT_COUNTS)
    T = int(counts.sum()) + 7
    aq, wq, counts, sched, _ = _problem(T, 128 * 3, 256, counts.numel(), "e4m3", True, seed=programs, counts=counts)
    ref, _, routed = _reference(aq, wq, counts, None)
    _forced_grid(monkeypatch, programs)
    out = _run(engine, aq, wq, counts, sched, None, 256, ctas_per_sm=1)
    bad, pad = int((out[:routed] != ref[:routed].to(torch.bfloat16)).sum()), int((out[routed:] != 0).sum())
    print("PERSISTENT_PLAIN", engine, programs, bad, pad)
    assert bad == 0 and pad == 0, (programs, bad, pad)


@pytest.mark.parametrize("programs,tiles", [(1, {}), (2, {}), (5, dict(block_n=64, block_k=64, num_warps=4)),
                                            (None, dict(block_n=64, block_k=64, num_warps=4, ctas_per_sm=3))])
@pytest.mark.parametrize("engine", WGRAD_GLUON)
def test_persistent_wgrad_exact_on_integer_data(monkeypatch, programs, tiles, engine):
    counts = torch.tensor(_PERSISTENT_COUNTS)
    N, K = 256, 384
    gq, xq, counts, sched = _wgrad_problem(int(counts.sum()) + 7, N, K, counts.numel(), True, seed=2, counts=counts)
    ref, _ = _wgrad_reference(gq, xq, counts, sched, N, K)
    if programs is not None:
        _forced_grid(monkeypatch, programs)
    dw = _run_wgrad(engine, gq, xq, sched, (counts.numel(), N, K), **tiles)
    bad = int((dw != ref.to(torch.bfloat16)).sum())
    print("PERSISTENT_WGRAD", engine, programs, tiles, bad)
    assert bad == 0, (programs, tiles, bad)


@pytest.mark.parametrize("programs", [1, 3])
def test_tile_prefetch_changes_no_bit(monkeypatch, programs):
    """``wgmma_ws.TILE_PREFETCH`` (each partition reads the schedule of the tiles ahead under this tile's
    K loop; the plain GEMM two tiles deep) moves reads, not results: on random data with runs of empty
    and one-block experts, over a forced grid of few programs (many tiles each, the prefetch running
    past the last tile), both kernels give the same bits with and without it, and the wgrad stays within
    the FP64 bound."""
    from te_fused_moe.backends.triton.fp8_block import wgmma_ws

    counts = torch.tensor(_PERSISTENT_COUNTS)
    T = int(counts.sum()) + 7
    aq, wq, counts, sched, bias = _problem(T, 128 * 3, 384, counts.numel(), "e4m3", False, seed=50 + programs,
                                           counts=counts)
    gq, xq, _, wgrad_sched = _wgrad_problem(T, 256, 384, counts.numel(), False, seed=60 + programs, counts=counts)
    ref, mag = _wgrad_reference(gq, xq, counts, wgrad_sched, 256, 384)
    _forced_grid(monkeypatch, programs)
    outs = {}
    for prefetch in (True, False):
        monkeypatch.setattr(wgmma_ws, "TILE_PREFETCH", prefetch)
        outs[prefetch] = (_run("gluon", aq, wq, counts, sched, bias, 384),
                          _run_wgrad("gluon", gq, xq, wgrad_sched, (counts.numel(), 256, 384)))
    (plain_on, dw_on), (plain_off, dw_off) = outs[True], outs[False]
    assert not plain_on.isnan().any() and not dw_on.isnan().any()
    assert torch.equal(plain_on, plain_off) and torch.equal(dw_on, dw_off)
    err = (dw_on.double() - ref).abs() - (2.0 ** -8 * ref.abs() + 2.0 ** -9 * mag)
    assert float(err.max()) <= 0, float(err.max())


@pytest.mark.parametrize("k", [512, 4096])
@pytest.mark.parametrize("programs", [1, 3, None])
def test_ring_scales_change_no_bit(monkeypatch, programs, k):
    """``wgmma_ws.RING_SCALES`` (the producer loads each K block's row scales and weight block scalar by
    TMA with its stage, the consumers read them from shared memory) moves loads, not results: on random
    data with runs of empty and one-block experts, T off a multiple of 4, bias, E4M3 and E5M2 A, the
    forward orientation (the weight's scales contiguous) and the dgrad's (the transposed copy's scales,
    copied contiguous for TMA), over few programs and the full grid, the same bits as the scales loaded
    from global memory; and those operands do take the TMA path. K = 512 (4 K blocks) and 4096 (32: as
    many as the weight scalar's TMA box is wide, run 33's open question)."""
    from te_fused_moe.backends.triton.fp8_block import quantize as Q, wgmma_gemm, wgmma_ws

    counts = torch.tensor(_PERSISTENT_COUNTS)
    T, K = int(counts.sum()) + 7, k
    if programs is not None:
        _forced_grid(monkeypatch, programs)
    for fmt in ("e4m3", "e5m2"):
        aq, wq, counts, sched, bias = _problem(T, K, 384, counts.numel(), fmt, False, seed=70 + (programs or 0),
                                               counts=counts)
        w_t = torch.randn(counts.numel(), K, 256, generator=torch.Generator().manual_seed(7)) * 0.05
        wtq = Q.quantize_weight(w_t.cuda().bfloat16(), Q.FP8Spec.of("e4m3", True), transposed=True)
        cases = {"forward": (wq.data, wq.scale, 384, bias), "dgrad": (wtq.data_t, wtq.scale_t, 256, None)}
        for name, (b, b_scale, n, b_bias) in cases.items():
            assert wgmma_gemm.ring_scale_descriptors(aq.scale, wgmma_ws._contiguous_scales(b_scale),
                                                     b.shape[1]) is not None, name
            outs = {}
            for ring in (True, False):
                monkeypatch.setattr(wgmma_ws, "RING_SCALES", ring)
                outs[ring] = _run("gluon", aq, Q.QuantizedWeight(b, None, b_scale), counts, sched, b_bias, n)
            print("RING_SCALES", fmt, name, programs, int((outs[True] != outs[False]).sum()))
            assert not outs[True].isnan().any() and torch.equal(outs[True], outs[False]), (fmt, name, programs)
