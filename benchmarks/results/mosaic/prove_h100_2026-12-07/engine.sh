# The engine on each attention backend, bf16 pool, Qwen3-0.6B shapes, in one call: ITL and TTFT at batch
# 1 / 64 / 256 with 32-token prompts (both backends in one process), then nano-vllm's workload on each.
# Run from the repository root: bash benchmarks/results/mosaic/prove_h100_2026-12-07/engine.sh
export PYTHONUNBUFFERED=1
F='W0000|I0000|W12|E12|DeprecationWarning|cuda_event|warnings.warn|^WARNING'
timeout 200 python3 benchmarks/bench_latency.py --backend triton,mosaic --batches 1,64,256 --prompts 32 \
  --out $OUT/latency 2>&1 | grep --line-buffered -v -E "$F" > $OUT/latency.log
tail -12 $OUT/latency.log
for b in mosaic triton; do
  timeout 150 python3 benchmarks/bench_throughput.py --backend $b --hf-requests 0 --out $OUT/throughput_$b 2>&1 \
    | grep --line-buffered -v -E "$F" > $OUT/throughput_$b.log
  echo "throughput $b: $(grep -a -A1 '^run ' $OUT/throughput_$b.log | tail -1)"
done
