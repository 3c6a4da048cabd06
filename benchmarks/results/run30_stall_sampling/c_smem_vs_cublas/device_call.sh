# Run 30c as it ran on the device (run from the repository root with OUT set; the cuBLAS script was in .whl/ then)
set -u
R=$OUT/r; mkdir -p $R
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/tests
NCU=/usr/local/cuda/bin/ncu
$NCU --query-metrics --chip gh100 > $R/all_metrics.txt 2>&1
WANT="gpu__time_duration.sum sm__cycles_elapsed.avg smsp__inst_executed.sum
sm__pipe_tensor_op_hmma_type_hmma_hgmma_qgmma_cycles_active.avg.pct_of_peak_sustained_elapsed
sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed
l1tex__data_pipe_lsu_wavefronts.avg.pct_of_peak_sustained_elapsed
l1tex__data_pipe_lsu_wavefronts_mem_shared.sum l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed
l1tex__data_pipe_lsu_wavefronts_mem_shared_op_gmma.sum l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum
l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_gmma.sum
l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum l1tex__throughput.avg.pct_of_peak_sustained_elapsed
l1tex__data_pipe_lsu_wavefronts_mem_shared_op_tma.sum l1tex__m_xbar2l1tex_read_bytes.sum
sm__throughput.avg.pct_of_peak_sustained_elapsed smsp__issue_active.avg.pct_of_peak_sustained_elapsed"
M=""; for w in $WANT; do b=${w%%.*}; if grep -q "^$b " $R/all_metrics.txt || grep -q "^[A-Za-z_.]*$b " $R/all_metrics.txt; then M="$M,$w"; else echo "no metric $b"; fi; done; M=${M#,}
echo "metrics: $M" > $R/metrics_used.txt
SEC="--section MemoryWorkloadAnalysis_Tables --section SpeedOfLight"
python benchmarks/results/run30_stall_sampling/c_smem_vs_cublas/cublas_fp8.py | tee $R/cublas_time.txt
run() { local name=$1; shift; local S=$SECONDS; timeout 120 $NCU $SEC --metrics $M "$@" > $R/$name.txt 2>&1; echo "$name rc=$? $((SECONDS-S)) s"; }
run cublas -k regex:"gemm|sm90|cutlass|xmma" -c 1 python benchmarks/results/run30_stall_sampling/c_smem_vs_cublas/cublas_fp8.py --once
run wgrad_base -k regex:wgrad_ws_kernel -c 1 python scripts/probe_wgrad.py --variant base --shape dsv3_w1_e32 --once
run wgrad_add_only -k regex:wgrad_ws_kernel -c 1 python scripts/probe_wgrad.py --variant add_only --shape dsv3_w1_e32 --once
run wgrad_row_only -k regex:wgrad_ws_kernel -c 1 python scripts/probe_wgrad.py --variant row_scale_only --shape dsv3_w1_e32 --once
run plain -k regex:gemm_ws_kernel -c 2 python scripts/profile_mlp.py --impls fp8_block_fused --shape dsv3-e32 --iterations 1
cd $OUT && tar -czf all.tgz r && rm -rf r && ls -la all.tgz
