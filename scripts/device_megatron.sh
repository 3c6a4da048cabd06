#!/usr/bin/env bash
# Megatron Core integration on one H200 (Python 3.12, torch 2.11, megatron-core 0.19.2 from .whl/).
# Run from the repository root on the device machine, carrying the wheel folder:
#     run(command="bash scripts/device_megatron.sh", carry=[".whl"], timeout_s=600)
# Writes everything under $OUT (default runs/device_megatron):
#   versions.txt                               megatron-core / torch / GPU
#   pytest_megatron_{gpu,cpu}.txt/.xml         GPU Megatron tests; the CPU Megatron tests under 0.19.2
#   <config>/<impl>/log.json (+ loss.png)      50 iterations, same seed, impl = fused | sequential
#   <config>/<impl>.log                        the run's stdout
#   summary.json, loss_curves.png              loss curves side by side, tokens/s, MoE-layer fwd+bwd ms
#   graphs/<mode>/log.json, graphs/summary.json  GRAPHS=1 only: GPT-OSS proxy, fused, whole-step tokens/s
#                                              with --cuda-graph none | local | full_iteration
# Options: SKIP_TESTS=1 (no pytest), SKIP_CPU_TESTS=1 (GPU tests only), SKIP_TRAIN=1 (no fused-vs-sequential runs), GRAPHS=1 (opt-in).
# Budget: about 5 minutes of GPU time; every step is bounded by `timeout` (75+60+4*60 s at most).
set -u -o pipefail
OUT=${OUT:-runs/device_megatron}
mkdir -p "$OUT"
# NVLink multicast stays off on these machines (KINDS.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PY:-python3}
ITERS=${ITERS:-50}
LR=${LR:-}  # learning-rate override for every run (default: each config's)
SEED=${SEED:-1234}

# 1. megatron-core 0.19.2 (and any other carried wheel) into /tmp/site, no index (no network there).
mkdir -p /tmp/site
$PY -m pip install --no-deps --no-index --target /tmp/site .whl/*.whl > "$OUT/pip.log" 2>&1 \
  || { echo "wheel install failed, see $OUT/pip.log"; tail -5 "$OUT/pip.log"; }
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
$PY - > "$OUT/versions.txt" 2>&1 <<'PYEOF'
import importlib.metadata as md, torch
import megatron.core
print("megatron-core", md.version("megatron-core"), megatron.core.__file__)
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
for name in ("triton", "psutil", "pyyaml", "numpy"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "missing")
PYEOF
cat "$OUT/versions.txt"

# 2. Tests: GPU Megatron tests, then the CPU Megatron tests against 0.19.2 with the GPU hidden
#    (Megatron moves router weights to CUDA whenever it sees one; those tests are CPU/gloo tests).
if [ -z "${SKIP_TESTS:-}" ]; then  # SKIP_TESTS=1: training runs only
timeout 75 $PY -m pytest -q -p no:cacheprovider -W ignore tests/gpu/test_megatron_gpu.py \
  --junitxml="$OUT/pytest_megatron_gpu.xml" > "$OUT/pytest_megatron_gpu.txt" 2>&1
echo "GPU pytest rc=$? ($(tail -1 "$OUT/pytest_megatron_gpu.txt"))"
[ -z "${SKIP_CPU_TESTS:-}" ] && CUDA_VISIBLE_DEVICES= timeout 90 $PY -m pytest -q -p no:cacheprovider -W ignore \
  tests/test_megatron_config.py tests/test_megatron_experts.py tests/test_megatron_checkpoint.py \
  tests/test_megatron_ep.py tests/test_megatron_quantized.py tests/test_megatron_cuda_graph.py \
  tests/test_megatron_no_sync.py --junitxml="$OUT/pytest_megatron_cpu.xml" > "$OUT/pytest_megatron_cpu.txt" 2>&1
[ -z "${SKIP_CPU_TESTS:-}" ] && echo "CPU pytest (megatron-core 0.19.2) rc=$? ($(tail -1 "$OUT/pytest_megatron_cpu.txt"))"
fi

# 3. Training: GPT-OSS and Qwen3-MoE proxies, fused vs sequential, same seed and data.
TRAIN_CONFIGS="gpt_oss_proxy qwen3_moe_proxy"
[ -n "${SKIP_TRAIN:-}" ] && TRAIN_CONFIGS=""
for cfg in $TRAIN_CONFIGS; do
  for impl in fused sequential; do
    mkdir -p "$OUT/$cfg"
    timeout 60 $PY scripts/pretrain_moe.py --config "configs/$cfg.yaml" --moe-grouped-gemm-impl "$impl" \
      --train-iters "$ITERS" --device cuda --seed "$SEED" --moe-timing-iters 10 --plot ${LR:+--lr "$LR"} \
      --out "$OUT/$cfg/$impl" > "$OUT/$cfg/$impl.log" 2>&1
    echo "$cfg $impl rc=$? $(grep -E 'wrote|Error' "$OUT/$cfg/$impl.log" | tail -1 | cut -c1-220)"
  done
done

# 3b. GRAPHS=1: whole-step tokens/s of the GPT-OSS proxy (fused) without and with CUDA graphs.
#     Megatron's alltoall/allgather dispatchers copy the routing counts to the host unless the
#     shapes are fixed (drop-and-pad), so the graph runs and their eager baseline use
#     --moe-expert-capacity-factor $CAPACITY; "dropless" is the usual eager run for reference.
CAPACITY=${CAPACITY:-1.5}
if [ -n "${GRAPHS:-}" ]; then
  for mode in dropless none local full_iteration; do
    mkdir -p "$OUT/graphs"
    if [ "$mode" = dropless ]; then extra="--cuda-graph none"; else
      extra="--cuda-graph $mode --moe-expert-capacity-factor $CAPACITY"; fi
    timeout 90 $PY scripts/pretrain_moe.py --config configs/gpt_oss_proxy.yaml --moe-grouped-gemm-impl fused \
      --train-iters "$ITERS" --device cuda --seed "$SEED" --moe-timing-iters 5 $extra \
      ${LR:+--lr "$LR"} --out "$OUT/graphs/$mode" > "$OUT/graphs/$mode.log" 2>&1
    echo "graphs $mode rc=$? $(grep -E 'wrote|Error' "$OUT/graphs/$mode.log" | tail -1 | cut -c1-220)"
  done
  $PY - "$OUT/graphs" <<'PYEOF'
import json, os, sys
out = sys.argv[1]
summary = {}
for mode in ("dropless", "none", "local", "full_iteration"):
    path = os.path.join(out, mode, "log.json")
    if not os.path.exists(path):
        summary[mode] = "missing (see %s.log)" % mode
        continue
    log = json.load(open(path))
    summary[mode] = {"tokens_per_s_after_warmup": log["tokens_per_s_after_warmup"],
                     "steady_state_from_step": log.get("steady_state_from_step"),
                     "cuda_graph_config": log.get("cuda_graph_config"),
                     "full_iteration_graph_captured": log.get("full_iteration_graph_captured"),
                     "moe_expert_capacity_factor": log.get("moe_expert_capacity_factor"),
                     "loss_first": log["steps"][0]["loss"], "loss_last": log["steps"][-1]["loss"],
                     "losses": [s["loss"] for s in log["steps"]]}
base = summary.get("none")
for mode, entry in summary.items():
    if isinstance(entry, dict) and isinstance(base, dict):
        entry["speedup_vs_none"] = entry["tokens_per_s_after_warmup"] / base["tokens_per_s_after_warmup"]
        entry["max_abs_loss_diff_vs_none"] = max(abs(a - b) for a, b in zip(entry["losses"], base["losses"]))
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
for mode, entry in summary.items():
    print("graphs", mode, entry if not isinstance(entry, dict) else
          {k: v for k, v in entry.items() if k != "losses"})
PYEOF
fi

# 4. Summary: loss curves side by side, tokens/s, MoE layer fwd+bwd.
[ -n "${SKIP_TRAIN:-}" ] && exit 0
$PY - "$OUT" <<'PYEOF'
import json, os, sys
out = sys.argv[1]
summary = {}
for cfg in ("gpt_oss_proxy", "qwen3_moe_proxy"):
    for impl in ("fused", "sequential"):
        path = os.path.join(out, cfg, impl, "log.json")
        if not os.path.exists(path):
            summary.setdefault(cfg, {})[impl] = "missing (see the .log)"
            continue
        log = json.load(open(path))
        summary.setdefault(cfg, {})[impl] = {
            "experts": log["experts_class"], "backend": log["fused_backend"],
            "loss_first": log["steps"][0]["loss"], "loss_last": log["steps"][-1]["loss"],
            "losses": [s["loss"] for s in log["steps"]],
            "tokens_per_s_after_warmup": log["tokens_per_s_after_warmup"],
            "moe_layer_timing": log["moe_layer_timing"], "versions": log["versions"],
        }
    pair = summary[cfg]
    if all(isinstance(pair.get(i), dict) for i in ("fused", "sequential")):
        f, s = pair["fused"], pair["sequential"]
        diffs = [abs(a - b) for a, b in zip(f["losses"], s["losses"])]
        pair["max_abs_loss_diff"] = max(diffs)
        pair["speedup_tokens_per_s"] = f["tokens_per_s_after_warmup"] / s["tokens_per_s_after_warmup"]
        pair["speedup_moe_layer"] = (s["moe_layer_timing"]["moe_layer_fwd_bwd_ms_median"]
                                     / f["moe_layer_timing"]["moe_layer_fwd_bwd_ms_median"])
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
for cfg, pair in summary.items():
    print(cfg, {k: v for k, v in pair.items() if not isinstance(v, dict)})
try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(summary), figsize=(6 * len(summary), 4))
    for ax, (cfg, pair) in zip(axes, summary.items()):
        for impl in ("fused", "sequential"):
            if isinstance(pair.get(impl), dict):
                ax.plot(pair[impl]["losses"], label=f"{impl} ({pair[impl]['tokens_per_s_after_warmup']:.0f} tok/s)")
        ax.set_title(cfg); ax.set_xlabel("step"); ax.set_ylabel("loss"); ax.legend()
    fig.tight_layout(); fig.savefig(os.path.join(out, "loss_curves.png"), dpi=100)
except Exception as exc:
    print("plot skipped:", exc)
PYEOF
