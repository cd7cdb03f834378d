# Batch-1 first token at 32-token prompts (Qwen3-0.6B shapes, max_num_seqs 1: the prefill launch pads to
# 8 sequences): Mosaic with short launches on the query tiles (new) and on the prefill kernel (old),
# Triton beside them, alternating twice
export PYTHONUNBUFFERED=1
F='W0000|I0000|W12|E12|DeprecationWarning|cuda_event|warnings.warn|^WARNING'
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
P=kernels/paged_attention_mgpu.py
lat() { timeout 70 python3 benchmarks/bench_latency.py --backend $1 --batches 1 --prompts 32 --out /tmp/l_$2 2>&1 | grep -v -E "$F" > $OUT/l_$2.log; echo "latency1 $2: $(grep -a -E '^ +1 ' $OUT/l_$2.log | head -1)" | tee -a $OUT/summary.txt; }
for r in ${ROUNDS:-1 2}; do
  cp .gpu/mgpu_new.py $P; lat mosaic new$r
  cp .gpu/mgpu_old.py $P; lat mosaic old$r
  lat triton triton$r
done
cp .gpu/mgpu_new.py $P
