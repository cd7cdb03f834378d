# fp8 engines marking their decode steps (uniform_decode) and running their other decode-shaped launches
# on the query tiles, against the routing by shape: the kernels' A/B (kernels), the engine's TTFT after a
# cached prefix and ITL with Triton as the reference (latency: at e6f93a9, the commit that marked them,
# and with old_routing.patch applied there, the routing by shape); the query tiles' split-K by padded
# sequences or by the tiles a launch's tokens fill (splits); TTFT after a cached prefix as the tree
# stands (prefix).
# Run from the repository root: bash benchmarks/results/mosaic/fp8_decode_steps/run.sh kernels|splits|latency|prefix
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
esac
done
