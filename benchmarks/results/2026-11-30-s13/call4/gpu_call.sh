#!/bin/bash
# Session 13, call 4: float32 tokens fused vs unfused (every float32 row), then batch-1 latency again.
export PYTHONUNBUFFERED=1
S=$(date +%s)
mkdir -p $OUT/r
export JAXPAGED_COMPILE_CACHE=$PWD/.xlacache
timeout 250 python3 benchmarks/check_fused_outputs.py > $OUT/r/cf.log 2>&1; echo "== cf rc $? $(( $(date +%s) - S )) s"
grep "identical\|differ\|MISMATCH" $OUT/r/cf.log | cut -c1-120
L="benchmarks/bench_latency.py --batches 1 --prompts 32 --repeats 30"
for x in "l5:auto" "l6:jax" "l7:auto"; do n=${x%%:*}; r=${x#*:}
  E=$(( $(date +%s) - S )); if [ $E -gt 330 ]; then break; fi
  timeout 90 python3 $L --token-readback $r --out $OUT/r/$n > $OUT/r/$n.log 2>&1; echo "== $n [$r] rc $? $(( $(date +%s) - S )) s"
  grep -A1 "^batch" $OUT/r/$n.log | tail -1; grep "token readback" $OUT/r/$n.log | cut -c1-200
done
tar czf $OUT/r.tgz -C $OUT r
rm -rf $OUT/r
