#!/usr/bin/env bash
# Set up, then run the test suite. GPU tests (marked `gpu`) skip without a CUDA device; on the H200
# run `pytest -m gpu tests/gpu` (see README). TE_FUSED_MOE_REQUIRE_TE=1 makes the TE-interop tests
# fail instead of skip if TE's Python package could not be prepared.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export TE_FUSED_MOE_TE_PATH="$PWD/.deps/te" TE_FUSED_MOE_REQUIRE_TE=1
exec .venv/bin/python -m pytest -q -p no:cacheprovider --timeout 900 "$@"
