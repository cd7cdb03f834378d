export PYTHONUNBUFFERED=1
F='W0000|I0000|W12|E12|DeprecationWarning|cuda_event|warnings.warn|^WARNING'
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
git rev-parse --short HEAD | tee -a $OUT/gpu.txt
timeout 560 python3 benchmarks/bench_latency.py --backend triton,mosaic --batches 1,8,64 --prompts 32,1536 --out $OUT 2>&1 | grep -v -E "$F" | tee $OUT/latency.log | tail -22
