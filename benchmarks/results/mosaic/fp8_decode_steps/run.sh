# fp8 engines marking their decode steps (uniform_decode) and running their other decode-shaped launches
# on the query tiles, against the routing by shape: the kernels' A/B (kernels), the engine's TTFT after a
# cached prefix and ITL with Triton as the reference (latency: at e6f93a9, the commit that marked them,
# and with old_routing.patch applied there, the routing by shape); the query tiles' split-K by padded
# sequences or by the tiles a launch's tokens fill (splits); TTFT after a cached prefix as the tree
# stands (prefix); the tree as it stands against marked_by_tiles.patch (fp8 engines mark their decode steps,
# other decode-shaped fp8 launches run the query tiles, whose split-K counts the tiles a launch's tokens
# fill; with the tests and docstrings that change with it): TTFT after a cached prefix, fp8 and bf16, and the nano-vllm workload over fp8 (marked).
# capped: as marked, with split-K capped at 4 where the tokens' tiles are fewer than the sequences
# (marked_capped.patch): after a cached prefix (fp8) and without one (fp8, bf16), against the tree.
# splitcost: where split-K's cost goes on a lone 32-token chunk with and without a prefix (split_cost.py), as
# the tree stands and with work_list.patch (a split launch runs persistent programs over its non-empty
# (tile, split) items). worklist: the engine's TTFT with and without a prefix, fp8 and bf16, as the tree
# stands and with marked_by_tiles.patch + work_list.patch (WL_RUNS="kv:prefix ..." picks the runs).
# mergerows: split-K on the query tiles capped at MERGE_ROWS partial rows a tile (merge_rows.patch), the
# kernel at 8-32 splits and the engine's TTFT both ways (MR_RUNS="kv:prefix ..." picks the runs).
# The patches of the parts before splitcost apply to the tree they were measured on (a139f76 and before).
# Run from the repository root: bash benchmarks/results/mosaic/fp8_decode_steps/run.sh kernels|splits|latency|prefix|marked|capped|splitcost|worklist|mergerows
export PYTHONUNBUFFERED=1
D=benchmarks/results/mosaic/fp8_decode_steps
F='W0000|I0000|W12|E12|DeprecationWarning|cuda_event|warnings.warn|^WARNING'
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
both() {  # both "PATCH..." AS_IS PATCHED COMMAND: COMMAND as the tree stands, then with the patches applied,
  # {} naming each
  local patches=$1 as_is=$2 patched=$3; shift 3
  eval "${@//\{\}/$as_is}"
  for p in $patches; do git apply $D/$p; done
  eval "${@//\{\}/$patched}"
  for p in $(echo $patches | tr ' ' '\n' | tac); do git apply -R $D/$p; done
}
for part in "$@"; do
case "$part" in
kernels)
  timeout 200 python3 $D/kernels_ab.py 2>&1 | grep --line-buffered -v -E "$F" > $OUT/kernels_ab.log
  cut -c1-220 $OUT/kernels_ab.log ;;
splits)
  timeout 300 python3 $D/splits_ab.py 2>&1 | grep --line-buffered -v -E "$F" > $OUT/splits_ab.log
  cut -c1-260 $OUT/splits_ab.log ;;
latency)
  both old_routing.patch new old 'timeout 220 python3 benchmarks/bench_latency.py --backend mosaic,triton --kv-cache-dtype fp8 --batches 1,8 \
    --prompts 32,256 --prefix-len 4096 --max-num-seqs 256 --max-tokens 16 --out $OUT/latency_{} 2>&1 \
    | grep --line-buffered -v -E "$F" > $OUT/latency_{}.log; echo {}; tail -11 $OUT/latency_{}.log' ;;
prefix)  # as landed: fp8 and bf16, Mosaic against Triton, TTFT after a cached prefix
  for kv in fp8 auto; do
    timeout 200 python3 benchmarks/bench_latency.py --backend mosaic,triton --kv-cache-dtype $kv --batches 1,8 \
      --prompts 32,256 --prefix-len 4096 --max-num-seqs 256 --max-tokens 16 --out $OUT/prefix_$kv 2>&1 \
      | grep --line-buffered -v -E "$F" > $OUT/prefix_$kv.log
    echo "KV $kv"; tail -11 $OUT/prefix_$kv.log
  done ;;
marked)
  L='python3 benchmarks/bench_latency.py --backend mosaic --prefix-len 4096 --max-num-seqs 256 --max-tokens 16'
  both marked_by_tiles.patch shape marked "timeout 120 $L --kv-cache-dtype fp8 --batches 1,8 --prompts 32,256 --out \$OUT/marked_fp8_{} 2>&1 \
    | grep --line-buffered -v -E '$F' > \$OUT/marked_fp8_{}.log; echo fp8 {}; tail -6 \$OUT/marked_fp8_{}.log"
  both marked_by_tiles.patch shape marked "timeout 100 $L --kv-cache-dtype auto --batches 1,8 --prompts 32 --out \$OUT/marked_bf16_{} 2>&1 \
    | grep --line-buffered -v -E '$F' > \$OUT/marked_bf16_{}.log; echo bf16 {}; tail -4 \$OUT/marked_bf16_{}.log"
  both marked_by_tiles.patch shape marked "timeout 110 python3 benchmarks/bench_throughput.py --backend mosaic --kv-cache-dtype fp8 \
    --hf-requests 0 --out \$OUT/marked_tput_{} 2>&1 | grep --line-buffered -v -E '$F' > \$OUT/marked_tput_{}.log; \
    echo throughput {}: \$(grep -a -A1 '^run ' \$OUT/marked_tput_{}.log | tail -1)" ;;
capped)
  L='python3 benchmarks/bench_latency.py --backend mosaic --max-num-seqs 256 --max-tokens 16 --batches 1,8 --prompts 32,256'
  git apply $D/marked_capped.patch
  timeout 100 $L --kv-cache-dtype fp8 --prefix-len 4096 --out $OUT/capped_fp8_4096 2>&1 | grep --line-buffered -v -E "$F" \
    > $OUT/capped_fp8_4096.log; echo "fp8 capped, prefix 4096"; tail -6 $OUT/capped_fp8_4096.log
  git apply -R $D/marked_capped.patch
  for kv in fp8 auto; do
    both marked_capped.patch shape capped "timeout 100 $L --kv-cache-dtype $kv --out \$OUT/capped_${kv}_0_{} 2>&1 \
      | grep --line-buffered -v -E '$F' > \$OUT/capped_${kv}_0_{}.log; echo $kv {}, no prefix; tail -6 \$OUT/capped_${kv}_0_{}.log"
  done ;;
splitcost)
  both work_list.patch tree work_list "timeout 200 python3 $D/split_cost.py 2>&1 | grep --line-buffered -v -E '$F' \
    > \$OUT/split_cost_{}.log; echo {}; tail -18 \$OUT/split_cost_{}.log" ;;
worklist)
  L='python3 benchmarks/bench_latency.py --backend mosaic --max-num-seqs 256 --max-tokens 16 --batches 1,8 --prompts 32,256'
  for run in ${WL_RUNS:-fp8:4096 fp8:0 auto:0 auto:4096}; do kv=${run%:*} pre=${run#*:}
    both "marked_by_tiles.patch work_list.patch" tree work_list "timeout 100 $L --kv-cache-dtype $kv --prefix-len $pre \
      --out \$OUT/wl_${kv}_${pre}_{} 2>&1 | grep --line-buffered -v -E '$F' > \$OUT/wl_${kv}_${pre}_{}.log; \
      echo $kv prefix $pre {}; tail -6 \$OUT/wl_${kv}_${pre}_{}.log"
  done ;;
mergerows)  # the lone chunk at 8-32 splits (fp8 and bf16), then the engine as the tree stands and with
  # merge_rows.patch (split-K on the query tiles capped at MERGE_ROWS partial rows a tile: 16 splits
  # for tiles of 32 tokens), TTFT without a prefix and after one, fp8 and bf16
  timeout 150 python3 $D/split_cost.py 8,16,32 fp8,bf16 2>&1 | grep --line-buffered -v -E "$F" > $OUT/split_cost_8_32.log
  tail -14 $OUT/split_cost_8_32.log
  L='python3 benchmarks/bench_latency.py --backend mosaic --max-num-seqs 256 --max-tokens 16 --batches 1,8 --prompts 32,256'
  for run in ${MR_RUNS:-fp8:0 auto:0 fp8:4096}; do kv=${run%:*} pre=${run#*:}
    both merge_rows.patch tree merge_rows "timeout 100 $L --kv-cache-dtype $kv --prefix-len $pre \
      --out \$OUT/mr_${kv}_${pre}_{} 2>&1 | grep --line-buffered -v -E '$F' > \$OUT/mr_${kv}_${pre}_{}.log; \
      echo $kv prefix $pre {}; tail -6 \$OUT/mr_${kv}_${pre}_{}.log"
  done ;;
esac
done
