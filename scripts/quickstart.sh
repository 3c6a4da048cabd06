#!/usr/bin/env bash
# The main job: set up, then a short MoE training run through Megatron Core's MoELayer with our
# fused expert MLP (`--moe-grouped-gemm-impl fused`). On a GPU it trains the proxy GPT-OSS model
# with the Triton backend; without one, a tiny model on the CPU reference backend.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
if .venv/bin/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  config=configs/gpt_oss_proxy.yaml; device=cuda
else
  config=configs/cpu_tiny.yaml; device=cpu
fi
exec .venv/bin/python scripts/pretrain_moe.py --config "$config" --device "$device" \
  --moe-grouped-gemm-impl fused --out runs/quickstart "$@"
