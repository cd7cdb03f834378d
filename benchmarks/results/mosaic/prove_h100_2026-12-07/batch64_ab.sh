# Engine ITL at batch 1 and 64 (32-token prompts, bf16 pool), both backends in one process, for the tree of
# an earlier commit (default 2a62af5, where batch 64 measured 0.98x Triton's) and then this tree, each with a
# fresh compilation cache, in one call. Run from the repository root (a checkout with that commit in its git):
#   bash benchmarks/results/mosaic/prove_h100_2026-12-07/batch64_ab.sh [commit]
export PYTHONUNBUFFERED=1
F='W0000|I0000|W12|E12|DeprecationWarning|cuda_event|warnings.warn|^WARNING'
OLD=${1:-2a62af5}
HERE=$(pwd)
rm -rf /tmp/old && mkdir -p /tmp/old && git archive $OLD | tar -x -C /tmp/old
for tree in /tmp/old $HERE; do
  name=$([ $tree = $HERE ] && echo tree || echo $OLD)
  (cd $tree && python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
   JAXPAGED_COMPILE_CACHE=$(mktemp -d) timeout 200 python3 benchmarks/bench_latency.py --backend triton,mosaic \
     --batches 1,64 --prompts 32 --out $OUT/latency_$name 2>&1 | grep --line-buffered -v -E "$F" > $OUT/latency_$name.log)
  echo "== $name"; tail -7 $OUT/latency_$name.log | head -5
done
