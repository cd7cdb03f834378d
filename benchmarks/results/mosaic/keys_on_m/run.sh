# Decode over bf16 pools on the keys-on-M decode kernel (what an engine's decode step runs since it
# marks the step uniform_decode): the GPU check, the decode launches against the read ceiling and Triton,
# then the engine against Triton (ITL at batch 1 / 64 / 256; nano-vllm's workload), in one call.
# Run from the repository root: bash benchmarks/results/mosaic/keys_on_m/run.sh check|kernel|engine (or several)
export PYTHONUNBUFFERED=1
F='W0000|I0000|W12|E12|DeprecationWarning|cuda_event|warnings.warn|^WARNING'
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
for part in "$@"; do
case "$part" in
check)
  timeout 150 python3 benchmarks/check_attention_mgpu.py --only check --out $OUT 2>&1 | grep --line-buffered -v -E "$F" > $OUT/check.log
  grep -a -E "errors|mosaic_ok.: False" $OUT/check.log | cut -c1-300 | tail -5 ;;
kernel)
  timeout 400 python3 benchmarks/check_attention_mgpu.py --only check,decode,sweep --no-sweep --reps 5 --out $OUT 2>&1 \
    | grep --line-buffered -v -E "$F" > $OUT/check.log
  grep -a -E "errors|decode sweep B=|^\|" $OUT/check.log | cut -c1-400 | tail -40 ;;
engine)
  timeout 200 python3 benchmarks/bench_latency.py --backend triton,mosaic --batches 1,64,256 --prompts 32 \
    --out $OUT/latency 2>&1 | grep --line-buffered -v -E "$F" > $OUT/latency.log
  tail -12 $OUT/latency.log
  for b in mosaic triton; do
    timeout 150 python3 benchmarks/bench_throughput.py --backend $b --hf-requests 0 --out $OUT/throughput_$b 2>&1 \
      | grep --line-buffered -v -E "$F" > $OUT/throughput_$b.log
    echo "throughput $b: $(grep -a -A1 '^run ' $OUT/throughput_$b.log | tail -1)"
    grep -a -o '"warmup_compile_s": [0-9.]*, .*"compiled_shapes": [0-9]*' $OUT/throughput_$b.log
  done
  ;;
esac
done
