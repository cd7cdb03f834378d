# Mosaic GPU attention lowered once per process instead of again in each step that launches it (a
# warm-up's two sampler variants of a bucket launch the same kernels), two ways:
#   lowered_once.patch (models/lowered_once.py): each attention launch, its kernels and the XLA code
#     around them, exported with jax.export and the export embedded in every step;
#   kernel_once.patch (kernels/lowered_once.py): each Mosaic GPU kernel alone exported, the XLA code
#     around it the step's own (on the CPU, cross-lowered: the same module text as the tree's but for
#     the export's call wrapper, which XLA inlines).
# Both patches apply to 22ee743, where these runs were made; kernel_once.patch is in the tree since
# 6c4f5f7 (kernels/lowered_once.py), so from there on the tree is what it measured.
# An fp8 engine on the Mosaic backend:
#   tokens:  greedy token ids of engines built one after another in one process (tree, lowered_once,
#            kernel_once, tree: one process shares XLA's GEMM autotuning, so equal programs give equal
#            tokens), then a second process's tree (how far two processes' autotuning alone moves the
#            tokens), with each cold warm-up's profile (lowering seconds); greedy_tokens.py
#   startup: bench_startup.py for the tree and each patch (cold and cached start, first TTFT)
# Run from the repository root: bash benchmarks/results/startup/lowered_once/run.sh [tokens] [startup]
# (TOKENS="tree kernel_once tree" SECOND=0 STARTUP="tree kernel_once": fewer engines, one call)
export PYTHONUNBUFFERED=1
D=benchmarks/results/startup/lowered_once
F='W0000|I0000|W12|E12|DeprecationWarning|cuda_event|warnings.warn|^WARNING'
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
for part in ${@:-tokens}; do case $part in
tokens)
  git apply $D/lowered_once.patch $D/kernel_once.patch
  timeout 420 python3 $D/greedy_tokens.py ${TOKENS:-tree lowered_once kernel_once tree} 2>&1 | grep --line-buffered -v -E "$F" > $OUT/tokens_one_process.log
  git apply -R $D/lowered_once.patch $D/kernel_once.patch
  grep -E "warm-up|equal" $OUT/tokens_one_process.log | cut -c1-300
  [ "${SECOND:-1}" = 0 ] && continue
  mkdir -p $OUT/second_process
  OUT=$OUT/second_process timeout 150 python3 $D/greedy_tokens.py tree 2>&1 | grep --line-buffered -v -E "$F" > $OUT/tokens_second_process.log
  echo "second process's tree equal to the first's: $(cmp -s $OUT/tokens_0_tree.json $OUT/second_process/tokens_0_tree.json && echo yes || echo NO)" ;;
startup)
  for variant in ${STARTUP:-tree lowered_once kernel_once}; do
    [ $variant != tree ] && git apply $D/$variant.patch
    timeout 180 python3 benchmarks/bench_startup.py --backend mosaic --kv-cache-dtype fp8 --out $OUT/startup_$variant 2>&1 \
      | grep --line-buffered -v -E "$F" > $OUT/startup_$variant.log; echo "start-up: $variant"; tail -4 $OUT/startup_$variant.log
    [ $variant != tree ] && git apply -R $D/$variant.patch
  done ;;
esac; done
