# A cold warm-up building its exported Mosaic GPU kernels at once, ahead of the steps' compilations
# (kernels/lowered_once.py, compile_exported) against each step's compilation building the kernels it
# calls ("none": no_kernel_builds.patch, which makes compile_exported build nothing; it applies to the
# tree): bench_startup.py on an fp8 engine on the Mosaic backend, cold and cached, variants in turn.
# Run from the repository root: bash benchmarks/results/startup/kernel_builds/run.sh [variants...]
export PYTHONUNBUFFERED=1
D=benchmarks/results/startup/kernel_builds
F='W0000|I0000|W12|E12|DeprecationWarning|cuda_event|warnings.warn|^WARNING'
n=0
for variant in ${@:-tree none tree}; do
  n=$((n + 1))
  [ $variant != tree ] && git apply $D/no_kernel_builds.patch
  timeout 200 python3 benchmarks/bench_startup.py --backend mosaic --kv-cache-dtype fp8 --out $OUT/startup_${n}_$variant 2>&1 \
    | grep --line-buffered -v -E "$F" > $OUT/startup_${n}_$variant.log; echo "start-up $n: $variant"; tail -6 $OUT/startup_${n}_$variant.log | cut -c1-330
  [ $variant != tree ] && git apply -R $D/no_kernel_builds.patch
done
