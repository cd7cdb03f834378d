# Each Mosaic GPU attention launch lowered once per process (lowered_once.patch: models/lowered_once.py,
# jax.export of each launch, embedded in every step that calls it) against the tree, which lowers the
# kernel again in each step that calls it (a warm-up's two sampler variants of a bucket: the same
# launches). An fp8 engine on the Mosaic backend, both ways: a cold warm-up's profile (lowering seconds)
# and greedy token ids, which must be equal (the same kernels; greedy_tokens.py); then, with `startup`,
# bench_startup.py both ways (cold and cached start, first TTFT).
# Run from the repository root: bash benchmarks/results/startup/lowered_once/run.sh [tokens] [startup]
export PYTHONUNBUFFERED=1
D=benchmarks/results/startup/lowered_once
F='W0000|I0000|W12|E12|DeprecationWarning|cuda_event|warnings.warn|^WARNING'
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
for part in ${@:-tokens}; do for variant in tree lowered_once; do
  [ $variant = lowered_once ] && git apply $D/lowered_once.patch
  case $part in
  tokens)
    timeout 200 python3 $D/greedy_tokens.py $variant 2>&1 | grep --line-buffered -v -E "$F" > $OUT/tokens_$variant.log
    tail -3 $OUT/tokens_$variant.log ;;
  startup)
    timeout 220 python3 benchmarks/bench_startup.py --backend mosaic --kv-cache-dtype fp8 --out $OUT/startup_$variant 2>&1 \
      | grep --line-buffered -v -E "$F" > $OUT/startup_$variant.log; echo "start-up: $variant"; tail -6 $OUT/startup_$variant.log ;;
  esac
  [ $variant = lowered_once ] && git apply -R $D/lowered_once.patch
done; done
[ -f $OUT/tokens_tree.json ] && [ -f $OUT/tokens_lowered_once.json ] && \
  echo "greedy token ids equal, tree vs lowered_once: $(cmp -s $OUT/tokens_tree.json $OUT/tokens_lowered_once.json && echo yes || echo NO)"
