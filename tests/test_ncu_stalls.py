"""scripts/ncu_stalls.py: the per-instruction stall summary of an ``ncu --page source --csv`` export,
on a small export written here in that format (two launches, an idle warp's NOP)."""

from __future__ import annotations

import csv
import json
import os
import random
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import ncu_stalls  # noqa: E402

REASONS = ("stall_barrier", "stall_long_sb", "stall_selected", "stall_short_sb")


def _export(path, kernels):
    """Writes ``kernels`` ({name: [(address, source, executed, {reason: samples})]}) as ncu does."""
    header = ["Address", "Source", ncu_stalls.SAMPLES, "Warp Stall Sampling (Not-issued Samples)",
              ncu_stalls.EXECUTED, *REASONS, *(r + " (Not Issued)" for r in REASONS)]
    with open(path, "w", newline="") as f:
        out = csv.writer(f, quoting=csv.QUOTE_ALL)
        for name, rows in kernels.items():
            out.writerow(["Kernel Name", name])
            out.writerow(header)
            for address, source, executed, stalls in rows:
                samples = sum(stalls.values())
                out.writerow([address, source, samples, samples, f"{executed:,}",
                              *(stalls.get(r, 0) for r in REASONS), *(0 for _ in REASONS)])


def test_summary_leaves_out_idle_nops_and_ranks_what_stalls(tmp_path):
    rng = random.Random()
    hot, warm, idle = rng.randint(500, 900), rng.randint(100, 400), rng.randint(1000, 3000)
    loads = rng.randint(1, 99)
    rows = [("0x7f0000000010", "      NOP", 132, {"stall_barrier": idle}),
            ("0x7f0000000020", "      FMUL R1, R2, R3", 884736, {"stall_long_sb": hot, "stall_selected": 7}),
            ("0x7f0000000030", "@!P0  BRA 0x7f0000000090", 458752, {"stall_long_sb": warm}),
            ("0x7f0000000040", "      LDS.64 R4, [R5+UR6+0x28000]", 688128, {"stall_short_sb": loads})]
    path = tmp_path / "rep_sass.csv"
    _export(path, {"first_kernel": rows[:2], "fp8_block_gemm_ws_kernel": rows})
    kernels = ncu_stalls.read_source_csv(str(path))
    assert [len(k) for k in kernels] == [2, 4]
    summary = ncu_stalls.summarize(kernels[1], top=2)
    total = hot + 7 + warm + loads
    assert summary["samples"] == total and summary["left_out"] == 1 and summary["instructions"] == 3
    assert summary["by_reason"]["long_sb"] == round((hot + warm) / total, 4)
    assert "barrier" not in summary["by_reason"]  # the idle warps' NOP is gone
    assert [h["source"] for h in summary["hottest"]] == ["FMUL R1, R2, R3", "@!P0  BRA 0x7f0000000090"]
    assert summary["hottest"][0]["executed"] == 884736 and summary["by_opcode"]["BRA"]["share"] == round(warm / total, 4)
    kept = ncu_stalls.summarize(kernels[1], skip_idle=False)
    assert kept["by_reason"]["barrier"] == round(idle / (total + idle), 4) and kept["left_out"] == 0
    assert ncu_stalls.opcode("@!UP1  SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR28]") == "SYNCS"


def test_main_writes_the_summary_and_names_a_bad_kernel_index(tmp_path, capsys):
    path = tmp_path / "rep_sass.csv"
    _export(path, {"k": [("0x10", "      FFMA R1, R2, R3, R1", 64, {"stall_selected": 5})]})
    assert ncu_stalls.main([str(path), "--json", str(tmp_path / "s.json")]) == 0
    assert json.load(open(tmp_path / "s.json"))["samples"] == 5
    assert "FFMA" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        ncu_stalls.main([str(path), "--kernel", "1"])
    assert "--kernel: expected 0..0 (1 launches" in capsys.readouterr().err
