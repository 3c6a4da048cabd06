#!/usr/bin/env bash
# The one script the device machine runs for the Triton backend: GPU tests, the benchmark at every
# shape, and (optionally) block-size variants. Logs and results go under $OUT; a short table last.
#   usage: scripts/device_gpu_check.sh [tests] [bench] [tune]     (default: all three)
set -u
OUT=${OUT:-/tmp/device_out}
mkdir -p "$OUT"
STEPS=${*:-tests bench tune}
export PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv
  python -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
  python -c "import tqdm, matplotlib; print('tqdm', tqdm.__version__, 'matplotlib', matplotlib.__version__)" 2>&1 | tail -1
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
for step in $STEPS; do
  case $step in
    tests)
      timeout ${TESTS_TIMEOUT:-170} python -m pytest -m gpu tests/gpu/test_triton_gpu.py -q -p no:cacheprovider \
        > "$OUT/pytest_triton_gpu.log" 2>&1
      echo "pytest exit $?"; tail -5 "$OUT/pytest_triton_gpu.log";;
    reliability)  # the team's reliability tests also drive backend='triton'
      timeout ${REL_TIMEOUT:-60} python -m pytest -m gpu tests/gpu/test_reliability_gpu.py -q -p no:cacheprovider \
        > "$OUT/pytest_reliability_gpu.log" 2>&1
      echo "reliability pytest exit $?"; tail -3 "$OUT/pytest_reliability_gpu.log";;
    bench)
      timeout ${BENCH_TIMEOUT:-200} python scripts/bench_experts.py --shapes ${SHAPES:-all} --out "$OUT" \
        > "$OUT/bench.log" 2>&1
      echo "bench exit $?";;
    tune)
      timeout ${TUNE_TIMEOUT:-120} python scripts/bench_experts.py --tune --shapes ${TUNE_SHAPES:-qwen3-30b-a3b,dsv3-e32,gpt-oss} \
        --out "$OUT" > "$OUT/tune.log" 2>&1
      echo "tune exit $?"; grep -v "it/s\|s/it" "$OUT/tune.log" | tail -25;;
  esac
done
echo "=== benchmark ==="
tail -12 "$OUT/bench.log" 2>/dev/null
