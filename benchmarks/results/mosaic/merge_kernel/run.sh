# Split-K's merge as one Mosaic GPU kernel (merge_kernel.patch: kernels/split_k_merge_mgpu.py, for the
# query tiles' and the decode kernel's split launches, each program copying only the splits its token's
# tile wrote) against XLA's merge (the tree: a chain of small reductions over every split's partials).
#   check:   check_attention_mgpu.py --only check with the patch (the split launches' outputs against the reference)
#   kernel:  split_cost.py both ways (a lone 32-token chunk at 1-32 splits with and without a cached
#            prefix, a mixed launch; GPU time by kernel)
#   latency: the engine's TTFT and ITL both ways (bench_latency; LAT_RUNS="kv:prefix ..." picks the runs,
#            LAT_SHAPES their --batches and --prompts)
#   profile: a batch-1 decode step after 4,096 tokens and a lone 32-token prompt's first token (bf16
#            pool) traced both ways, and Triton's (tools/profile_step.py: GPU time by kernel; PROFILES picks)
#   startup: bench_startup.py both ways (an fp8 engine on Mosaic: cold and cached start; each merge
#            kernel is one more Mosaic GPU lowering in the steps that split)
# Run from the repository root: bash benchmarks/results/mosaic/merge_kernel/run.sh check|kernel|latency|profile|startup ...
export PYTHONUNBUFFERED=1
D=benchmarks/results/mosaic/merge_kernel
F='W0000|I0000|W12|E12|DeprecationWarning|cuda_event|warnings.warn|^WARNING'
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
both() {  # both AS_IS PATCHED COMMAND: COMMAND as the tree stands, then with merge_kernel.patch, {} naming each
  local as_is=$1 patched=$2; shift 2
  eval "${@//\{\}/$as_is}"
  git apply $D/merge_kernel.patch
  eval "${@//\{\}/$patched}"
  git apply -R $D/merge_kernel.patch
}
for part in "$@"; do
case "$part" in
check)
  git apply $D/merge_kernel.patch; mkdir -p $OUT/check
  timeout 240 python3 benchmarks/check_attention_mgpu.py --only check --out $OUT/check 2>&1 \
    | grep --line-buffered -v -E "$F" > $OUT/check/check.log
  git apply -R $D/merge_kernel.patch
  grep -E "FAILED|^errors" $OUT/check/check.log | cut -c1-300; sed -n "/^correctness/,/^decode/p" $OUT/check/check.log ;;
kernel)
  both xla kernel "timeout 150 python3 benchmarks/results/mosaic/fp8_decode_steps/split_cost.py 2>&1 \
    | grep --line-buffered -v -E '$F' > \$OUT/split_cost_{}.log; echo {}; tail -18 \$OUT/split_cost_{}.log | cut -c1-240" ;;
latency)
  L="python3 benchmarks/bench_latency.py --backend mosaic --max-num-seqs 256 --max-tokens 16 ${LAT_SHAPES:---batches 1,8 --prompts 32,256}"
  for run in ${LAT_RUNS:-auto:0 fp8:0 auto:4096 fp8:4096}; do kv=${run%:*} pre=${run#*:}
    both xla kernel "timeout 100 $L --kv-cache-dtype $kv --prefix-len $pre --out \$OUT/lat_${kv}_${pre}_{} 2>&1 \
      | grep --line-buffered -v -E '$F' > \$OUT/lat_${kv}_${pre}_{}.log; echo $kv prefix $pre {}; tail -6 \$OUT/lat_${kv}_${pre}_{}.log"
  done ;;
profile)  # PROFILES="decode ttft" picks: a batch-1 decode step after 4,096 tokens, or a lone 32-token
  # prompt's first token on a 256-slot engine (padded to as many sequences as tokens, as bench_latency's are)
  show() { grep -E "untraced: median|GPU kernel time" $1 | cut -c1-200; sed -n '/kernel (normalised name)/,$p' $1 | head -16 | cut -c1-110; }
  for prof in ${PROFILES:-decode ttft}; do
    case $prof in
    decode) P='python3 tools/profile_step.py --batch 1 --ctx 4096 --steps 30 --top 14' ;;
    ttft) P='python3 tools/profile_step.py --ttft --ctx 32 --max-num-seqs 256 --steps 30 --top 14' ;;
    esac
    both xla kernel "timeout 100 $P --backend mosaic --out \$OUT/${prof}_{} 2>&1 | grep --line-buffered -v -E '$F' \
      > \$OUT/${prof}_{}.log; echo $prof mosaic {}; show \$OUT/${prof}_{}.log"
    timeout 100 $P --backend triton --out $OUT/${prof}_triton 2>&1 | grep --line-buffered -v -E "$F" > $OUT/${prof}_triton.log
    echo $prof triton; show $OUT/${prof}_triton.log
  done ;;
startup)
  both xla kernel "timeout 220 python3 benchmarks/bench_startup.py --backend mosaic --kv-cache-dtype fp8 --out \$OUT/startup_{} 2>&1 \
    | grep --line-buffered -v -E '$F' > \$OUT/startup_{}.log; echo start-up {}; tail -6 \$OUT/startup_{}.log" ;;
esac
done
