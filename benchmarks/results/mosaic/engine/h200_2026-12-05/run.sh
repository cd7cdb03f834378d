# batch-1 first token and decode step, both backends: kernels by time, busy, idle gap
export PYTHONUNBUFFERED=1
F='W0000|I0000|W1205|E1205|DeprecationWarning|cuda_event|warnings.warn|^WARNING'
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
for b in triton mosaic; do
  timeout 110 python3 tools/profile_step.py --ttft --ctx 32 --steps 20 --backend $b --top 30 --out /tmp/ttft_$b --trace-dir /tmp/tr_ttft_$b 2>&1 | grep -v -E "$F" > $OUT/ttft_$b.log
  cp /tmp/ttft_$b/profile_step.json $OUT/ttft_$b.json
  grep -a "add_request ->" $OUT/ttft_$b.log
done
for b in triton mosaic; do
  timeout 110 python3 tools/profile_step.py --batch 1 --ctx 32 --steps 20 --backend $b --top 30 --out /tmp/dec_$b --trace-dir /tmp/tr_dec_$b 2>&1 | grep -v -E "$F" > $OUT/dec_$b.log
  cp /tmp/dec_$b/profile_step.json $OUT/dec_$b.json
done
tail -45 $OUT/ttft_triton.log; tail -45 $OUT/ttft_mosaic.log
