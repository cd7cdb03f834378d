# The fp8 value-slab layouts A/B (layout_ab.py), alternating, one process each (run from the repository root).
export PYTHONUNBUFFERED=1
F="^W0000\|^I0000\|DeprecationWarning\|cuda_event\|Source Location\|cuda_status\|cuda_executor\|^$"
for L in new old old new; do
  mkdir -p $OUT/$L
  timeout 75 python3 benchmarks/results/fp8/mosaic/layout_ab.py $L --model qwen3-0.6b --hf-requests 0 --kv-cache-dtype fp8 --out $OUT/$L 2>&1 | grep --line-buffered -v "$F" >> $OUT/$L/run.log
  echo "== $L"; grep "ours full" $OUT/$L/run.log | tail -1 | cut -c1-120
done
