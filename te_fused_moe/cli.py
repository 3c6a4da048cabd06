"""Command line: ``te-fused-moe env`` (what this machine can run, and why not) and
``te-fused-moe bench`` (the expert benchmark, see ``te_fused_moe.bench``)."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import platform
import sys
from typing import Dict, List, Optional

import torch

from .activations import ACTIVATIONS, ActivationConfig
from .backends import explain
from .recipes import RECIPES_BY_NAME

PACKAGES = (
    "torch",
    "triton",
    "transformer-engine",
    "transformer-engine-torch",
    "nvidia-cudnn-frontend",
    "nvidia-cutlass-dsl",
    "megatron-core",
)


def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _gpu_report() -> Dict[str, object]:
    if not torch.cuda.is_available():
        return {"cuda_available": False, "torch_cuda": torch.version.cuda}
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return {
        "cuda_available": True,
        "torch_cuda": torch.version.cuda,
        "name": props.name,
        "compute_capability": f"{props.major}.{props.minor}",
        "multiprocessors": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
    }


def _te_report() -> Dict[str, object]:
    try:
        te_compat = importlib.import_module("te_fused_moe.te_compat")
        return te_compat.te_status()
    except Exception as error:  # the report must never crash on a broken optional install
        return {"error": f"{type(error).__name__}: {error}"}


def _support_matrix(device: torch.device) -> List[Dict[str, object]]:
    """For every recipe, which backend ``auto`` would use here and why the others can't."""
    rows = []
    dtype = torch.bfloat16
    for recipe_name, recipe_cls in RECIPES_BY_NAME.items():
        recipe = recipe_cls()
        for activation in ("swiglu", "gpt_oss_swiglu", "srelu"):
            verdicts = explain(device, ActivationConfig(activation), recipe, dtype)
            chosen = next((name for name, v in verdicts if v), None)
            rows.append(
                {
                    "recipe": recipe_name,
                    "activation": activation,
                    "auto": chosen,
                    "backends": {name: (True if v else v.reason) for name, v in verdicts},
                }
            )
    return rows


def env_report() -> Dict[str, object]:
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": {name: _version(name) for name in PACKAGES},
        "gpu": _gpu_report(),
        "transformer_engine": _te_report(),
        "device": str(device),
        "activations": sorted(ACTIVATIONS),
        "support": _support_matrix(device),
        "fp8_block_kernels": _fp8_block_kernels(device),
        "ptxas": _ptxas_report(),
    }


def _ptxas_report() -> str:
    """The ptxas the triton backend builds with (TE_FUSED_MOE_PTXAS chooses it)."""
    try:
        from .backends.triton import ptxas
    except ImportError as exc:  # no triton, or a setting that cannot be met
        return f"unavailable: {exc}"
    try:
        used = ptxas.in_use()
    except Exception as exc:  # noqa: BLE001 - no ptxas at all: say so instead of failing `env`
        return f"unavailable: {type(exc).__name__}: {exc}"
    hints = "interleaves FFMA yield hints" if used.interleaves_ffma else "no FFMA interleaving (< 12.9)"
    return f"{used.path} ({used.version}; {hints}; {ptxas.ENV}={os.environ.get(ptxas.ENV, 'triton')})"


def _fp8_block_kernels(device: torch.device) -> Dict[str, str]:
    """Which FP8 block kernels backend='triton' runs here (Gluon on sm_90 with Triton >= 3.6)."""
    try:
        from .backends.triton.fp8_block.gemm import engines_on
    except ImportError as exc:  # no triton
        return {"all": f"unavailable: {exc}"}
    return engines_on(device)


def _print_env(report: Dict[str, object]) -> None:
    print(f"python                    {report['python']} ({report['platform']})")
    for name, version in report["packages"].items():
        print(f"{name:<26}{version or 'not installed'}")
    gpu = report["gpu"]
    if gpu.get("cuda_available"):
        print(f"gpu                       {gpu['name']} (sm_{gpu['compute_capability'].replace('.', '')}, "
              f"{gpu['multiprocessors']} SMs, {gpu['memory_gib']} GiB), torch CUDA {gpu['torch_cuda']}")
    else:
        print(f"gpu                       none visible to torch (torch CUDA build: {gpu['torch_cuda']})")
    print(f"TE                        {json.dumps(report['transformer_engine'])}")
    print("fp8_block kernels         " + "; ".join(f"{k}: {v}" for k, v in report["fp8_block_kernels"].items()))
    print(f"ptxas                     {report['ptxas']}")
    print(f"\nwhat backend='auto' runs on {report['device']} (bf16 params):")
    for row in report["support"]:
        print(f"  {row['recipe']:<10} {row['activation']:<15} -> {row['auto']}")
        for name, verdict in row["backends"].items():
            if verdict is not True:
                print(f"      {name:<10} no: {verdict}")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="te-fused-moe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    env = sub.add_parser("env", help="versions, GPU, and which backends/recipes can run here (and why not)")
    env.add_argument("--json", action="store_true", help="print the report as JSON")
    sub.add_parser("bench", help="expert-MLP benchmark vs the unfused path (GPU); see --help of it", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "env":
        report = env_report()
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            _print_env(report)
        return 0
    if args.command == "bench":
        bench = importlib.import_module("te_fused_moe.bench")
        return bench.main(rest)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
