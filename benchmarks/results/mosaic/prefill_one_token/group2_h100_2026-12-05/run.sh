# Mosaic with and without the decode-tile launch for one-token sequences (Qwen3-0.6B shapes, G=2):
# batch-1 first token and the nano-vllm workload; Triton's batch-1 as the reference
export PYTHONUNBUFFERED=1
F='W0000|I0000|W1205|E1205|DeprecationWarning|cuda_event|warnings.warn|^WARNING'
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
P=kernels/paged_attention_mgpu_prefill.py
cp $P /tmp/prefill_on.py
sed 's/    one_token_apart = not is_fp8(kv_pool.dtype)/    one_token_apart = False/' /tmp/prefill_on.py > /tmp/prefill_off.py
grep -c "one_token_apart = False" /tmp/prefill_off.py
lat() { timeout 60 python3 benchmarks/bench_latency.py --backend $1 --batches 1 --prompts 32 --out /tmp/l_$2 2>&1 | grep -v -E "$F" > /tmp/l_$2.log; echo "latency1 $2: $(grep -a -E '^ +1 ' /tmp/l_$2.log | head -1)" | tee -a $OUT/summary.txt; }
thr() { timeout 150 python3 benchmarks/bench_throughput.py --backend mosaic --hf-requests 0 --out /tmp/t_$1 2>&1 | grep -v -E "$F" > /tmp/t_$1.log; echo "throughput $1: $(grep -a -A1 '^run ' /tmp/t_$1.log | tail -1)" | tee -a $OUT/summary.txt; }
for r in 1 2; do
  cp /tmp/prefill_on.py $P; lat mosaic on$r
  cp /tmp/prefill_off.py $P; lat mosaic off$r
  lat triton triton$r
done
cp /tmp/prefill_on.py $P; thr on
cp /tmp/prefill_off.py $P; thr off
cp /tmp/prefill_on.py $P
tar czf $OUT/logs.tgz /tmp/l_*.log /tmp/t_*.log 2>/dev/null
