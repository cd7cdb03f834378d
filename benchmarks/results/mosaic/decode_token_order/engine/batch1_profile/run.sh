export PYTHONUNBUFFERED=1
F='^WARNING\|^I0000\|^W0000\|^E1203\|^W1203'
for b in triton mosaic triton mosaic; do
  n=$((n+1)); d=$OUT/b1_${b}_$n
  timeout 130 python3 tools/profile_step.py --batch 1 --ctx 32 --steps 40 --backend $b --top 14 --out $d --trace-dir /tmp/trace_$n 2>&1 | grep --line-buffered -v "$F" > $d.log
  echo "== $b run $n"; grep -a "wall per step, untraced\|GPU kernel time\|idle gap\|per traced step" $d.log | cut -c1-260
done
for f in $OUT/b1_*.log; do echo "#### $f"; sed -n "/host ops per step/,\$p" $f | head -34; done
