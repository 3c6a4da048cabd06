#!/usr/bin/env bash
# Creates (or reuses) .venv with everything the main job and the tests need, on a CPU or GPU machine.
#   - torch: kept if the chosen python already has one (GPU machines bring their CUDA build);
#     else the CPU build (torch 2.13.0 on Python 3.11).
#   - megatron-core (oldest supported, 0.16.1, on Python 3.11; newest on 3.12+), triton (its CPU
#     interpreter runs our kernels in the tests), pytest, hypothesis, matplotlib, tqdm.
#   - Transformer Engine's pure-Python package goes to .deps/te, NOT into the venv: installed there
#     it would make `import megatron.core` raise. Tests that need TE's real recipe classes put it
#     on PYTHONPATH in a subprocess.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip install -q --disable-pip-version-check)

if ! "$PY" -c "import torch" 2>/dev/null; then
  "${PIP[@]}" "torch>=2.4,<=2.14.1"
fi
pyver=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
if [ "$pyver" = "3.11" ] || [ "$pyver" = "3.10" ]; then
  megatron="megatron-core==0.16.1"
else
  megatron="megatron-core>=0.16.1,<0.20"
fi
# numpy<2.3: Triton 3.6's interpreter fails on numpy 2.4 scalars ("only 0-dimensional arrays ...").
"${PIP[@]}" -e ".[test,bench]" "$megatron" einops pydantic psutil "numpy<2.3" "triton>=3.3,<3.7" pytest-timeout
if [ ! -d .deps/te/transformer_engine ]; then
  "$PY" -m pip install -q --disable-pip-version-check --no-deps --target .deps/te "transformer-engine==2.20.2"
fi
echo "environment ready: $VENV ($("$PY" -c 'import torch, sys; print(sys.version.split()[0], "torch", torch.__version__)'))"
