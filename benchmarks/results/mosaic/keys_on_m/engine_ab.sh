# The engine with bf16 decode launches of at most a token a sequence on keys-on-M decode (routing.patch:
# the decode kernel of kernels/paged_attention_mgpu_decode.py made to read bf16 pools too) against the
# query tiles, Mosaic both: nano-vllm's workload, then ITL at batch 1 / 64 / 256, in one call.
# Run from the repository root on a clean checkout: bash benchmarks/results/mosaic/keys_on_m/engine_ab.sh
export PYTHONUNBUFFERED=1
F='W0000|I0000|W12|E12|DeprecationWarning|cuda_event|warnings.warn|^WARNING'
P=benchmarks/results/mosaic/keys_on_m/routing.patch
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
run() {  # $1: label
  timeout 170 python3 benchmarks/bench_throughput.py --backend mosaic --hf-requests 0 --out $OUT/throughput_$1 2>&1 | grep -v -E "$F" > $OUT/throughput_$1.log
  echo "throughput $1: $(grep -a -A1 '^run ' $OUT/throughput_$1.log | tail -1)"
}
lat() {
  timeout 150 python3 benchmarks/bench_latency.py --backend mosaic --batches 1,64,256 --prompts 32 --out $OUT/latency_$1 2>&1 | grep -v -E "$F" > $OUT/latency_$1.log
  echo "latency $1:"; grep -a -E "^mosaic" $OUT/latency_$1.log
}
run tiles_1
git apply $P && run keys_on_m_1
git apply -R $P && run tiles_2
git apply $P && run keys_on_m_2 && lat keys_on_m
git apply -R $P && lat tiles
