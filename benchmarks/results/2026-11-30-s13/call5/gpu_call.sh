#!/bin/bash
# Session 13, call 5: batch-1 latency (default reader) three more times, then nano-vllm's workload once.
export PYTHONUNBUFFERED=1
S=$(date +%s)
mkdir -p $OUT/r
export JAXPAGED_COMPILE_CACHE=$PWD/.xlacache
L="benchmarks/bench_latency.py --batches 1 --prompts 32 --repeats 30"
for n in l8 l9 l10; do
  timeout 80 python3 $L --out $OUT/r/$n > $OUT/r/$n.log 2>&1; echo "== $n [default] rc $? $(( $(date +%s) - S )) s"
  grep -A1 "^batch" $OUT/r/$n.log | tail -1; grep "token readback" $OUT/r/$n.log | cut -c1-200
done
E=$(( $(date +%s) - S ))
timeout $(( 300 - E )) python3 benchmarks/bench_throughput.py --hf-requests 0 --out $OUT/r/n4 > $OUT/r/n4.log 2>&1; echo "== n4 rc $? $(( $(date +%s) - S )) s"
grep "^compile\|^jaxpaged \|Error" $OUT/r/n4.log | tail -2 | cut -c1-220
tar czf $OUT/r.tgz -C $OUT r
rm -rf $OUT/r
