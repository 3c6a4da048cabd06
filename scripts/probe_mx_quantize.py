"""MXFP8's quantize pass at DSv3's x / dy ([32768, 7168] BF16 in 32 balanced experts) at a few launch
configs (``quantize.QUANT_COLS`` columns per program, ``QUANT_WARPS``), for the copies the MLP asks of
it, and the expansion pass whose work the values-writing modes take over
(``autograd.QUANTIZE_TO_VALUES``). A measurement tool, not a test: the kernel's bytes are checked by
the MXFP8 tests.

Run 33a (H100) timed the kernel before this one here too (the whole 128-row tile at once, its 32-token
blocks by 3-D reshapes; removed since): 0.853 ms for x's codes against 0.567, 0.952 for the columnwise
copy alone against 0.376 (``benchmarks/results/run33_mx_quantize/``).

Modes (what each quantize call of the MLP writes): ``x_codes`` row + column codes (FC1's operand and w1's
wgrad operand, as shipped); ``x_values`` row values + column codes (QUANTIZE_TO_VALUES); ``dy_codes`` both
copies' codes + per-tile column sums (db2); ``dy_values`` both as values + column sums; ``col_codes`` the
columnwise copy alone; ``row_codes`` the rowwise copy alone. ``expand_row`` is the expansion pass of x's
rowwise copy (what ``x_values`` saves, next to what it costs).

  usage: python scripts/probe_mx_quantize.py [--out DIR]
"""

from __future__ import annotations

from probe_results import run_and_save

ROUTED, HIDDEN, EXPERTS = 32768, 7168, 32
MODES = {  # rowwise, colwise, row_values, col_values, col_sums
    "x_codes": (True, True, False, False, False),
    "x_values": (True, True, True, False, False),
    "dy_codes": (True, True, False, False, True),
    "dy_values": (True, True, True, True, True),
    "col_codes": (False, True, False, False, False),
    "row_codes": (True, False, False, False, False),
}
# (columns per program, warps): the shipped launch first
CONFIGS = [(128, 4), (128, 8), (64, 4)]


def moved_bytes(mode: str) -> int:
    """Bytes a pass must move at least: x read (BF16), each copy written (1 byte a code, 2 a value)."""
    rowwise, colwise, row_values, col_values, col_sums = MODES[mode]
    elements = ROUTED * HIDDEN
    return elements * (2 + rowwise * (1 + row_values) + colwise * (1 + col_values))


def run() -> dict:
    import torch

    from te_fused_moe.backends.triton.mxfp8 import quantize as Q
    from te_fused_moe.backends.triton.schedule import build_schedule, max_m_tiles
    from te_fused_moe.bench import do_bench_ms

    torch.manual_seed(0)
    x = torch.randn(ROUTED, HIDDEN, device="cuda", dtype=torch.bfloat16)
    counts = torch.full((EXPERTS,), ROUTED // EXPERTS, dtype=torch.int32, device="cuda")
    sched = build_schedule(counts, ROUTED, Q.TILE)
    sums = torch.empty(max_m_tiles(ROUTED, EXPERTS, Q.TILE), HIDDEN, device="cuda", dtype=torch.float32)
    spec = Q.MXSpec()
    out = {"shape": [ROUTED, HIDDEN, EXPERTS], "device": torch.cuda.get_device_name()}
    reference = {}
    for cols, warps in CONFIGS:
        Q.QUANT_COLS, Q.QUANT_WARPS = cols, warps
        name = f"{cols}c_{warps}w"
        out[name] = {}
        for mode, (rowwise, colwise, row_values, col_values, col_sums) in MODES.items():
            fn = lambda: Q.quantize_rows(x, sched, EXPERTS, spec, rowwise=rowwise, colwise=colwise,
                                         row_values=row_values, col_values=col_values,
                                         col_sums=sums if col_sums else None)
            q = fn()
            # the same bytes from every config (the first config's are the reference), over the
            # slots the routing fills (balanced: whole tiles; the buffers' spare slots are not written)
            copies = [t for t in (q.data, q.scale, None if q.data_t is None else q.data_t[:, :ROUTED],
                                  None if q.scale_t is None else q.scale_t[:ROUTED // 32]) if t is not None]
            same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                       for a, b in zip(copies, reference.setdefault(mode, copies)))
            ms = do_bench_ms(fn)
            out[name][mode] = {"ms": round(ms, 4), "GB/s": round(moved_bytes(mode) / ms / 1e6), "same_bytes": same}
    q = Q.quantize_rows(x, sched, EXPERTS, spec, rowwise=True, colwise=False)
    ms = do_bench_ms(lambda: Q.expand_values(q.data, q.scale))
    out["expand_row"] = {"ms": round(ms, 4), "GB/s": round(ROUTED * HIDDEN * 3 / ms / 1e6)}
    return out


if __name__ == "__main__":
    run_and_save(run, __doc__.splitlines()[0], "probe_mx_quantize.json")
