set -u
mkdir -p /tmp/t39 && tar -xJf .whl/triton39.tar.xz -C /tmp/t39
export PYTHONUNBUFFERED=1 TRITON_PTXAS_PATH=/usr/local/cuda/bin/ptxas TRITON_CUOBJDUMP_PATH=/usr/local/cuda/bin/cuobjdump TRITON_NVDISASM_PATH=/usr/local/cuda/bin/nvdisasm
export TRITON_BACKENDS_IN_TREE=1 TRITON_PTXAS_BLACKWELL_PATH=/usr/local/cuda/bin/ptxas
T36="$PWD:$PWD/tests"; T39="/tmp/t39:$PWD:$PWD/tests"
PYTHONPATH=$T39 python -c "import triton, torch; print('triton', triton.__version__, torch.__version__)"
PYTHONPATH=$T39 timeout 240 python -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_fp8_block_wgmma_gpu.py -k "wgrad_exact or persistent or random_data_vs or no_host_syncs or exact_on_integer" 2>&1 | grep -E "passed|failed|FAILED|Error" | head -12
for r in 1 2; do for t in 36 39; do eval P=\$T$t; PYTHONPATH=$P timeout 90 python scripts/probe_wgrad.py --variant base > $OUT/probe_${t}_${r}.json 2>$OUT/probe_err_${t}_${r}.txt; echo "t$t r$r $(cat $OUT/probe_${t}_${r}.json | tail -c 400)"; done; done
