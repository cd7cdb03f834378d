export PYTHONUNBUFFERED=1
F='W0000|I0000|W12|E12|DeprecationWarning|cuda_event|warnings.warn|^WARNING'
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
git rev-parse --short HEAD | tee -a $OUT/gpu.txt
timeout 230 python3 benchmarks/results/mosaic/launch_gaps/chain_gaps.py 2>&1 | grep -v -E "$F" > $OUT/chain_gaps.log
tail -16 $OUT/chain_gaps.log
for bc in "64 32" "1 32"; do set -- $bc
 for b in triton mosaic; do
  timeout 80 python3 tools/profile_step.py --batch $1 --ctx $2 --steps 30 --backend $b --top 14 --all-host-events --out $OUT/p$1_$2_$b --trace-dir /tmp/tr_$1_$2_$b 2>&1 | grep -v -E "$F" > $OUT/profile_b$1_c$2_$b.log
  echo "== b$1 c$2 $b"; grep -E "wall per step, untraced|GPU kernel time|idle gap|paged|attention|mosaic|triton" $OUT/profile_b$1_c$2_$b.log | head -12
 done
done
