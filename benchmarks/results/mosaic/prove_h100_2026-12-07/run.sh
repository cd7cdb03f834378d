#!/bin/bash
# the one-call measurement: correctness, decode sweep against the read ceiling, prefill against cuDNN
set -o pipefail
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv | tee $OUT/gpu.txt
git rev-parse --short HEAD | tee -a $OUT/gpu.txt
python3 benchmarks/check_attention_mgpu.py --only check,decode,sweep,prefill --no-sweep --reps 5 \
  --prefill 256+0,1024+0,2048+0,4096+0,8192+0,16384+0,2048+2048,8192+8192 --out $OUT 2>&1 \
  | grep -v -E "W0000|I0000|W12|DeprecationWarning|cuda_event|warnings.warn" | tee $OUT/prove.log | tail -60
