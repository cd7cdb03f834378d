# The measurements in one run of at most LIMIT seconds, most wanted first, each stopped in time:
# start-up with and without the kernels built ahead (run.sh), the query tiles' hoisted block ids
# (mosaic/short_prompt/hoist.sh), a launch's fixed cost (mosaic/launch_floor), a short prompt under ncu.
# Run from the repository root: bash benchmarks/results/startup/kernel_builds/all.sh
export PYTHONUNBUFFERED=1
start=$SECONDS
left() { echo $(( ${LIMIT:-580} - (SECONDS - start) )); }
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
bash benchmarks/results/startup/kernel_builds/run.sh ${VARIANTS:-tree none}
[ $(left) -gt 200 ] && timeout $(( $(left) - 10 )) bash benchmarks/results/mosaic/short_prompt/hoist.sh
[ $(left) -gt 60 ] && { timeout $(( $(left) - 5 )) python3 benchmarks/results/mosaic/launch_floor/launch_floor.py 50 2>&1 \
  | grep -v -E "W0000|I0000|W12|E12|DeprecationWarning|warnings.warn|^WARNING" > $OUT/launch_floor.log; tail -13 $OUT/launch_floor.log; }
[ $(left) -gt 60 ] && timeout $(( $(left) - 5 )) bash benchmarks/results/mosaic/short_prompt/run.sh
echo "done after $(( SECONDS - start )) s"
