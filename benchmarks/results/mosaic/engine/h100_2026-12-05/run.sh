# engine end to end, both backends in one call: nano-vllm workload, batch 64 latency, batch-1 ITL alternating
export PYTHONUNBUFFERED=1
F='W0000|I0000|W1205|E1205|DeprecationWarning|cuda_event|warnings.warn|^WARNING'
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
git rev-parse --short HEAD | tee -a $OUT/gpu.txt
for b in triton mosaic; do
  timeout 150 python3 benchmarks/bench_throughput.py --backend $b --hf-requests 0 --out $OUT/throughput_$b 2>&1 | grep -v -E "$F" > $OUT/throughput_$b.log
  echo "throughput $b: $(grep -a -A1 '^run ' $OUT/throughput_$b.log | tail -1)"
done
for b in triton mosaic; do
  timeout 100 python3 benchmarks/bench_latency.py --backend $b --batches 64 --prompts 1536 --out $OUT/latency64_$b 2>&1 | grep -v -E "$F" > $OUT/latency64_$b.log
  echo "latency64 $b: $(grep -a -E '^ +64 ' $OUT/latency64_$b.log | head -1)"
done
for b in triton mosaic triton2 mosaic2; do
  timeout 60 python3 benchmarks/bench_latency.py --backend ${b%2} --batches 1 --prompts 32 --out $OUT/latency1_$b 2>&1 | grep -v -E "$F" > $OUT/latency1_$b.log
  echo "latency1 $b: $(grep -a -E '^ +1 ' $OUT/latency1_$b.log | head -1)"
done
