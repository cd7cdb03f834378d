# Batch-1 first token of a 32-token prompt, bf16 pool, where each backend's step time goes
# (tools/profile_step.py --ttft: untraced wall time, then a trace: kernels, GPU busy, host launch):
# Triton and Mosaic in a 256-slot engine (bench_latency's; the step pads to 32 sequences, so Mosaic
# runs its query tiles with split-K), and Mosaic in a 1-slot engine (one sequence: its prefill kernel).
# mosaic_nosplit: Mosaic with nosplit.patch (the query tiles never split: no split-K merge).
# MAXLEN: the engines' max_model_len (default: profile_step's, the prompt + 8, which leaves Mosaic's
# 32-token launch unsplit; bench_latency's engines fit their longest prompt, e.g. 1,600).
# Run from the repository root: [RUNS="triton:256 mosaic:256"] [LIMIT=150] [MAXLEN=1600] bash benchmarks/results/mosaic/ttft_thunks/run.sh
export PYTHONUNBUFFERED=1
F='W0000|I0000|W12|E12|DeprecationWarning|cuda_event|warnings.warn|^WARNING'
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
for run in ${RUNS:-triton:256 mosaic:256 mosaic:1}; do
  b=${run%:*}; s=${run#*:}; backend=${b%_nosplit}
  [ $b != $backend ] && git apply benchmarks/results/mosaic/ttft_thunks/nosplit.patch
  timeout ${LIMIT:-150} python3 tools/profile_step.py --ttft --ctx 32 --steps 20 --backend $backend --max-num-seqs $s ${MAXLEN:+--max-model-len $MAXLEN} --top 40 \
    --out /tmp/ttft_${b}_$s --trace-dir /tmp/tr_${b}_$s 2>&1 | grep -v -E "$F" > $OUT/ttft_${b}_$s.log
  cp /tmp/ttft_${b}_$s/profile_step.json $OUT/ttft_${b}_$s.json
  [ $b != $backend ] && git apply -R benchmarks/results/mosaic/ttft_thunks/nosplit.patch
  echo "== $b, max_num_seqs $s"; grep -a -E "add_request ->|busy|launch|wall" $OUT/ttft_${b}_$s.log | head -8
done
