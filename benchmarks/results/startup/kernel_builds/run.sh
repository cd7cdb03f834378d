# A cold warm-up that builds its exported Mosaic GPU kernels at once, ahead of the steps' compilations
# ("built_ahead": kernel_builds.patch, lowered_once.compile_exported; each step's compilation waits for the
# kernels it launches), against each step's compilation building the kernels it calls ("tree"):
# bench_startup.py on an fp8 engine on the Mosaic backend, cold and cached, variants in turn.
# Run from the repository root: bash benchmarks/results/startup/kernel_builds/run.sh [variants...]
export PYTHONUNBUFFERED=1
D=benchmarks/results/startup/kernel_builds
F='W0000|I0000|W12|E12|DeprecationWarning|cuda_event|warnings.warn|^WARNING'
n=0
for variant in ${@:-built_ahead tree tree}; do
  n=$((n + 1))
  [ $variant = built_ahead ] && git apply $D/kernel_builds.patch
  timeout 200 python3 benchmarks/bench_startup.py --backend mosaic --kv-cache-dtype fp8 --out $OUT/startup_${n}_$variant 2>&1 \
    | grep --line-buffered -v -E "$F" > $OUT/startup_${n}_$variant.log; echo "start-up $n: $variant"; tail -6 $OUT/startup_${n}_$variant.log | cut -c1-330
  [ $variant = built_ahead ] && git apply -R $D/kernel_builds.patch
done
