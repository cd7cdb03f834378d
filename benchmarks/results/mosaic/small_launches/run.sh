# Where the Mosaic GPU backend's time goes in an engine's small launches, against Triton's: a batch-1
# decode step after 4,096 tokens (bf16 and fp8 pools) and a lone 32-token prompt's first token on a
# 256-slot engine (padded to as many sequences as tokens, as bench_latency's engines do), each traced
# with tools/profile_step.py (GPU time by kernel; PROFILE_KV="auto fp8" picks the decode pools). `check`
# runs the GPU check of the kernels against the reference first (check_attention_mgpu.py --only check).
# Run from the repository root: bash benchmarks/results/mosaic/small_launches/run.sh [check] [profile]
export PYTHONUNBUFFERED=1
F='W0000|I0000|W12|E12|DeprecationWarning|cuda_event|warnings.warn|^WARNING'
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
show() {  # the step's wall, GPU time and its top kernels
  grep -E "untraced: median|GPU kernel time|idle gap" $1 | cut -c1-200; sed -n '/kernel (normalised name)/,$p' $1 | head -14 | cut -c1-110
}
for part in "$@"; do
case "$part" in
check)
  mkdir -p $OUT/check
  timeout 240 python3 benchmarks/check_attention_mgpu.py --only check --out $OUT/check 2>&1 \
    | grep --line-buffered -v -E "$F" > $OUT/check/check.log
  grep -E "FAILED|^errors" $OUT/check/check.log | cut -c1-300; sed -n "/^correctness/,/^decode/p" $OUT/check/check.log ;;
profile)
  for kv in ${PROFILE_KV:-auto fp8}; do for b in mosaic triton; do
    timeout 110 python3 tools/profile_step.py --batch 1 --ctx 4096 --steps 30 --backend $b --kv-cache-dtype $kv \
      --top 12 --out $OUT/decode1_${kv}_$b 2>&1 | grep --line-buffered -v -E "$F" > $OUT/decode1_${kv}_$b.log
    echo "== decode batch 1 after 4096, $kv, $b"; show $OUT/decode1_${kv}_$b.log
  done; done
  for b in mosaic triton; do
    timeout 90 python3 tools/profile_step.py --ttft --ctx 32 --max-num-seqs 256 --steps 30 --backend $b --top 12 \
      --out $OUT/ttft32_$b 2>&1 | grep --line-buffered -v -E "$F" > $OUT/ttft32_$b.log
    echo "== first token of a lone 32-token prompt, 256 slots, bf16, $b"; show $OUT/ttft32_$b.log
  done ;;
esac
done
