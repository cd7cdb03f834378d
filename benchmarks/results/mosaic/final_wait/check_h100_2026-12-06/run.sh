export PYTHONUNBUFFERED=1
F='W0000|I0000|W12|E12|DeprecationWarning|cuda_event|warnings.warn|^WARNING'
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
timeout 300 python3 benchmarks/check_attention_mgpu.py --only check --out $OUT 2>&1 | grep -v -E "$F" > $OUT/check.log
grep -E "errors|FAIL|fail|Error" $OUT/check.log | tail -5; tail -4 $OUT/check.log
timeout 200 python3 benchmarks/bench_latency.py --backend triton,mosaic --batches 64,256 --prompts 32 --out $OUT/lat 2>&1 | grep -v -E "$F" > $OUT/latency_short.log
tail -9 $OUT/latency_short.log
