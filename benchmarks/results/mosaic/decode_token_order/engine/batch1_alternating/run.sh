export PYTHONUNBUFFERED=1
F='^WARNING\|^I0000\|^W0000\|^E1203\|^W1203'
for b in triton mosaic triton2 mosaic2 triton3 mosaic3; do
  timeout 60 python3 benchmarks/bench_latency.py --backend ${b%[23]} --batches 1 --prompts 32 --out $OUT/latency_$b 2>&1 | grep --line-buffered -v "$F" > $OUT/latency_$b.log; echo "$b $(grep -a 'ITL p50' $OUT/latency_$b.log | head -1)"
done
