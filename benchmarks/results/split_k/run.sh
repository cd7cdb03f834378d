# Split-K's merge as one reduction (one_reduction_merge.patch) against the tree's three: the merge alone
# (merge_cost.py), then the engine's TTFT and ITL, Mosaic GPU and Triton, bf16 without a cached prefix
# (where a split step's merge is most of its attention's cost), as the tree stands and with the patch;
# last, with the patch, fp8 after a cached 4,096-token prefix.
# Run from the repository root: bash benchmarks/results/split_k/run.sh
export PYTHONUNBUFFERED=1
D=benchmarks/results/split_k
F='W0000|I0000|W12|E12|DeprecationWarning|cuda_event|warnings.warn|^WARNING'
L='python3 benchmarks/bench_latency.py --backend mosaic,triton --max-num-seqs 256 --max-tokens 16 --batches 1,8 --prompts 32,256'
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
timeout 100 python3 $D/merge_cost.py 2>&1 | grep --line-buffered -v -E "$F" > $OUT/merge_cost.log; tail -14 $OUT/merge_cost.log
for variant in tree one_reduction; do
  [ $variant = one_reduction ] && git apply $D/one_reduction_merge.patch
  timeout 170 $L --kv-cache-dtype auto --prefix-len 0 --out $OUT/latency_auto_0_$variant 2>&1 | grep --line-buffered -v -E "$F" \
    > $OUT/latency_auto_0_$variant.log; echo "bf16, no prefix: $variant"; tail -11 $OUT/latency_auto_0_$variant.log
done
timeout 170 $L --kv-cache-dtype fp8 --prefix-len 4096 --out $OUT/latency_fp8_4096_one_reduction 2>&1 | grep --line-buffered -v -E "$F" \
  > $OUT/latency_fp8_4096_one_reduction.log; echo "fp8, prefix 4096: one_reduction"; tail -11 $OUT/latency_fp8_4096_one_reduction.log
git apply -R $D/one_reduction_merge.patch
