# Mosaic GPU kernels of a warm-up exported in worker processes at once (kernels/lowered_once.py,
# export_traced) instead of one at a time in the engine's process; an fp8 engine on the Mosaic backend:
#   tokens:  greedy token ids of engines built one after another in one process (in_process, workers,
#            in_process), with each cold warm-up's profile; greedy_tokens.py
#   startup: bench_startup.py (cold and cached start, first TTFT) with the workers ("tree") and without
#            them ("in_process": no_workers.patch, which makes worker_count() return 0; it applies to the
#            tree, and did to bfc6dee, where these runs were made)
# Run from the repository root: bash benchmarks/results/startup/export_workers/run.sh [tokens] [startup]
export PYTHONUNBUFFERED=1
D=benchmarks/results/startup/export_workers
F='W0000|I0000|W12|E12|DeprecationWarning|cuda_event|warnings.warn|^WARNING'
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
nproc | tee $OUT/nproc.txt
for part in ${@:-tokens startup}; do case $part in
tokens)
  timeout ${TOKENS_LIMIT:-300} python3 $D/greedy_tokens.py ${TOKENS:-in_process workers in_process} 2>&1 | grep --line-buffered -v -E "$F" > $OUT/tokens.log
  grep -E "warm-up|equal" $OUT/tokens.log | cut -c1-400 ;;
startup)
  for variant in ${STARTUP:-in_process tree}; do
    [ $variant != tree ] && git apply $D/no_workers.patch
    timeout 180 python3 benchmarks/bench_startup.py --backend mosaic --kv-cache-dtype fp8 --out $OUT/startup_$variant 2>&1 \
      | grep --line-buffered -v -E "$F" > $OUT/startup_$variant.log; echo "start-up: $variant"; tail -6 $OUT/startup_$variant.log
    [ $variant != tree ] && git apply -R $D/no_workers.patch
  done ;;
esac; done
