# fp8 engines mark their decode steps (uniform_decode) and run their other decode-shaped launches on the
# query tiles: the kernels' A/B, then the engine's TTFT after a cached prefix and ITL against the routing
# by shape (old_routing.patch, applied to the first version of this change: decode-shaped launches over
# fp8 on the decode kernel, as before it), Triton in both as the reference; then start-up and nano-vllm's workload, each way.
# Run from the repository root: bash benchmarks/results/mosaic/fp8_decode_steps/run.sh kernels|splits|latency|prefix|startup|throughput
export PYTHONUNBUFFERED=1
D=benchmarks/results/mosaic/fp8_decode_steps
F='W0000|I0000|W12|E12|DeprecationWarning|cuda_event|warnings.warn|^WARNING'
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
both() {  # runs "$@" as landed (new), then with old_routing.patch applied (old), naming outputs by {}
  for way in new old; do
    [ $way = old ] && git apply $D/old_routing.patch
    eval "${@//\{\}/$way}"
    [ $way = old ] && git apply -R $D/old_routing.patch
  done
}
for part in "$@"; do
case "$part" in
kernels)
  timeout 200 python3 $D/kernels_ab.py 2>&1 | grep --line-buffered -v -E "$F" > $OUT/kernels_ab.log
  cut -c1-220 $OUT/kernels_ab.log ;;
splits)
  timeout 300 python3 $D/splits_ab.py 2>&1 | grep --line-buffered -v -E "$F" > $OUT/splits_ab.log
  cut -c1-260 $OUT/splits_ab.log ;;
latency)
  both 'timeout 220 python3 benchmarks/bench_latency.py --backend mosaic,triton --kv-cache-dtype fp8 --batches 1,8 \
    --prompts 32,256 --prefix-len 4096 --max-num-seqs 256 --max-tokens 16 --out $OUT/latency_{} 2>&1 \
    | grep --line-buffered -v -E "$F" > $OUT/latency_{}.log; echo {}; tail -11 $OUT/latency_{}.log' ;;
prefix)  # as landed: fp8 and bf16, Mosaic against Triton, TTFT after a cached prefix
  for kv in fp8 auto; do
    timeout 200 python3 benchmarks/bench_latency.py --backend mosaic,triton --kv-cache-dtype $kv --batches 1,8 \
      --prompts 32,256 --prefix-len 4096 --max-num-seqs 256 --max-tokens 16 --out $OUT/prefix_$kv 2>&1 \
      | grep --line-buffered -v -E "$F" > $OUT/prefix_$kv.log
    echo "KV $kv"; tail -11 $OUT/prefix_$kv.log
  done ;;
startup)
  both 'timeout 200 python3 benchmarks/bench_startup.py --model qwen3-0.6b --backend mosaic --kv-cache-dtype fp8 \
    --out $OUT/startup_{} 2>&1 | grep --line-buffered -v -E "$F" > $OUT/startup_{}.log; echo {}; tail -8 $OUT/startup_{}.log' ;;
throughput)
  both 'timeout 170 python3 benchmarks/bench_throughput.py --backend mosaic --kv-cache-dtype fp8 --hf-requests 0 \
    --out $OUT/throughput_{} 2>&1 | grep --line-buffered -v -E "$F" > $OUT/throughput_{}.log; \
    echo "throughput {}: $(grep -a -A1 "^run " $OUT/throughput_{}.log | tail -1)"' ;;
esac
done
