# The nano-vllm workload, a process a backend, both in one call (the second call: mosaic first).
# The traced runs: bench_throughput.py --backend mosaic|triton --hf-requests 0 --trace (trace_*.log).
export PYTHONUNBUFFERED=1
F='W0000|I0000|W12|E12|DeprecationWarning|cuda_event|warnings.warn|^WARNING'
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
for b in triton mosaic; do
  timeout 170 python3 benchmarks/bench_throughput.py --backend $b --hf-requests 0 --out $OUT/throughput_$b 2>&1 | grep -v -E "$F" > $OUT/throughput_$b.log
  echo "throughput $b: $(grep -a -A1 '^run ' $OUT/throughput_$b.log | tail -1)"
done
