set -u
mkdir -p /tmp/t39 && [ -d /tmp/t39/triton ] || tar -xJf .whl/triton39.tar.xz -C /tmp/t39
export PYTHONUNBUFFERED=1 TRITON_PTXAS_PATH=/usr/local/cuda/bin/ptxas TRITON_CUOBJDUMP_PATH=/usr/local/cuda/bin/cuobjdump TRITON_NVDISASM_PATH=/usr/local/cuda/bin/nvdisasm
export TRITON_BACKENDS_IN_TREE=1 TRITON_PTXAS_BLACKWELL_PATH=/usr/local/cuda/bin/ptxas
T36="$PWD"; T39="/tmp/t39:$PWD"
for t in ${ORDER:-36 39}; do eval P=\$T$t; start=$SECONDS
  PYTHONPATH=$P timeout 240 python scripts/bench_recipes.py --recipes fp8_block --shapes dsv3-e32 --no-kernels --rounds ${ROUNDS:-5} \
    --implementations fp8_block_fused --out $OUT/mlp_$t > $OUT/mlp_$t.log 2>&1; echo "t$t rc=$? $((SECONDS-start)) s"; grep -iE "ms|ratio|x " $OUT/mlp_$t.log | tail -6; done
